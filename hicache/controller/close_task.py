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
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["CloseTask", "start_close_task"]

_T = TypeVar("_T")


class CloseTask(asyncio.Task[_T]):
    """An :class:`asyncio.Task` whose cancellation before its first step is delivered just
    after that step (the step is queued when the task is made, so it always runs first)."""

    def cancel(self, msg: Any | None = None) -> bool:
        coro = self.get_coro()
        if not self.done() and inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            self.get_loop().call_soon(self._cancel_after_first_step, msg)
            return True
        return super().cancel(msg)

    def _cancel_after_first_step(self, msg: Any | None) -> None:
        super().cancel(msg)


def start_close_task(coro: Coroutine[Any, Any, _T], *, name: str,
                     loop: asyncio.AbstractEventLoop | None = None) -> CloseTask[_T]:
    """Run ``coro`` (a close) as a :class:`CloseTask` on ``loop`` (default: the running one)."""
    return CloseTask(coro, loop=loop or asyncio.get_running_loop(), name=name)
