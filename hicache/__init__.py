"""hicache: a hierarchical KV cache (device, pinned host, shared storage) for async LLM servers.

The storage layer is importable on its own (``hicache.storage``); the memory tiers, prefix
cache, controller and facade build on it.
"""

from hicache.errors import (
    BackendLoadError,
    BackendNotFoundError,
    CacheClosedError,
    ConfigError,
    HiCacheError,
    InvalidKeyError,
    LoopMisuseError,
    StorageStateError,
)
from hicache.keys import Namespace, page_hash, page_hashes

__version__ = "0.1.0"

__all__ = [
    "BackendLoadError",
    "BackendNotFoundError",
    "CacheClosedError",
    "ConfigError",
    "HiCacheError",
    "InvalidKeyError",
    "LoopMisuseError",
    "Namespace",
    "StorageStateError",
    "__version__",
    "page_hash",
    "page_hashes",
]
