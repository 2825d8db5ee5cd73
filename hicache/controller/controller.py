"""``HiCacheController``: the one asyncio component that moves KV pages between tiers.

It runs in the caller's event loop, next to the server's scheduler, and never blocks it: torch
copies run on the copy engine's thread, storage I/O is awaited, and the tree the cache keeps is
only touched from completion callbacks that run on the loop. That is why no lock guards the
tree: there is one thread.

Work and who owns it::

    submit_backup()          -> backup queue (bounded)  -> backup worker  -> CopyEngine.backup
    start_load()             -> CopyEngine.load (per layer) + a watcher task
    submit_storage_write()   -> storage queue (bounded) -> storage worker -> batch_set_v2 (retries)
    start_prefetch()         -> one task per request    -> batch_exists_v2, batch_get_v2 in batches
                                (a :class:`~hicache.controller.prefetch.Prefetcher` it owns)

Storage coroutines run on a private I/O loop thread (:mod:`hicache.controller.io_thread`), so
whatever a backend does before its first ``await`` never runs on the server's loop.

Whether the store answers is remembered (:mod:`hicache.controller.health`): a store that hangs
or keeps failing is skipped, for every backend, until a probe finds it back.

Every task is created by :meth:`_spawn` and kept in ``self._tasks`` until it ends; ``aclose()``
drains the queues (or reports what it could not write), cancels the rest and awaits them all.
A backend that raises or hangs costs a counter and a log line, never a worker.

The controller does not know the tree. The cache hands it indices, keys and callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import enum
import inspect
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from hicache.controller.close_task import close_with, start_close_task
from hicache.controller.config import ControllerConfig
from hicache.controller.health import HealthState, StorageHealth
from hicache.controller.io_thread import IoThread
from hicache.controller.jobs import (
    BackupJob,
    CloseReport,
    PrefetchOp,
    PrefetchResult,
    StorageWriteJob,
    UnwrittenBackup,
)
from hicache.controller.metrics import ControllerMetrics
from hicache.controller.prefetch import Prefetcher
from hicache.controller.transfers import all_pools_ok, call_back, slice_transfer
from hicache.errors import CacheClosedError, ConfigError, InvalidKeyError, LoopMisuseError, quoted
from hicache.memory.slots import read_slots
from hicache.observability import tracing
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
)
from hicache.storage.base import time_share
from hicache.storage.hit_policy import leading_run
from hicache.storage.offload import wait_out
from hicache.storage.stats import CallCounts, Throttle, counting_call

__all__ = ["HiCacheController", "ControllerState"]

_F = TypeVar("_F", bound="asyncio.Future[Any]")

logger = logging.getLogger("hicache.controller")


KV = PoolName.KV.value
#: the key health probes look up: never written, so a probe only asks the store to answer
_PROBE_KEY = "hicache-health-probe"
# the storage call kinds the controller makes, named as the latency histogram names them
_OPS = {"exists": "exists", "read": "get", "write": "set"}
#: storage write jobs the worker takes at once (see HiCacheController._write_jobs)
_HOP_MAX_JOBS = 64
_STORAGE_WORKER = "hicache-storage-write"  # the storage worker's task name (close looks for it)
#: the close's last two waits (a store close that outlived its cancellation, workers stuck in a
#: hung store's write), each at most this long and never past the close's deadline
_LAST_CLOSE_WAIT_S = 1.0
#: one storage call made inside a hop: its result (or the exception it raised), its seconds,
#: whether the backend counted an error meanwhile (judged on the loop, see _judge), and the
#: pages it refused for room (see _no_room)
_InnerCall = tuple[Any, float, bool, int]


@dataclasses.dataclass(eq=False)
class _CallClock:
    """When one storage call left this loop, began on the I/O loop and ended there
    (``time.monotonic``; ``None``: not yet).

    Why: the stall and timeout limits judge the store, so they must count the time the store
    took, not the time the server's loop was blocked (a slow synchronous forward pass, a long
    garbage collection). While this loop is blocked the I/O loop goes on, a call may end there,
    and its answer waits for this loop; the expired wait would then read as a store that gave
    no answer. So a call that has ended on the I/O loop is never stalled or timed out, and one
    that has not yet left this loop (its task has not run) has not started to count."""

    handed: float | None = None
    began: float | None = None
    ended: float | None = None

    def since(self, floor: float) -> float:
        """Where the call's limits count from: ``floor`` (the caller's start, or a hop's last
        inner call), or later when the call began later (on the I/O loop) or has not yet left
        this loop (now)."""
        if self.handed is None:
            return max(floor, time.monotonic())
        return max(floor, self.handed, self.began or 0.0)

    def seconds(self, fallback: float) -> float:
        """The call's latency as the I/O loop saw it (``fallback`` when it never ran there)."""
        if self.began is None or self.ended is None:
            return fallback
        return self.ended - self.began


async def _clocked(coro: Coroutine[Any, Any, Any], clock: _CallClock,
                   landed: Callable[[], None] | None = None) -> Any:
    """Run ``coro`` (on the I/O loop), noting in ``clock`` when it began and ended there, and
    calling ``landed()`` there once it has returned (not raised)."""
    clock.began = time.monotonic()
    try:
        result = await coro
    finally:
        clock.ended = time.monotonic()
    if landed is not None:
        landed()
    return result


@dataclasses.dataclass(eq=False)
class _Batch:
    """One ``batch_set_v2`` call of a storage write job."""

    transfers: list[PoolTransfer]
    info: HiCacheStorageExtraInfo
    pages: int


@dataclasses.dataclass(eq=False)
class _HopResult:
    """What one job's part of a hop did, call by call: its deletions (``None``: not sent, or
    none asked) and each batch sent."""

    deleted: _InnerCall | None = None
    batches: list[_InnerCall] = dataclasses.field(default_factory=list)


class ControllerState(enum.Enum):
    UNSTARTED = "unstarted"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class HiCacheController:
    """Moves pages device<->host (copy engine) and host<->storage (async backend).

    Args:
        copy_engine: ``hicache.memory.CopyEngine`` between the device pool and ``host_pool``.
        host_pool: the host KV pool (page protocol; ``page_size``, ``page_nbytes``).
        storage: an ``AsyncHiCacheStorage`` or ``None`` (no L3).
        config: :class:`ControllerConfig`.
        metrics: shared :class:`ControllerMetrics` (one is made when omitted).
        own_storage: close ``storage`` in :meth:`aclose`.
        storage_thread: run storage coroutines on a private I/O loop thread (see
            :mod:`hicache.controller.io_thread`) so backend work never runs on this loop.
    """

    def __init__(
        self,
        *,
        copy_engine: Any,
        host_pool: Any,
        storage: AsyncHiCacheStorage | None = None,
        config: ControllerConfig | None = None,
        metrics: ControllerMetrics | None = None,
        own_storage: bool = False,
        storage_thread: bool = True,
    ) -> None:
        self.copy_engine = copy_engine
        self.host_pool = host_pool
        self.storage = storage
        self.config = config or ControllerConfig()
        self.metrics = metrics or ControllerMetrics()
        self.own_storage = own_storage
        self._io = IoThread(nice=self.config.io_thread_nice) if storage is not None and storage_thread else None
        self.page_size: int = int(host_pool.page_size)
        self.page_nbytes: int = int(getattr(host_pool, "page_nbytes", 0) or 0)
        self.state = ControllerState.UNSTARTED
        #: the loop :meth:`start` ran on: every call that takes work must come from it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._backup_q: asyncio.Queue[BackupJob] | None = None
        self._storage_q: asyncio.Queue[StorageWriteJob] | None = None
        self._loads: set[asyncio.Task[Any]] = set()
        #: the storage jobs the worker has taken and not acknowledged, each with the leading
        #: pages it has landed so far (close acknowledges those, reports only the rest)
        self._storage_busy: dict[StorageWriteJob, int] = {}
        #: the jobs whose storage call the worker is in (a hop's, or the one job it writes on
        #: its own): when the worker is stuck at close, the ones close reports ``"stuck"``
        self._storage_calling: list[StorageWriteJob] = []
        #: callers of :meth:`wait_storage_progress`, woken when the next storage job ends
        self._storage_progress: list[asyncio.Future[None]] = []
        self._backup_busy: list[BackupJob] = []
        #: set once close has reported what its cancelled workers left: from then on nothing
        #: is queued, not even a continuation, since no worker would ever run it
        self._sealed = False
        #: set whenever the backup queue may have room (a worker took jobs, close emptied it or
        #: sealed): what :meth:`backup` waits on instead of a put that close cannot reach
        self._backup_room = asyncio.Event()
        #: the one close every aclose() caller awaits (a second caller must not be told
        #: "drained" while the first is still draining)
        self._close_task: asyncio.Task[CloseReport] | None = None
        #: the caller that started the close was cancelled before it got the report: the next
        #: aclose() gets it whole (its lists are then reported once, not never)
        self._report_owed = False
        #: the close task was cancelled: the rest of the close goes on, hurried (see _hurry)
        self._close_cancelled = False
        self._free_host: Callable[[torch.Tensor], None] = host_pool.free
        #: the owner's count of the pages it meant for storage that are not there at close (see
        #: set_unstored_count), and the keys close reported ``unwritten`` (that count leaves them out)
        self._count_unstored: Callable[[set[str]], int] | None = None
        self._unwritten_keys: set[str] = set()
        self._prefetcher: Prefetcher | None = None
        self.health = StorageHealth(
            errors_to_trip=self.config.storage_health_errors,
            probe_base_s=self.config.storage_probe_base_s,
            probe_max_s=self.config.storage_probe_max_s,
            on_change=self._health_changed,
            count=self.metrics.incr,
        )
        #: storage calls in flight that a store going down interrupts, each with its caller's
        #: ``gave_up`` (see :meth:`_storage_call`)
        self._calls: dict[asyncio.Future[Any], Callable[[], None] | None] = {}
        self._up_listeners: list[Callable[[], None]] = []  # see on_storage_up
        self._stuck_calls = 0  # cancelled calls still running past cancelled_io_grace_s
        self._no_room_warnings = Throttle()  # writes a bounded store refused for room (see _no_room)
        self._prober: asyncio.Task[None] | None = None
        if storage is not None:
            registered = getattr(storage, "registered_pools", {}).get(KV)
            if registered is None:
                storage.register_mem_pool_host(host_pool)
            elif registered is not host_pool:
                raise ConfigError(
                    "the storage backend moves pages of another host pool; give each cache its "
                    "own backend object (share a medium instead, e.g. the memory backend's store_id)"
                )
            self._prefetcher = Prefetcher(
                storage=storage, config=self.config, metrics=self.metrics, page_size=self.page_size,
                page_nbytes=self.page_nbytes, spawn=self._spawn, storage_call=self._storage_call,
                free_host=lambda indices: self._free_host(indices),
            )
        self.metrics.gauge("backup_queue_depth", lambda: self._backup_q.qsize() if self._backup_q else 0)
        self.metrics.gauge("storage_queue_depth", lambda: self._storage_q.qsize() if self._storage_q else 0)
        self.metrics.gauge("prefetch_inflight", lambda: self._prefetcher.inflight if self._prefetcher else 0)
        self.metrics.gauge("prefetch_inflight_tokens",
                           lambda: self._prefetcher.inflight_tokens if self._prefetcher else 0)
        self.metrics.gauge("loads_inflight", lambda: len(self._loads))
        self.metrics.gauge("recompute_tokens_per_s", self._recompute_rate,
                           "prefill tokens/s the prefetch wait is weighed against (0: not known yet)")
        self.metrics.gauge("tasks", lambda: len(self._tasks))
        self.metrics.gauge("storage_calls_stuck_now", lambda: self._stuck_calls)
        if storage is not None:
            self.metrics.gauge("storage_up", lambda: 1.0 if self.health.up else 0.0)

    # ------------------------------------------------------------------ lifecycle

    @property
    def has_storage(self) -> bool:
        return self.storage is not None

    async def open_storage(self) -> None:
        """Open the storage backend on the loop its calls run on (the private I/O loop when
        there is one): backends bind locks, events and background tasks to the loop that opens
        them, and that loop is also the one that closes them in :meth:`aclose`."""
        if self.storage is not None:
            await self._on_io(self.storage.open())

    def set_host_free(self, free: Callable[[torch.Tensor], None]) -> None:
        """Route host-page frees through the cache (which keeps its own accounting)."""
        self._free_host = free

    def set_unstored_count(self, count: Callable[[set[str]], int]) -> None:
        """Let the close report's ``failed_storage_pages`` come from ``count(unwritten_keys)``:
        the pages the owner meant for storage that are not there once the close has drained,
        but for ``unwritten_keys`` (reported in ``unwritten``). Why: only the owner knows what
        a later write landed (the tree offers a skipped or failed write again when the store
        comes back); the controller's counters are lifetime totals, and summed as "never
        written" they named pages storage held at close."""
        self._count_unstored = count

    def start(self) -> None:
        """Create queues and workers on the running loop (called lazily on first use)."""
        if self.state is ControllerState.RUNNING:
            return
        if self.state is not ControllerState.UNSTARTED:
            raise CacheClosedError("the controller is closed")
        try:
            self._loop = asyncio.get_running_loop()  # the loop that will own the tasks
        except RuntimeError:
            raise LoopMisuseError(
                "HiCacheController runs in the server's event loop: call the cache from a "
                "coroutine (or a callback) on that loop's thread"
            ) from None
        self._backup_q = asyncio.Queue(self.config.backup_queue_size)
        self._storage_q = asyncio.Queue(self.config.storage_queue_size)
        self.state = ControllerState.RUNNING
        self._spawn(self._backup_worker(), "hicache-backup", detached=True)
        if self.storage is not None:
            self._spawn(self._storage_worker(), _STORAGE_WORKER, detached=True)

    def _accepting(self, continuation: bool = False) -> bool:
        """Whether new work is taken. While closing, only continuations of work already
        accepted (a finished host backup queueing its storage write) are, so that ``aclose``
        drains them or reports them."""
        if self.state is ControllerState.UNSTARTED:
            self.start()
        if self.state is not ControllerState.CLOSED:
            self._check_loop()
        if self.state is ControllerState.CLOSING:
            return continuation and not self._sealed
        return self.state is ControllerState.RUNNING

    def _check_loop(self) -> None:
        """:class:`LoopMisuseError` unless called on the loop the controller started on. Why:
        its queues, tasks and prefetch ops belong to that loop and are not thread-safe. A
        :meth:`start_prefetch` from another thread registered its op and tokens, then failed to
        start its task (no running loop there): the op, its in-flight tokens and its rid stayed
        taken for good, and a ``start_load`` left a copy running that nobody watched."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise LoopMisuseError(
                "HiCacheController was started on another event loop: call it from a coroutine "
                "(or a callback) on that loop's thread (asyncio.run_coroutine_threadsafe from another thread)"
            )

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str, *, detached: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` as a task the close waits for. ``detached``: in a fresh context, for a
        task that outlives the call that starts it (the workers, the prober). Why: a task copies
        its creator's context, and the workers start lazily inside the first request's
        ``begin``: they took its current span, so every later request's ``hicache.backup``
        spans landed in that first request's trace instead of being roots."""
        context = contextvars.Context() if detached else None
        task = asyncio.get_running_loop().create_task(coro, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.metrics.incr("worker_errors")
            logger.error("controller task %s died", quoted(task.get_name()), exc_info=task.exception())

    async def drain(self) -> None:
        """Wait until every queued and running backup and load has completed (a completion may
        queue more work, e.g. a host backup queues its storage write, so loop until quiet)."""
        if self.state in (ControllerState.UNSTARTED, ControllerState.CLOSED):
            return  # closed: every job was completed or reported; nothing will ever finish
        while True:
            if self._backup_q is not None:
                await self._backup_q.join()
            if self._storage_q is not None:
                await self._storage_q.join()
            if self._loads:
                await asyncio.wait(set(self._loads))
            await asyncio.sleep(0)
            if (
                (self._backup_q is None or self._backup_q._unfinished_tasks == 0)  # type: ignore[attr-defined]
                and (self._storage_q is None or self._storage_q._unfinished_tasks == 0)  # type: ignore[attr-defined]
                and not self._loads
            ):
                return

    async def drain_backups(self) -> None:
        """Wait until every queued device->host copy and every load has completed; storage
        writes may still be running. What device eviction waits for: a slow or hung storage
        backend must not hold up freeing device memory whose host copy is already done."""
        if self.state in (ControllerState.UNSTARTED, ControllerState.CLOSED):
            return
        while True:
            if self._backup_q is not None:
                await self._backup_q.join()
            if self._loads:
                await asyncio.wait(set(self._loads))
            await asyncio.sleep(0)
            if (self._backup_q is None or self._backup_q._unfinished_tasks == 0) and not self._loads:  # type: ignore[attr-defined]
                return

    @property
    def storage_writes_pending(self) -> int:
        """Storage write jobs queued or running (not yet acknowledged)."""
        q = self._storage_q
        return 0 if q is None or self.state is ControllerState.CLOSED else q._unfinished_tasks  # type: ignore[attr-defined]

    @property
    def storage_queue_full(self) -> bool:
        """Whether :meth:`submit_storage_write` would refuse a job for want of queue room now."""
        q = self._storage_q
        return q is not None and q.full()

    async def wait_storage_progress(self) -> None:
        """Wait until the next storage write job ends (written, failed or reported at close);
        at once when none is queued or running. What device eviction waits for when the room it
        needs is held by writes in flight: the first that lands may free it, and waiting for the
        whole queue (:meth:`drain`) made eviction as slow as the slowest store's backlog."""
        if not self.storage_writes_pending:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._storage_progress.append(fut)
        try:
            await fut
        finally:
            if fut in self._storage_progress:
                self._storage_progress.remove(fut)

    def _storage_progressed(self) -> None:
        waiters, self._storage_progress = self._storage_progress, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_prefetches(self) -> None:
        """Wait until every prefetch task has ended and every page it held is back (tests,
        replay)."""
        while True:
            pending = [t for t in self._tasks if t.get_name().startswith("hicache-prefetch")]
            if not pending:
                return
            await asyncio.wait(pending)

    async def aclose(self, timeout: float | None = None, *, deadline: float | None = None) -> CloseReport:
        """Stop accepting work, drain the queues (up to ``timeout``, default
        ``config.close_timeout_s``), report each backup left unwritten, and leave no task
        running. Idempotent: a call while another is closing waits for that close and gets its
        report; a call after it returns an empty report. A cancelled caller does not cancel
        the close (another caller may be waiting for it).

        ``timeout=0`` is a hurried close (what a cancelled close falls back to): a close
        already running is hurried as a cancellation of it would (its drain cut short now, what
        it leaves reported, each later wait capped at ``cancelled_io_grace_s``). Why: the caller
        falling back after a cancellation waited for the running drain (up to
        ``close_timeout_s``) instead; a cancellation hurries a close wherever it lands.

        ``deadline`` (``time.monotonic()``): when the whole close must end (what is left of a
        server's drain). The drain, the wait for the workers, the storage's close (handed what
        is left, so it stops waiting and says what it left) and the I/O thread's stop each take
        a share of the time left, none more than its own bound. Why: each step bounded on its
        own, a close with a slow store took four times ``timeout``, past the server's drain.
        ``None``: each step its own bound. The first call's deadline holds."""
        # the close task is looked at before the state: a first caller cancelled while the
        # close ran never got its report, and the close may have ended before the next call
        # (the state alone said "closed" and that call got an empty report: lost silently)
        task = self._close_task
        if task is None and self.state is ControllerState.CLOSED:
            return CloseReport(drained=True)
        if task is None:
            if timeout is not None and timeout <= 0:
                self._close_cancelled = True  # hurried from the start: each wait capped as after a cancel
            # a CloseTask: cancelled before its first step, it still closes (hurried)
            self._close_task = start_close_task(self._close(timeout, deadline), name="hicache-controller-close")
            try:
                return await asyncio.shield(self._close_task)
            except asyncio.CancelledError:
                self._report_owed = True  # the first caller never got the report: the next one does
                raise
        if task.cancelled():  # unwound by a cancellation it did not take back: nothing reported
            return CloseReport(drained=False)
        if timeout is not None and timeout <= 0 and not task.done():
            task.cancel()  # hurried: the close takes it back and goes on (see _hurry)
        report = await asyncio.shield(task)
        if self._report_owed:
            self._report_owed = False
            return report
        # the first caller owns the report; later ones learn how it went, not its lists
        return CloseReport(drained=report.drained)

    async def _close(self, timeout: float | None, deadline: float | None = None) -> CloseReport:
        was_running = self.state is ControllerState.RUNNING
        self.state = ControllerState.CLOSING
        report = CloseReport(drained=True)
        stuck = 0
        if was_running:
            # (the drain leaves half of the time left for the rest of the close)
            limit = time_share(self.config.close_timeout_s if timeout is None else timeout, deadline, 0.5)
            if self._prefetcher is not None:
                report.cancelled_prefetches += self._prefetcher.abort_all()
            try:
                async with asyncio.timeout(limit):
                    await self._drain_for_close()
            except TimeoutError:
                report.drained = False
                logger.warning("controller close: queues did not drain within %.1f s", limit)
            except asyncio.CancelledError:
                # The close task itself was cancelled: a shutdown sweep (asyncio.run cancels
                # every task left at its end) or a caller's cleanup. Re-raised here, it left the
                # workers running, the storage open, its I/O thread alive and every queued write
                # neither written nor reported. A cancellation only cuts the drain short (as
                # the timeout does); the rest of the close is bounded and still runs.
                self._hurry("while draining; reporting what is left")
                report.drained = False
            for task in list(self._tasks):
                task.cancel()
            pending = await self._wait_tasks(self._hurried(time_share(limit, deadline, 1 / 3)))
            stuck = len(pending)
            report.stuck_storage_calls = stuck
            writing = any(t.get_name() == _STORAGE_WORKER for t in pending)
            self._report_leftovers(report, self._storage_calling if writing else [])
        self._sealed = True  # no worker is left: a continuation from now on is refused, not lost
        self._backup_room.set()  # a backup() waiting for room learns the queue is closed
        # A backend that blocks its I/O loop (a hung mount) must not make close hang: its
        # close and the I/O thread's exit are each waited for at most max(1 s,
        # close_timeout_s); the thread is a daemon and is left behind with a warning.
        limit = self._hurried(max(1.0, self.config.close_timeout_s if timeout is None else timeout))
        closing: asyncio.Future[Any] | None = None
        if self.own_storage and self.storage is not None:
            # waited for, not cancelled: cancelling a call whose I/O loop is blocked waits for
            # that loop to run the cancellation, which it never does (close hung for good);
            # stopping the I/O thread below settles it instead
            # submitted, not a task of this loop: a shutdown sweep cancelling every task would
            # cancel the backend's close halfway (its threads left running)
            # The store is handed most of the time it is waited for (the rest: its answer),
            # with a deadline most of what is left (the rest also for the I/O thread's stop).
            # Why: a store whose own bounds were longer (an S3 store waiting for its writes)
            # had its close abandoned mid-way, its I/O loop stopped under it, and the uploads
            # it would have aborted were left in the bucket without a word
            waited = time_share(limit, deadline, 0.9)
            store_close = close_with(self.storage.aclose, timeout=time_share(0.8 * limit, deadline, 0.8))
            closing = (self._io.submit(store_close) if self._io is not None
                       else asyncio.ensure_future(store_close))
            await self._close_wait({closing}, waited)
            if not closing.done():
                logger.warning("controller close: the storage backend did not close within %.1f s", waited)
            elif not closing.cancelled() and closing.exception() is not None:
                logger.error("closing the storage backend failed", exc_info=closing.exception())
        if self._io is not None:
            try:
                # settles the calls its loop never finished
                stop_s = limit if deadline is None else max(0.1, time_share(limit, deadline))
                await self._io.stop(timeout=self._hurried(stop_s), cancelled_limit=self._hurried(stop_s, True))
            except asyncio.CancelledError:  # raised once the stop is done: the thread was joined
                self._hurry("while its I/O thread stopped")
        # the last two waits (_LAST_CLOSE_WAIT_S each at most) take what the deadline leaves, no more: a
        # store's close that outlives its cancellation and calls stuck in a hung store held a
        # close with a deadline up to 2 s past it (what they leave is reported all the same)
        if closing is not None and not closing.done():
            closing.cancel()  # its I/O call was settled by stop(): this only ends the wrapper
            await self._close_wait({closing}, time_share(_LAST_CLOSE_WAIT_S, deadline))
        if stuck:
            await self._wait_tasks(time_share(_LAST_CLOSE_WAIT_S, deadline))
        self.state = ControllerState.CLOSED
        self._count_failed_storage(report)
        if stuck:  # the stuck calls beside all else the close left (the report's fields are final now)
            logger.warning("controller %s", report.summary())
        try:
            await self.metrics.aclose()  # this cache's families leave the scrape
        except asyncio.CancelledError:  # they left all the same (its finally): keep the report
            self._hurry("while its metrics closed")
        return report

    def _count_failed_storage(self, report: CloseReport) -> None:
        """Fill the report's storage failures: the lifetime total of the failure counters, and
        the pages not in storage at close (the owner's count, see :meth:`set_unstored_count`;
        without one, the lifetime total: nothing here offers a write again)."""
        counters = self.metrics.counters
        lifetime = int(counters.get("storage_write_failures", 0) + counters.get(
            "storage_write_skipped_unhealthy", 0) + counters.get("storage_write_dropped_pages", 0))
        report.lifetime_failed_storage_pages = lifetime
        report.failed_storage_pages = lifetime
        counted = False
        if self._count_unstored is not None:
            try:
                report.failed_storage_pages = self._count_unstored(self._unwritten_keys)
                counted = True
            except Exception:  # noqa: BLE001 - the close goes on; the lifetime total stands in
                logger.exception("controller close: counting the pages not in storage failed")
        self._unwritten_keys = set()
        if report.failed_storage_pages and counted:
            logger.warning("controller close: %d page(s) meant for storage are not there (their writes failed, "
                           "were skipped while storage was down or wait for their prefix's, and nothing wrote "
                           "them since)", report.failed_storage_pages)
        elif report.failed_storage_pages:
            logger.warning("controller close: over its life, %d page(s) meant for storage were not written there "
                           "(writes failed, skipped while storage was down, or dropped from host before their turn)",
                           report.failed_storage_pages)

    def _hurry(self, where: str) -> None:
        """The close task was cancelled (asyncio.run's shutdown sweep, a caller's cleanup):
        take the cancellation back and go on. Why: unwinding at an await after the drain
        skipped the rest of the close - the storage stayed open, the I/O and file threads
        alive, the state CLOSING - and the report was lost. A cancellation only hurries the
        close, wherever it lands."""
        _uncancel()
        if not self._close_cancelled:
            logger.warning("controller close: cancelled %s", where)
        self._close_cancelled = True

    async def _close_wait(self, aws: set[_F], timeout: float) -> set[_F]:
        """``asyncio.wait(aws, timeout=timeout)`` for a step of the close, through any
        cancellation of the close task (see :meth:`_hurry`); returns what is still pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = set(aws)
        while pending:
            try:
                _, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
                return pending
            except asyncio.CancelledError:
                self._hurry("while it waited for its tasks, storage or I/O thread")
                deadline = min(deadline, loop.time() + self._hurried(timeout, True))
        return pending

    def _hurried(self, limit: float, cancelled: bool = False) -> float:
        """``limit`` for a wait of the close, capped once the close was cancelled (or when
        ``cancelled``) at ``cancelled_io_grace_s`` (1 s when that is 0). Why: a cancelled close
        runs inside asyncio.run's shutdown, and waiting close_timeout_s for each of its tasks,
        storage close and I/O thread (3 x 30 s by default) held the process that long."""
        if cancelled or self._close_cancelled:
            return min(limit, self.config.cancelled_io_grace_s or 1.0)
        return limit

    async def _wait_tasks(self, timeout: float) -> set[asyncio.Task[Any]]:
        """Wait up to ``timeout`` for the (cancelled) tasks to end; those still running.
        A task can outlive its cancellation only while it waits out a storage call that has not
        returned (a hung mount): it is reported, never abandoned silently."""
        if not self._tasks:
            return set()
        pending = await self._close_wait(set(self._tasks), max(0.1, timeout))
        if pending:
            logger.warning(
                "controller close: %d task(s) still wait for storage calls that have not returned: %s",
                # quoted, a few: a prefetch's name carries its request's id (the caller's text)
                len(pending), quoted(sorted(t.get_name() for t in pending)),
            )
        return pending

    async def _drain_for_close(self) -> None:
        while True:
            await self.drain()
            if not [t for t in self._tasks if t.get_name().startswith("hicache-prefetch")]:
                return
            await asyncio.wait([t for t in self._tasks if t.get_name().startswith("hicache-prefetch")])

    def _report_leftovers(self, report: CloseReport, stuck: list[StorageWriteJob]) -> None:
        """Fail every job the cancelled workers left behind; report storage writes, those in
        ``stuck`` (in the write call the worker still waits for) as ``"stuck"``: that call may
        yet land their pages, unlike a write never sent. Their callbacks may queue more
        (nothing succeeds now), so repeat until the queues are empty."""
        while True:
            backups: list[BackupJob] = list(self._backup_busy)
            self._backup_busy = []
            # jobs a cancelled worker had taken were never marked done: mark them, or every
            # later join() (drain) would wait forever
            for _ in backups:
                if self._backup_q is not None:
                    self._backup_q.task_done()
            if self._backup_q is not None:
                while not self._backup_q.empty():
                    backups.append(self._backup_q.get_nowait())
                    self._backup_q.task_done()
            leftovers: list[tuple[StorageWriteJob, int]] = list(self._storage_busy.items())
            self._storage_busy = {}
            for _ in leftovers:
                if self._storage_q is not None:
                    self._storage_q.task_done()
            if self._storage_q is not None:
                while not self._storage_q.empty():
                    leftovers.append((self._storage_q.get_nowait(), 0))
                    self._storage_q.task_done()
            if not backups and not leftovers:
                self._storage_progressed()  # nothing is left to end: no waiter may stay asleep
                return
            for bjob in backups:
                report.failed_device_backups += 1
                call_back(bjob.on_done, False)
            for job, landed in leftovers:
                pages = len(job.keys) - landed
                if pages > 0:  # (a job of deletions alone writes nothing: its end tells its policy)
                    first = job.keys[landed]
                    reason = "stuck" if job in stuck else "closed"
                    report.unwritten.append(UnwrittenBackup(first, pages, reason))
                    self._unwritten_keys.update(job.keys[landed:])
                    self.metrics.incr("unwritten_on_close", pages)
                    logger.warning("controller close: %d page(s) from key %.16s... were not written to storage%s",
                                   pages, first, " (their write call is stuck; it may still land them)"
                                   if reason == "stuck" else "")
                call_back(job.on_done, landed)

    # ------------------------------------------------------------------ device -> host

    def submit_backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor,
                      on_done: Callable[[bool], None]) -> bool:
        """Queue a device->host copy; ``False`` (and nothing queued) when the queue is full or
        the controller is closed. ``on_done(ok)`` runs on the loop once the host pages hold the
        data (or the copy failed)."""
        if not self._accepting(continuation=True):
            return False
        self._check_backup(device_indices, host_indices)
        assert self._backup_q is not None
        try:
            self._backup_q.put_nowait(BackupJob(device_indices, host_indices, on_done))
        except asyncio.QueueFull:
            self.metrics.incr("backup_rejected")
            return False
        return True

    def _check_backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """``ValueError`` for a copy whose two sides are not the same whole pages. Why at
        submit: jobs are joined into one copy, where a job with one page too many on one side
        and one too few on the other paired its pages with its neighbour's, silently."""
        n, m = int(device_indices.numel()), int(host_indices.numel())
        if n != m or n % self.page_size:
            raise ValueError(f"a backup copies whole pages: {n} device and {m} host token indices "
                             f"(page size {self.page_size})")

    async def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> bool:
        """Queue a device->host copy and wait for it (waits for room instead of refusing).

        A call that was waiting for room when close began is still drained (or reported) by
        it; once close has sealed the queues it raises :class:`CacheClosedError` instead of
        queueing a job no worker would run."""
        if not self._accepting():
            raise CacheClosedError("the controller is closed")
        q = self._backup_q
        assert q is not None
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def done(ok: bool) -> None:
            if not fut.done():
                fut.set_result(ok)

        self._check_backup(device_indices, host_indices)
        job = BackupJob(device_indices, host_indices, done)
        while q.full():
            self._backup_room.clear()
            await self._backup_room.wait()
            if not self._accepting(continuation=True):
                raise CacheClosedError("the controller closed while the backup waited for room")
        q.put_nowait(job)
        return await asyncio.shield(fut)

    async def _backup_worker(self) -> None:
        assert self._backup_q is not None
        q = self._backup_q
        while True:
            first = await q.get()
            jobs = [first]
            pages = first.num_tokens // self.page_size
            while pages < self.config.backup_batch_pages and not q.empty():
                job = q.get_nowait()
                jobs.append(job)
                pages += job.num_tokens // self.page_size
            self._backup_busy = jobs
            self._backup_room.set()
            t0 = time.perf_counter()
            try:
                # joined in numpy where the indices are on CPU: torch's own cat (and a reshape
                # per job) ran on its intra-op pool and released the GIL at every call
                dev = read_slots([j.device_indices for j in jobs])
                host = read_slots([j.host_indices for j in jobs], dtype=torch.int64)
                with tracing.span("hicache.backup") as span:
                    span.set_attribute("hicache.pages", pages)
                    await self.copy_engine.backup(dev, host)
                oks = [True] * len(jobs)
            except asyncio.CancelledError:
                raise  # the jobs stay in _backup_busy; aclose reports them as failed
            except Exception:  # noqa: BLE001 - a failed copy fails its jobs, not the worker
                logger.exception("device->host backup of %d page(s) in %d job(s) failed", pages, len(jobs))
                # one bad job (an index past the pool) must not fail the others joined with it
                oks = await self._backup_one_by_one(jobs) if len(jobs) > 1 else [False]
                self.metrics.incr("backup_failures", oks.count(False))
            done = sum(j.num_tokens for j, ok in zip(jobs, oks) if ok) // self.page_size
            if done:
                self.metrics.transfer("d2h", done, done * self.page_nbytes, time.perf_counter() - t0)
                self.metrics.observe("backup", "host", time.perf_counter() - t0)
            self._backup_busy = []
            for i, (job, ok) in enumerate(zip(jobs, oks)):
                call_back(job.on_done, ok)
                q.task_done()
                if i % 8 == 7 and i + 1 < len(jobs):
                    # a batch of many jobs must not hold the loop through all their callbacks
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        for rest, rest_ok in zip(jobs[i + 1 :], oks[i + 1 :]):
                            call_back(rest.on_done, rest_ok)
                            q.task_done()
                        raise

    async def _backup_one_by_one(self, jobs: list[BackupJob]) -> list[bool]:
        """Copy each job of a failed batch alone: which of them fail."""
        oks: list[bool] = []
        for job in jobs:
            try:
                await self.copy_engine.backup(job.device_indices, job.host_indices)
                oks.append(True)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - this job fails alone
                oks.append(False)
        return oks

    # ------------------------------------------------------------------ host -> device

    def start_load(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
                   on_done: Callable[[bool], None]) -> Any:
        """Start a layer-by-layer host->device copy; returns the copy engine's handle
        (``.counter`` is the ``LayerDoneCounter``). ``on_done(ok)`` runs when all layers landed
        or the load failed. Raises ``CacheClosedError`` after close."""
        if not self._accepting():
            raise CacheClosedError("the controller is closed")
        t0 = time.perf_counter()
        handle = self.copy_engine.load(host_indices, device_indices)
        pages = int(host_indices.numel()) // self.page_size

        async def watch() -> None:
            ok = False
            try:
                with tracing.span("hicache.load_back") as span:
                    span.set_attribute("hicache.pages", pages)
                    await handle.wait()
                ok = True
            except asyncio.CancelledError:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(handle.wait())
                    ok = True
                raise
            except Exception:  # noqa: BLE001
                self.metrics.incr("load_failures")
                logger.exception("host->device load of %d page(s) failed", pages)
            finally:
                if ok:
                    self.metrics.transfer("h2d", pages, pages * self.page_nbytes, time.perf_counter() - t0)
                    self.metrics.observe("load_back", "host", time.perf_counter() - t0)
                call_back(on_done, ok)

        task = self._spawn(watch(), "hicache-load")
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        return handle

    # ------------------------------------------------------------------ host -> storage

    def submit_storage_write(self, job: StorageWriteJob) -> bool:
        """Queue a host->storage write; ``False`` when there is no storage, the queue is full
        or the controller is closed. A malformed job (bad key, host indices that are not one
        page per key) is a ``ValueError`` here, never a failure of the store later."""
        if self.storage is None or not self._accepting(continuation=True):
            return False
        job.check(self.page_size)
        assert self._storage_q is not None
        try:
            self._storage_q.put_nowait(job)
        except asyncio.QueueFull:
            self.metrics.incr("storage_rejected")
            return False
        return True

    async def _storage_worker(self) -> None:
        assert self._storage_q is not None
        q = self._storage_q
        while True:
            jobs = [await q.get()]
            # take what else is queued, up to one hop's pages (see _write_jobs); the last job
            # taken may pass the budget: it is then written on its own after the hop
            pages = len(jobs[0].keys)
            while pages < self._hop_pages and len(jobs) < _HOP_MAX_JOBS and not q.empty():
                jobs.append(q.get_nowait())
                pages += len(jobs[-1].keys)
            self._storage_busy = dict.fromkeys(jobs, 0)
            t0 = time.perf_counter()
            try:
                with tracing.span("hicache.backup.storage") as span:
                    span.set_attribute("hicache.pages", pages)
                    span.set_attribute("hicache.jobs", len(jobs))
                    await self._write_jobs(jobs, t0)
                self._storage_calling = []  # (the jobs are done with: their tensors are not kept)
            except asyncio.CancelledError:
                raise  # the jobs not finished stay in _storage_busy; aclose reports them unwritten
            except Exception:  # noqa: BLE001
                self.metrics.incr("worker_errors")
                logger.exception("storage write of %d job(s) failed unexpectedly", len(jobs))
            for job, landed in list(self._storage_busy.items()):  # what a failure above left unfinished
                self._finish(job, landed, t0)

    def _note_landed(self, job: StorageWriteJob, done: int) -> None:
        """``job``'s first ``done`` pages have landed: what close acknowledges if the job is
        still busy then (never recorded for a job close has already reported)."""
        if job in self._storage_busy:
            self._storage_busy[job] = done

    def _finish(self, job: StorageWriteJob, written: int, t0: float) -> None:
        """``job`` is over with ``written`` leading pages: acknowledged now (its nodes wait for
        it: host eviction, their children's writes). A job that landed in a hop is acknowledged
        when the hop returns (a hop is bounded by ``storage_hop_bytes``), never after the
        retries of the jobs taken with it."""
        assert self._storage_q is not None
        if self._storage_busy.pop(job, None) is None:
            return  # the controller closed meanwhile: close acknowledged it (_report_leftovers)
        if written:
            self.metrics.observe("backup", "storage", time.perf_counter() - t0)
        call_back(job.on_done, written)
        self._storage_q.task_done()
        self._storage_progressed()

    @property
    def _hop_pages(self) -> int:
        """Pages the storage worker sends to the I/O thread in one call (a *hop*): at least one
        batch, at most ``storage_hop_bytes`` and 16 batches."""
        batch = self.config.storage_batch_pages
        by_bytes = self.config.storage_hop_bytes // self.page_nbytes if self.page_nbytes else batch
        return max(batch, min(by_bytes, 16 * batch))

    async def _write_jobs(self, jobs: list[StorageWriteJob], t0: float) -> None:
        """Write ``jobs``, acknowledging each as soon as it is over (:meth:`_finish`).

        Why hops: each storage call crosses to the I/O thread and back, two thread wake-ups
        that cost the server's loop ~0.2 ms however small the call (most of the loop's share
        of a write of a few small pages). So the jobs that fit in :attr:`_hop_pages` go in one
        call, every batch of each and their deletions in order (:meth:`_hop`); the stall and
        timeout limits count from the end of the hop's last inner call, as for a call of its
        own, and each inner call is judged as a call of its own (latency sample, health, in
        the order they ran: :meth:`_judge`). What landed counts even when the hop is cut short
        (timeout, store down, the controller closing). A job whose batch did not fully land,
        and a job past the budget, continue through :meth:`_write_job` (one call per batch,
        with retries), as every job did before; such a retry runs after the deletions of the
        jobs taken with it, so jobs are ordered by their first attempt, not their last.
        """
        if not self.health.up:
            self.metrics.incr("storage_write_skipped_unhealthy", sum(len(job.keys) for job in jobs))
            for job in jobs:
                self._finish(job, 0, t0)
            return
        budget = self._hop_pages
        hop: list[tuple[StorageWriteJob, list[_Batch]]] = []
        for job in jobs:
            if len(job.keys) > budget:
                break
            budget -= len(job.keys)
            hop.append((job, self._batches(job)))
        results: list[_HopResult] = []
        if hop:
            progress = [time.monotonic()]
            self._storage_calling = [job for job, _ in hop]
            try:
                await self._storage_call(self._hop(hop, results, progress), "write", progress)
            except asyncio.CancelledError:
                # the controller is closing: what landed is acknowledged (the hop has ended:
                # _storage_call outlasts it), the rest is left to close's report
                try:
                    self._settle_hop(hop, results, t0)
                except Exception:  # noqa: BLE001 - the cancellation must go on
                    logger.exception("storage write: settling a cancelled hop failed")
                raise
        for job, done, deletions, tried in self._settle_hop(hop, results, t0):
            self._storage_calling = [job]
            self._finish(job, await self._write_job(job, done=done, attempt=int(tried), delete=deletions), t0)
        for job in jobs[len(hop):]:
            self._storage_calling = [job]
            self._finish(job, await self._write_job(job, delete=True), t0)

    def _settle_hop(self, hop: list[tuple[StorageWriteJob, list[_Batch]]], results: list[_HopResult],
                    t0: float) -> list[tuple[StorageWriteJob, int, bool, bool]]:
        """Judge and count a finished hop's calls in the order they ran, acknowledge every job
        that fully landed, note what the others landed (:meth:`_note_landed`) and return them
        as (job, leading pages landed, whether its deletions are still to send, whether the hop
        reached it: a job it reached was tried, even if its call was cut short)."""
        unfinished: list[tuple[StorageWriteJob, int, bool, bool]] = []
        for i, (job, batches) in enumerate(hop):
            if i >= len(results):  # the hop ended before this job: never tried
                unfinished.append((job, 0, bool(job.delete_first), False))
                continue
            result = results[i]
            if result.deleted is not None:  # the store answered the job's deletions
                job.deletions_sent = True
                outcome = self._judge(result.deleted, "delete")
                self._count_deleted(len(job.delete_first), None if isinstance(outcome, BaseException) else outcome)
            done = 0
            for batch, call in zip(batches, result.batches):
                outcome = self._judge(call, "write")
                if isinstance(outcome, BaseException):
                    break
                ok = self._landed(outcome, batch, call[1])
                done += ok
                if ok < batch.pages:
                    break
            if done == len(job.keys):
                self._finish(job, done, t0)
            elif len(result.batches) and self._no_room(job, done, *_refusal(result.batches[-1])):
                self._finish(job, done, t0)
            else:
                self._note_landed(job, done)
                unfinished.append((job, done, bool(job.delete_first) and result.deleted is None, True))
        return unfinished

    def _batches(self, job: StorageWriteJob) -> list[_Batch]:
        """``job``'s storage calls: ``storage_batch_pages`` pages each, chained by key."""
        ps, size = self.page_size, self.config.storage_batch_pages
        out: list[_Batch] = []
        prior = job.prior_key
        for first in range(0, len(job.keys), size):
            n = min(size, len(job.keys) - first)
            out.append(self._batch(job, first, n, prior))
            prior = job.keys[first + n - 1]
        return out

    def _batch(self, job: StorageWriteJob, first: int, n: int, prior: str | None) -> _Batch:
        ps = self.page_size
        transfers = [PoolTransfer(PoolName.KV, job.host_indices[first * ps : (first + n) * ps],
                                  keys=job.keys[first : first + n])]
        for extra in job.extra:
            transfers.append(slice_transfer(extra, first, n, len(job.keys)))
        return _Batch(transfers, HiCacheStorageExtraInfo(prefix_keys=[prior] if prior else None), n)

    async def _hop(self, hop: list[tuple[StorageWriteJob, list[_Batch]]], out: list[_HopResult],
                   progress: list[float]) -> None:
        """Runs on the I/O loop: each job's deletions, then its batches in order, stopping the
        job at its first batch that does not fully land (a page after a missing one cannot be
        found by a prefix lookup). A raising call ends only its own job. Results go into
        ``out`` as each call ends (the caller reads what landed even if the hop is cut short),
        and ``progress[0]`` takes the time each call ended (the caller's stall clock)."""
        assert self.storage is not None
        storage = self.storage
        for job, batches in hop:
            result = _HopResult()
            out.append(result)
            if job.delete_first:  # a failed delete never blocks the write
                result.deleted = await self._inner_call(storage.batch_delete(job.delete_first))
                progress[0] = time.monotonic()
            for batch in batches:
                call = await self._inner_call(storage.batch_set_v2(batch.transfers, batch.info))
                result.batches.append(call)
                progress[0] = time.monotonic()
                outcome = call[0]
                if isinstance(outcome, BaseException) or \
                        leading_run(all_pools_ok(outcome, batch.pages, batch.transfers)) < batch.pages:
                    break

    async def _inner_call(self, coro: Coroutine[Any, Any, Any]) -> _InnerCall:
        """One call inside a hop, on the I/O loop: what it returned or raised, its seconds, and
        whether the backend counted an error meanwhile; judged later on the loop (:meth:`_judge`)."""
        t0 = time.perf_counter()
        with counting_call() as call:
            try:
                outcome: Any = await coro
            except Exception as exc:  # noqa: BLE001 - judged on the loop
                outcome = exc
        return outcome, time.perf_counter() - t0, call.errors > 0, _refused_for_room(call)

    def _judge(self, call: _InnerCall, what: str) -> Any:
        """A call made inside a hop, judged as :meth:`_storage_call` judges a call of its own:
        one latency sample, and held for or against the store's health (a raise is logged; a
        bad key is the caller's bug and says nothing of the store). Returns its outcome."""
        outcome, seconds, errored, _ = call
        self.metrics.observe(_OPS.get(what, what), "storage", seconds)
        self._judge_outcome(outcome, errored, what)
        return outcome

    def _judge_outcome(self, outcome: Any, errored: bool, what: str) -> None:
        """Hold a storage call's end for or against the store's health: a raise (logged; a bad
        key is the caller's bug and says nothing of the store) or an error the backend counted
        meanwhile is a failure, anything else a success."""
        if isinstance(outcome, BaseException):
            logger.error("storage %s failed", what, exc_info=outcome)
            if not isinstance(outcome, InvalidKeyError):
                self.health.failed(f"{what} raised {type(outcome).__name__}")
        elif errored:
            self.health.failed(f"the backend counted an error during a {what}")
        else:
            self.health.succeeded()

    async def _write_job(self, job: StorageWriteJob, *, done: int = 0, attempt: int = 0,
                         delete: bool = False) -> int:
        """Write ``job`` from page ``done`` on, one call per batch, retrying a batch that did
        not fully land (``attempt``: failures so far); returns the leading pages written.
        ``delete``: send the job's deletions first."""
        assert self.storage is not None
        cfg = self.config
        total = len(job.keys)
        prior = job.keys[done - 1] if done else job.prior_key
        if delete and job.delete_first:
            # not made or cut short because the store is down: not sent (the policy defers it)
            job.deletions_sent = await self._delete_pages(job.delete_first)
        while done < total:
            if attempt and self.health.up:
                if attempt > cfg.storage_max_retries:
                    failed = total - done
                    self.metrics.incr("storage_write_failures", failed)
                    logger.warning("storage write: %d page(s) from key %.16s... failed after %d retries",
                                   failed, job.keys[done], cfg.storage_max_retries)
                    return done
                self.metrics.incr("storage_write_retries")
                await asyncio.sleep(min(cfg.storage_retry_max_s, cfg.storage_retry_base_s * 2 ** (attempt - 1)))
            if not self.health.up:
                self.metrics.incr("storage_write_skipped_unhealthy", total - done)
                return done
            n = min(cfg.storage_batch_pages, total - done)
            batch = self._batch(job, done, n, prior)
            t0 = time.perf_counter()
            with counting_call() as counted:
                result = await self._storage_call(self.storage.batch_set_v2(batch.transfers, batch.info), "write")
            ok = self._landed(result, batch, time.perf_counter() - t0)
            if ok:
                done += ok
                prior = job.keys[done - 1]
                self._note_landed(job, done)
            if ok < n and self._no_room(job, done, result, counted.errors > 0, _refused_for_room(counted)):
                return done
            attempt = 0 if ok == n else attempt + 1
        return done

    def _no_room(self, job: StorageWriteJob, done: int, outcome: Any, errored: bool, refused: int) -> bool:
        """Whether a write call of ``job`` that landed its pages short (``done`` written) was
        refused for room no retry can make: the store counted pages it cannot hold at all
        (``rejected_pages_beyond_capacity``, ``oversized_pages``) and no error. Then the rest
        of the job is not retried: a bounded store keeps the leading pages that fit and refuses
        the rest (a page after a missing one is never found), and asked again it refuses again,
        or would have to evict the job's own prefix. Retried as a transient failure, each retry
        slept the storage queue's backoff, and the pages were counted as failed writes. The
        job's pages left (refused, or after a refused one) are counted
        ``storage_write_no_space_pages``."""
        if outcome is None or isinstance(outcome, BaseException) or errored or not refused:
            return False
        left = len(job.keys) - done
        self.metrics.incr("storage_write_no_space_pages", left)
        count = self._no_room_warnings.due(left)
        if count:
            logger.warning("storage write: the store refused %d page(s) for room (a write longer than it holds, "
                           "or room only its own prefix could give); its leading pages are kept, the rest is "
                           "not retried (raise the store's max_bytes to keep longer prefixes)", count)
        return True

    def _landed(self, result: dict[str, list[bool]] | None, batch: _Batch, seconds: float) -> int:
        """Leading pages of a write call that landed in every pool (``None``: none), counted."""
        ok = leading_run(all_pools_ok(result, batch.pages, batch.transfers))
        if ok:
            self.metrics.transfer("h2s", ok, ok * self.page_nbytes, seconds)
        return ok

    async def _delete_pages(self, keys: list[str]) -> bool:
        """Storage eviction a placement policy chose (``StorageWriteJob.delete_first``). A
        failed or refused delete costs a counter, never the write: the backend's own bound
        still keeps the store within its size. ``False`` when the store went down before it
        answered (the call was cut short or not made): the deletions are then still to send.
        A delete the store refused or failed while up is not retried (a store that always
        fails deletes would otherwise take them with every write)."""
        assert self.storage is not None
        flags = await self._storage_call(self.storage.batch_delete(keys), "delete")
        if flags is None and not self.health.up:
            return False
        self._count_deleted(len(keys), flags)
        return True

    def _count_deleted(self, asked: int, flags: list[bool] | None) -> None:
        if not asked:
            return
        deleted = sum(bool(f) for f in flags) if flags else 0
        self.metrics.incr("storage_deleted_pages", deleted)
        if deleted < asked:
            self.metrics.incr("storage_delete_missed_pages", asked - deleted)

    # ------------------------------------------------------------------ storage -> host

    def start_prefetch(
        self,
        rid: str,
        keys: list[str],
        *,
        alloc_host: Callable[[int], torch.Tensor | None],
        extra: list[PoolTransfer] | None = None,
        promised: bool = False,
    ) -> PrefetchOp | None:
        """Start fetching the pages under ``keys`` (a chain continuing the host hit) into host
        memory in the background (see :meth:`Prefetcher.start`). ``None`` when not started.

        ``promised``: an engine already counted these pages as hits (vLLM's scheduler told its
        workers to load them), so not reading them fails its blocks instead of costing a
        recompute: the read is tried even while the store is marked down (the health mark may
        come from a slow write while reads work; the caller bounds the wait), and the
        prefetcher's threshold and in-flight budget do not apply."""
        if self._prefetcher is None or not self._accepting():
            return None
        if not self.health.up:
            if not promised:
                self.metrics.incr("prefetch_skipped_unhealthy")
                return None
            self.metrics.incr("prefetch_promised_while_down")
        return self._prefetcher.start(rid, keys, alloc_host=alloc_host, extra=extra, promised=promised)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds``: the recompute cost the
        ``timeout`` prefetch policy weighs a wait against (see :mod:`hicache.controller.recompute`)."""
        if self._prefetcher is not None:
            self._prefetcher.prefill.observe(tokens, seconds)

    def _recompute_rate(self) -> float:
        rate = self._prefetcher.prefill.tokens_per_s if self._prefetcher is not None else None
        return 0.0 if rate is None else rate  # 0: not known yet

    def prefetch_op(self, rid: str) -> PrefetchOp | None:
        return self._prefetcher.op(rid) if self._prefetcher is not None else None

    def prefetch_ready(self, rid: str) -> bool:
        """Non-blocking: may the request stop waiting for its prefetch, under the policy?"""
        return self._prefetcher.ready(rid) if self._prefetcher is not None else True

    async def wait_prefetch(self, rid: str, policy: str | None = None) -> PrefetchResult | None:
        """Wait as the stop policy allows, then take what completed; ``None`` without a prefetch."""
        return await self._prefetcher.wait(rid, policy) if self._prefetcher is not None else None

    def take_prefetch(self, rid: str) -> PrefetchResult | None:
        """Stop ``rid``'s prefetch and hand over the pages completed so far (the caller owns them)."""
        return self._prefetcher.take(rid) if self._prefetcher is not None else None

    def abort_prefetch(self, rid: str) -> bool:
        """Cancel ``rid``'s prefetch (its host pages are freed); whether there was one."""
        return self._prefetcher.abort(rid) if self._prefetcher is not None else False

    async def _on_io(self, coro: Coroutine[Any, Any, Any], clock: _CallClock | None = None) -> Any:
        if clock is not None:
            clock.handed = time.monotonic()
        if self._io is None:
            return await coro
        return await self._io.run(coro)

    async def _storage_call(self, coro: Coroutine[Any, Any, Any], what: str,
                            progress: list[float] | None = None, *,
                            landed: Callable[[], None] | None = None, promised: bool = False,
                            gave_up: Callable[[], None] | None = None) -> Any:
        """Await a storage call under the health rules and the I/O timeout; ``None`` when it
        failed, timed out, was interrupted because the store went down, or was not made
        because the store is down. A ``promised`` call (a read an engine already counted as a
        hit, see :meth:`start_prefetch`) is made while the store is marked down and is not
        interrupted when it goes down: only the I/O timeout (and its caller) ends it.

        An interrupted call is cancelled, and then waited for until it has really ended (also
        when the caller is cancelled meanwhile): until then the backend may still be reading
        or writing the host pages the caller handed it, and a page reused early would be
        written to storage or served to a request with someone else's KV. A call still running
        ``cancelled_io_grace_s`` after it was cancelled is logged and counted as stuck (its
        pages stay out of use; the store is marked down, so no new call piles up behind it).
        ``gave_up()`` runs (on this loop) as soon as the call is given up on, timed out or
        interrupted, before that wait: whoever waits for the caller need not wait for a call
        that may never return (a prefetch's request takes the pages that completed).
        """
        if not self.health.up and not promised:
            coro.close()
            self.metrics.incr("storage_calls_skipped")
            return None
        cfg = self.config
        t0 = time.perf_counter()
        clock = _CallClock()  # the limits and the latency sample count the store's time only
        clocked = _clocked(coro, clock, landed)
        with counting_call() as counted:  # the task copies the context: its errors only
            call = asyncio.ensure_future(self._on_io(clocked, clock))
        if progress is None:  # a hop's inner calls are sampled one by one (_judge)
            call.add_done_callback(lambda _: self.metrics.observe(
                _OPS.get(what, what), "storage", clock.seconds(time.perf_counter() - t0)))

        def close_unstarted(_: object) -> None:
            _close_unstarted(clocked)
            _close_unstarted(coro)  # the wrapper never started: nor did the call it wraps

        call.add_done_callback(close_unstarted)
        if not promised:  # the calls a store that goes down interrupts
            self._calls[call] = gave_up
            call.add_done_callback(lambda c: self._calls.pop(c, None))
        try:
            stall = cfg.storage_stall_s if 0 < cfg.storage_stall_s < cfg.storage_io_timeout_s else 0.0
            # a call that makes several calls inside (a hop) reports each one's end in
            # progress[0]: the stall and the timeout count from there, each inner call gets
            # the time a call of its own would (its caller samples and judges each one)
            since = progress if progress is not None else [time.monotonic()]
            stalled = False
            while not call.done():
                if clock.ended is not None:  # the store answered; this loop was late to take it
                    await asyncio.wait({call})
                    continue
                limit = stall if stall and not stalled else cfg.storage_io_timeout_s
                left = clock.since(since[0]) + limit - time.monotonic()
                if left > 0:
                    await asyncio.wait({call}, timeout=left)
                    continue
                # the stall limit passed: only when one is set (``limit == stall`` also held
                # for an I/O timeout of 0 with no stall limit, and looped without awaiting)
                if stall and not stalled:
                    stalled = True
                    self.metrics.incr("storage_stalls")
                    self.health.trip(f"a storage {what} gave no answer within {stall:.1f} s")
                    continue
                self.metrics.incr("storage_timeouts")
                logger.warning("storage %s timed out after %.1f s", what, cfg.storage_io_timeout_s)
                self.health.trip(f"a storage {what} timed out after {cfg.storage_io_timeout_s:.1f} s")
                call.cancel()
                if gave_up is not None and not call.done():
                    gave_up()
                break
        except asyncio.CancelledError:
            call.cancel()
            await self._outlast(call, what)
            raise
        if await self._outlast(call, what):
            raise asyncio.CancelledError
        # counted here alone, once per call, whatever ended it (timed out, interrupted as the
        # store went down, raised): a caller seeing ``None`` cannot tell these apart from a
        # call not made (counted in storage_calls_skipped) and must not count it again
        if what in ("exists", "read") and (call.cancelled() or call.exception() is not None):
            self.metrics.incr("storage_read_failures")
        if call.cancelled():
            return None
        exc = call.exception()
        if exc is not None:  # the backend's base class guards, but be sure
            self._judge_outcome(exc, False, what)
            return None
        if progress is None:  # a hop's caller judges each inner call, in order (_judge)
            self._judge_outcome(None, counted.errors > 0, what)
        return call.result()

    async def _outlast(self, call: asyncio.Future[Any], what: str) -> bool:
        """Wait until a cancelled storage call has really ended (see :meth:`_storage_call`);
        returns whether the caller was cancelled meanwhile."""
        if call.done():
            return False
        stuck = False

        def report() -> None:
            nonlocal stuck
            stuck = True
            self._stuck_calls += 1
            self.metrics.incr("storage_calls_stuck")
            logger.warning(
                "a cancelled storage %s is still running after %.1f s; the host pages it was "
                "given stay out of use until it returns", what, self.config.cancelled_io_grace_s,
            )

        try:
            return await wait_out(call, slow_after=self.config.cancelled_io_grace_s, on_slow=report)
        finally:
            if stuck:
                self._stuck_calls -= 1
                logger.info("the stuck storage %s has returned; its host pages are free again", what)

    # ------------------------------------------------------------------ storage health

    def on_storage_up(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on this controller's loop) each time the store is taken back
        after it was marked down: what was skipped meanwhile can be offered again."""
        self._up_listeners.append(listener)

    def _health_changed(self, state: HealthState) -> None:
        """Down: interrupt the calls in flight (they wait for a store that does not answer)
        and start the prober. Up: the prober has ended by itself; the listeners are told."""
        if state is HealthState.UP:
            for listener in list(self._up_listeners):
                try:
                    listener()
                except Exception:  # noqa: BLE001 - one listener must not stop the others
                    logger.exception("a storage-up listener failed")
            return
        if state is not HealthState.DOWN:
            return
        for call, gave_up in list(self._calls.items()):
            call.cancel()
            if gave_up is not None and not call.done():
                gave_up()
        if self.state is ControllerState.RUNNING and (self._prober is None or self._prober.done()):
            self._prober = self._spawn(self._probe_until_up(), "hicache-storage-probe", detached=True)

    async def _probe_until_up(self) -> None:
        """Probe the store after each backoff until it answers (or the controller closes)."""
        assert self.storage is not None
        cfg = self.config
        limit = cfg.storage_stall_s if 0 < cfg.storage_stall_s < cfg.storage_io_timeout_s else cfg.storage_io_timeout_s
        while not self.health.up:
            await asyncio.sleep(self.health.next_probe_in())
            self.metrics.incr("storage_probes")
            with counting_call() as counted:
                call = asyncio.ensure_future(self._on_io(self.storage.batch_exists_v2([_PROBE_KEY])))
            try:
                done, _ = await asyncio.wait({call}, timeout=limit)
            except asyncio.CancelledError:
                call.cancel()
                raise
            if not done:
                call.cancel()
            ok = bool(done) and not call.cancelled() and call.exception() is None
            if ok and not counted.errors:
                self.health.probe_passed()
            else:
                self.health.probe_failed()


def _refusal(call: _InnerCall) -> tuple[Any, bool, int]:
    """What :meth:`HiCacheController._no_room` reads of a call made inside a hop: its outcome,
    whether the backend counted an error, the pages it refused for room."""
    outcome, _, errored, refused = call
    return outcome, errored, refused


def _refused_for_room(call: CallCounts) -> int:
    """Pages a storage call's backend refused for room no retry can make (see
    ``AsyncHiCacheStorage``): a page bigger than the store, or beyond what it can hold beside
    the prefix the write continues. Not a refusal that may clear up (``rejected_pages_no_space``
    alone: the file store's, whose room comes back as a peer's pages are indexed, a read in
    flight ends or the disk frees up), which is retried as before."""
    return int(call.counts["rejected_pages_beyond_capacity"] + call.counts["oversized_pages"])


def _uncancel() -> None:
    """Take back a cancellation of the running task that was handled (so that a later
    ``asyncio.timeout`` in it tells its own expiry from an outside cancellation)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    """A storage call cancelled before its task first ran never starts its coroutine: close it,
    so it is released without a "never awaited" warning (a started one is its runner's)."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()

