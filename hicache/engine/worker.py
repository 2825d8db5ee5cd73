"""``ForwardWorker``: the one thread that runs model forwards, prefills before decode steps.

Why not a plain one-thread ``ThreadPoolExecutor``: its queue is FIFO, so a new request's
prefill waits behind one decode step of every running request - time-to-first-token then grows
with the number of requests decoding, whatever the cache saved. Running queued prefills first
(lower ``priority`` value first, FIFO within a priority) keeps TTFT at "the forward in progress
plus my prefill", the policy inference servers use; decode steps are delayed by at most the
prefills that arrived meanwhile.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DECODE", "PREFILL", "ForwardWorker"]

T = TypeVar("T")

PREFILL = 0
DECODE = 1


class ForwardWorker:
    """A daemon thread executing submitted callables by priority; :meth:`shutdown` finishes the
    queued work, then stops the thread."""

    def __init__(self, name: str = "hicache-forward") -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T], priority: int = DECODE) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("forward worker is shut down")
            self._queue.put((priority, next(self._seq), (fn, fut)))
        return fut

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # after everything queued (a higher number than any priority in use)
            self._queue.put((1 << 30, next(self._seq), None))
        if wait:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine
                fut.set_exception(exc)
