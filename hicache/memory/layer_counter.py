"""Per-layer completion of a layer-by-layer load (SGLang's ``LayerDoneCounter``).

Why per layer: a prefix loaded back from host is needed by attention of layer 0 first and layer
``L-1`` last, so the forward pass can start as soon as layer 0 is in place and overlap the rest
of the copy with compute. Copies complete on another thread (the copy executor or a CUDA event
watcher); consumers are asyncio code (``await counter.wait(i)``) or a model forward running on a
plain thread (``counter.wait_sync(i)`` / ``counter.is_done(i)``).

Thread safety: all state sits behind one lock; asyncio waiters are woken with
``loop.call_soon_threadsafe`` on their own loop, never touched from the copying thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType

__all__ = ["LayerDoneCounter"]


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class LayerDoneCounter:
    """Tracks which of ``num_layers`` layers are complete, or the error that stopped the load.

    A layer marked done stays done even if the load fails later (its data is valid); layers
    not yet done when :meth:`fail` is called raise the failure to every waiter and to
    :meth:`is_done`, so a forward pass polling a failed load never spins forever.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        self.num_layers: int = num_layers
        self._cond = threading.Condition(threading.Lock())
        self._done: list[bool] = [False] * num_layers
        self._num_done: int = 0
        self._exc: BaseException | None = None
        self._tb: TracebackType | None = None  # where the load failed (see _error)
        # (layer, loop, future); layer == -1 waits for all layers
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # blocked threads per awaited layer (-1: all); mark_done wakes threads only when one
        # waits for that layer, so a forward waiting for layer 5 is not woken 4 times for nothing
        # (on a small CPU every spurious wake-up steals time from the copying thread)
        self._sync_waiting: dict[int, int] = {}

    # -- producer side
    def mark_done(self, layer: int) -> None:
        """Layer ``layer`` is complete and may be read. Idempotent; any order is allowed."""
        self._check(layer)
        with self._cond:
            if self._done[layer]:
                return
            self._done[layer] = True
            self._num_done += 1
            all_done = self._num_done == self.num_layers
            wake = [w for w in self._waiters if w[0] == layer or (all_done and w[0] == -1)]
            if wake:
                self._waiters = [w for w in self._waiters if w not in wake]
            if self._sync_waiting.get(layer) or (all_done and self._sync_waiting.get(-1)):
                self._cond.notify_all()
        for _, loop, fut in wake:
            self._wake(loop, fut, None)

    def mark_all_done(self) -> None:
        for layer in range(self.num_layers):
            self.mark_done(layer)

    def fail(self, exc: BaseException) -> None:
        """Stop the load: waiters of layers not yet done get ``exc``. The first failure wins."""
        with self._cond:
            if self._exc is None:
                self._exc = exc
                self._tb = exc.__traceback__
            wake = self._waiters
            self._waiters = []
            self._cond.notify_all()
        for _, loop, fut in wake:
            self._wake(loop, fut, self._exc)

    # -- consumer side
    def is_done(self, layer: int) -> bool:
        """Non-blocking: whether ``layer`` is complete. Raises the load's error if it failed
        before this layer completed."""
        self._check(layer)
        with self._cond:
            if self._done[layer]:
                return True
            if self._exc is not None:
                raise self._error()
            return False

    def all_done(self) -> bool:
        with self._cond:
            if self._num_done == self.num_layers:
                return True
            if self._exc is not None:
                raise self._error()
            return False

    def ended(self) -> bool:
        """Whether the load is over: every layer done, or failed. Never raises, unlike
        :meth:`all_done`: one read under the lock, for bookkeeping on another thread than the
        copy's (asking :attr:`exception` and then ``all_done()`` let a failure landing in
        between raise that load's error into the caller)."""
        with self._cond:
            return self._num_done == self.num_layers or self._exc is not None

    @property
    def exception(self) -> BaseException | None:
        return self._exc

    def wait_sync(self, layer: int, timeout: float | None = None) -> None:
        """Block the calling thread until ``layer`` is complete (for a model forward on a worker
        thread). Raises the load's error, or ``TimeoutError`` after ``timeout`` seconds. Do not
        call it on an event loop thread; use ``await wait(layer)`` there."""
        self._check(layer)
        self._block(layer, timeout)

    def wait_all_sync(self, timeout: float | None = None) -> None:
        """Block until every layer is complete (see :meth:`wait_sync`)."""
        self._block(-1, timeout)

    async def wait(self, layer: int) -> None:
        """Wait until ``layer`` is complete without blocking the loop."""
        self._check(layer)
        await self._await(layer)

    async def wait_all(self) -> None:
        """Wait until every layer is complete."""
        await self._await(-1)

    # -- internals
    def _error(self) -> BaseException:
        """The failure, to raise, with the traceback of where the load failed. Why: every
        waiter raises the same object, and a raise stacks the raiser's frames onto its
        traceback; after a forward's waits on every layer the error logged hundreds of repeated
        frames and kept each waiter's frames (and their tensors) alive with the counter."""
        assert self._exc is not None
        return self._exc.with_traceback(self._tb)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def _ready(self, layer: int) -> bool:
        return self._num_done == self.num_layers if layer == -1 else self._done[layer]

    def _block(self, layer: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._ready(layer):
                return
            self._sync_waiting[layer] = self._sync_waiting.get(layer, 0) + 1
            try:
                while not self._ready(layer):
                    if self._exc is not None:
                        raise self._error()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        what = "all layers" if layer == -1 else f"layer {layer}"
                        raise TimeoutError(f"{what} not loaded after {timeout} s")
                    self._cond.wait(remaining)
            finally:
                self._sync_waiting[layer] -= 1
                if not self._sync_waiting[layer]:
                    del self._sync_waiting[layer]

    async def _await(self, layer: int) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._ready(layer):
                return
            if self._exc is not None:
                raise self._error()
            fut: asyncio.Future[None] = loop.create_future()
            entry = (layer, loop, fut)
            self._waiters.append(entry)
        try:
            await fut
        finally:
            # a cancelled waiter removes itself so the list never grows with dead futures
            with self._cond:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    @staticmethod
    def _wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(_resolve, fut, exc)
        except RuntimeError:  # loop already closed: nobody is left to wake
            pass

    def __repr__(self) -> str:
        state = "failed" if self._exc is not None else f"{self._num_done}/{self.num_layers} done"
        return f"LayerDoneCounter({state})"
