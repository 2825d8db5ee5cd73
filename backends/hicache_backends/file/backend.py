"""``FileStorage``: KV pages as verified, atomically published files under a shared root.

What it improves over SGLang's ``HiCacheFile`` (see FIELD-NOTES):

* integrity - every page carries the shared :class:`~hicache.storage.page_format.PageCodec`
  header (namespace, key, pool, length, xxh3) and is verified on every read; a page that fails
  is deleted, counted (``corrupt_pages``) and reported as a miss;
* namespaces - a folder per namespace digest with a manifest, so pages of another model, dtype,
  layout or rank are never even looked at;
* lookups - ``exists`` answers from an in-memory index (O(keys asked)); an index miss falls back
  to one ``stat`` so pages that other processes add to the same root are found;
* I/O - pages move on a dedicated thread pool in parallel chunks, straight between the file and
  the host pool's memory (``preadv``/``pwritev``, no staging copy);
* capacity - ``max_bytes`` and a free-space floor, enforced before each write by evicting
  leaves first (a page's descendants before the page), least recently used first; sizes and
  parent links are rebuilt from the files after a restart;
* robustness - writes are atomic (temp file + rename); a full disk fails the write,
  removes its temp file and leaves reads working; the background scan never dies.

The index is mutated only on the event loop thread; executor threads only return facts.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from hicache.errors import ConfigError
from hicache.keys import Namespace
from hicache.observability.tier_events import ChangeKind, Tier
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, PageCodec, PageKey, StorageState
from hicache.storage.base import time_share
from hicache.storage.changes import Written, report_cleared
from hicache.storage.io_threads import copy_threads
from hicache.storage.options import bool_option
from hicache.storage.segments import PageSegments
from hicache.storage.staging import PoolPage, StagedPage
from hicache.storage.stats import Throttle

from hicache_backends.file import io as page_io
from hicache_backends.file.index import Entry, PageIndex
from hicache_backends.file.journal import PeerRemoval
from hicache_backends.file.layout import NamespaceLayout, page_id
from hicache_backends.file.ledger import LEDGER_NAME, Usage, read_usage
from hicache_backends.file.peers import PeerRemovals
from hicache_backends.file.pins import PagePins
from hicache_backends.file.scan import IndexScanner
from hicache_backends.file.space import Reservation, SpaceAccountant
from hicache_backends.file.threads import UNANSWERED, BatchOutcome, CallerCalls, PageThreads, ProbeThreads, page_threads

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MIN_FREE_BYTES", "FileStorage"]

logger = logging.getLogger("hicache.storage.file")

#: 64 GiB: bounded by default (an unbounded cache fills disks; see FIELD-NOTES), yet large
#: enough that most single-machine users never tune it. ``max_bytes=None`` opts out.
DEFAULT_MAX_BYTES = 64 << 30
#: Keep 1 GiB free on the file system whatever ``max_bytes`` says: other programs need the disk.
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_ROOT = "/tmp/hicache"
ROOT_ENV = "HICACHE_FILE_ROOT"
_CLEAR_WAIT_SECONDS = 1.0
_FILE_OP_COST = 32 << 10  # an open+close costs about as much as copying 32 KiB
_WARN_SECONDS = 60.0  # at most one warning of a kind (disk full, I/O errors) per store this often


def _tracked(fn: Callable[..., Any], *, writes: bool = False) -> Callable[..., Any]:
    """A primitive that :meth:`FileStorage._close` waits for before it shuts the executors;
    ``writes``: its first argument's pages are counted while it runs (what a close cut short
    leaves, see there)."""

    @functools.wraps(fn)
    async def call(self: FileStorage, *args: Any) -> Any:
        self._calls += 1
        self._calls_idle.clear()
        pages = len(args[0]) if writes else 0
        self._writing_pages += pages
        try:
            return await fn(self, *args)
        finally:
            self._writing_pages -= pages
            self._calls -= 1
            if not self._calls:
                self._calls_idle.set()

    return call


def _tracked_write(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_tracked` for the write primitive, whose pages are counted while it runs."""
    return _tracked(fn, writes=True)


_CLOSE_CALLS_WAIT_SECONDS = 30.0  # what a close waits for calls in progress before it stops the threads
#: probes of lookups on callers' threads running at once, stuck ones included (see ProbeThreads)
_PROBE_THREADS = 4


@dataclass(slots=True)
class _WriteJob:
    index: int  # position in the caller's batch
    pid: str
    page: PageKey
    buf: memoryview | PageSegments | PoolPage
    parent: str | None
    size: int
    skip_size: int | None
    #: the index held the page when the write began (it was announced stored, or found on disk)
    held: bool = False


class FileStorage(AsyncHiCacheStorage):
    """Pages as files under ``root/<namespace digest>/pages/<xx>/<page id>.page``.

    Options:
        root: the store directory, shared by every process and namespace that uses it
            (default ``$HICACHE_FILE_ROOT`` or ``/tmp/hicache``).
        max_bytes: bytes this namespace may take on disk (page files counted whole by size),
            default 64 GiB; ``None`` for unbounded. Enforced by leaf-first LRU eviction before
            each write, against a usage ledger shared by every process on the root (see
            :mod:`.ledger` and the README's reliability section for the slack).
        min_free_bytes: free space to leave on the file system (default 1 GiB); writes evict
            this namespace's pages, then fail, rather than go below it. 0 disables the check.
        fsync: fsync each page and its folder before a write reports success (default off:
            a crash then loses recent pages, but never exposes a torn one).
        io_threads: threads doing page I/O (default 4); a batch is split into at most this
            many chunks, which bounds its concurrency (a batch of staged seed-protocol reads:
            at most cores + 1, see :func:`~hicache.storage.io_threads.copy_threads`).
        skip_existing: do not rewrite a page already stored with the same size (default on:
            keys are chained content hashes within a namespace, as in SGLang's HiCacheFile,
            so the bytes would be the same). Turn off for overwrite semantics.
        shared: other processes may add pages to this root (default on), so a key the index
            does not know is checked with one ``stat``. Off: once the index is built, a key it
            does not know is a miss without touching the disk (for a store's only writer).
        removal_journal: append this store's removals (evictions, corrupt pages, clears) to
            the namespace's journal and tail the other processes' (default on for shared
            stores), so every process reports every removal as a KV event (:mod:`.journal`).
        journal_poll_s: how often the journal is read (default 0.5 s).
        read_only: open as an observer (default off; ``hicache inspect`` opens stores so): the
            store lists, looks up and reads pages, and changes nothing else on disk - no
            folder or manifest made, no eviction (whatever ``max_bytes`` says: the writers
            set the bound, and an observer with the default one deleted what a writer with
            a larger one kept), no stale temp file, torn page or cleared trash swept, the
            usage ledger and the removal journal neither joined nor written. Writes and
            deletes are refused (``read_only_refused_pages``), a clear fails. The one
            removal left is a read's: a page that fails verification is deleted as on any
            read (counted ``corrupt_pages``), its bytes taken off the shared count at once
            (the ledger's counters, and its process's observer slot - never a writer's -
            marked for the page before the unlink, so that a kill in between leaves no
            over-count: still not joined), and peers find it gone at their next read. Left
            in the count for "a writer's scan" to correct, they stayed: a writer's index
            still held the page (no rescan was due) and its scans correct the count only
            with the namespace to themselves and no write in flight, so each drop shrank
            ``max_bytes`` for as long as it served.
        namespace: override the namespace derived from the storage config.
    """

    backend_name = "file"
    supports_segments = True  # pages scattered in pool memory move by preadv/pwritev, no staging
    supports_staged_pages = True  # seed-protocol pools: each page copied and moved by one thread
    supports_read_only = True  # ``read_only`` (see the class docstring)

    @classmethod
    def stored_page_nbytes(cls, payload_nbytes: int) -> int:
        """Bytes one page of ``payload_nbytes`` counts against ``max_bytes``: the whole file,
        header and footer too, for a cache key (a 64-hex-digit hash) in the ``kv`` pool."""
        return NamespaceLayout.file_size("0" * 64, "kv", payload_nbytes)

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        *,
        root: str | os.PathLike[str] | None = None,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
        fsync: bool = False,
        io_threads: int = 4,
        skip_existing: bool = True,
        shared: bool = True,
        removal_journal: bool = True,
        journal_poll_s: float = 0.5,
        read_only: bool = False,
        namespace: Namespace | dict[str, Any] | None = None,
    ) -> None:
        super().__init__(storage_config, namespace=namespace)
        if root is None:
            root = os.environ.get(ROOT_ENV) or DEFAULT_ROOT
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            # "" would silently become the current directory
            raise ConfigError(f"file backend: root must be a non-empty path, got {root!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ConfigError(f"file backend: max_bytes must be a positive integer or None, got {max_bytes!r}")
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int) or min_free_bytes < 0:
            raise ConfigError(f"file backend: min_free_bytes must be an integer >= 0, got {min_free_bytes!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
            raise ConfigError(f"file backend: io_threads must be an integer in 1..256, got {io_threads!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.fsync = bool_option("file", "fsync", fsync)
        self.io_threads = io_threads
        self.skip_existing = bool_option("file", "skip_existing", skip_existing)
        self.shared = bool_option("file", "shared", shared)
        self.read_only = bool_option("file", "read_only", read_only)
        if isinstance(journal_poll_s, bool) or not isinstance(journal_poll_s, (int, float)) or not 0 < journal_poll_s <= 3600:
            raise ConfigError(f"file backend: journal_poll_s must be a number of seconds in (0, 3600], got {journal_poll_s!r}")
        # an observer appends nothing (and a journal file opened is a journal file created)
        self.removal_journal = bool_option("file", "removal_journal", removal_journal) and self.shared and not self.read_only
        self.journal_poll_s = float(journal_poll_s)
        # this store's removals out to the other processes, theirs in (shared stores only)
        self._peers = PeerRemovals(self.root, self.journal_poll_s, self._peer_removal) if self.removal_journal else None

        self.index = PageIndex()
        self._layout: NamespaceLayout | None = None
        self._codec: PageCodec | None = None
        self._threads = PageThreads(io_threads)  # the I/O threads, started at open
        self._loop: asyncio.AbstractEventLoop | None = None  # the store's loop, while open
        self._caller_reads = CallerCalls()  # reads on blocking callers' threads (a close waits for them)
        self._probes = ProbeThreads(_PROBE_THREADS, "hicache-file-probe")  # lookups' disk probes, bounded
        self._scan_executor: ThreadPoolExecutor | None = None
        self._pins = PagePins()  # pages being read or written, pages being unlinked
        self._generation = 0  # bumped by clear(): older writes do not re-enter the index
        # reservations, the shared ledger and what is owed to it, free space, eviction; it
        # reaches the store only through what it is handed here (the scanner, made below, late)
        self._space = SpaceAccountant(
            self.root, max_bytes, min_free_bytes, index=self.index, pins=self._pins, stats=self.stats,
            generation=lambda: self._generation,
            report_removed=lambda pages, **kw: self.report_removed(pages, **kw),
            wants_identities=self._wants_removed_identities,
            leaving=lambda ids: self._scanner.leaving(ids),
            on_reclaim=lambda usage: self._scanner.maybe_rescan(usage, reclaimed=True),
        )
        self._stop = threading.Event()  # tells long background deletions to give up (close)
        # the index scan at open (and again when needed), its tombstones and readiness
        self._scanner = IndexScanner(
            self.root, index=self.index, pins=self._pins, space=self._space, stats=self.stats,
            generation=lambda: self._generation, stop=self._stop, housekeeping=self._housekeeping,
            read_only=self.read_only,
        )
        self._manifest_pending = False  # the disk was too full to write it: housekeeping retries
        # calls of the primitives in progress: close() waits for them, so that a batch in
        # flight settles its ledger reservation and indexes its pages, and a clear hands its
        # trash to a background task, on executors that are still running
        self._calls = 0
        self._calls_idle = asyncio.Event()
        self._calls_idle.set()
        self._writing_pages = 0  # pages of the write calls in progress (what a close cut short leaves)
        self._enospc_warnings = Throttle(_WARN_SECONDS)
        self._pool_warnings = Throttle(_WARN_SECONDS)
        # I/O errors repeat for every page while their cause lasts (a root remounted read-only,
        # the process out of file descriptors): one line a minute each way, not one per page
        self._write_error_warnings = Throttle(_WARN_SECONDS)
        self._read_error_warnings = Throttle(_WARN_SECONDS)
        self._read_only_warnings = Throttle(_WARN_SECONDS)
        self._probe_log = Throttle(_WARN_SECONDS)  # lookups whose disk probe timed out
        self._background: set[asyncio.Task[None]] = set()
        self._rehousing: asyncio.Task[None] | None = None  # housekeeping after the folder was deleted
        self._pruning: asyncio.Task[None] | None = None  # the index checked against the disk (journal lines lost)
        self._prune_again = False  # journal lines were lost while that check ran

    # ------------------------------------------------------------------ properties

    @property
    def layout(self) -> NamespaceLayout:
        """Paths of this store's namespace (available once open)."""
        if self._layout is None:
            self._layout = NamespaceLayout(self.root, self.namespace.digest)
        return self._layout

    @property
    def index_ready(self) -> bool:
        """Whether the background scan has indexed every page that was on disk at open."""
        return self._scanner.is_ready

    async def wait_index_ready(self, timeout: float | None = None) -> bool:
        """Wait for the background scan; ``False`` if ``timeout`` passed first."""
        await self._ensure_open()
        assert self._scanner.ready is not None
        try:
            async with asyncio.timeout(timeout):
                await self._scanner.ready.wait()
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ lifecycle

    async def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._layout = NamespaceLayout(self.root, self.namespace.digest)
        self._codec = PageCodec(self.namespace.digest_bytes)
        self._threads.start()
        assert self._threads.executor is not None
        self._probes.start()
        # The scan gets its own thread so it never queues in front of requests.
        self._scan_executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-file-scan")
        self._scanner.prepare()
        try:
            # an observer makes nothing: a namespace without a folder is simply empty to it
            self._manifest_pending = not self.read_only and not await self._threads.run(
                page_io.prepare_namespace, self._layout, self.namespace.to_dict()
            )
        except BaseException as exc:
            self._shutdown_executors(wait=False)
            if isinstance(exc, OSError):
                raise ConfigError(f"file backend: cannot use root {self.root!r}: {exc}") from exc
            raise
        if self._manifest_pending:
            self._warn_manifest_deferred()
        # an observer leaves the ledger alone: joining it writes it (a dead writer's slot
        # reclaimed, a short file completed) and holds its users lock, so a writer's scan
        # could not correct the count while it looks
        # (it still gives back the corrupt pages its reads remove: see SpaceAccountant.give_back_removed)
        self._space.open(self._layout, self._threads.executor, shared=self.shared and not self.read_only,
                         observer=self.shared and self.read_only)
        if self.shared and self.read_only:
            await self._threads.run(self._space.observe)
        if self._peers is not None:
            await self._peers.open(self._layout.ns_dir, self.namespace.digest)
        self._scanner.start(self._layout, self._scan_executor, self.namespace.digest)
        self._caller_reads.open()

    async def _close(self) -> None:
        self._stop.set()  # background deletions stop at the next file; the next open resumes them
        # With a caller's deadline (``aclose(timeout)``: what is left of a server's drain), the
        # waits take shares of what is left (the calls half, the background work half of the
        # rest, the threads' end the rest) and what the close leaves is logged, the pages of the
        # writes left running counted (close_left_write_pages).
        # Why: each wait bounded on its own (30 s for the calls, the threads' end unbounded),
        # a write stuck on a hung mount held the close past the caller's budget, and the
        # shutdown's SIGKILL came before a word of the writes it left.
        deadline = self._close_deadline
        cut = 0
        try:
            # calls already running finish first: their settlement, indexing and trash need the
            # executors (new calls are refused: the store's state is CLOSED already)
            # one limit for both kinds of call (the loop's and the callers' threads'), not one each
            waited = time_share(_CLOSE_CALLS_WAIT_SECONDS, deadline, 0.5)
            calls_by = time.monotonic() + waited
            try:
                async with asyncio.timeout(waited):
                    await self._calls_idle.wait()
            except TimeoutError:  # a call stuck in its I/O: close anyway (it fails when it resumes)
                cut = self._writing_pages
                logger.warning("file store %s: closing with %d call(s) still running after %.1f s%s", self.root,
                               self._calls, waited, f", writes of {cut} page(s) among them: left running, they "
                               "may yet land or fail" if cut else "")
            left = await asyncio.to_thread(self._caller_reads.close, max(0.0, calls_by - time.monotonic()))
            if left:
                logger.warning("file store %s: closing with %d read(s) on callers' threads still running after %.1f s",
                               self.root, left, waited)
            await self._scanner.stop()
            if self._peers is not None:
                await self._peers.stop_tailing()
            if self._background:
                background = set(self._background)
                _, late = await asyncio.wait(
                    background, timeout=None if deadline is None else time_share(float("inf"), deadline, 0.5))
                if late:
                    logger.warning("file store %s: closing with %d background task(s) (deletions) still running; "
                                   "the next open finishes them", self.root, len(late))
                    for task in late:
                        task.cancel()  # (each stops at its next file anyway: the close set _stop)
            # what settlements could not tell the shared ledger, told now (no write is left to
            # carry it: see SpaceAccountant.settle_owed)
            await self._space.settle_owed(self._threads.executor)
            # in-flight page writes finish (each cleans up after itself), off the loop
            ending = asyncio.ensure_future(asyncio.to_thread(self._shutdown_executors, True))
            ending.add_done_callback(lambda f: f.cancelled() or f.exception())  # (an outcome nobody may await)
            _, late = await asyncio.wait({ending}, timeout=None if deadline is None else time_share(float("inf"), deadline))
            if late:  # (the threads end on their own: nothing here waits for them any more)
                logger.warning("file store %s: closing with its I/O threads still busy (a call stuck on the medium)",
                               self.root)
        finally:
            # released however the close ends, cut short included (cancelled past a caller's
            # limit; at interpreter exit, where no executor takes work): a ledger file left
            # open keeps its shared lock, and every later store of the namespace would believe
            # another process still uses it (its scans never correct the usage again)
            if cut:
                self.stats.incr("close_left_write_pages", cut)
            self._shutdown_executors(wait=False)
            self._space.close()
            if self._peers is not None:
                await self._peers.close()

    def _executors(self) -> list[ThreadPoolExecutor]:
        journal = self._peers.executor if self._peers is not None else None
        return [e for e in (self._threads.executor, self._scan_executor, journal) if e is not None]

    def _shutdown_executors(self, wait: bool) -> None:
        self._probes.shutdown()  # never waited for: a probe stuck on a hung mount holds nothing
        for e in self._executors():
            e.shutdown(wait=wait)

    # ------------------------------------------------------------------ helpers

    def _adopt(self, pid: str, result: page_io.ReadResult) -> None:
        """Index a page this store did not know (written by another process, or not scanned yet)."""
        if pid in self.index or pid in self._pins.deleting:
            return
        self.index.add(pid, result.size, result.parent, result.mtime or time.time())
        self.stats.incr("adopted_pages")

    def _corrupt(self, page: PageKey, pid: str, result: page_io.ReadResult) -> None:
        self._count_corrupt(result)
        self._scanner.forget(pid)
        self.report_removed([page], reason="corrupt")
        logger.warning(
            "file store %s: page %s failed verification (%s); removed, served as a miss",
            self.root, page.label()[:80], result.reason,
        )

    def _count_corrupt(self, result: page_io.ReadResult) -> None:
        """A corrupt page counted (its bytes left the shared count with its removal, see
        :meth:`SpaceAccountant.discard`)."""
        self.stats.incr("corrupt_pages")

    # ------------------------------------------------------------------ housekeeping

    async def _housekeeping(self) -> None:
        """Off the request path: finish clears that a killed (or closed) process left half
        deleted - first, since on a full disk that is what frees space -, write the manifest if
        the disk was too full for it, remove the manifest's temporary files a killed writer
        left, then create missing page folders. Never raises but
        cancellation. Nothing for an observer (:attr:`read_only`): each step writes."""
        assert self._layout is not None and self._scan_executor is not None
        if self.read_only:
            return
        loop = asyncio.get_running_loop()
        for what, fn, args in (
            ("removing stale trash", page_io.remove_stale_trash, (self._layout.root, self._layout.digest, self._stop)),
            ("writing the manifest", self._retry_manifest, ()),
            ("removing stale manifest temporary files", page_io.remove_stale_manifest_tmps, (self._layout,)),
            ("creating page folders", page_io.ensure_subdirs, (self._layout, self._stop)),
        ):
            try:
                await loop.run_in_executor(self._scan_executor, fn, *args)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - writes create folders themselves; trash is only space
                logger.exception("file store %s: %s failed", self.root, what)

    def _retry_manifest(self) -> None:
        """(On the scan thread.) Write a manifest that a full disk deferred, or one that is gone
        (the namespace folder was deleted under us and a write made it again: without one,
        ``hicache inspect`` saw no namespace there, and none of its pages, until a restart)."""
        if self._layout is not None and (self._manifest_pending or not os.path.exists(self._layout.manifest_path)):
            if page_io.prepare_namespace(self._layout, self.namespace.to_dict()):
                self._manifest_pending = False
                logger.info("file store %s: manifest of namespace %s written", self.root, self.namespace.digest)

    def _warn_manifest_deferred(self) -> None:
        logger.warning(
            "file store %s: disk full, the manifest of namespace %s is written once space is reclaimed",
            self.root, self.namespace.digest,
        )

    @_tracked
    async def _delete(self, pages: Sequence[PageKey]) -> list[bool]:
        """Evictions a placement policy chose. A page being read or written is kept (``False``),
        as the store's own eviction keeps it; the others are forgotten before their unlink so a
        concurrent lookup never answers present for a page on its way out.

        A page the index does not know is looked for on disk, as a lookup looks for it
        (:meth:`_exists`): another process sharing the root may have written it since this
        store's scan, or the scan has not reached it yet. Answered ``False`` and left there,
        it stayed on disk and in the shared count although the caller was told nothing of it,
        and the next lookup found and adopted it. It is removed like an indexed page: its
        writer counted it in the shared ledger, and the unlink gives its bytes back there."""
        if self.read_only:
            return self._refused_read_only("delete", len(pages))
        ids = [page_id(p.key, p.pool) for p in pages]
        busy, deleting = self._pins.busy, self._pins.deleting  # (changed in place, never replaced)
        on_disk: dict[str, int] = {}
        unknown = [pid for pid in dict.fromkeys(ids) if not (pid in self.index or pid in busy or pid in deleting)]
        if unknown and (self.shared or not self.index_ready):
            assert self._layout is not None
            paths = [(self._layout.path(pid),) for pid in unknown]
            sizes = await self._threads.run_chunked(page_io.probe_removable, paths)
            on_disk = {pid: size for pid, size in zip(unknown, sizes) if size is not None}
        # from here on one loop step: the pins and the index as they are after the probe
        doomed: dict[str, int] = {}
        for pid in ids:
            if pid in doomed or pid in busy or pid in deleting:
                continue
            entry = self.index.get(pid)
            if entry is not None:
                doomed[pid] = entry.size
            elif pid in on_disk:
                doomed[pid] = on_disk[pid]
        if not doomed:
            return [False] * len(ids)
        for pid in doomed:
            self._scanner.forget(pid)
        _, _, kept = await self._space.remove(list(doomed), list(doomed.values()))
        # a page named twice is answered at its first place only (as the memory and S3 backends
        # answer): deleted_pages and the REMOVED event count it once
        deleted = {pid: pid not in kept for pid in doomed}
        return [deleted.pop(pid, False) for pid in ids]

    # ------------------------------------------------------------------ primitives

    @_tracked
    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        ids = [page_id(p.key, p.pool) for p in pages]
        entries = self.index.entries
        deleting = self._pins.deleting
        out = [pid in entries and pid not in deleting for pid in ids]
        missing = [i for i, hit in enumerate(out) if not hit]
        if missing and (self.shared or not self.index_ready):
            # Not indexed: another process may have written it, or the scan has not reached it.
            assert self._layout is not None
            paths = [(self._layout.path(ids[i]),) for i in missing]
            results = await self._threads.run_chunked(page_io.probe_page, paths)
            for i, r in zip(missing, results):
                if r.status is page_io.ReadStatus.OK and ids[i] not in self._pins.deleting:
                    self._adopt(ids[i], r)
                    out[i] = True
        return out

    def _exists_prefix_now(self, pages: Sequence[PageKey], deadline: float | None = None) -> int | None:
        """(Any thread.) The run of indexed pages up to the first that is not; that one is
        probed on disk when another process may have written it (a shared store, or the scan
        still running): found there, it must be indexed on the loop, so the answer is then
        ``None``. Reads the index and the pins only (dictionary and set lookups, atomic under
        the GIL); an answer is as fresh as one the loop would give a moment later.

        With a ``deadline`` the probe runs on :class:`ProbeThreads` and one unanswered by then
        (a slow or hung mount) is a miss, counted in ``call_timeouts`` and
        ``lookup_probe_timeouts``: on the caller's thread it held SGLang's prefetch thread for
        as long as the mount took, whatever ``hicache_call_timeout`` said."""
        layout = self._layout
        if layout is None:
            return None
        entries = self.index.entries
        deleting = self._pins.deleting
        probe = self.shared or not self.index_ready
        run = 0
        for p in pages:
            pid = page_id(p.key, p.pool)
            if pid in deleting:  # on its way out, whatever the disk still holds
                break
            if pid in entries:
                run += 1
                continue
            if probe:
                found = self._probes.call(page_io.probe_page, layout.path(pid), deadline=deadline)
                if found is UNANSWERED:
                    self._probe_timed_out()
                elif found.status is not page_io.ReadStatus.MISSING:
                    return None  # written by another process (or unreadable): the loop's lookup sorts it out
            break
        return run

    def _probe_timed_out(self) -> None:
        """A lookup's probe outlived its caller's deadline (or found every probe thread still
        stuck): counted, and logged now and then, since the lookup answers a miss instead."""
        self.stats.incr("call_timeouts")
        self.stats.incr("lookup_probe_timeouts")
        count = self._probe_log.due()
        if count:
            logger.warning("file store %s: %d lookup(s) answered as misses: a probe of the disk took longer "
                           "than the call timeout (%d probe(s) still running)", self.root, count, self._probes.stuck())

    @_tracked
    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview | PageSegments | StagedPage]) -> list[bool]:
        assert self._layout is not None and self._codec is not None
        ids = [page_id(p.key, p.pool) for p in pages]
        before = [self.index.get(pid) for pid in ids]
        calls = [
            (self._layout.path(pid), self._codec, p.key, p.pool, buf, self._space.discard)
            for pid, p, buf in zip(ids, pages, buffers)
        ]
        # staged pages are copied into their pool on these threads: CPU work, not I/O waits
        staged = any(isinstance(b, StagedPage) for b in buffers)
        self._pins.hold(ids)
        try:
            results = await self._threads.run_chunked(
                page_io.read_page_into, calls, sum(b.nbytes for b in buffers), _FILE_OP_COST,
                threads=copy_threads(self.io_threads) if staged else None,
            )
        finally:
            self._pins.release(ids)
        ok = self._settle_reads(pages, ids, results, before)
        if self.read_only or any(r.removed for r in results):  # corrupt pages removed leave the shared count
            await self._space.give_back_removed(self._threads.executor)
        return ok

    def _read_now(self, pages: Sequence[PageKey], buffers: Sequence[Any], deadline: float | None = None) -> list[bool] | None:
        """Pages read on the caller's thread, one after the other, as one I/O thread reads a
        batch of small pages; a batch the loop would spread over several threads (pages of
        128 KiB and more) is declined. The index learns what the reads found on the loop, after
        the answer (``call_soon_threadsafe``: a touch, an adoption, a corrupt or vanished page
        forgotten). Past ``deadline`` (``time.monotonic()``) no page starts: the rest fail, as
        the pages not started when a call on the loop times out.

        The pages are not pinned against eviction: a page unlinked under the read is a miss (a
        file opened before the unlink reads whole), a page replaced is read whole from either
        file (writes rename complete files), every page is verified, and the index keeps what
        changed while the page was read (see :meth:`_settle_reads_later`). A close waits for
        these reads and refuses new ones."""
        layout, codec, loop = self._layout, self._codec, self._loop
        if layout is None or codec is None or loop is None:
            return None
        if not self._reads_now(len(buffers), sum(b.nbytes for b in buffers)):
            return None
        if not self._caller_reads.enter():  # closing: the loop's path refuses it properly
            return None
        try:
            return self._read_pages_now(layout, codec, loop, pages, buffers, deadline)
        finally:
            self._caller_reads.leave()

    def _reads_now(self, num_pages: int, nbytes: int) -> bool:
        """Batches one I/O thread would read on the loop (see :meth:`_read_now`)."""
        return self.io_threads <= 1 or page_threads(nbytes, num_pages) <= 1

    def _read_pages_now(
        self, layout: NamespaceLayout, codec: PageCodec, loop: asyncio.AbstractEventLoop,
        pages: Sequence[PageKey], buffers: Sequence[Any], deadline: float | None,
    ) -> list[bool]:
        ids = [page_id(p.key, p.pool) for p in pages]
        entries = self.index.entries
        before = [entries.get(pid) for pid in ids]
        generation = self._generation
        results: list[page_io.ReadResult] = []
        for pid, p, buf in zip(ids, pages, buffers):
            if deadline is not None and time.monotonic() > deadline:  # as a timeout on the loop:
                self.stats.incr("call_timeouts")  # pages not started are not, they fail
                break
            results.append(page_io.read_page_into(layout.path(pid), codec, p.key, p.pool, buf, self._space.discard))
        done = len(results)
        try:
            loop.call_soon_threadsafe(self._settle_reads_later, pages[:done], ids[:done], results, before[:done], generation)
        except RuntimeError:  # the loop closed under the read: the index went with it
            pass
        return [r.status is page_io.ReadStatus.OK for r in results] + [False] * (len(pages) - done)

    def _settle_reads_later(
        self, pages: Sequence[PageKey], ids: list[str], results: list[page_io.ReadResult], before: list[Any], generation: int
    ) -> None:
        """(Loop.) :meth:`_settle_reads` for reads done on another thread, without their pins:
        nothing after a clear, and nothing for a page whose index entry changed since it was
        read (removed, written again, or touched by another read: its removal or write ran
        beside the read, and what the read found may be another file's news). A corrupt page
        the read found is still counted (its removal settles the shared count on its own). A
        failure is counted and logged (a loop callback has nobody to raise to)."""
        if self.state is not StorageState.OPEN or generation != self._generation:
            return
        changed = {i for i, (pid, was) in enumerate(zip(ids, before)) if self.index.get(pid) is not was}
        if changed:
            for i in changed:
                if results[i].status is page_io.ReadStatus.CORRUPT:
                    self._count_corrupt(results[i])
            keep = [i for i in range(len(ids)) if i not in changed]
            pages, ids = [pages[i] for i in keep], [ids[i] for i in keep]
            results, before = [results[i] for i in keep], [before[i] for i in keep]
        try:
            self._settle_reads(pages, ids, results, before)
        except Exception:  # noqa: BLE001
            self.stats.incr("backend_errors")
            logger.exception("file store %s: indexing what a read on the caller's thread found failed", self.root)

    def _settle_reads(self, pages: Sequence[PageKey], ids: list[str], results: list[page_io.ReadResult], before: list[Any]) -> list[bool]:
        """(Loop.) What reads found, into the index: a page read is touched (or adopted, when
        another process wrote it), a failed one handled by :meth:`_after_failed_read`; one
        flag per page."""
        now = time.time()
        ok = [False] * len(pages)
        for i, (pid, r) in enumerate(zip(ids, results)):
            if r.status is page_io.ReadStatus.OK or r.status is page_io.ReadStatus.REFUSED:
                ok[i] = r.status is page_io.ReadStatus.OK  # refused: a sound page, not taken
                if pid in self.index:
                    self.index.touch(pid, now)
                else:
                    self._adopt(pid, r)
                if not ok[i]:
                    self.stats.incr("pool_refused_pages")
            else:
                self._after_failed_read(pages[i], pid, r, before[i])
        return ok

    def _after_failed_read(self, page: PageKey, pid: str, r: page_io.ReadResult, before: Any) -> None:
        if r.status is page_io.ReadStatus.CORRUPT:
            self._corrupt(page, pid, r)
        elif r.status is page_io.ReadStatus.MISSING:
            # Gone (evicted or cleared by another process): forget it, unless a write of ours
            # re-created it while we were reading.
            if self.index.get(pid) is before:
                if before is not None:
                    self.stats.incr("vanished_pages")
                    self.report_removed([page], reason="vanished", origin="peer")
                self._scanner.forget(pid)
        elif r.status is page_io.ReadStatus.ERROR:
            self.stats.incr("io_errors")
            if r.errno in (errno.EACCES, errno.EPERM) and self.index.get(pid) is before:
                # A page file this process may not open (its permissions changed, or another
                # user's writer made it with a private umask) stays unreadable: indexed, it was
                # answered present for good, and skip_existing kept every rewrite from replacing
                # it. Forgotten, lookups miss (a probe cannot open it either) and the next write
                # replaces it (a rename needs only the folder's permission).
                self._scanner.forget(pid)
            count = self._read_error_warnings.due()
            if count:
                logger.warning("file store %s: %d page read(s) failed since the last warning; reading %s: %s",
                               self.root, count, page.label()[:80], r.reason)

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        r = await self._read_result(page)
        return r.payload if r.status is page_io.ReadStatus.OK else None

    @_tracked
    async def _read_result(self, page: PageKey) -> page_io.ReadResult:
        """Read one page, with the bookkeeping of any read (a page adopted, a corrupt one
        dropped, a vanished one forgotten); the result says which (:meth:`check_page`)."""
        assert self._layout is not None and self._codec is not None
        pid = page_id(page.key, page.pool)
        before = self.index.get(pid)
        self._pins.hold((pid,))
        try:
            r = await self._threads.run(
                functools.partial(page_io.read_page_bytes, discard=self._space.discard),
                self._layout.path(pid), self._codec, page.key, page.pool,
            )
        finally:
            self._pins.release((pid,))
        if r.status is page_io.ReadStatus.OK:
            if pid in self.index:
                self.index.touch(pid, time.time())
            else:
                self._adopt(pid, r)
            return r
        self._after_failed_read(page, pid, r, before)
        if self.read_only or r.removed:
            await self._space.give_back_removed(self._threads.executor)
        return r

    async def check_page(self, page: PageKey) -> str:
        """:meth:`verify_page`, telling a page that is gone (no file: evicted or cleared by a
        writer between ``hicache inspect``'s listing and this read, as a live store does all
        the time) - ``"vanished"`` - from one that failed verification or could not be read -
        ``"corrupt"``, dropped as on any read."""
        await self._ensure_open()
        r = await self._guard("verify", self._read_result(page), None)
        if r is None:  # the read raised (counted and logged): unreadable, as before
            return "corrupt"
        if r.status is page_io.ReadStatus.OK:
            return "ok"
        return "vanished" if r.status is page_io.ReadStatus.MISSING else "corrupt"

    @_tracked_write
    async def _write(
        self,
        pages: Sequence[PageKey],
        buffers: Sequence[memoryview | PageSegments | PoolPage],
        parents: Sequence[PageKey | None],
    ) -> list[bool]:
        assert self._layout is not None and self._codec is not None
        if self.read_only:
            return self._refused_read_only("write", len(pages))
        ok = [False] * len(pages)
        jobs: list[_WriteJob] = []
        pids = [page_id(page.key, page.pool) for page in pages]
        await self._pins.after_pending_removals(pids)
        for i, (page, buf, parent) in enumerate(zip(pages, buffers, parents)):
            pid = pids[i]
            size = self._layout.file_size(page.key, page.pool, buf.nbytes)
            if self.max_bytes is not None and size > self.max_bytes:
                self.stats.incr("oversized_pages")
                continue
            entry = self.index.get(pid)
            skip = size if self.skip_existing and entry is not None and entry.size == size else None
            ppid = page_id(parent.key, parent.pool) if parent is not None else None
            jobs.append(_WriteJob(i, pid, page, buf, ppid, size, skip, entry is not None))
        if not jobs:
            return ok

        # Reserve, then make room: the reservation is taken synchronously so that concurrent
        # batches cannot both claim the same space (and in the shared ledger, before any byte is
        # written, so that other processes cannot either). Parents of the new pages and pages in
        # flight are protected from eviction. With the shared ledger the batch's own I/O thread
        # reserves before its first write and settles after its last (no round trips of their
        # own); a batch that does not fit then writes nothing and comes back for room.
        protect = {j.pid for j in jobs} | {j.parent for j in jobs if j.parent is not None}
        incoming = sum(j.size for j in jobs if j.skip_size is None)
        generation = self._generation
        ids = [j.pid for j in jobs]
        res = self._space.begin_batch(incoming)
        self._pins.hold(ids)
        results: list[page_io.WriteResult] | None = None
        refused = 0
        raced = False  # a clear ran meanwhile (what landed after it is counted there)
        settled: tuple[Usage | None] | None = None
        try:
            batch = None
            if await self._space.reserves_in_batch(incoming):
                debt = self._space.take_debt(res)
                try:
                    batch = await self._write_batch(jobs, res, 0, reserve=(incoming, debt))
                finally:
                    self._space.reserved_first(res, debt)
                if batch.declined and batch.cancelled:  # nothing written: stop, as a cancelled reserve did
                    raise asyncio.CancelledError
            if batch is None or batch.declined:
                if batch is None:
                    await self._space.reserve(res, incoming)
                missing = await self._space.evict_for(incoming > 0, protect, res.usage)
                batch_jobs = list(jobs)
                while missing > 0 and jobs:  # cannot fit them all: drop the deepest pages (batch tail)
                    dropped = jobs.pop()
                    if dropped.skip_size is None:
                        missing -= dropped.size
                        incoming -= dropped.size
                        self._space.unreserve(dropped.size)
                    refused += 1
                if refused:
                    self.stats.incr("rejected_pages_no_space", refused)
                    if self.max_bytes is not None and self._chain_bytes(dropped, batch_jobs) > self.max_bytes:
                        self.stats.incr("rejected_pages_beyond_capacity", refused)
                    self._scanner.maybe_rescan(res.usage)
                    await self._space.refused_for_space(refused, res.usage)
                batch = await self._write_batch(jobs, res, refused)
            results, cancelled, settled = batch.results, batch.cancelled, batch.after
            if results is not None and any(r is None for r in results):
                # the caller gave up and the batch stopped between pages: the pages never
                # started were not written (nothing to index or count; the settlement gave
                # back their reservation), the others are facts about the disk
                started = [i for i, r in enumerate(results) if r is not None]
                jobs, results = [jobs[i] for i in started], [results[i] for i in started]
            if results is not None and (generation != self._generation or self._space.ledger_replaced(res, settled)):
                # a clear ran meanwhile: ours, or another process's (it replaced the ledger the
                # batch reserved in, so the settlement was not applied: what landed in the
                # new folder was counted nowhere, and the namespace stayed over max_bytes)
                raced = True
                generation, results, late = await self._published_after_clear(jobs, results)
                cancelled = cancelled or late
        finally:
            self._pins.release(ids)
            await self._space.end_batch(res, incoming, results, refused, raced, settled)
        if results is None:
            raise asyncio.CancelledError
        # Pages on disk are indexed even when the caller was cancelled meanwhile: an unindexed
        # page would escape max_bytes (and, unshared, lookups) until the next restart.
        held = self._apply_writes(jobs, results, generation, ok)
        if cancelled:
            # the caller answers every page of the batch as failed (an engine adapter, a miss)
            # and no write counter counts a cancelled call: the pages that landed anyway are
            # counted here, or the store's figures would disagree with its disk
            landed = sum(r.ok and not r.skipped for r in results)
            if landed:
                self.stats.incr("write_late_pages", landed)
            raise asyncio.CancelledError
        return Written(ok, held)

    def _chain_bytes(self, job: _WriteJob, batch: list[_WriteJob]) -> int:
        """Bytes of ``job``'s page and of every page it chains from (its parent, the parent's
        parent...: in ``batch``, else in the index), up to the first one not stored.

        Why: a chained page is stored only with its prefix kept (eviction takes leaves first,
        and never a page a write continues), so where those bytes pass ``max_bytes`` no
        eviction can ever make its room: the refusal is final
        (``rejected_pages_beyond_capacity``, as the memory store counts it). Counted only as
        ``rejected_pages_no_space``, the controller retried it with backoff, held up the
        storage queue, and counted the pages as failed writes."""
        in_batch = {j.pid: j for j in batch}
        total, seen, pid = job.size, {job.pid}, job.parent
        while pid is not None and pid not in seen:
            seen.add(pid)
            link: _WriteJob | Entry | None = in_batch.get(pid) or self.index.get(pid)
            if link is None:
                break
            total += link.size
            pid = link.parent
        return total

    async def _write_batch(
        self, jobs: list[_WriteJob], res: Reservation, refused: int, reserve: tuple[int, int] | None = None
    ) -> BatchOutcome:
        """Write ``jobs`` on the I/O threads. A cancelled caller (a facade's ``call_timeout``)
        starts no more pages: those being written finish (each is a temporary file renamed into
        place, whole or not at all), the others keep a ``None`` result; before, the whole batch
        was written for a caller that had answered it as failed. With a shared reservation,
        the last write's thread settles it (:meth:`SpaceAccountant.settle_last`), giving back
        what the pages not written reserved;
        ``reserve`` (bytes, debt): the first thread takes it, and the batch is declined (writes
        nothing) when it does not fit (:meth:`SpaceAccountant.reserve_first`)."""
        assert self._layout is not None and self._codec is not None
        calls = [
            (self._layout, self._codec, j.pid, j.page.key, j.page.pool, j.buf, j.parent, self.fsync, j.skip_size)
            for j in jobs
        ]
        first = functools.partial(self._space.reserve_first, res, *reserve) if reserve is not None else None
        last = (functools.partial(self._space.settle_last, res, refused)
                if reserve is not None or res.usage is not None else None)
        return await self._threads.run_batch(
            page_io.write_page, calls, sum(j.buf.nbytes for j in jobs), 4 * _FILE_OP_COST,
            stop_on_cancel=True, first=first, last=last,
        )

    async def _published_after_clear(
        self, jobs: list[_WriteJob], results: list[page_io.WriteResult]
    ) -> tuple[int, list[page_io.WriteResult], bool]:
        """A ``clear()`` ran while these pages were written (this store's, or another process's
        that replaced the ledger the batch reserved in). A write that landed before it went
        with the old folder; one that landed after it (the folder is recreated) is in the
        namespace that followed, ordered after the clear: it is indexed and counted (in the new
        ledger) like any write, never a file that the index and ``max_bytes`` do not know. The
        first kind is still reported done (it was written, then cleared) and counted nowhere
        (as ``skipped``). Returns the generation the results now belong to, the results, and
        whether the caller was cancelled meanwhile (the checks still ran to the end)."""
        assert self._layout is not None
        generation = self._generation
        wrote = [i for i, r in enumerate(results) if r.ok and not r.skipped]
        paths = [self._layout.path(jobs[i].pid) for i in wrote]
        cancelled = False
        try:
            sizes: list[int | None] = await self._threads.run(page_io.published_sizes, paths)
        except asyncio.CancelledError:  # the answer is lost: index none (a later scan does)
            sizes, generation, cancelled = [None] * len(wrote), -1, True
        checked = list(results)
        published = 0
        for i, size in zip(wrote, sizes):
            r = results[i]
            if size == r.size:
                published += r.size - r.replaced
            else:
                checked[i] = replace(r, skipped=True, replaced=0)
        self.stats.incr("writes_racing_clear", len(wrote))
        if published and generation == self._generation:  # (another clear since: they went with it)
            # the batch's own settlement goes to the old ledger's token: not applied (nor its
            # in-flight release: that slot went with the old ledger)
            try:
                await self._space.ledger_call(self._threads.executor, published)
            except asyncio.CancelledError:
                cancelled = True
        return generation, checked, cancelled

    def _apply_writes(
        self, jobs: list[_WriteJob], results: Sequence[page_io.WriteResult], generation: int, ok: list[bool]
    ) -> list[bool] | None:
        """Index what landed and count it; answers which of the pages it stored are not to be
        announced (see :class:`Written`), ``None`` if none: those held since the write began
        (announced stored before), and those a racing clear took (landed before it, or
        another clear since: answered written, but the store does not hold them, and no
        removal of them follows). Held when it began, not when it lands: the scan or a
        lookup's probe may index the file this very write published before this runs (then it
        was never announced); and one removed meanwhile (reported) is new again."""
        now = time.time()
        written = 0
        skipped = 0
        held = [False] * len(ok)
        index = self.index
        for j, r in zip(jobs, results):
            if r.ok:
                ok[j.index] = True
                cleared = generation != self._generation or (r.skipped and j.skip_size is None)
                held[j.index] = cleared or (j.held and j.pid in index)
                # a page skip_existing found stored (a page written before a racing clear is
                # marked skipped too, but it was written: it has no skip_size)
                skipped += r.skipped and j.skip_size is not None
                if generation == self._generation:
                    if r.skipped:
                        self.index.touch(j.pid, now)
                    else:
                        written += r.size
                        self.index.add(j.pid, r.size, j.parent, now)
                        self._scanner.indexed(j.pid)
            else:
                self._write_failed(j, r)
        self._space.wrote(written)
        if skipped:  # reported True like a write; engines' write metrics must tell them apart
            self.stats.incr("write_skipped_pages", skipped)
        if any(r.remade_namespace for r in results):
            self._namespace_remade()
        return held if any(held) else None

    def _refused_read_only(self, what: str, n: int) -> list[bool]:
        """An observer's write or delete: refused, counted, and said at most once a minute (an
        answer of ``False`` alone looks like a full or failing disk)."""
        self.stats.incr("read_only_refused_pages", n)
        count = self._read_only_warnings.due(n)
        if count:
            logger.warning("file store %s: opened read_only; refused %d page %s(s)", self.root, count, what)
        return [False] * n

    def _namespace_remade(self) -> None:
        """A write made the namespace folder again (a cleaner had deleted it: the default root
        is under /tmp). Housekeeping, which otherwise runs only after a scan or a clear, writes
        its manifest back and makes its page folders; once at a time."""
        if self._rehouse():
            logger.warning("file store %s: the folder of namespace %s was gone (deleted while in use?); set up again",
                           self.root, self.namespace.digest)

    def _rehouse(self) -> bool:
        """Run housekeeping in the background (the namespace folder was made again, or replaced
        by another process); whether it started (not while one runs, nor once closing)."""
        if self._stop.is_set() or (self._rehousing is not None and not self._rehousing.done()):
            return False
        task = self._rehousing = asyncio.get_running_loop().create_task(self._housekeeping())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    def _write_failed(self, job: _WriteJob, r: page_io.WriteResult) -> None:
        if r.pool_error:
            self.stats.incr("pool_page_errors")
            count = self._pool_warnings.due()
            if count:
                logger.error("file store %s: %d page(s) not written: %s", self.root, count, r.reason)
        elif r.errno in (errno.ENOSPC, errno.EDQUOT):
            self.stats.incr("enospc_errors")
            self._space.disk_full()
            count = self._enospc_warnings.due()
            if count:
                logger.warning(
                    "file store %s: disk full; %d page write(s) failed since the last warning (%s)",
                    self.root, count, job.page.label()[:80],
                )
        else:
            self.stats.incr("io_errors")
            count = self._write_error_warnings.due()
            if count:
                logger.warning("file store %s: %d page write(s) failed since the last warning; writing %s: %s",
                               self.root, count, job.page.label()[:80], r.reason)

    @_tracked
    async def _clear(self) -> list[PageKey] | None:
        """Empty the namespace; answers the pages it dropped (:meth:`_cleared_pages`)."""
        assert self._layout is not None
        if self.read_only:
            raise ConfigError(f"file store {self.root}: opened read_only, a clear is refused")
        self._generation += 1
        await self._scanner.stop()
        held = list(self.index.entries) if self._names_cleared_pages() else None
        self.index.clear()
        self._scanner.cleared()
        self._space.cleared()
        # before the rename: this store's journal reader may poll while the clear runs
        if self._peers is not None:
            self._peers.clearing()
        try:
            trash, written = await self._threads.run(page_io.clear_namespace, self._layout, self.namespace.to_dict())
        except BaseException:
            if self._peers is not None:  # no clear line comes: a fresh folder found is a replaced one
                self._peers.clearing(False)
            raise
        if self._peers is not None:
            await self._peers.append_cleared()
        self._manifest_pending = not written
        if not written:
            self._warn_manifest_deferred()
        self._scanner.complete()
        task: asyncio.Task[None] | None = None
        try:
            # after the rename, whatever happens here: the namespace is cleared. A header that
            # failed to read (EIO) or a cancellation while they were read skipped the rest: the
            # clear answered failed, reported nothing, and never removed the folder set aside
            dropped = await self._cleared_pages(trash, held)
        except Exception as exc:  # noqa: BLE001 - the pages are gone; only their names are lost
            logger.warning("file store %s: naming the pages a clear dropped failed (%s); reported as a clear "
                           "of any page", self.root, exc)
            dropped = None
        finally:  # (the headers are read before the folder set aside goes)
            if trash is not None or self._manifest_pending:
                work = self._remove_trash(trash) if trash is not None else self._housekeeping()
                task = asyncio.get_running_loop().create_task(work)
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if task is not None:
            # A small namespace is gone before clear() returns (its space is free at once); a
            # huge one keeps being deleted in the background instead of stalling the caller.
            await asyncio.wait({task}, timeout=_CLEAR_WAIT_SECONDS)
        return dropped

    def _names_cleared_pages(self) -> bool:
        """Whether a clear names the pages it drops: when KV-event consumers listen (a vLLM-schema
        router reads a clear without pages as "this replica holds nothing", device and host
        too), and the index lists every page this store announced (its opening scan is done:
        until then a page an earlier run wrote may be on disk unindexed)."""
        return self._scanner.is_ready and self.tier_changes.wants(ChangeKind.CLEARED, Tier.STORAGE)

    async def _cleared_pages(self, trash: str | None, held: list[str] | None) -> list[PageKey] | None:
        """The pages a clear dropped (``held``: the ids the index listed), named from their
        headers in the folder set aside before it is deleted: one header read per page, on the
        I/O threads, only where :meth:`_names_cleared_pages`. ``None`` where it cannot name
        them all (not asked to, or a header unreadable): the clear is then reported without
        pages."""
        if held is None:
            return None
        if not held:  # an empty index: nothing dropped that was announced
            return []
        if trash is None:  # the folder was gone already (deleted under the store): unknown when
            return None
        named = await self._threads.run(page_io.cleared_identities, self._layout, trash, held)
        return None if named is None else [PageKey(k, p) for k, p in named]

    # ------------------------------------------------------------------ removal journal

    def report_removed(self, pages: Sequence[PageKey], *, reason: str, origin: str = "local") -> None:
        """Report removed pages to subscribers and, for this store's own removals (evicted,
        corrupt), to the other processes through the journal: the one place removals go."""
        super().report_removed(pages, reason=reason, origin=origin)
        if origin == "local" and pages and self._peers is not None:
            self._peers.queue([(p.key, p.pool) for p in pages], reason)

    def _wants_removed_identities(self) -> bool:
        """(On an I/O thread.) Whether anyone needs the keys of the pages an eviction removes:
        the removal journal or KV-event subscribers."""
        return (self._peers is not None and self._peers.journal is not None) or self.tier_changes.wants(
            ChangeKind.REMOVED, Tier.STORAGE
        )

    def _peer_removal(self, removal: PeerRemoval) -> None:
        if removal.missed:
            self._prune_later()
            return
        if removal.replaced:
            # what the old folder held is gone, and a clear killed before its line leaves no other
            # sign (an ordinary clear's line says it, see .journal): the index is checked against
            # the disk, and housekeeping finishes the deletion
            self.stats.incr("namespace_folder_replaced")
            self._prune_later()
            self._rehouse()
            return
        if removal.cleared:
            self.stats.incr("peer_clears")
            # the namespace's files are gone: forget them all, or every lookup answered from the
            # index found pages no read returns. Pages this store wrote since the clear are on
            # disk still; a shared store probes what its index lacks and adopts them again
            busy = self._pins.busy
            for pid in [pid for pid in self.index.entries if not busy[pid]]:
                self._scanner.forget(pid)
            report_cleared(self.tier_changes, self.backend_name, origin="peer")
            return
        for key, pool in removal.pages:
            pid = page_id(key, pool)
            if pid in self.index and not self._pins.busy[pid]:
                self._scanner.forget(pid)  # a page we wrote again since is found again by its stat
        self.stats.incr("peer_removed_pages", len(removal.pages))
        self.report_removed([PageKey(k, p) for k, p in removal.pages], reason=removal.reason, origin="peer")

    def _prune_later(self) -> None:
        """The journal's tail skipped a whole file of it (rotated twice between two polls):
        what other processes removed meanwhile is unknown, and their pages stayed indexed,
        answered present until a read missed them. The index is checked against the disk
        instead (:meth:`_prune`), in the background, one check at a time (a file missed
        while one runs asks for one more after it: the running one may have looked already)."""
        if self._stop.is_set():
            return
        if self._pruning is not None and not self._pruning.done():
            self._prune_again = True
            return
        task = self._pruning = asyncio.get_running_loop().create_task(self._prune_until_done())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prune_until_done(self) -> None:
        while True:
            self._prune_again = False
            await self._prune()
            if not self._prune_again or self._stop.is_set():
                return

    async def _prune(self) -> None:
        """Forget the indexed pages whose files are gone (``pruned_pages``), on the scan's
        thread. A page written, read or removed here since the check kept (or lost) its entry
        for a reason of its own: only entries unchanged since are forgotten. Their keys are
        not known (the index holds page ids, the lines are lost), so no KV event goes out for
        them. Never raises but cancellation."""
        assert self._layout is not None and self._scan_executor is not None
        generation = self._generation
        entries = dict(self.index.entries)
        ids = list(entries)
        try:
            gone = await asyncio.get_running_loop().run_in_executor(
                self._scan_executor, page_io.missing_files, [self._layout.path(pid) for pid in ids], self._stop
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the pages are found gone at their next read instead
            logger.exception("file store %s: checking the index against the disk failed", self.root)
            return
        if generation != self._generation:  # cleared meanwhile: the index started over
            return
        busy, deleting = self._pins.busy, self._pins.deleting
        pids = [ids[i] for i in gone]
        pids = [pid for pid in pids if self.index.get(pid) is entries[pid] and not busy[pid] and pid not in deleting]
        for pid in pids:
            self._scanner.forget(pid)
        self.stats.incr("pruned_pages", len(pids))

    async def _remove_trash(self, trash: str) -> None:
        """Delete a cleared namespace's old files off the request path; never raises."""
        assert self._scan_executor is not None
        t0 = time.perf_counter()
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                self._scan_executor, page_io.remove_tree, trash, self._stop
            )
        except Exception:  # noqa: BLE001 - leftovers are only wasted space, retried at next open
            logger.exception("file store %s: deleting cleared pages in %s failed", self.root, trash)
            return
        logger.debug("file store %s: deleted %s in %.3fs (complete: %s)", self.root, trash, time.perf_counter() - t0, done)
        await self._housekeeping()

    async def wait_background(self) -> None:
        """Wait until the start-up scan and its housekeeping, and the deletion of cleared pages,
        are done (for tests and benchmarks; requests never need to wait for these)."""
        await self._ensure_open()
        while True:
            pending = [t for t in (self._scanner.task, *self._background) if t is not None and not t.done()]
            if not pending:
                return
            await asyncio.gather(*pending, return_exceptions=True)

    async def list_namespaces(self) -> list[Namespace]:
        """Every namespace a folder's manifest describes; :meth:`read_namespaces` also names
        the folders whose manifest describes none (inspect lists them, so no warning here)."""
        return (await self.read_namespaces())[0]

    async def read_namespaces(self) -> tuple[list[Namespace], dict[str, str]]:
        """The namespace each folder's manifest describes, and why for each folder whose
        manifest is corrupt (not JSON, fields of another format) or describes another
        namespace than its folder's (each folder is in one of the two)."""
        manifests = await asyncio.to_thread(page_io.read_manifests, str(self.root))
        found: list[Namespace] = []
        corrupt: dict[str, str] = {}
        for digest, m in manifests.items():
            if isinstance(m, str):
                corrupt[digest] = m
                continue
            try:
                ns = Namespace.from_dict(m)
            except (ConfigError, TypeError, ValueError) as exc:  # ValueError: an ``extra`` like "ab"
                corrupt[digest] = f"manifest.json has fields of another format: {type(exc).__name__}: {exc}"
                continue
            if ns.digest != digest:
                # corrupt only: listed as found too, one edited manifest was two problems in
                # inspect's report (a corrupt manifest, and one naming a folder that is not there)
                corrupt[digest] = (f"manifest.json describes namespace {ns.digest}, not this folder's "
                                   "(edited, or written by another version)")
                continue
            found.append(ns)
        return found, corrupt

    def other_namespaces_holding(self, key: str, pool: str = "kv", *, limit: int = 8) -> list[str] | None:
        """Other namespaces under this root (the first ``limit`` by digest) with a file for the
        page: one ``listdir`` and at most ``limit`` ``lstat`` calls; no page is read."""
        pid = page_id(key, pool)
        own = self.namespace.digest
        found = []
        for digest in [d for d in page_io.namespace_dirs(self.root) if d != own][:limit]:
            try:
                os.lstat(NamespaceLayout(self.root, digest).path(pid))
            except OSError:
                continue
            found.append(digest)
        return found

    async def list_pages(self) -> list[tuple[PageKey, int]]:
        return (await self.survey_pages())[0]

    async def survey_pages(self) -> tuple[list[tuple[PageKey, int]], int]:
        """:meth:`list_pages`, and how many page files the listing could not read (torn, a
        damaged footer: ``hicache inspect`` counts them corrupt), from the same look at each
        folder: counted apart, a live server's writes and evictions in between were miscounted
        as corrupt pages."""
        await self._ensure_open()
        assert self._layout is not None
        rows, unreadable = await asyncio.to_thread(page_io.survey_pages, self._layout)
        return [(PageKey(key, pool), size) for key, pool, size in rows], unreadable

    async def describe_space(self) -> dict[str, Any]:
        """The file system's free space against ``min_free_bytes``, and this namespace's shared
        count (``used_bytes``: pages; ``inflight_bytes``: reserved by writes in flight) and
        refused writes (recorded by every process in the usage ledger)."""
        ledger_path = os.path.join(self.layout.ns_dir, LEDGER_NAME)

        def facts() -> tuple[os.statvfs_result | None, Usage | None]:
            try:
                st = os.statvfs(self.root)
            except OSError:
                st = None
            return st, read_usage(ledger_path)

        st, usage = await asyncio.to_thread(facts)
        out: dict[str, Any] = {"min_free_bytes": self.min_free_bytes, "max_bytes": self.max_bytes}
        if st is not None:
            free = st.f_bavail * st.f_frsize
            out.update(free_bytes=free, fs_bytes=st.f_blocks * st.f_frsize)
            out["writes_refused_for_free_space"] = bool(self.min_free_bytes) and free < self.min_free_bytes
        if usage is not None:
            # the count holds every write in flight (reserved before a byte is written) and a
            # killed writer's reservation until a writer gives it back: not pages
            out.update(used_bytes=max(0, usage.used - usage.inflight), inflight_bytes=usage.inflight,
                       refused_pages_no_space=usage.refused)
            if usage.refused:
                out["last_refused_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(usage.refused_at))
        return out

    def _backend_stats(self) -> dict[str, Any]:
        return {
            "root": self.root,
            # the medium the store-wide figures describe: one namespace of one root (every cache
            # on it reports the same pages; a scrape counts them once per store, not per cache)
            "store": f"file:{self.root}#{self.namespace.digest}",
            "stored_pages": len(self.index),
            "stored_bytes": self.index.nbytes,
            "max_bytes": self.max_bytes,
            "min_free_bytes": self.min_free_bytes,
            "evicted_pages": self.stats.get("evicted_pages"),
            "evicted_bytes": self.stats.get("evicted_bytes"),
            "corrupt_pages": self.stats.get("corrupt_pages"),
            "rejected_pages_no_space": self.stats.get("rejected_pages_no_space"),
            "write_late_pages": self.stats.get("write_late_pages"),  # stored for a caller that gave up
            "index_ready": self.index_ready,
            "scan_seconds": self._scanner.seconds,
            "io_threads": self.io_threads,
            "fsync": self.fsync,
            "shared": self.shared,
            "read_only": self.read_only,
            "journal_dropped_lines": self._peers.dropped_lines if self._peers is not None else 0,
            "journal_missed_files": self._peers.missed_files if self._peers is not None else 0,
            "journal_torn_lines": self._peers.torn_lines if self._peers is not None else 0,
            # lines no store writes (another version's, a damaged file): skipped, each a warning
            "journal_malformed_lines": self._peers.malformed_lines if self._peers is not None else 0,
            "pruned_pages": self.stats.get("pruned_pages"),
            "journal_failed_removals": self._peers.failed_removals if self._peers is not None else 0,
        }
