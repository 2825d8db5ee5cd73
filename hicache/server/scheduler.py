"""The request scheduler: a bounded queue in front of the engine, one asyncio task draining it.

Why a scheduler between HTTP handlers and the engine:

- backpressure: the queue is bounded; when it is full a request is refused at once (the server
  answers 503) instead of piling up coroutines and memory;
- admission: at most ``max_active`` requests generate at a time, so the device pool is shared by
  a known number of sequences, and each admitted request's forwards interleave with the others'
  on the engine's single worker thread (continuous batching by time slicing);
- memory admission: a request that finds no free device slots (``OutOfKVSlotsError``) waits
  for another request to finish (or, alone, backs off briefly while write-backs release slots)
  and starts again, instead of failing at once. While it waits no new request is admitted, so
  the memory the next finished request frees goes to the waiter, not to a newcomer (without this
  gate a large request could lose every race and fail while the server was merely busy). Waits
  behind running requests are bounded in time (``memory_wait_total_s``); only the retries made
  alone, where nothing else can free memory, count against ``max_memory_retries``. Greedy decoding is deterministic, so a
  restarted stream resumes without repeating the tokens it already sent;
- ordering within a session: turns of one session run one after another (a later turn must see
  the earlier turn's KV committed), different sessions run concurrently. A release of a session
  takes its place in that order (:meth:`Scheduler.release_session`): it applies after the turns
  submitted before it and before the ones submitted after it;
- a graceful drain: :meth:`Scheduler.aclose` refuses new work, lets queued and running requests
  finish, and only then returns, so the cache is closed with nothing in flight.

All job tasks belong to one ``asyncio.TaskGroup`` owned by the dispatcher task; nothing is fire
and forget.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hicache.engine.runner import Engine, GenerateResult
from hicache.errors import CacheClosedError, HiCacheError, OutOfKVSlotsError, quoted
from hicache.server.metrics import ServerMetrics
from hicache.server.protocol import GenerateRequest
from hicache.server.session_order import SessionOrder, SessionTurn

__all__ = ["Job", "QueueFullError", "Scheduler", "SchedulerClosedError", "status_of"]

logger = logging.getLogger("hicache.server")


class QueueFullError(HiCacheError, RuntimeError):
    """The request queue is full; retry later (HTTP 503)."""


class SchedulerClosedError(CacheClosedError):
    """The scheduler is draining or closed and takes no new requests (HTTP 503)."""


@dataclass(eq=False)
class Job:
    """One queued request and the future its handler awaits."""

    request: GenerateRequest
    arrival: float
    future: asyncio.Future[GenerateResult]
    on_token: Callable[[int], None] | None = None
    reference: list[int] | None = field(default=None)
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # set once it runs
    queued: bool = field(default=False, repr=False)  # waiting for the scheduler, counted in its bound


def status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and ``requests`` outcome label for an exception raised while serving.

    One mapping for both places a request can fail: refused at :meth:`Scheduler.submit` (the
    handler counts it) and failed once it ran (:meth:`Scheduler._serve` counts it). The
    scheduler counted every failure of a job that ran as ``error``, so a 503 for device memory
    or a closed cache and a 400 for a bad value inflated ``outcome="error"`` (and the alerts
    on it) with rejections and bad requests, while the same failure at submit was labelled by
    its status. A stream that fails after its 200 is labelled the same way, by what failed.
    Lives here, not in the app, since the app imports the scheduler."""
    if isinstance(exc, (QueueFullError, CacheClosedError, MemoryError)):
        return 503, "rejected"
    if isinstance(exc, ValueError):
        return 400, "bad_request"
    return 500, "error"


_STOP = object()
#: how many request ids a drain's log line names
_LOGGED_RIDS = 8


def _rids(jobs: list[Job]) -> str:
    """The ids of ``jobs`` for a log line, quoted (a client chose them), the first few only."""
    shown = ", ".join(quoted(job.request.rid) for job in jobs[:_LOGGED_RIDS])
    return shown + (f" and {len(jobs) - _LOGGED_RIDS} more" if len(jobs) > _LOGGED_RIDS else "")


@dataclass(frozen=True)
class _Release:
    """A release of ``session_id`` queued behind that session's turns."""

    session_id: str


class Scheduler:
    """Feeds requests from a bounded queue to an :class:`Engine`."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_active: int,
        queue_size: int,
        metrics: ServerMetrics | None = None,
        max_memory_retries: int = 8,
        memory_wait_s: float = 5.0,
        memory_wait_total_s: float = 120.0,
    ) -> None:
        if max_active <= 0 or queue_size <= 0:
            raise ValueError("max_active and queue_size must be positive")
        self.engine: Engine = engine
        self.metrics: ServerMetrics = metrics or ServerMetrics()
        self.max_active: int = max_active
        # unbounded: the bound is on the requests still waiting (``_waiting``), so a client that
        # hangs up while queued gives its place back at once, not when the scheduler reaches it
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queue_size = queue_size
        #: the requests queued and not yet taken (the queue bound counts them; the drain's end
        #: refuses them, :meth:`shed_waiting`)
        self._waiting: set[Job] = set()
        #: the requests the dispatcher has given a task and that have not ended (waiting for
        #: their session or a slot, or running): what :meth:`stop_running` answers
        self._started: set[Job] = set()
        self._slots = asyncio.Semaphore(max_active)
        self._sessions = SessionOrder()
        # jobs per session id from submit until done (queued, waiting, running): a release
        # while any is pending must wait for them, or the next of them re-opened the session
        self._session_jobs: dict[str, int] = {}
        # sessions with a release queued behind their turns and no turn submitted since: a
        # second release is that same one (queued again, a client looping on it piled up
        # releases without bound)
        self._release_queued: set[str] = set()
        self._finished = asyncio.Condition()  # notified whenever a request ends
        self.max_memory_retries = max_memory_retries
        self.memory_wait_s = memory_wait_s
        self.memory_wait_total_s = memory_wait_total_s
        self._memory_waiters = 0
        self._generating = 0  # requests holding their session, in or waiting for generation
        self._admit = asyncio.Event()  # cleared while a running request waits for device memory
        self._admit.set()
        self._main: asyncio.Task[None] | None = None
        self._closing = False

    # -- lifecycle
    async def start(self) -> None:
        if self._main is not None:
            raise RuntimeError("scheduler already started")
        ready = asyncio.Event()
        self._main = asyncio.create_task(self._run(ready), name="hicache-scheduler")
        await ready.wait()

    async def aclose(self) -> None:
        """Refuse new requests, finish every queued and running one, then stop."""
        if self._closing:
            if self._main is not None:
                await asyncio.shield(self._main)
            return
        self._closing = True
        if self._main is None:
            return
        await self._queue.put(_STOP)
        await asyncio.shield(self._main)
        await self._sessions.aclose()  # the releases the last turns owed, run in their turns
        logger.info("scheduler drained")

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queued(self) -> int:
        """Requests that have not started: queued, or waiting for their session or a slot."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests started and not ended."""
        return sum(1 for job in self._started if not job.queued)

    # -- submission
    def submit(self, request: GenerateRequest, *, arrival: float | None = None,
               on_token: Callable[[int], None] | None = None) -> Job:
        """Queue ``request``; await ``job.future`` for its result. Raises
        :class:`QueueFullError` or :class:`SchedulerClosedError` instead of waiting."""
        if self._closing or self._main is None:
            raise SchedulerClosedError("the server is shutting down" if self._closing else "scheduler not started")
        if len(self._waiting) >= self.queue_size:
            raise QueueFullError(f"request queue full ({len(self._waiting)} waiting)")
        job = Job(request, time.perf_counter() if arrival is None else arrival,
                  asyncio.get_running_loop().create_future(), on_token, queued=True)
        self._queue.put_nowait(job)
        self._waiting.add(job)
        self.metrics.queue_depth = len(self._waiting)
        if request.session_id is not None:
            self._session_jobs[request.session_id] = self._session_jobs.get(request.session_id, 0) + 1
            self._release_queued.discard(request.session_id)
        return job

    def _job_done(self, job: Job, turn: SessionTurn | None = None, _task: object = None) -> None:
        """``job`` is over (served, failed, or dropped before it ran): no longer pending, and
        its place in its session's order (``turn``) is given up, if it was not already."""
        self._started.discard(job)
        if turn is not None:
            turn.leave()
        sid = job.request.session_id
        if sid is None:
            return
        left = self._session_jobs.get(sid, 0) - 1
        if left > 0:
            self._session_jobs[sid] = left
        else:
            self._session_jobs.pop(sid, None)
            self._release_queued.discard(sid)

    async def release_session(self, session_id: str) -> Literal["released", "deferred", "missing"]:
        """The client ended the conversation: release the session in its turn.

        With no turn of the session queued or running, the cache releases it now: ``"released"``
        (or ``"missing"`` when the cache has no such session). Otherwise the release queues
        behind those turns (``"deferred"``) and applies once the last of them has finished,
        its memory retries included. Released straight away, a turn still waiting (for a slot,
        its session, or device memory between two attempts) was invisible to the cache: the
        release closed the session and the turn then re-opened it, holding its row and pages
        until ``idle_offload_s``/``session_timeout_s`` though the client was told it was
        released. A turn submitted after the release runs after it, on a fresh session; a
        release again before any such turn is the one already queued (not queued twice).
        Raises :class:`SchedulerClosedError` while draining with turns of it pending."""
        if not self._session_jobs.get(session_id):
            existed = await self.engine.cache.release_session(session_id)
            return "missing" if existed is False else "released"  # (None: a cache without sessions)
        if self._closing:  # the dispatcher may be past its last item: nothing would apply it
            raise SchedulerClosedError("the server is shutting down")
        if session_id not in self._release_queued:
            self._release_queued.add(session_id)
            self._queue.put_nowait(_Release(session_id))
        return "deferred"

    def _dequeued(self, job: Job) -> None:
        """``job`` no longer waits (taken by the scheduler, or abandoned): its place is free."""
        if job.queued:
            job.queued = False
            self._waiting.discard(job)
            self.metrics.queue_depth = len(self._waiting)

    def abandon(self, job: Job) -> None:
        """The client went away: drop ``job``. A queued job is skipped when its turn comes; a
        running one is cancelled (the engine aborts the request and frees what it held)."""
        if job.future.done() and (job.task is None or job.task.done()):
            return
        self.metrics.requests["abandoned"] += 1
        self._dequeued(job)
        job.future.cancel()
        if job.task is not None and not job.task.done():
            job.task.cancel()

    def shed_waiting(self) -> int:
        """The drain's time is up: refuse every request that has not started (queued, or
        waiting for its session or a slot) with :class:`SchedulerClosedError` (HTTP 503, retry
        elsewhere), counted ``rejected``; the running ones are left to finish. Returns how many.

        Why: once the HTTP server's ``shutdown_timeout`` has passed, aiohttp cancels its
        handlers and then cuts their connections; a request still queued was cut with no
        status, which no client or balancer can tell safe to retry, and logged as a client
        that hung up."""
        return self._refuse(self._waiting, "start", "had not started were refused (503)")

    def stop_running(self) -> int:
        """The drain is about to cut its handlers: answer every request not finished yet with
        :class:`SchedulerClosedError` (HTTP 503 with Retry-After; a stream already under way
        ends with an error line after its tokens), counted ``rejected``, and stop its
        generation (the engine aborts it and frees what it held). Returns how many.

        Why: aiohttp cancels a handler still running a second ``shutdown_timeout`` after the
        first and cuts its connection, with no status: the client and its balancer could not
        tell a server that went away from a network fault, and the request was counted only
        as ``abandoned``, with no log line."""
        return self._refuse(self._started, "finish", "did not finish were stopped and answered 503")

    def _refuse(self, jobs: set[Job], missed: str, logged: str) -> int:
        """Answer each unanswered job of ``jobs`` with :class:`SchedulerClosedError` (the
        request did not ``missed`` in time), counted ``rejected``, its generation stopped; the
        drain's warning says how many ``logged``."""
        refused = [job for job in jobs if not job.future.done()]
        for job in refused:
            self._dequeued(job)
            self.metrics.requests["rejected"] += 1
            job.future.set_exception(SchedulerClosedError(f"the server is shutting down: the request did not {missed} in time"))
            if job.task is not None and not job.task.done():
                job.task.cancel()
        if refused:
            logger.warning("drain timed out: %d request(s) that %s: %s", len(refused), logged, _rids(refused))
        return len(refused)

    # -- internals
    async def _run(self, ready: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tg:
            ready.set()
            while True:
                item = await self._queue.get()
                if item is _STOP:
                    break
                if isinstance(item, _Release):
                    self._sessions.reserve(item.session_id, self._release_after(item.session_id)).leave()
                    continue
                job: Job = item
                sid = job.request.session_id
                # the job's place in its session's order is taken here, in submission order; a
                # final turn owes the session's end, which runs in that place whatever happens
                # to the turn (dropped while queued, while waiting, or failing)
                turn = None if sid is None else self._sessions.reserve(
                    sid, self._release_after(sid) if job.request.end_session else None)
                if job.future.done():  # the client went away while queued
                    self._job_done(job, turn)
                    continue
                job.task = tg.create_task(self._serve(job, turn), name=f"hicache-req-{job.request.rid}")
                self._started.add(job)
                # a callback, not _serve's finally: a task cancelled before its first step
                # never enters _serve's body
                job.task.add_done_callback(functools.partial(self._job_done, job, turn))

    def _release_after(self, session_id: str) -> Callable[[], Awaitable[object]]:
        return functools.partial(self.engine.cache.release_session, session_id)

    async def _serve(self, job: Job, turn: SessionTurn | None) -> None:
        """Run ``job``: its session first, then an active slot. A turn waiting for its session
        (an earlier turn of it runs) holds no slot: the other sessions' requests take them
        meanwhile. The job counts as queued (in the bound and the queue depth) until it has
        its slot, and is served in arrival order among the jobs ready to run. A final turn
        ends its session before its client is answered, whether it succeeded or failed; one
        dropped before it ran leaves that to its place in the session's order
        (:meth:`SessionTurn.leave`), so the session ends after the turns before it and before
        the ones after it."""
        req = job.request
        slotted = running = False
        try:
            try:
                if turn is not None:
                    await turn.wait()
                await self._slots.acquire()
                slotted = True
                await self._admit.wait()  # a request waiting for memory gets it before newcomers
                self._dequeued(job)
                if job.future.done():  # the client went away while it waited
                    return
                self.metrics.active += 1
                running = True
                # counted for "alone" only once it holds its session: a later turn queued on
                # the session holds no memory, and counting it made a turn that cannot fit wait
                # (with admissions paused) for a request that could never finish first
                self._generating += 1
                try:
                    result = await self._generate_with_memory_retry(job)
                except BaseException:
                    await self._end_failed_session(req, turn)
                    raise
                finally:
                    self._generating -= 1
                if turn is not None and turn.after is not None:
                    await self.engine.cache.release_session(turn.session_id)
                    turn.after = None
                if req.debug_reference:
                    job.reference = await self.engine.run(self.engine.reference_generate, req.tokens, req.max_new_tokens)
            finally:
                if turn is not None:
                    turn.leave()  # (ending the session first if this turn still owes that)
            self.metrics.observe(result)
            if not job.future.done():
                job.future.set_result(result)
        except Exception as exc:  # a failed request must not take the scheduler down
            # labelled as it is answered (status_of): 503 rejected, 400 bad_request, 500 error
            self.metrics.requests[status_of(exc)[1]] += 1
            logger.warning("request %s failed: %r", quoted(req.rid), exc)
            if not job.future.done():
                job.future.set_exception(exc)
        finally:
            self._dequeued(job)  # (cancelled while it waited)
            if running:
                self.metrics.active -= 1
            if slotted:
                self._slots.release()
            async with self._finished:
                self._finished.notify_all()

    async def _end_failed_session(self, req: GenerateRequest, turn: SessionTurn | None) -> None:
        """The turn that was to end its session failed, or its client went away while it ran:
        end the session all the same, before the error is answered. The conversation is over
        either way, and the session otherwise held its row and pages until
        ``session_timeout_s`` (for good with none); its history is handed to the tree, so a
        retried turn still finds it. The turn's error is what the client is told; a release
        failing too is logged; one cut short (cancelled again) is still owed, and the turn's
        place in the session's order runs it."""
        if turn is None or turn.after is None:
            return
        try:
            await self.engine.cache.release_session(turn.session_id)
        except Exception as exc:  # noqa: BLE001 - the turn's own failure is the one to answer
            logger.warning("request %s: ending session %s after the turn failed failed too: %r",
                           quoted(req.rid), quoted(turn.session_id), exc)
        turn.after = None

    async def _generate_with_memory_retry(self, job: Job) -> GenerateResult:
        """``engine.generate``; on ``OutOfKVSlotsError`` wait for a running request to end (or
        back off when none runs) and start over. Gives up (re-raising) after
        ``max_memory_retries`` retries made alone, or once ``memory_wait_total_s`` has passed."""
        req = job.request
        sent = 0  # tokens already passed to the stream: a restart must not send them twice
        produced = 0  # tokens produced by the current attempt

        def forward(tok: int) -> None:
            nonlocal sent, produced
            produced += 1
            if produced > sent:
                sent = produced
                if job.on_token is not None:
                    job.on_token(tok)

        solo_retries = 0
        deadline = time.monotonic() + self.memory_wait_total_s
        waiting = False
        try:
            while True:
                produced = 0
                try:
                    return await self.engine.generate(
                        req.rid, req.tokens, req.max_new_tokens, req.session_id, arrival=job.arrival, on_token=forward
                    )
                except OutOfKVSlotsError:
                    alone = self._generating <= 1
                    if (alone and solo_retries >= self.max_memory_retries) or time.monotonic() >= deadline:
                        raise
                    self.metrics.memory_retries += 1
                    if not waiting:
                        waiting = True
                        self._memory_waiters += 1
                        self._admit.clear()
                    if not alone:
                        logger.info("request %s: device full, waiting for a running request to finish", quoted(req.rid))
                        async with self._finished:
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(max(0.0, min(self.memory_wait_s, deadline - time.monotonic()))):
                                    await self._finished.wait()
                    else:  # alone: slots may still be held by write-backs the cache completes shortly
                        await asyncio.sleep(min(0.05 * 2**solo_retries, 1.0))
                        solo_retries += 1
        finally:
            if waiting:
                self._memory_waiters -= 1
                if self._memory_waiters == 0:
                    self._admit.set()
