"""A private event loop on its own thread where storage calls run.

Why: a backend may do real work inside its coroutines before the first ``await`` (the memory
backend copies every page inline, a file backend may hash or stat), and on the server's loop
that work delays everything else. Running each storage coroutine on this loop keeps the server's
loop free. Cancelling the awaiting task cancels the coroutine on the I/O loop too, and the
awaiting task ends only when that coroutine has ended: a backend call still running on the I/O
loop may be reading or writing host pages the caller handed it, and the caller must not reuse
them before then (``asyncio.wrap_future`` would report the cancellation at once).

A backend used through the controller must only be used from this loop while the controller
runs (backends bind locks to the loop that first opens them).

CPU priority (``nice``): the I/O thread is background work. On a machine with few cores, the
threads that move pages (the copy engine's, this one, the backend's copy threads) are runnable at
the same time as the server's loop thread, and the OS shares the cores fairly between them: the
loop thread then waits in the run queue for milliseconds although it holds nothing up itself.
With ``nice > 0`` (Linux, where niceness is per thread) this thread lowers its own priority by
that much when it starts; threads it starts later - the I/O loop's default executor, where
backends run their copies - inherit it. Nothing else in the process is touched.

What hicache does not set, because it is process-wide and the application's: the GIL switch
interval (``sys.setswitchinterval``, 5 ms by default). A thread running Python - a worker
between two copies, a garbage collection that happens to run on it - keeps the GIL for up to
that long after the loop thread asks for it. A server that wants its loop late by no more than
a few milliseconds while pages stream sets it lower itself (1 ms took about 3 ms off the p99
lateness of a 2 ms ticker on a 2-core machine), and may ``gc.freeze()`` after start-up: a full
collection of a process that imported torch holds the GIL for ~90 ms on whichever thread
triggers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from hicache.storage.offload import wait_out

__all__ = ["IoThread", "lower_thread_priority"]

logger = logging.getLogger("hicache.controller")

T = TypeVar("T")


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice`` (at most to 19). Linux only (elsewhere
    ``setpriority`` would act on the whole process): returns whether it did."""
    if nice <= 0 or sys.platform != "linux" or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        logger.debug("could not lower the priority of thread %d: %s", tid, exc)
        return False
    return True


class IoThread:
    """Runs coroutines on a dedicated loop thread (started lazily, stopped by :meth:`stop`)."""

    def __init__(self, name: str = "hicache-storage-io", *, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._waiting: set[asyncio.Future[Any]] = set()  # outcomes callers still await

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            lower_thread_priority(self.nice)
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` executed on the I/O loop. If the caller is cancelled, ``coro`` is
        cancelled on the I/O loop, and the cancellation reaches the caller once it has ended."""
        outcome, started = self._begin(coro)
        assert self._loop is not None
        io_loop = self._loop
        try:
            await asyncio.wait({outcome})  # a cancellation of ours leaves outcome pending
        except asyncio.CancelledError:
            with contextlib.suppress(RuntimeError):  # closed: stop() settles outcome
                # begin() was queued first and the loop runs callbacks in order: started is set
                io_loop.call_soon_threadsafe(lambda: started[0].cancel() if started else None)
            await wait_out(outcome)
            raise
        return outcome.result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Start ``coro`` on the I/O loop; a future of the caller's loop settled like it ends.

        Why besides :meth:`run`: nothing on the caller's loop is a task here, so a sweep that
        cancels every task (``asyncio.run``'s end) cannot cancel the call. For a call that must
        run to its end, the storage close: cancelled halfway, it left the backend's threads
        running. :meth:`stop` settles it if the loop never finishes it."""
        return self._begin(coro)[0]

    def _begin(self, coro: Coroutine[Any, Any, T]) -> tuple[asyncio.Future[T], list[asyncio.Task[T]]]:
        """Queue ``coro`` on the I/O loop: the caller's future for its outcome, and the list
        that holds the I/O loop's task once it was made."""
        if not self.running:
            self.start()
        assert self._loop is not None
        io_loop, here = self._loop, asyncio.get_running_loop()
        outcome: asyncio.Future[T] = here.create_future()
        started: list[asyncio.Task[T]] = []

        def relay(task: asyncio.Task[T]) -> None:  # on the I/O loop
            try:
                here.call_soon_threadsafe(_copy_outcome, task, outcome)
            except RuntimeError:  # the caller's loop is closed: nobody waits any more
                pass

        def begin() -> None:  # on the I/O loop
            task = io_loop.create_task(_contained(coro, self.name))
            task.add_done_callback(relay)
            task.add_done_callback(lambda _: _close_unstarted(coro))
            started.append(task)

        try:
            io_loop.call_soon_threadsafe(begin)
        except RuntimeError:  # the I/O loop was closed meanwhile
            coro.close()
            raise
        self._waiting.add(outcome)
        outcome.add_done_callback(self._waiting.discard)
        return outcome, started

    async def stop(self, timeout: float | None = None, *, cancelled_limit: float | None = None) -> bool:
        """Stop the loop (cancelling what still runs there) and join the thread off-loop, for
        at most ``timeout`` seconds (``None``: no limit). A coroutine that blocks the I/O loop
        (a backend stuck in a synchronous call) would otherwise make this wait forever; the
        thread is a daemon, so it is left behind with a warning. Returns whether it ended.

        A cancellation while it waits does not cut the stop short (the calls the loop never
        finished would stay unsettled, their callers waiting for good): it is raised once the
        stop is done, and it cuts the rest of the wait to ``cancelled_limit`` seconds when given
        (a cancelled close is hurried, not held for the whole ``timeout``)."""
        if self._loop is None or self._thread is None:
            return True
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed meanwhile
                pass
        clock = asyncio.get_running_loop().time
        deadline = None if timeout is None else clock() + timeout
        cancelled = False
        while thread.is_alive() and (deadline is None or clock() < deadline):
            try:  # polled, not joined on a thread: an abandoned join would outlive the wait
                await asyncio.sleep(0.005 if deadline is None else max(0.0, min(0.005, deadline - clock())))
            except asyncio.CancelledError:
                cancelled = True
                if cancelled_limit is not None:
                    cap = clock() + cancelled_limit
                    deadline = cap if deadline is None else min(deadline, cap)
        for outcome in list(self._waiting):  # coroutines the stopped loop never ran to the end
            if not outcome.done():
                outcome.get_loop().call_soon_threadsafe(outcome.cancel)
        if thread.is_alive():
            logger.warning("%s: the storage I/O loop is blocked; its thread is left behind", self.name)
        if cancelled:
            raise asyncio.CancelledError
        return not thread.is_alive()


async def _contained(coro: Coroutine[Any, Any, T], name: str) -> T:
    """Await ``coro`` on the I/O loop, turning a ``KeyboardInterrupt`` or ``SystemExit`` it
    raises into a ``RuntimeError``.

    Why: asyncio re-raises those two out of the loop that runs the task. On the I/O thread
    that stopped the I/O loop for good (every later storage call started a new loop the
    backend was not bound to), and the relayed exception then stopped the server's loop too:
    one backend calling ``sys.exit()`` took the server down. Neither can come from a signal
    on this thread (Python delivers those to the main thread only), so it is a failure of the
    store like any other, and the caller treats it as one."""
    try:
        return await coro
    except (KeyboardInterrupt, SystemExit) as exc:
        logger.error("%s: a storage call raised %s; treated as a failed call", name, type(exc).__name__,
                     exc_info=exc)  # the backend's traceback: where it exited
        raise RuntimeError(f"a storage call raised {type(exc).__name__} on the I/O thread") from exc


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    """Close ``coro`` if its wrapper task ended before it ever ran (cancelled before its first
    step): the wrapper never awaited it, and it was collected with a "coroutine ... was never
    awaited" warning. A started one ended with its wrapper."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def _copy_outcome(task: asyncio.Task[T], outcome: asyncio.Future[T]) -> None:
    """Settle the caller's future like the I/O loop's task ended (on the caller's loop)."""
    if outcome.done():
        return
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        outcome.set_result(task.result())
