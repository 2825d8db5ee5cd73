"""A close's own task: a cancellation hurries the close, it never skips it.

Why: ``Task.cancel()`` on a task whose first step has not run yet throws the cancellation into
a coroutine that never started, so none of its code runs. A close task cancelled that early
(asyncio.run's shutdown sweep, when the close was started in the loop's last iteration, or any
"cancel every task" cleanup) closed nothing: the controller kept running, the storage open, its
I/O and file threads alive, and every queued write was neither written nor reported. Once a
close runs, it takes a cancellation as "hurry" wherever it lands (see ``Controller._hurry``);
this task holds a cancellation that comes before its first step until that step has run, so it
lands at the close's first await like any other.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

__all__ = ["CloseTask", "coroutine_function", "start_close_task"]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


class CloseTask(asyncio.Task[_T]):
    """An :class:`asyncio.Task` whose cancellation before its first step is delivered just
    after that step (the step is queued when the task is made, so it always runs first).

    A held cancellation counts as one requested: :meth:`cancelling` includes it, and
    :meth:`uncancel` takes it back before it is delivered, as a plain task's bookkeeping
    would (``asyncio.timeout`` and task groups rely on those counts). The loop's task factory
    is not used: a close is this class or it is not safe."""

    _held = 0  # cancellations requested before the first step, not delivered yet

    def cancel(self, msg: Any | None = None) -> bool:
        coro = self.get_coro()
        loop = self.get_loop()
        if (not self.done() and not loop.is_closed() and inspect.iscoroutine(coro)
                and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED):
            self._held += 1
            loop.call_soon(self._deliver_held, msg)
            return True
        return super().cancel(msg)

    def _deliver_held(self, msg: Any | None) -> None:
        if self._held <= 0:  # taken back by uncancel() before it was delivered
            return
        self._held -= 1
        super().cancel(msg)

    def cancelling(self) -> int:
        return super().cancelling() + self._held

    def uncancel(self) -> int:
        if self._held > 0:
            self._held -= 1
            return self.cancelling()
        return super().uncancel()


def coroutine_function(fn: _F) -> _F:
    """Mark ``fn``, a plain function that returns a coroutine, as a coroutine function.

    Why: a close entry point that must act when it is *called* (``HiCache.aclose`` starts its
    close there, so a task cancelled before its first step still closes the cache) cannot be
    an ``async def``, and then ``asyncio.iscoroutinefunction``, ``inspect.iscoroutinefunction``
    (3.12+) and ``unittest.mock``'s autospec took it for a plain function: an embedder's
    autospecced mock was not awaitable, a framework hook ran it on a thread and dropped the
    coroutine. On 3.11 the mark is asyncio's own (``inspect`` there reads code flags only)."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        return cast(_F, mark(fn))
    legacy = getattr(asyncio.coroutines, "_is_coroutine", None)
    if legacy is not None:
        fn._is_coroutine = legacy  # type: ignore[attr-defined]
    return fn


def start_close_task(coro: Coroutine[Any, Any, _T], *, name: str,
                     loop: asyncio.AbstractEventLoop | None = None) -> CloseTask[_T]:
    """Run ``coro`` (a close) as a :class:`CloseTask` on ``loop`` (default: the running one)."""
    return CloseTask(coro, loop=loop or asyncio.get_running_loop(), name=name)
