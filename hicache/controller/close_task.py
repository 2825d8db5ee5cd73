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
import functools
import inspect
import types
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

__all__ = ["CLOSE_CUT", "CloseTask", "close_with", "coroutine_function", "start_close_task", "wait_for_close"]

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
    and ``unittest.mock``'s autospec took it for a plain function: an embedder's autospecced
    mock was not awaitable, a framework hook ran it on a thread and dropped the coroutine.
    Python 3.12+ has ``inspect.markcoroutinefunction``; 3.11's ``inspect`` reads a function's
    code flags only, so there ``fn`` is wrapped in a :class:`_MarkedCoroutineFunction`."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        return cast(_F, mark(fn))
    return cast(_F, _MarkedCoroutineFunction(fn))


class _MarkedCoroutineFunction:
    """``fn`` as a callable that Python 3.11's ``inspect.iscoroutinefunction`` takes for a
    coroutine function: it reads the flags of a function-like object's ``__code__`` (the
    duck typing it keeps for compiled functions), here ``fn``'s own code flagged as a
    coroutine's, never run (calls go to ``fn``). A method on a class: bound like a function.
    ``asyncio``'s older mark is set too; ``inspect.signature`` and ``help`` see ``fn``'s."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        functools.update_wrapper(self, fn, updated=())
        del self.__wrapped__  # type: ignore[attr-defined]  # unwrapped, a framework would find the plain function
        self.__code__ = fn.__code__.replace(co_flags=fn.__code__.co_flags | inspect.CO_COROUTINE)
        self.__defaults__ = fn.__defaults__
        self.__kwdefaults__ = fn.__kwdefaults__
        legacy = getattr(asyncio.coroutines, "_is_coroutine", None)
        if legacy is not None:
            self._is_coroutine = legacy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)


def start_close_task(coro: Coroutine[Any, Any, _T], *, name: str,
                     loop: asyncio.AbstractEventLoop | None = None) -> CloseTask[_T]:
    """Run ``coro`` (a close) as a :class:`CloseTask` on ``loop`` (default: the running one)."""
    return CloseTask(coro, loop=loop or asyncio.get_running_loop(), name=name)


#: what :func:`wait_for_close` answers when the close task itself was cancelled and could not go on
CLOSE_CUT: Any = object()


async def wait_for_close(task: asyncio.Task[_T]) -> Any:
    """Wait for the one close ``task`` that every caller of a close shares, shielded: a caller
    cancelled meanwhile gets its ``CancelledError`` and the close goes on for the others.
    :data:`CLOSE_CUT` when the close task itself, not this caller, was cancelled and could not
    finish: re-raising told every later caller, whom nobody cancelled, "cancelled"; each
    closer answers with what it can (the report so far, a hurried close)."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if not task.cancelled() or (me is not None and me.cancelling()):
            raise  # this caller was cancelled
    return CLOSE_CUT


def close_with(aclose: Callable[..., Coroutine[Any, Any, _T]], **bounds: float | None) -> Coroutine[Any, Any, _T]:
    """``aclose(**bounds)`` with only the bounds it takes (``timeout``, ``deadline``...) and
    that are set (not ``None``). Why: a close is handed the time it may take down a chain of
    closes (server, caches, controller, store), and a link that takes no bound (a wrapper's, an
    engine's stand-in, a plugin written before the bound existed) is still closed, as it
    closes."""
    params = inspect.signature(aclose).parameters
    return aclose(**{k: v for k, v in bounds.items() if v is not None and k in params})
