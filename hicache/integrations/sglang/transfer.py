"""KV pages between an SGLang host pool and a hicache backend, with reorder and I/O overlapped.

A backend with scatter/gather I/O (``supports_segments``: the file backend) needs none of
this: it reads and writes the pool's pieces of each page itself, and this class hands the
batch straight over. What follows is for the others (S3, fsspec, memory, plugins).

For a layout whose pages are not one contiguous canonical region, every page needs one strided
copy between the pool and canonical bytes. Done per page on the storage path (the page
protocol's staging), that copy runs after the read and before the write, and a fresh staging
page is allocated and faulted in each time. Here the batch is cut into chunks that fit half of
a staging area allocated once: while the backend reads chunk ``i`` into one half, chunk ``i-1``
is scattered into the pool from the other (and the other way round for writes). Storage sees
each staging page as the page's live view (:meth:`CanonicalPagePool.bind`), so the backend
itself does no extra copy.

A batch stops at its first failed chunk: SGLang only uses the leading run of pages, and a page
written after a gap would be an orphan. Everything here runs on the adapter's event loop;
copies go to a worker thread through ``run_to_completion``, so a cancelled call (SGLang's call
timeout) waits for the copy and for the backend before the staging area is reused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import torch

from hicache.integrations.sglang.pages import CanonicalPagePool
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageExtraInfo, PoolTransfer
from hicache.storage.offload import run_to_completion
from hicache.storage.pool_pages import clashing_reads

__all__ = ["PageMover"]

logger = logging.getLogger("hicache.integrations.sglang")


class _Staging:
    """Two halves of reusable page memory for one direction, one call at a time."""

    def __init__(self, pool: CanonicalPagePool, staging_bytes: int) -> None:
        self.chunk_pages = max(1, staging_bytes // 2 // pool.page_nbytes)
        self.halves = [pool.new_staging(self.chunk_pages) for _ in range(2)]
        self.lock = asyncio.Lock()


class PageMover:
    """Reads and writes KV pages of one canonical pool through a hicache backend."""

    def __init__(self, backend: AsyncHiCacheStorage, pool: CanonicalPagePool, pool_name: str, staging_bytes: int) -> None:
        self.backend = backend
        self.pool = pool
        self.pool_name = pool_name
        self.staging_bytes = staging_bytes
        self._staging: dict[str, _Staging] = {}

    def _area(self, direction: str) -> _Staging:
        area = self._staging.get(direction)
        if area is None:  # allocated on first use (on the loop thread: no race)
            area = self._staging[direction] = _Staging(self.pool, self.staging_bytes)
        return area

    def _transfer(self, keys: list[str], host_indices: torch.Tensor) -> list[PoolTransfer]:
        return [PoolTransfer(self.pool_name, host_indices, keys=keys)]

    def _chunks(self, n: int, size: int) -> list[tuple[int, int]]:
        return [(lo, min(n, lo + size)) for lo in range(0, n, size)]

    def _starts(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        ps = self.pool.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != n * ps:
            return None
        return host_indices.reshape(-1)[::ps].cpu().tolist()

    @property
    def moves_directly(self) -> bool:
        """Whether the backend moves every page of this pool itself, without this class's
        staging: contiguous pages, or a backend that takes pages as pool memory pieces
        (scatter/gather I/O, :mod:`hicache.storage.segments`)."""
        return self.pool.has_live_pages or self.backend.supports_segments

    def _direct(self, starts: list[int] | None, n: int) -> bool:
        """:attr:`moves_directly`, or a malformed request the backend reports itself."""
        return self.moves_directly or starts is None or n == 0

    async def get(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Read ``keys`` into the pool at ``host_indices``; one flag per key."""
        n = len(keys)
        starts = self._starts(host_indices, n)
        if starts is None or self._direct(starts, n):
            got = await self.backend.batch_get_v2(self._transfer(keys, host_indices))
            return got[self.pool_name]
        ps = self.pool.page_size
        # two pages of the batch read into the same host page: the chunks below catch that only
        # within a chunk and its neighbour, so the batch stops before the first such page (as
        # a failed page stops it), whatever their distance (the direct path fails them too)
        clash = clashing_reads(self.backend, str(self.pool_name), starts, ps, "the batch stops before the first")
        if clash:
            n = min(clash)
            if n == 0:
                return [False] * len(keys)
        area = self._area("get")
        ok = [False] * len(keys)
        async with area.lock:
            previous: tuple[int, int, int, list[int]] | None = None  # (lo, hi, half, bound)
            for ci, (lo, hi) in enumerate(self._chunks(n, area.chunk_pages)):
                half = ci % 2
                bound = self.pool.bind(zip(starts[lo:hi], area.halves[half]))
                k = _owned_run(starts[lo:hi], bound, range(hi - lo))
                if k < hi - lo:  # ask only for the pages routed to this call's staging
                    keep = set(starts[lo : lo + k])
                    self.pool.unbind([x for x in bound if x not in keep])
                    bound = [x for x in bound if x in keep]
                cut, hi = k < hi - lo, lo + k
                if hi == lo:
                    break
                try:
                    async with asyncio.TaskGroup() as tg:
                        read = tg.create_task(
                            self.backend.batch_get_v2(self._transfer(keys[lo:hi], host_indices[lo * ps : hi * ps]))
                        )
                        if previous is not None:
                            tg.create_task(self._commit(previous, starts, area, ok))
                except BaseException:
                    self.pool.unbind(bound)
                    if previous is not None:
                        self.pool.unbind(previous[3])
                    raise
                if previous is not None:
                    self.pool.unbind(previous[3])
                flags = read.result()[self.pool_name]
                ok[lo:hi] = flags
                previous = (lo, hi, half, bound)
                if cut or not all(flags):
                    break
            if previous is not None:
                try:
                    await self._commit(previous, starts, area, ok)
                finally:
                    self.pool.unbind(previous[3])
        return _leading(ok)

    async def _commit(self, chunk: tuple[int, int, int, list[int]], starts: list[int], area: _Staging, ok: list[bool]) -> None:
        lo, hi, half, bound = chunk
        buffers = area.halves[half]
        held = set(bound)
        todo = [(i, starts[i], buffers[i - lo]) for i in range(lo, hi) if ok[i] and starts[i] in held]
        if todo:
            failed = await run_to_completion(_scatter_pages, self.pool, todo)
            for i in failed:
                ok[i] = False

    async def set(self, keys: list[str], host_indices: torch.Tensor, prefix_keys: list[str] | None) -> list[bool]:
        """Write the pool's pages at ``host_indices`` under ``keys``; one flag per key."""
        n = len(keys)
        starts = self._starts(host_indices, n)
        info = HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys) if prefix_keys else None)
        if starts is None or self._direct(starts, n):
            got = await self.backend.batch_set_v2(self._transfer(keys, host_indices), info)
            return got[self.pool_name]
        area = self._area("set")
        ps = self.pool.page_size
        ok = [False] * n
        chunks = self._chunks(n, area.chunk_pages)
        async with area.lock:
            ready = await run_to_completion(_gather_pages, self.pool, starts[chunks[0][0] : chunks[0][1]], area.halves[0])
            for ci, (lo, hi) in enumerate(chunks):
                half = ci % 2
                # only the leading pages this call gathered and bound are written: an index
                # another call holds would route the backend to that call's staging bytes
                bound = self.pool.bind((starts[lo + j], area.halves[half][j]) for j in ready)
                k = _owned_run(starts[lo:hi], bound, ready)
                cut, hi = k < hi - lo, lo + k
                if hi == lo:
                    self.pool.unbind(bound)
                    break
                extra = info if ci == 0 else HiCacheStorageExtraInfo(prefix_keys=[keys[lo - 1]])
                try:
                    async with asyncio.TaskGroup() as tg:
                        write = tg.create_task(
                            self.backend.batch_set_v2(self._transfer(keys[lo:hi], host_indices[lo * ps : hi * ps]), extra)
                        )
                        nxt = None
                        if ci + 1 < len(chunks):
                            nlo, nhi = chunks[ci + 1]
                            nxt = tg.create_task(
                                run_to_completion(_gather_pages, self.pool, starts[nlo:nhi], area.halves[1 - half])
                            )
                finally:
                    self.pool.unbind(bound)
                flags = write.result()[self.pool_name]
                ok[lo:hi] = [bool(f) for f in flags]
                if cut or not all(ok[lo:hi]):
                    break
                ready = nxt.result() if nxt is not None else []
        return _leading(ok)


def _owned_run(chunk_starts: list[int], bound: list[int], usable: Iterable[int]) -> int:
    """How many leading pages of a chunk this call may move through its staging: each must be
    usable (gathered, for a write), bound by this call, and its host page not named earlier in
    the chunk (two keys into one page would share one staging page)."""
    owned, ok, seen = set(bound), set(usable), set()
    for j, start in enumerate(chunk_starts):
        if j not in ok or start not in owned or start in seen:
            return j
        seen.add(start)
    return len(chunk_starts)


def _leading(flags: list[bool]) -> list[bool]:
    """Flags past the first failure are dropped to False (SGLang uses the leading run)."""
    out = list(flags)
    for i, flag in enumerate(out):
        if not flag:
            out[i + 1 :] = [False] * (len(out) - i - 1)
            break
    return out


def _scatter_pages(pool: CanonicalPagePool, todo: list[tuple[int, int, torch.Tensor]]) -> list[int]:
    failed = []
    for i, start, buf in todo:
        try:
            pool.scatter(start, buf)
        except Exception:  # noqa: BLE001 - a page that cannot be stored fails alone
            logger.exception("scatter of page at %d failed", start)
            failed.append(i)
    return failed


def _gather_pages(pool: CanonicalPagePool, starts: list[int], buffers: torch.Tensor) -> list[int]:
    """Copy pages into staging rows; returns the positions that were copied."""
    done = []
    for j, start in enumerate(starts):
        try:
            pool.gather(start, buffers[j])
            done.append(j)
        except Exception:  # noqa: BLE001 - a bad index fails that page
            pass
    return done
