"""The file backend behind a slow medium, for benchmarks and tests of what a slow store costs.

:class:`SlowFileStorage` is the real ``file`` backend (real page files, verified reads) whose
calls wait first, as a remote store or a busy disk makes them: each ``exists`` and read call
``latency_ms``, each read ``bytes / read_mbps`` more. The waits are on the store's loop, as a
network round trip is, so they never hold a thread. Both are backend options, so a process that
builds its store from a config (an engine's worker) can be given one by name:
:func:`register_slow_file` registers the class as ``slow-file`` in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hicache.storage.registry import register_backend
from hicache_backends.file.backend import FileStorage

__all__ = ["SlowFileStorage", "register_slow_file"]


class SlowFileStorage(FileStorage):
    """``FileStorage`` whose ``exists`` and read calls wait ``latency_ms``, reads also their
    bytes at ``read_mbps`` (megabytes a second; 0: no bandwidth limit). Writes are not slowed:
    what a benchmark of reads measures is the read side."""

    backend_name = "slow-file"

    def __init__(self, *args: Any, latency_ms: float = 0.0, read_mbps: float = 0.0, **kwargs: Any) -> None:
        if latency_ms < 0 or read_mbps < 0:
            raise ValueError(f"latency_ms and read_mbps must be >= 0, got {latency_ms!r} and {read_mbps!r}")
        super().__init__(*args, **kwargs)
        self.latency_s = latency_ms / 1e3
        self.bytes_per_s = read_mbps * 1e6

    async def _exists(self, pages: Sequence[Any]) -> list[bool]:
        await asyncio.sleep(self.latency_s)
        return await super()._exists(pages)

    async def _read(self, pages: Sequence[Any], buffers: Sequence[Any]) -> list[bool]:
        nbytes = sum(getattr(b, "nbytes", 0) for b in buffers)
        await asyncio.sleep(self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0))
        return await super()._read(pages, buffers)


def register_slow_file(name: str = "slow-file") -> None:
    """Make :class:`SlowFileStorage` a backend of this process under ``name``."""
    register_backend(name, SlowFileStorage)
