"""The ``memory`` backend: pages in process memory, bounded by bytes, LRU-evicted."""

from hicache_backends.memory.backend import MemoryMedium, MemoryStorage

__all__ = ["MemoryMedium", "MemoryStorage"]
