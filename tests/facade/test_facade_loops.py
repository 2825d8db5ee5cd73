"""The facade is used from the one event loop that started it.

A call from another loop (another thread's ``asyncio.run``) used to run against the tree, the
pools and the controller's queues from a second thread, and an ``aclose()`` there made a close
task of that loop: it hung, and the owner's own close then raised ``CancelledError`` with the
controller never closed (its threads left running).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from hicache.errors import LoopMisuseError
from hicache.facade import HiCache

sys.path.insert(0, str(Path(__file__).parent))
from test_facade import PS, config, prompt, run  # noqa: E402
from test_facade_races import assert_no_leak  # noqa: E402


async def test_calls_from_another_loop_are_refused_and_the_owner_still_closes() -> None:
    cache = await HiCache.from_config(config()).start()
    await run(cache, "a", prompt(1, 4 * PS))
    seen: list[BaseException] = []

    def other_thread() -> None:
        async def go() -> None:
            for call in (lambda: cache.begin("x", prompt(2, 4 * PS)), cache.drain, cache.aclose):
                try:
                    await asyncio.wait_for(call(), 5.0)
                except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
                    seen.append(exc)

        asyncio.run(go())

    await asyncio.to_thread(other_thread)
    assert [type(e) for e in seen] == [LoopMisuseError] * 3, seen
    assert not cache._live and not cache._rids  # nothing was admitted from the other loop
    await cache.drain()
    assert_no_leak(cache)
    report = await asyncio.wait_for(cache.aclose(), 10.0)
    assert report.drained
    assert not [t for t in threading.enumerate() if t.name.startswith(("hicache-storage-io", "hicache-copy"))]
    # a finished close answers on any loop
    assert await asyncio.to_thread(asyncio.run, cache.aclose()) is report


def test_a_close_after_the_owner_loop_ended_says_why_instead_of_hanging() -> None:
    async def open_it() -> HiCache:
        cache = await HiCache.from_config(config(storage={"backend": None})).start()
        await run(cache, "a", prompt(1, 4 * PS))
        return cache

    cache = asyncio.run(open_it())
    with pytest.raises(LoopMisuseError, match="loop is closed"):
        asyncio.run(asyncio.wait_for(cache.aclose(), 5.0))


def test_a_failed_start_binds_no_loop() -> None:
    cache = HiCache.from_config(config(storage={"backend": None}))

    async def failing_start() -> None:
        cache._stack_config = None  # type: ignore[assignment]  # build_stack fails
        with pytest.raises(Exception):
            await cache.start()

    asyncio.run(failing_start())
    cache._stack_config = HiCache.from_config(config(storage={"backend": None}))._stack_config

    async def start_and_close() -> None:
        await cache.start()
        await cache.aclose()

    asyncio.run(start_and_close())  # a retry on a new loop is not refused
