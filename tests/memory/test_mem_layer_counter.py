"""LayerDoneCounter: asyncio and thread waiters, failures, cancellation, timeouts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hicache.memory import LayerDoneCounter


async def test_async_waiters_wake_per_layer_from_another_thread():
    c = LayerDoneCounter(3)
    woke: list[int] = []

    async def waiter(i: int) -> None:
        await c.wait(i)
        woke.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in (2, 0, 1)]
    await asyncio.sleep(0.01)
    assert woke == []
    threading.Thread(target=c.mark_done, args=(0,)).start()
    await asyncio.wait_for(tasks[1], 2)
    await asyncio.sleep(0.01)
    assert woke == [0]
    t = threading.Thread(target=lambda: (c.mark_done(1), c.mark_done(2)))
    t.start()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    t.join()
    assert sorted(woke) == [0, 1, 2]
    assert c.is_done(2) and c.all_done()
    await c.wait(1)  # already done: returns at once
    await c.wait_all()


def test_wait_sync_and_timeout():
    c = LayerDoneCounter(2)
    assert not c.is_done(0)
    with pytest.raises(TimeoutError):
        c.wait_sync(0, timeout=0.01)
    timer = threading.Timer(0.02, c.mark_done, args=(0,))
    timer.start()
    t0 = time.monotonic()
    c.wait_sync(0, timeout=2)
    assert time.monotonic() - t0 < 2
    assert c.is_done(0) and not c.is_done(1)
    c.mark_done(0)  # idempotent
    c.mark_done(1)
    c.wait_all_sync(timeout=1)
    assert c._sync_waiting == {}  # timed-out and woken waiters both deregister


def test_thread_waiting_for_all_wakes_once_all_done():
    c = LayerDoneCounter(3)
    done = threading.Event()

    def waiter() -> None:
        c.wait_all_sync(timeout=5)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    c.mark_done(0)
    c.mark_done(2)
    assert not done.wait(0.02)
    c.mark_done(1)
    assert done.wait(5)
    t.join()


async def test_fail_reaches_async_and_sync_waiters():
    c = LayerDoneCounter(3)
    c.mark_done(0)
    pending = asyncio.create_task(c.wait(2))
    all_task = asyncio.create_task(c.wait_all())
    await asyncio.sleep(0.01)
    err = RuntimeError("copy failed")
    threading.Thread(target=c.fail, args=(err,)).start()
    with pytest.raises(RuntimeError, match="copy failed"):
        await asyncio.wait_for(pending, 2)
    with pytest.raises(RuntimeError):
        await all_task
    assert c.is_done(0)  # a layer already done stays valid
    with pytest.raises(RuntimeError):
        c.is_done(1)  # polling a failed load raises instead of spinning forever
    with pytest.raises(RuntimeError):
        c.wait_sync(1)
    with pytest.raises(RuntimeError):
        await c.wait(1)
    assert c.exception is err


async def test_cancelled_waiter_removes_itself():
    c = LayerDoneCounter(1)
    t = asyncio.create_task(c.wait(0))
    await asyncio.sleep(0.01)
    assert len(c._waiters) == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert c._waiters == []
    c.mark_done(0)


def test_layer_range_checked():
    c = LayerDoneCounter(2)
    with pytest.raises(IndexError):
        c.mark_done(2)
    with pytest.raises(IndexError):
        c.is_done(-1)


async def test_zero_layers_is_done():
    c = LayerDoneCounter(0)
    assert c.all_done()
    await c.wait_all()


async def test_a_failure_raised_to_many_waiters_keeps_its_own_traceback():
    """Every waiter of a failed load gets the same exception object. Raised as it was, each
    raise stacked the raiser's frames onto that object's traceback: after a forward's waits on
    every layer the load's error logged hundreds of repeated frames, and kept every waiter's
    frames (and their tensors) alive as long as the counter."""
    import traceback

    def boom() -> None:
        raise RuntimeError("copy failed")

    c = LayerDoneCounter(4)
    try:
        boom()
    except RuntimeError as exc:
        c.fail(exc)
    depth = len(traceback.extract_tb(c.exception.__traceback__))

    def frames_of_one_raise(call) -> int:  # type: ignore[no-untyped-def]
        try:
            call()
        except RuntimeError as exc:
            return len(traceback.extract_tb(exc.__traceback__))
        raise AssertionError("no raise")

    for _ in range(50):
        for call in (lambda: c.is_done(1), c.all_done, lambda: c.wait_sync(2, timeout=1), c.wait_all_sync):
            frames_of_one_raise(call)
    for _ in range(20):
        with pytest.raises(RuntimeError):
            await c.wait(3)
    assert frames_of_one_raise(lambda: c.is_done(1)) <= depth + 3
    tb = traceback.extract_tb(c.exception.__traceback__)
    assert len(tb) <= depth + 3 and tb[-1].name == "boom"  # still says where the copy failed
