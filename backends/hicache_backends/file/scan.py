"""The index scan of one file store: every page on disk indexed at open, and again when needed.

At open a background task indexes the namespace one hashed folder at a time (requests never
wait for it: a page it has not reached is found by a ``stat``). Pages the store forgets while
a scan runs are *tombstoned*, so the scan does not bring them back. A scan runs again
(:meth:`IndexScanner.maybe_rescan`) when the shared count holds bytes the store does not know
(pages other processes wrote since it opened), and after the ledger gave back a dead writer's
reservation. A complete scan corrects the shared count (:meth:`.space.SpaceAccountant.measured`).

Touched only on the event loop thread; the blocking work runs on the scan's own thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from hicache.storage.stats import StorageStats

from hicache_backends.file import io as page_io
from hicache_backends.file.index import PageIndex
from hicache_backends.file.layout import NamespaceLayout
from hicache_backends.file.ledger import Usage
from hicache_backends.file.pins import PagePins
from hicache_backends.file.space import SpaceAccountant
from hicache_backends.writers import STALE_TMP_SECONDS

__all__ = ["IndexScanner"]

logger = logging.getLogger("hicache.storage.file")

_RESCAN_SECONDS = 5.0  # at least this long between rescans for pages other processes wrote


class IndexScanner:
    """The background scan, its tombstones and when the index is ready.

    Handed what it needs of its store: the index it fills, the pins (pages being unlinked are
    not indexed), the space accountant (the shared count the scan corrects, the eviction after
    it), ``generation`` (bumped by each clear: a scan of the cleared folder stops), ``stop``
    (set when the store closes: no new scan), ``housekeeping`` (run after each scan) and the
    stats it counts in. The layout and the scan's thread come at :meth:`start`. ``read_only``
    (an observer's store, see ``FileStorage``): the scan only indexes - it removes no file and
    evicts nothing after it.
    """

    def __init__(
        self,
        root: str,
        *,
        index: PageIndex,
        pins: PagePins,
        space: SpaceAccountant,
        stats: StorageStats,
        generation: Callable[[], int],
        stop: threading.Event,
        housekeeping: Callable[[], Awaitable[None]],
        read_only: bool = False,
    ) -> None:
        self.root = root
        self._index = index
        self._pins = pins
        self._space = space
        self._stats = stats
        self._generation = generation
        self._stop = stop
        self._housekeeping = housekeeping
        self._read_only = read_only
        self._layout: NamespaceLayout | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tag = ""  # the namespace digest's start, in the scan tasks' names
        self.task: asyncio.Task[None] | None = None
        self.ready: asyncio.Event | None = None
        self.tombstones: set[str] | None = None  # pages forgotten while the scan runs
        self.seconds: float | None = None
        self._last_rescan = float("-inf")
        self._rescan_pending = False  # a reclaim asked for a scan while one was running

    @property
    def is_ready(self) -> bool:
        """Whether the background scan has indexed every page that was on disk at open."""
        return self.ready is not None and self.ready.is_set()

    def prepare(self) -> None:
        """Before the store's first await of its open: ``ready`` exists (not set) from then on."""
        self.ready = asyncio.Event()

    def start(self, layout: NamespaceLayout, executor: ThreadPoolExecutor, digest: str) -> None:
        """Start the opening scan (``executor``: the scan's own thread)."""
        self._layout = layout
        self._executor = executor
        self._tag = digest[:8]
        self.tombstones = set()
        self.task = asyncio.get_running_loop().create_task(
            self._scan(self._generation()), name=f"hicache-file-scan-{self._tag}"
        )

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def cleared(self) -> None:
        """The namespace was cleared (the scan stopped first): nothing left to tombstone."""
        self.tombstones = None

    def complete(self) -> None:
        """The index is complete without a scan (a clear emptied the namespace)."""
        assert self.ready is not None
        self.ready.set()

    # ------------------------------------------------------------------ what the scan must not undo

    def forget(self, pid: str) -> None:
        """Drop a page known to be gone from disk; the running scan must not bring it back."""
        self._index.remove(pid)
        if self.tombstones is not None:
            self.tombstones.add(pid)

    def leaving(self, ids: Iterable[str]) -> None:
        """Pages picked for eviction (already out of the index)."""
        if self.tombstones is not None:
            self.tombstones.update(ids)

    def indexed(self, pid: str) -> None:
        """A write indexed the page: on disk again."""
        if self.tombstones is not None:
            self.tombstones.discard(pid)

    # ------------------------------------------------------------------ scans

    def maybe_rescan(self, usage: Usage | None, *, reclaimed: bool = False) -> None:
        """When the shared count holds bytes this store does not know (pages other processes
        wrote since it opened; they may have exited), index them so they can be evicted. After
        a reclaim (``reclaimed``) always: the count may now miss pages a dead writer published."""
        if self._stop.is_set():  # closing: no new scan (nothing would wait for it)
            return
        if not reclaimed and (usage is None or usage.used <= self._index.nbytes + self._space.reserved):
            return
        if reclaimed:
            self._rescan_pending = True
        if (self.task is not None and not self.task.done()) or not self.is_ready:
            return
        now = time.monotonic()
        if now - self._last_rescan < _RESCAN_SECONDS and not self._rescan_pending:
            return
        self._rescan_pending = False
        self._last_rescan = now
        self._stats.incr("rescans")
        if self.tombstones is None:
            self.tombstones = set()
        self.task = asyncio.get_running_loop().create_task(
            self._scan(self._generation()), name=f"hicache-file-rescan-{self._tag}"
        )

    def _on_disk(self, pages: dict[str, int]) -> dict[str, int]:
        """(On the scan's thread.) ``pages`` (id -> size) less those no longer on disk."""
        assert self._layout is not None
        sizes = page_io.published_sizes([self._layout.path(pid) for pid in pages])
        return {pid: size for (pid, size), now in zip(pages.items(), sizes) if now is not None}

    async def _present(self, pages: dict[str, int], token: int | None) -> tuple[dict[str, int], int | None]:
        """``pages`` less those no longer on disk, looked at on the scan's thread after a
        reading of the ledger file ``token`` names, and that reading's ``seq`` (``None``: no
        reading of that file)."""
        assert self._executor is not None
        reading = await self._space.ledger_call(self._executor, 0, token=-1)
        looked = reading.seq if reading is not None and reading.token == token else None
        present = await asyncio.get_running_loop().run_in_executor(self._executor, self._on_disk, pages)
        return present, looked

    async def _scan(self, generation: int) -> None:
        """Index every page on disk, one hashed folder at a time, never dying on an error."""
        assert self._layout is not None and self._executor is not None
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        found = removed_tmp = 0
        seen: dict[str, int] = {}  # page id -> size of every page file the scan found
        complete = True
        try:
            before, token = await self._space.baseline(self._executor)
            # an observer's scan removes nothing (a torn page, a dead writer's temp file)
            scan_subdir = functools.partial(page_io.scan_subdir, remove=False) if self._read_only else page_io.scan_subdir
            subdirs = await loop.run_in_executor(self._executor, page_io.list_subdirs, self._layout)
            for subdir in subdirs:
                try:
                    entries, removed, torn = await loop.run_in_executor(
                        self._executor, scan_subdir, subdir, STALE_TMP_SECONDS
                    )
                except asyncio.CancelledError:
                    raise
                except page_io.PartialScan as partial:  # index what could be read
                    self._stats.incr("scan_errors")
                    logger.warning("file store %s: scanning %s: %s", self.root, subdir, partial)
                    complete = False  # unknown files: the ledger is not corrected from this scan
                    entries, removed, torn = partial.entries, partial.removed, partial.torn
                except Exception:  # noqa: BLE001 - one bad folder must not stop the scan
                    self._stats.incr("scan_errors")
                    logger.exception("file store %s: scanning %s failed", self.root, subdir)
                    complete = False
                    continue
                if generation != self._generation():
                    return
                removed_tmp += removed
                if torn:
                    self._stats.incr("corrupt_pages", torn)
                    self._stats.incr("torn_pages_removed", torn)
                tomb = self.tombstones or set()
                for e in entries:
                    seen[e.pid] = e.size
                    if e.pid in self._index or e.pid in tomb or e.pid in self._pins.deleting:
                        continue
                    self._index.add(e.pid, e.size, e.parent, e.atime)
                    found += 1
            if complete:
                # What is on disk *now*: a page found early in the scan may have been removed
                # by us since (the first writes after opening evict while the scan runs), and
                # its removal already subtracted; counting it again raised the count by a page
                # (one eviction too many). Summed under the ledger's lock from the live sets
                # (a removal is tombstoned on the loop before its unlink and its subtraction,
                # so every removal already subtracted is in them); membership tests only, safe
                # from that thread. Nor is a page another process removed since the scan saw it
                # (evicted, deleted: its bytes already off the count): counted, the floor raised
                # the count by it for as long as peers kept the namespace open (floors never
                # lower it), and a full store refused for good writes it had room for. Pages gone
                # by now are dropped off the lock, after a reading of the ledger; under it, a
                # floor that would raise the count looks again only if the ledger changed since
                # that reading (a removal is subtracted after its unlink: with no change, none
                # of the pages looked at has left the count). Looked at under the lock, 100k
                # pages held it ~0.5 s on a local disk, and peers' writes wait on it.
                present, looked = seen, None
                if before is None:
                    present, looked = await self._present(seen, token)

                def still_on_disk(used: int, seq: int) -> int:
                    tombstones, deleting = self.tombstones or (), self._pins.deleting
                    kept = {pid: size for pid, size in present.items() if pid not in tombstones and pid not in deleting}
                    least = sum(kept.values())
                    return least if least <= used or seq == looked else sum(self._on_disk(kept).values())

                await self._space.measured(self._executor, before, token, sum(seen.values()), still_on_disk)
            self.seconds = time.perf_counter() - t0
            logger.info(
                "file store %s: indexed %d pages (%d bytes) in %.3fs; removed %d stale temp files",
                self._layout.ns_dir, found, self._index.nbytes, self.seconds, removed_tmp,
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the index then relies on stat fallbacks
            self._stats.incr("scan_errors")
            logger.exception("file store %s: index scan failed", self.root)
        finally:
            if generation == self._generation():
                self.tombstones = None
                assert self.ready is not None
                self.ready.set()
                if self._rescan_pending and not self._stop.is_set():  # a reclaim came in meanwhile: once more
                    asyncio.get_running_loop().call_soon(lambda: self.maybe_rescan(None, reclaimed=True))
        if removed_tmp:
            self._stats.incr("stale_tmp_removed", removed_tmp)
        if self._read_only:
            # an observer never evicts: the bound is the writers' (an observer opened with the
            # default max_bytes deleted what a writer with a larger one, or none, had kept)
            return
        try:  # pages found on disk may exceed a max_bytes lowered since the last run
            await self._space.evict_for(False, frozenset(), whole_excess=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001
            logger.exception("file store %s: eviction after scan failed", self.root)
        await self._housekeeping()
