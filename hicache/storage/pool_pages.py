"""The v2 interface's page movement between host pools and storage.

:meth:`~hicache.storage.base.AsyncHiCacheStorage.batch_get_v2` and ``batch_set_v2`` hand each
transfer to :func:`read_pages` / :func:`write_pages`, which check its host indices and pick the
cheapest way a page of that pool can move for this backend: straight into/from live page views
(``page_view``), as pool memory pieces (``page_segments``, a backend with
``supports_segments``), straight into live ``get_data_page(flat=False)`` views
(:mod:`~hicache.storage.view_pages`), or through reused staging pages
(:mod:`~hicache.storage.staging`). Bytes always move through the storage's guarded
``_read_guarded`` / ``_write_guarded``, so counting, the guard and tier-change reports stay in
the interface. :func:`read_pages_now` is the read done on a blocking caller's own thread (through
``_read_guarded_now``) for the batches that need no staging; it hands every other batch back
untouched.

Why functions over :class:`PoolPagesHost` and not methods of the storage class (or a mixin):
the movement needs a narrow slice of the storage, spelled out as the protocol, so this module
does not import the storage class, and the interface module keeps only the interface. The
functions hold no state (the staging arena and the live page views they use stay the
storage's, where backends and tests reach them), so they add no attribute to a backend's
namespace, and a transfer costs the one call the storage's own method did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, Protocol

import torch

from hicache.storage import pages as page_io
from hicache.storage import staging
from hicache.storage.offload import run_to_completion
from hicache.storage.segments import PageSegments, segment_sources
from hicache.storage.stats import StorageStats
from hicache.storage.types import PageKey
from hicache.storage.view_pages import LivePageViews

__all__ = ["PoolPagesHost", "overlapping", "page_keys", "read_pages", "read_pages_now", "write_pages"]

logger = logging.getLogger("hicache.storage")


class PoolPagesHost(Protocol):
    """What the page movement uses of its storage (an
    :class:`~hicache.storage.base.AsyncHiCacheStorage`)."""

    stats: StorageStats
    _staging: staging.StagingArena
    _view_reads: LivePageViews

    @property
    def supports_segments(self) -> bool: ...
    @property
    def supports_staged_pages(self) -> bool: ...
    def _pool(self, name: str) -> Any: ...
    async def _read_guarded(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]: ...
    def _reads_now(self, num_pages: int, nbytes: int) -> bool: ...
    def _read_guarded_now(
        self, pages: Sequence[PageKey], buffers: Sequence[Any], deadline: float | None = None
    ) -> list[bool] | None: ...
    async def _write_guarded(
        self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]
    ) -> list[bool]: ...


def _starts(
    host: PoolPagesHost, name: str, keys: list[str], host_indices: torch.Tensor | None, op: str
) -> tuple[Any, list[int | None] | None]:
    """The pool and each page's first token index (``None`` for a page whose indices are
    malformed); ``None`` instead of the list when the batch as a whole is malformed."""
    pool = host._pool(name)
    if isinstance(host_indices, torch.Tensor) and host_indices.device.type != "cpu":
        host_indices = host_indices.cpu()  # one device sync for every check below
    starts, bad = page_io.checked_starts(host_indices, len(keys), pool.page_size)
    if starts is None:
        host.stats.incr("invalid_requests")
        logger.error(
            "%s %s: pool %r expects %d integer host indices (%d keys x page %d), %s",
            type(host).__name__, op, name, len(keys) * pool.page_size, len(keys),
            pool.page_size, page_io.indices_refusal(host_indices),
        )
        return pool, None
    if bad:
        host.stats.incr("invalid_requests")
        logger.error(
            "%s %s: pool %r: %d page(s) whose host indices are not %d consecutive "
            "non-negative token indices (first at position %d); those pages fail",
            type(host).__name__, op, name, len(bad), pool.page_size, bad[0],
        )
    out: list[int | None] = starts  # type: ignore[assignment] # a fresh list of ours
    for i in bad:
        out[i] = None
    return pool, out


async def read_pages(host: PoolPagesHost, name: str, keys: list[str], host_indices: torch.Tensor | None) -> list[bool]:
    """Read ``keys``' pages of pool ``name`` into its host pool at ``host_indices``."""
    pool, starts = _starts(host, name, keys, host_indices, "get")
    if not starts:
        return [False] * len(keys)
    _drop_overlapping_targets(host, name, starts, pool.page_size)
    good, good_starts = _good(starts)
    if not good:
        return [False] * len(keys)
    staged = page_io.needs_thread(pool, good_starts)
    pieces = _segments(host, pool, good_starts, staged)
    if pieces is None and staged and host.supports_segments and host._view_reads.may_read(pool):
        # the seed protocol alone: straight into get_data_page(flat=False) where it is live
        pieces = await run_to_completion(
            host._view_reads.read_segments, pool, good_starts, page_io.page_nbytes_hint(pool)
        )
    if pieces is not None:
        return await _move_segments(host, name, keys, good, pieces, None)
    if staged:
        # no live page view: the seed page protocol alone, through reused staging pages
        async def read(positions: list[int], bufs: Sequence[Any]) -> list[bool]:
            return await host._read_guarded([PageKey(keys[good[j]], name) for j in positions], bufs)

        nbytes = page_io.page_nbytes_hint(pool)
        if host.supports_staged_pages:
            flags = await staging.read_committed(
                pool, good_starts, read, host._staging, nbytes, lambda n: _refused(host, name, "get", n)
            )
        else:
            flags = await staging.read_staged(
                pool, good_starts, read, host._staging, nbytes, lambda n: _refused(host, name, "get", n)
            )
        return _scatter(len(keys), good, flags)
    found = page_io.read_targets(pool, good_starts)
    targets: list[page_io.ReadTarget | None] = [None] * len(keys)
    for i, t in zip(good, found):
        targets[i] = t
    if None in found:
        _refused(host, name, "get", found.count(None))
    live = [i for i, t in enumerate(targets) if t is not None]
    ok = [False] * len(keys)
    got = await host._read_guarded(
        [PageKey(keys[i], name) for i in live], [targets[i].buffer for i in live]  # type: ignore[union-attr]
    )
    for i, flag in zip(live, got):
        ok[i] = flag
    if any(t is not None and t.staging is not None for t in targets):
        # Commits write into the pool: a cancelled caller must not get the pages back while
        # a thread is still copying into them.
        read_ok = sum(ok)
        ok = await run_to_completion(page_io.commit_reads, pool, targets, ok)
        if sum(ok) < read_ok:
            _refused(host, name, "get", read_ok - sum(ok))
    return ok


def read_pages_now(
    host: PoolPagesHost, name: str, keys: list[str], host_indices: torch.Tensor | None, deadline: float | None = None
) -> list[bool] | None:
    """:func:`read_pages` on the calling thread, or ``None`` (nothing read, nothing counted)
    where only the loop's path can take the batch: host indices it must refuse (it counts and
    logs them), a page the pool cannot hand out as a live view or pieces (staging), or a
    backend that declines (:meth:`_read_guarded_now`). Every check before the read has no side
    effect, so a ``None`` leaves the whole batch to :func:`read_pages` as if never asked.
    Past ``deadline`` (``time.monotonic()``) no page starts.

    Why: a blocking caller on its own thread (SGLang's prefetch thread) otherwise hands the
    batch to the store's loop, which hands it to an I/O thread, and back twice: four waits for
    a GIL that a busy engine's threads hold, more than the reads of small pages themselves."""
    pool = host._pool(name)
    if isinstance(host_indices, torch.Tensor) and host_indices.device.type != "cpu":
        return None
    page_nbytes = page_io.page_nbytes_hint(pool)
    if page_nbytes is not None and not host._reads_now(len(keys), len(keys) * page_nbytes):
        return None  # the backend leaves this batch to its loop: nothing prepared for it
    starts, bad = page_io.checked_starts(host_indices, len(keys), pool.page_size)
    if not starts or bad or overlapping((None, st, st + pool.page_size, i) for i, st in enumerate(starts)):
        return None
    bufs: list[Any]
    if page_io.needs_thread(pool, starts):
        pieces = segment_sources(pool, starts) if host.supports_segments else None
        if pieces is None or None in pieces:
            return None
        bufs = pieces
    else:
        targets = page_io.read_targets(pool, starts)
        if any(t is None or t.staging is not None for t in targets):
            return None
        bufs = [t.buffer for t in targets]  # type: ignore[union-attr]  # no None (checked)
    return host._read_guarded_now(page_keys(keys, name), bufs, deadline)


def _refused(host: PoolPagesHost, name: str, op: str, n: int) -> None:
    """``n`` pages of a batch the host pool refused (its page methods raised for their index)
    or, on a write, gave at another size than its page: host indices past the pool's end,
    which SGLang's pools do not check. Those pages fail; counted as a caller error, which
    they are, so a miss the store had no part in still shows in the counters."""
    host.stats.incr("invalid_requests")
    logger.error(
        "%s %s: pool %r refused %d page(s) (host indices outside the pool?); those pages fail",
        type(host).__name__, op, name, n,
    )


def _drop_overlapping_targets(host: PoolPagesHost, name: str, starts: list[int | None], page_size: int) -> None:
    """Fail (set to ``None``) every read target that overlaps an earlier one.

    Two pages read into the same host memory are filled concurrently: each may be verified
    and reported True while the other's bytes end up there. The first page (lowest start)
    is kept; writes may share a source page freely and are not checked.
    """
    for i in clashing_reads(host, name, starts, page_size, "those pages fail"):
        starts[i] = None


def clashing_reads(host: Any, name: str, starts: Sequence[int | None], page_size: int, outcome: str) -> set[int]:
    """Positions of the read targets in ``starts`` that overlap an earlier one (the lowest
    start is kept; see :func:`_drop_overlapping_targets`); counted as an invalid request and
    logged with ``outcome`` (what the caller does with them) when there are any."""
    clashing = overlapping((None, st, st + page_size, i) for i, st in enumerate(starts) if st is not None)
    if clashing:
        host.stats.incr("invalid_requests")
        logger.error("%s get: pool %r: %d page(s) would be read into host memory another page of the "
                     "batch is read into; %s", type(host).__name__, name, len(clashing), outcome)
    return clashing


async def write_pages(
    host: PoolPagesHost,
    name: str,
    keys: list[str],
    host_indices: torch.Tensor | None,
    parents: Sequence[PageKey | None],
    pages: list[PageKey] | None = None,
) -> list[bool]:
    """Write ``keys``' pages of pool ``name``; ``pages``: their page keys when the caller
    has them already (made once a batch: the KV ones are the parents too)."""
    pool, starts = _starts(host, name, keys, host_indices, "set")
    if not starts:
        return [False] * len(keys)
    good, good_starts = _good(starts)
    if not good:
        return [False] * len(keys)
    views = page_io.live_views(pool, good_starts)
    if views is not None:  # live views of every page (a page_first pool of ours): asked once
        return await _write_found(host, name, keys, good, views, parents, pages)
    staged = page_io.needs_thread(pool, good_starts)
    pieces = _segments(host, pool, good_starts, staged)
    if pieces is not None:
        return await _move_segments(host, name, keys, good, pieces, parents)
    if staged:
        # no live page view: copies of one chunk are made while the previous one is written
        async def write(positions: list[int], bufs: Sequence[Any]) -> list[bool]:
            return await host._write_guarded(
                [PageKey(keys[good[j]], name) for j in positions], bufs, [parents[good[j]] for j in positions]
            )

        nbytes = page_io.page_nbytes_hint(pool)
        if nbytes is None:
            try:
                nbytes = await run_to_completion(page_io.page_nbytes, pool)
            except Exception:  # noqa: BLE001 - then one page a chunk
                nbytes = None
        if host.supports_staged_pages:
            if not nbytes:
                logger.error("%s set: pool %r cannot say its page size; its pages fail", type(host).__name__, name)
                return [False] * len(keys)
            flags = await staging.write_produced(pool, good_starts, write, nbytes, lambda n: _refused(host, name, "set", n))
        else:
            flags = await staging.write_staged(pool, good_starts, write, nbytes, lambda n: _refused(host, name, "set", n))
        return _scatter(len(keys), good, flags)
    sources = page_io.write_sources(pool, good_starts, page_io.page_nbytes_hint(pool))
    return await _write_found(host, name, keys, good, sources, parents, pages)


async def _write_found(
    host: PoolPagesHost,
    name: str,
    keys: list[str],
    good: list[int],
    found: Sequence[memoryview | None],
    parents: Sequence[PageKey | None],
    pages: list[PageKey] | None,
) -> list[bool]:
    """Write the pages at positions ``good`` of ``keys`` from their sources ``found``
    (``None``: a page the pool could not produce, which fails). The usual batch (every page
    good and produced) goes as it is, without a Python step per page."""
    if pages is None:
        pages = page_keys(keys, name)
    if len(good) == len(keys) and None not in found:
        return await host._write_guarded(pages, found, parents)  # type: ignore[arg-type]
    live = [(i, src) for i, src in zip(good, found) if src is not None]
    if len(live) < len(good):
        _refused(host, name, "set", len(good) - len(live))
    done = await host._write_guarded(
        [pages[i] for i, _ in live], [src for _, src in live], [parents[i] for i, _ in live]
    )
    return _scatter(len(keys), [i for i, _ in live], done)


def _segments(host: PoolPagesHost, pool: Any, starts: list[int], staged: bool) -> list[PageSegments | None] | None:
    """The pages as pool memory pieces, when the backend takes them and the pool has no
    live contiguous view of its pages (``staged``: :func:`~hicache.storage.pages.needs_thread`,
    asked once by the caller; a live view is simpler still)."""
    if not host.supports_segments or not staged:
        return None
    return segment_sources(pool, starts)


async def _move_segments(
    host: PoolPagesHost,
    name: str,
    keys: list[str],
    good: list[int],
    pieces: list[PageSegments | None],
    parents: Sequence[PageKey | None] | None,
) -> list[bool]:
    """Read (``parents is None``) or write the pages straight from/into pool memory."""
    live = [(i, seg) for i, seg in zip(good, pieces) if seg is not None]
    ok = [False] * len(keys)
    if not live:
        return ok
    pages = [PageKey(keys[i], name) for i, _ in live]
    bufs: list[Any] = [seg for _, seg in live]
    if parents is None:
        flags = await host._read_guarded(pages, bufs)
    else:
        flags = await host._write_guarded(pages, bufs, [parents[i] for i, _ in live])
    for (i, _), flag in zip(live, flags):
        ok[i] = flag
    return ok


def _good(starts: list[int | None]) -> tuple[list[int], list[int]]:
    """The positions of the pages that have a start, and their starts (the whole list, without
    a Python iteration per page, when every page has one: the usual batch)."""
    if None not in starts:
        return list(range(len(starts))), starts  # type: ignore[return-value] # no None in it
    good = [i for i, st in enumerate(starts) if st is not None]
    return good, [starts[i] for i in good]  # type: ignore[misc]


def page_keys(keys: Sequence[str], pool: str) -> list[PageKey]:
    """``[PageKey(k, pool) for k in keys]`` built in C: a named tuple's ``__new__`` is a Python
    function, a call per page on the I/O thread that the event loop waits on for the GIL."""
    return list(map(tuple.__new__, repeat(PageKey), zip(keys, repeat(pool))))


def _scatter(n: int, positions: Sequence[int], flags: Sequence[bool]) -> list[bool]:
    """``n`` flags, ``flags[j]`` at ``positions[j]`` and False elsewhere."""
    out = [False] * n
    for i, flag in zip(positions, flags):
        out[i] = flag
    return out


def overlapping(spans: Iterable[tuple[Any, int, int, int]]) -> set[int]:
    """Of ``(space, start, stop, index)`` ranges, the indices of those that overlap a range
    kept before them in address order (the lowest start is kept); ranges of different spaces
    (devices) never overlap."""
    dropped: set[int] = set()
    space, end = object(), 0
    for sp, start, stop, i in sorted(spans, key=lambda s: (str(s[0]), s[1], s[3])):
        if sp == space and start < end:
            dropped.add(i)
            continue
        space, end = sp, stop
    return dropped

