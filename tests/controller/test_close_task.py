"""``CloseTask``: a cancellation before the first step is held until that step ran, and counted
as a plain task counts it (``asyncio.timeout`` and task groups read those counts); and the
close entry point that starts work when called still looks like a coroutine function."""

from __future__ import annotations

import asyncio
import inspect
from unittest import mock

from hicache.controller.close_task import CloseTask, start_close_task
from hicache.facade import HiCache


async def _close(steps: list[str]) -> str:
    steps.append("started")
    try:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        steps.append("hurried")
        return "hurried"
    steps.append("ended")
    return "ended"


async def test_a_cancellation_before_the_first_step_is_held_counted_and_delivered() -> None:
    steps: list[str] = []
    task = start_close_task(_close(steps), name="t")
    assert task.cancel() and task.cancelling() == 1  # a plain task says 1 here too
    assert await task == "hurried" and steps == ["started", "hurried"]


async def test_uncancel_takes_back_a_held_cancellation_before_it_lands() -> None:
    steps: list[str] = []
    task = start_close_task(_close(steps), name="t")
    task.cancel()
    assert task.uncancel() == 0 and task.cancelling() == 0
    assert await task == "ended"  # the held cancellation did not land after being taken back


async def test_two_held_cancellations_count_two() -> None:
    task = start_close_task(_close([]), name="t")
    task.cancel()
    task.cancel()
    assert task.cancelling() == 2
    assert await task == "hurried"


def test_a_cancel_after_the_loop_closed_does_not_raise() -> None:
    loop = asyncio.new_event_loop()
    coro = _close([])
    task: CloseTask[str] = CloseTask(coro, loop=loop, name="t")
    loop.close()
    assert task.cancel()  # a plain task's answer; scheduling the delivery on a closed loop raised
    coro.close()


def test_aclose_is_a_coroutine_function_for_frameworks_and_mocks() -> None:
    """``HiCache.aclose`` starts the close when called, so it is a plain function returning a
    coroutine; marked, or an embedder's autospecced mock was not awaitable and frameworks that
    ask ``iscoroutinefunction`` ran it on a thread and dropped the coroutine."""
    assert asyncio.iscoroutinefunction(HiCache.aclose)
    # inspect's own answer too (Python 3.11 reads code flags only; 3.12+ a mark)
    assert inspect.iscoroutinefunction(HiCache.aclose)
    assert str(inspect.signature(HiCache.aclose)).startswith("(self")
    assert HiCache.aclose.__name__ == "aclose" and "Release every session" in (HiCache.aclose.__doc__ or "")
    spec = mock.create_autospec(HiCache, instance=True)
    assert isinstance(spec.aclose, mock.AsyncMock)


async def test_a_bound_aclose_is_a_coroutine_function_and_still_closes_when_called() -> None:
    from tests.facade.test_facade import config

    cache = HiCache.from_config(config())
    await cache.start()
    assert inspect.iscoroutinefunction(cache.aclose) and asyncio.iscoroutinefunction(cache.aclose)
    coro = cache.aclose()  # the close starts here, before the coroutine's first step
    assert cache._close_task is not None
    await coro
