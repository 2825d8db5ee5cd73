"""The I/O threads of one file store, and the batches of blocking calls that run on them.

Page I/O blocks (``preadv``/``pwritev``, ``stat``, ``rename``), so every page operation runs on
a pool of ``io_threads`` torch-serial threads (the pool copies of seed-protocol pages run on
them too). A batch is spread over at most that many threads, fewer when it is cheap; a cancelled
caller still waits for calls in progress, since they may be filling its buffers or changing
the disk under the index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache.storage.io_threads import io_executor
from hicache.storage.offload import run_to_completion

__all__ = ["BatchOutcome", "CallerCalls", "PageThreads", "ProbeThreads", "UNANSWERED", "page_threads"]

T = TypeVar("T")

logger = logging.getLogger("hicache.storage.file")

_BYTES_PER_CHUNK = 1 << 20  # below this much work per thread, fewer threads are faster
#: a page's work held under the GIL (its Python: paths, header, checksum stream, results), in
#: bytes-equivalent of the copying that runs off it: a batch of pages this small or smaller
#: gains nothing from a second thread (Amdahl), and more threads only pass the GIL back and
#: forth (32 KiB pages on 4 threads: ~10 context switches and 2x the CPU of one thread per page)
_GIL_BYTES_PER_PAGE = 128 << 10


def page_threads(nbytes: int, calls: int) -> int:
    """The threads a batch's pages can keep busy: one, plus one per :data:`_GIL_BYTES_PER_PAGE`
    of an average page. A small page's time is mostly Python under the GIL, which threads only
    take turns at; its bytes (the copy into or out of the page cache, off the GIL) are what a
    second thread overlaps. 4 MiB pages keep every I/O thread; 32 KiB pages run on one."""
    return 1 + nbytes // max(1, calls) // _GIL_BYTES_PER_PAGE


class _SharedCalls:
    """The calls of one batch, each taken by whichever of the batch's I/O threads is free.

    Fixed slices per thread let a batch wait for its slowest thread: on a busy machine one
    thread gets the cores less often, and its slice ends long after the others (128 x 4 MiB
    reads, 4 threads on 2 cores: one slice in 38 ms, the other three in ~100 ms). Threads
    that take the next call when free end together. Results land at their call's position.

    ``first`` runs once, on the first thread in, before any call (the others wait for it);
    when it answers False no call runs (``declined``). ``last`` runs once, on the thread that
    finishes the last call, given the results, when every call returned; its answer is
    ``after`` (``None`` when it did not run or raised, so it must answer something else).
    Both save the batch a round trip to the event loop each (a write batch's reservation and
    settlement in the shared usage ledger).

    :meth:`stop` (the caller gave up) ends the batch early: calls not started never run and
    keep a ``None`` result, and ``last`` runs once the calls that did start have returned, so
    a write batch's settlement gives back what its unwritten pages reserved. Stopped before
    ``first`` ran, the batch is ``declined`` (nothing reserved, nothing to settle).
    """

    __slots__ = ("fn", "calls", "results", "first", "last", "declined", "after", "_next", "_end", "_done",
                 "_started", "_stopped", "_last_taken", "_lock", "_first_lock")

    def __init__(
        self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]],
        first: Callable[[], bool] | None = None, last: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.fn = fn
        self.calls = calls
        self.results: list[Any] = [None] * len(calls)
        self.first = first
        self.last = last
        self.declined = False
        self.after: Any = None
        self._next = 0  # the next call to start
        self._end = len(calls)  # calls that will start: lowered by a decline or a stop
        self._done = 0
        self._started = first is None
        self._stopped = False
        self._last_taken = False
        self._lock = threading.Lock()  # never held across a call or a step: stop() takes it on the loop
        self._first_lock = threading.Lock()  # the batch's other threads wait here for ``first``

    def drain(self) -> None:
        """Run calls until none is left (on an I/O thread); a call that raises stops this
        thread only (the batch then fails as a whole, once every thread has stopped)."""
        if not self._started:
            with self._first_lock:
                if not self._started:
                    assert self.first is not None
                    go = False
                    try:
                        go = not self._stopped and self.first()
                    finally:  # declined, stopped before it, or it raised: no call runs
                        if not go:
                            with self._lock:
                                self.declined = True
                                self._end = 0
                        self._started = True
        while True:
            with self._lock:
                i = self._next
                more = i < self._end
                if more:
                    self._next = i + 1
            if more:
                self.results[i] = self.fn(*self.calls[i])
            with self._lock:
                self._done += more
                # every call that will ever start has returned (all of them, or those started
                # before a stop): checked after each call *and* by a thread that finds none
                # left, since a stop may land while no call runs
                due = (self.last is not None and not self.declined and not self._last_taken
                       and self._done == self._end)
                self._last_taken = self._last_taken or due
            if due:
                assert self.last is not None
                try:
                    self.after = self.last(self.results)
                except Exception:  # noqa: BLE001 - the calls' results must still reach the caller
                    logger.exception("the last step of an I/O batch failed; the event loop does it instead")
            if not more:
                return

    def stop(self) -> None:
        """Start no more calls (those running finish; the others keep a ``None`` result);
        ``last`` still runs, after the calls that started."""
        with self._lock:
            self._stopped = True
            self._end = min(self._end, self._next)


class CallerCalls:
    """Calls running on their callers' threads (a blocking caller's reads of small pages,
    without the store's loop): counted, so that a close refuses new ones and waits for those
    running, as it waits for the calls on its loop; a read must not land in pool memory after
    the close returned."""

    __slots__ = ("_cond", "_running", "_open")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._open = False

    def open(self) -> None:
        with self._cond:
            self._open = True

    def enter(self) -> bool:
        """Count one call in; ``False`` (not counted) once the store is closing."""
        with self._cond:
            if not self._open:
                return False
            self._running += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            if not self._running:
                self._cond.notify_all()

    def close(self, timeout: float) -> int:
        """(Blocking.) Refuse new calls and wait up to ``timeout`` seconds for the running ones;
        how many still run."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: not self._running, timeout)
            return self._running


#: What :meth:`ProbeThreads.call` answers for a call it gave up on (see there).
UNANSWERED: Any = object()


class ProbeThreads:
    """A few threads for the quick looks a blocking caller takes at the disk (a lookup's probe
    of a page its index lacks), so that the caller waits only until its deadline.

    Why: a ``stat`` on a slow or hung mount cannot be cut, and run on the caller's own thread
    (SGLang's prefetch thread) it held that thread, and every request behind it, for as long as
    the mount took, whatever the call timeout. A call outliving its caller's deadline is left
    to end on its own; at most ``threads`` run at once, so stuck ones never pile up: a call
    finding every thread busy is not started at all (answered :data:`UNANSWERED` at once).
    :meth:`stuck` counts those still running. Threads start on first use."""

    __slots__ = ("threads", "_name", "_executor", "_running", "_lock")

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._running = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)

    def shutdown(self) -> None:
        """Take no more calls; never waits (a call stuck on a hung mount holds nothing of ours)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    def stuck(self) -> int:
        """Calls running now (past their callers' deadlines, when the mount hangs)."""
        with self._lock:
            return self._running

    def call(self, fn: Callable[..., T], *args: Any, deadline: float | None) -> T | Any:
        """``fn(*args)``, waited for until ``deadline`` (``time.monotonic()``; ``None``: on the
        calling thread, unbounded), else :data:`UNANSWERED`; also when every thread is still
        busy, or the threads are shut down."""
        if deadline is None:
            return fn(*args)
        with self._lock:
            if self._executor is None or self._running >= self.threads:
                return UNANSWERED
            try:
                fut = self._executor.submit(fn, *args)
            except RuntimeError:  # shut down by a close meanwhile
                return UNANSWERED
            self._running += 1
        fut.add_done_callback(self._ended)
        try:
            return fut.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return UNANSWERED

    def _ended(self, _fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._running -= 1


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What became of a batch: its ``results`` in call order (``None`` when a call raised, the
    batch was declined, or the loop shut down; an entry is ``None`` for a call a stop on
    cancellation never started), whether the caller was ``cancelled`` meanwhile,
    whether its ``first`` step ``declined`` it (no call ran), and what its ``last`` step
    answered (``after``: ``None`` when it did not run)."""

    results: list[Any] | None
    cancelled: bool
    declined: bool
    after: Any


class PageThreads:
    """``io_threads`` threads (started by :meth:`start`) and the ways a store runs work on them."""

    def __init__(self, io_threads: int) -> None:
        self.io_threads = io_threads
        self.executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        # torch-serial threads: the pool copies of seed-protocol pages run on them (io_threads)
        self.executor = io_executor(self.io_threads, "hicache-file-io")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """One blocking call on the I/O threads; a cancelled caller still waits for it (a
        rename or delete half seen by the index is worse than a late cancellation)."""
        assert self.executor is not None
        return await run_to_completion(fn, *args, executor=self.executor)

    async def run_chunked(
        self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], nbytes: int = 0, per_call: int = 0,
        threads: int | None = None,
    ) -> list[T]:
        """Run ``fn(*args)`` for each call on the I/O threads; results come back in call order.

        A batch runs on at most ``io_threads`` threads (which bounds its concurrency), each
        taking the next call when free (:class:`_SharedCalls`), and on fewer when it is cheap:
        a hop to a thread costs tens of microseconds, more than a stat of a missing file, so a
        batch goes to one thread unless its bytes (``nbytes``) plus a per-call cost
        (``per_call``, bytes-equivalent: opening, creating and renaming files cost more than
        they move) add up to a share per thread, and to no more threads than its average page
        keeps busy (:func:`page_threads`: small pages are GIL-bound); ``threads`` lowers the
        cap below ``io_threads``.
        A cancelled caller waits for the threads (see :meth:`run_chunked_to_end`).
        """
        # cancelled: the calls not started yet are not (their results are dropped anyway), so
        # a caller's timeout frees its thread after the pages in flight, not the whole batch
        results, cancelled = await self.run_chunked_to_end(fn, calls, nbytes, per_call, threads, stop_on_cancel=True)
        if cancelled:
            raise asyncio.CancelledError
        return results  # type: ignore[return-value]

    async def run_chunked_to_end(
        self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], nbytes: int = 0, per_call: int = 0,
        threads: int | None = None, *, stop_on_cancel: bool = False,
    ) -> tuple[list[T] | None, bool]:
        """:meth:`run_chunked` that always lets the threads finish - they may be filling the
        caller's buffers (host-pool memory the caller reuses once we return) - and returns
        ``(results, cancelled)``: the results (``None`` if a call raised) even when the caller
        was cancelled meanwhile, so facts about the disk (pages written) are never lost."""
        batch = await self.run_batch(fn, calls, nbytes, per_call, threads, stop_on_cancel=stop_on_cancel)
        return batch.results, batch.cancelled

    async def run_batch(
        self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], nbytes: int = 0, per_call: int = 0,
        threads: int | None = None, *, stop_on_cancel: bool = False,
        first: Callable[[], bool] | None = None, last: Callable[[list[Any]], Any] | None = None,
    ) -> BatchOutcome:
        """:meth:`run_chunked_to_end` with a ``first`` and a ``last`` step on the batch's own
        threads (see :class:`_SharedCalls`), and what they did, in a :class:`BatchOutcome`.
        ``stop_on_cancel``: a cancelled caller starts no more calls (their results stay
        ``None``); ``last`` still runs, after the calls that started."""
        if not calls:
            return BatchOutcome([], False, False, None)
        assert self.executor is not None
        loop = asyncio.get_running_loop()
        cap = self.io_threads if threads is None else max(1, min(threads, self.io_threads))
        n = min(cap, len(calls), max(1, (nbytes + per_call * len(calls)) // _BYTES_PER_CHUNK), page_threads(nbytes, len(calls)))
        shared = _SharedCalls(fn, calls, first, last)
        work = asyncio.gather(
            *(loop.run_in_executor(self.executor, shared.drain) for _ in range(n)),
            return_exceptions=True,  # one thread failing must not stop us waiting for the others
        )
        cancelled = False
        while True:
            try:
                parts = await asyncio.shield(work)
                break
            except asyncio.CancelledError:
                cancelled = True
                if stop_on_cancel:
                    shared.stop()
                if work.done():
                    if work.cancelled():  # the work itself was cancelled (loop shutting down)
                        return BatchOutcome(None, True, shared.declined, shared.after)
                    # it ended before this task woke to its cancellation: its results are facts
                    # about the disk (pages written) that the caller must still index
                    parts = work.result()
                    break
        for part in parts:
            if isinstance(part, BaseException):
                if cancelled or isinstance(part, asyncio.CancelledError):
                    return BatchOutcome(None, True, shared.declined, shared.after)
                raise part
        return BatchOutcome(None if shared.declined else shared.results, cancelled, shared.declined, shared.after)
