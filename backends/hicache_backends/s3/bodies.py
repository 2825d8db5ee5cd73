"""Write bodies built in reused buffers, so a PUT costs one copy of its page and nothing else.

Why not ``bytes``: botocore wraps a ``bytes`` body of ``PutObject`` in a ``BytesIO``, which
aiohttp then sends in 64 KiB chunks with a loop pass between them (one more copy and several
wake-ups per page). A ``bytearray`` body is passed through as it is and sent with one socket
write. Building header + payload into a fresh buffer also costs an allocation, zero-fill and page
faults per page; buffers returned here after their request are reused.

A buffer is given back only after its request was answered at its first attempt: an attempt
that was cancelled or timed out may still have its body referenced by a transport (Python 3.12+
buffers a view of unsent bytes, not a copy, and a closing transport goes on sending them), so
after one the buffer is dropped, never reused, even when a retry was answered. The free list is bounded by count and bytes,
so an idle store keeps little memory.
"""

from __future__ import annotations

__all__ = ["BodyBuffers"]


class BodyBuffers:
    """Free ``bytearray`` bodies of one event loop, by size (not thread-safe: one loop's)."""

    def __init__(self, max_buffers: int, max_bytes: int = 64 << 20) -> None:
        self.max_buffers = max(0, int(max_buffers))
        self.max_bytes = max(0, int(max_bytes))
        self._free: dict[int, list[bytearray]] = {}
        self._count = 0
        self._bytes = 0

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes to build a body in (a reused one when one is free)."""
        free = self._free.get(size)
        if free:
            self._count -= 1
            self._bytes -= size
            return free.pop()
        return bytearray(size)

    def give_back(self, body: bytearray) -> None:
        """``body``'s request has ended with an answer: it may be reused."""
        size = len(body)
        if self._count >= self.max_buffers or self._bytes + size > self.max_bytes:
            return
        self._free.setdefault(size, []).append(body)
        self._count += 1
        self._bytes += size

    def __len__(self) -> int:
        return self._count
