"""A storage call cancelled before its task first runs must not leak an un-awaited coroutine."""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings

from hicache.controller.controller import _close_unstarted


async def _call() -> int:
    await asyncio.sleep(0)
    return 1


def test_unstarted_call_is_closed_without_warning() -> None:
    coro = _call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _close_unstarted(coro)
        del coro
        gc.collect()


async def test_started_call_is_left_to_its_runner() -> None:
    coro = _call()
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # the task has started the coroutine
    _close_unstarted(coro)
    assert await task == 1
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
