"""Pages moved through the seed page protocol alone, with reused staging.

A host pool without ``page_view`` (SGLang's ``HostKVCache`` among them) hands out copies:
``get_data_page`` for writes, ``get_dummy_flat_data_page`` + ``set_from_flat_data_page`` for
reads. Done naively - every page copied or staged before the first byte moves, then every
page committed after the last byte arrived, each staged read into a freshly zeroed page - a
128 x 4 MiB batch ran at 0.06-0.18x a plain readinto loop (get) and 0.55-0.66x (set).

Reads, for a backend that takes :class:`StagedPage` buffers (``supports_staged_pages``): each
page is read, verified and committed by one I/O thread in one go, into a staging page taken
from a bounded :class:`StagingArena` and given back at once - so the next page reuses the same
memory, which is still in the CPU cache for the checksum pass and the pool's commit copy (a
4 MiB page: read 0.24 ms, hash 0.06 ms, commit 0.05 ms from cache against 0.45-0.6 ms from
memory). Writes, likewise: each :class:`PoolPage` is copied out of the pool by the I/O thread
that hashes and writes it, right before it does, and dropped right after (the allocator hands
the same warm memory to the next copy). Other backends get the batch in chunks of about :data:`CHUNK_BYTES`, a few at a time:
while the backend reads (or writes) one chunk, the pool copies of another run on a thread.
Either way a page is committed only after the backend verified it, so a failed read never
reaches the pool, and every step keeps the base class's cancellation rule: a cancelled caller
returns only once no thread touches its pages any more.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from hicache.storage.offload import run_to_completion
from hicache.storage.pages import ReadTarget, as_bytes, commit_reads, write_sources

__all__ = [
    "CHUNK_BYTES", "PoolPage", "StagedPage", "StagingArena",
    "read_committed", "read_staged", "staging_bytes", "write_produced", "write_staged",
]

logger = logging.getLogger("hicache.storage")

#: Bytes per chunk: large enough that a chunk keeps every I/O thread busy, small enough that
#: the pool copies of one chunk overlap the I/O of the next (and staging stays cache-friendly).
CHUNK_BYTES = 16 << 20
#: Chunks in flight: some moving through the backend while another goes through the pool's
#: copies (128 x 4 MiB reads, medians of 4 runs: 16 MiB x 3 took 0.16 s, 32 MiB x 2 0.28 s).
IN_FLIGHT = 3

#: ``read(positions, buffers)``: memoryviews, or :class:`StagedPage` for :func:`read_committed`
ReadFn = Callable[[list[int], Sequence[Any]], Awaitable[list[bool]]]
WriteFn = Callable[[list[int], Sequence[Any]], Awaitable[list[bool]]]


class StagingArena:
    """Staging pages kept between batches, by (dtype, shape); at most ``max_bytes`` kept idle.

    Thread-safe (I/O threads take and give pages one at a time). A page taken is the caller's
    alone until given back; the page given back last is taken first (it is the one in cache).
    """

    #: Pools whose staging shape is remembered at once (more are forgotten, then asked again).
    MAX_POOLS = 64

    def __init__(self, max_bytes: int = IN_FLIGHT * CHUNK_BYTES) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._likes: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()

    def known_like(self, pool: Any) -> torch.Tensor | None:
        """The staging shape :meth:`remember_like` kept for this very pool object, or ``None``."""
        try:
            return self._likes.get(pool)
        except TypeError:  # not weakly referenceable, or unhashable: never remembered
            return None

    def remember_like(self, pool: Any, like: torch.Tensor) -> None:
        """Keep ``pool``'s staging dtype and shape (no memory) for as long as the pool lives.

        Asking the pool costs a fresh zeroed page per batch (``get_dummy_flat_data_page``;
        pinned memory in SGLang's pools): 4 MiB pages, 3.5-5 ms at the head of every batch,
        before any page moves (about 5% of a 128-page get). A pool's page geometry is fixed
        when it is built, so once per pool object is enough; the entry dies with the pool. A
        pool that cannot be weakly referenced (or hashed) is not remembered.
        """
        if len(self._likes) >= self.MAX_POOLS:  # pools that died are gone already
            self._likes.clear()
        try:
            self._likes[pool] = torch.empty(like.shape, dtype=like.dtype, device="meta")
        except TypeError:
            return

    def take(self, like: torch.Tensor, n: int) -> list[torch.Tensor]:
        """``n`` CPU contiguous pages of ``like``'s dtype and shape (contents undefined)."""
        out: list[torch.Tensor] = []
        with self._lock:
            free = self._idle.get((like.dtype, tuple(like.shape)), [])
            while free and len(out) < n:
                t = free.pop()
                self._idle_bytes -= t.numel() * t.element_size()
                out.append(t)
        out.extend(torch.empty(like.shape, dtype=like.dtype) for _ in range(n - len(out)))
        return out

    def give(self, pages: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in pages:
                nbytes = t.numel() * t.element_size()
                if self._idle_bytes + nbytes > self.max_bytes:
                    return
                self._idle.setdefault((t.dtype, tuple(t.shape)), []).append(t)
                self._idle_bytes += nbytes

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


def staging_bytes(stage: torch.Tensor) -> memoryview:
    """The byte view of an arena staging page, made on its first use and kept on the page.

    A view costs a few torch calls, and each hands the GIL around the I/O threads, which wait
    for it in turn (4 threads, 4 MiB pages: 0.1 ms of CPU a page, against 0.015 ms reused).
    The view lives and dies with its page (it only references the page's memory).
    """
    view = getattr(stage, "_hicache_bytes", None)
    if view is None:
        view = as_bytes(stage)
        stage._hicache_bytes = view  # type: ignore[attr-defined]
    return view


def _chunks(n: int, per_chunk: int) -> list[range]:
    return [range(i, min(n, i + per_chunk)) for i in range(0, n, per_chunk)]


async def _pipelined(parts: list[range], one: Callable[[range], Awaitable[None]]) -> None:
    """Run ``one(part)`` for every part, :data:`IN_FLIGHT` at a time. A TaskGroup, not gather:
    on cancellation it waits for every part, and so for the threads that touch pool memory."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def gated(part: range) -> None:
        async with gate:
            try:
                await one(part)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the chunk's pages fail; the batch goes on
                logger.exception("staged storage I/O of %d pages failed", len(part))

    async with asyncio.TaskGroup() as tg:
        for part in parts:
            tg.create_task(gated(part))


def _staging_like(pool: Any) -> torch.Tensor:
    like = pool.get_dummy_flat_data_page()
    if like.device.type != "cpu" or not like.is_contiguous():
        like = torch.empty(like.shape, dtype=like.dtype)
    return like


class _PageOfPool:
    """One page of a host pool as a backend buffer: its pool, first token index and bytes;
    ``refused`` once the pool would not hand the page out or take it (its index outside
    the pool, a page of another size), told to the caller after the backend's call."""

    __slots__ = ("pool", "index", "nbytes", "refused")

    def __init__(self, pool: Any, index: int, nbytes: int) -> None:
        self.pool = pool
        self.index = index
        self.nbytes = nbytes
        self.refused = False

    def __len__(self) -> int:
        return self.nbytes


class StagedPage(_PageOfPool):
    """A page to read through staging and commit to its pool, all on the backend's I/O thread.

    A backend with ``supports_staged_pages`` gets these as read buffers: it calls :meth:`take`
    for a staging page, reads and verifies the payload into it (``len(page)`` bytes), calls
    :meth:`commit` only if the page verified, and :meth:`give` back in every case.
    """

    __slots__ = ("like", "arena")

    def __init__(self, pool: Any, index: int, like: torch.Tensor, arena: StagingArena, nbytes: int) -> None:
        super().__init__(pool, index, nbytes)
        self.like = like
        self.arena = arena

    def take(self) -> tuple[torch.Tensor, memoryview]:
        """A staging page of this pool's page shape and a byte view of it."""
        stage = self.arena.take(self.like, 1)[0]
        return stage, staging_bytes(stage)

    def commit(self, stage: torch.Tensor) -> bool:
        """``set_from_flat_data_page`` of the verified staging page; False if the pool refused."""
        try:
            self.pool.set_from_flat_data_page(self.index, stage)
        except Exception:  # noqa: BLE001 - a page the pool refuses fails alone
            logger.debug("host pool refused page at %d", self.index, exc_info=True)
            self.refused = True
            return False
        return True

    def give(self, stage: torch.Tensor) -> None:
        self.arena.give([stage])


async def _checked_like(pool: Any, nbytes_hint: int | None, arena: StagingArena) -> torch.Tensor | None:
    """The pool's staging shape (asked once per pool, see :meth:`StagingArena.remember_like`),
    or ``None`` (logged) when the pool cannot stage or its dummy page disagrees with the page
    size it reports: reading a page of one size into a staging page of another would fail
    every page, or commit a truncated one."""
    like = arena.known_like(pool)
    if like is None:
        try:
            like = await run_to_completion(_staging_like, pool)
        except Exception:  # noqa: BLE001 - a pool that cannot stage: every page is a miss
            logger.exception("host pool %s cannot hand out a staging page; its reads are misses", type(pool).__name__)
            return None
        if like.numel():
            arena.remember_like(pool, like)
    nbytes = like.numel() * like.element_size()
    if not nbytes or (nbytes_hint is not None and nbytes != nbytes_hint):
        logger.error(
            "host pool %s: get_dummy_flat_data_page() is %d bytes but a page is %s bytes; its reads are misses",
            type(pool).__name__, nbytes, nbytes_hint,
        )
        return None
    return like


async def read_committed(
    pool: Any,
    starts: Sequence[int],
    read: ReadFn,
    arena: StagingArena,
    nbytes_hint: int | None = None,
    refused: Callable[[int], None] | None = None,
) -> list[bool]:
    """Read pages ``starts`` of ``pool`` as :class:`StagedPage` buffers, in one backend call:
    ``read(positions, pages)`` reads, verifies and commits each page on its I/O threads;
    ``refused(n)`` hears of the pages the pool would not take (as :func:`read_staged`)."""
    if not starts:
        return []
    like = await _checked_like(pool, nbytes_hint, arena)
    if like is None:
        return [False] * len(starts)
    nbytes = like.numel() * like.element_size()
    pages = [StagedPage(pool, start, like, arena, nbytes) for start in starts]
    flags = list(await read(list(range(len(starts))), pages))
    _tell_refused(pages, refused)
    return flags


def _tell_refused(pages: Sequence[_PageOfPool], refused: Callable[[int], None] | None) -> None:
    """``refused(n)`` of the pages a backend's threads found the pool refusing, if any."""
    n = sum(p.refused for p in pages)
    if n and refused is not None:
        refused(n)


async def read_staged(
    pool: Any,
    starts: Sequence[int],
    read: ReadFn,
    arena: StagingArena,
    nbytes_hint: int | None = None,
    refused: Callable[[int], None] | None = None,
) -> list[bool]:
    """Read pages ``starts`` of ``pool`` through staging: ``read(positions, buffers)`` fills and
    verifies the buffers of the pages at those positions of ``starts``; verified pages are
    committed with ``set_from_flat_data_page``, and ``refused(n)`` hears of the pages the pool
    would not take. Returns one flag per start."""
    ok = [False] * len(starts)
    if not starts:
        return ok
    like = await _checked_like(pool, nbytes_hint, arena)
    if like is None:
        return ok
    page_bytes = like.numel() * like.element_size()

    async def one(part: range) -> None:
        pages = arena.take(like, len(part))
        try:
            views = [staging_bytes(p) for p in pages]
            got = await read(list(part), views)
            if not any(got):
                return
            targets: list[ReadTarget | None] = [ReadTarget(starts[i], v, p) for i, v, p in zip(part, views, pages)]
            done = await run_to_completion(commit_reads, pool, targets, list(got))
            for i, flag in zip(part, done):
                ok[i] = flag
            if refused is not None and sum(done) < sum(got):
                refused(sum(got) - sum(done))
        finally:
            arena.give(pages)

    await _pipelined(_chunks(len(starts), max(1, CHUNK_BYTES // page_bytes)), one)
    return ok


async def write_staged(
    pool: Any,
    starts: Sequence[int],
    write: WriteFn,
    page_bytes: int | None,
    refused: Callable[[int], None] | None = None,
) -> list[bool]:
    """Write pages ``starts`` of ``pool``: each chunk's ``get_data_page`` copies are made on a
    thread while the previous chunk is written by ``write(positions, buffers)``. A page the pool
    cannot produce, or (``page_bytes`` known) produces at another size, fails alone, and
    ``refused(n)`` hears of them. Returns one flag per start."""
    ok = [False] * len(starts)

    async def one(part: range) -> None:
        sources = await run_to_completion(write_sources, pool, [starts[i] for i in part], page_bytes)
        live = [(i, src) for i, src in zip(part, sources) if src is not None]
        if refused is not None and len(live) < len(part):
            refused(len(part) - len(live))
        if not live:
            return
        done = await write([i for i, _ in live], [src for _, src in live])
        for (i, _), flag in zip(live, done):
            ok[i] = flag

    await _pipelined(_chunks(len(starts), max(1, CHUNK_BYTES // max(1, page_bytes or CHUNK_BYTES))), one)
    return ok


class PoolPage(_PageOfPool):
    """A page to copy out of its pool (``get_data_page``) by the backend's I/O thread that
    writes it, right before it does (backends with ``supports_staged_pages``)."""

    __slots__ = ()

    def produce(self) -> tuple[torch.Tensor, memoryview]:
        """The page's copy and a byte view of it; ``ValueError`` if it is not ``nbytes`` long
        (a pool whose pages are not the size it reports would store truncated pages)."""
        try:
            page = self.pool.get_data_page(self.index, flat=True)
            if page.device.type != "cpu":
                page = page.cpu()
            if not page.is_contiguous():
                page = page.contiguous()
            view = as_bytes(page)
            if len(view) != self.nbytes:
                raise ValueError(
                    f"host pool {type(self.pool).__name__}: get_data_page({self.index}) is {len(view)} bytes, "
                    f"a page is {self.nbytes}"
                )
        except Exception:
            self.refused = True
            raise
        return page, view


async def write_produced(
    pool: Any, starts: Sequence[int], write: WriteFn, page_bytes: int, refused: Callable[[int], None] | None = None
) -> list[bool]:
    """Write pages ``starts`` of ``pool`` as :class:`PoolPage` buffers, in one backend call;
    ``refused(n)`` hears of the pages the pool could not produce (as :func:`write_staged`)."""
    if not starts:
        return []
    pages = [PoolPage(pool, start, page_bytes) for start in starts]
    flags = list(await write(list(range(len(starts))), pages))
    _tell_refused(pages, refused)
    return flags
