"""A controller close whose caller or own task is cancelled: the report is handed on, never
dropped, and a cancellation only hurries the rest of the close."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
from hicache.controller.controller import ControllerState
from hicache.replay import StackConfig, build_stack, serve_request

PS = 4


def make(store: FaultyStorage, close_timeout_s: float = 0.3):  # type: ignore[no-untyped-def]
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_io_timeout_s=60.0, storage_stall_s=0,
                                                  cancelled_io_grace_s=0.2, close_timeout_s=close_timeout_s))
    return build_stack(cfg, storage=store)


async def test_the_report_owed_to_a_cancelled_first_caller_survives_the_close_ending() -> None:
    """The first caller is cancelled, the close then ends before anyone calls again: the next
    aclose() used to see the state CLOSED first and get an empty report (lost silently)."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    store.hang_now()
    await serve_request(stack, list(range(8)), rid="a")
    await asyncio.sleep(0.05)  # the storage write is in flight, hung
    ctl = stack.controller
    try:
        await asyncio.wait_for(ctl.aclose(), 0.05)
    except TimeoutError:
        pass
    assert ctl._close_task is not None
    real = await asyncio.shield(ctl._close_task)
    assert ctl.state is ControllerState.CLOSED and real.unwritten_pages == 2
    owed = await ctl.aclose()
    assert not owed.drained and owed.unwritten_pages == 2
    again = await ctl.aclose()  # handed over once: later callers learn how it went, not its lists
    assert not again.drained and not again.unwritten
    await stack.aclose()


class LoopBlockingStorage(FaultyStorage):
    """Writes block the storage I/O loop's thread (a synchronous call on a hung mount)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.unblock = threading.Event()
        self.entered = threading.Event()  # a write is blocking the I/O loop

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.unblock.wait(20)
        return await super()._write(pages, buffers, parents)


async def test_a_cancelled_close_is_hurried_not_held_for_each_close_timeout() -> None:
    """Cancelled while draining (asyncio.run's sweep), the close still waited close_timeout_s
    for its tasks, again for the storage close and again for the I/O thread: 3 x 30 s by
    default, inside the loop's shutdown. After a cancellation each wait is capped."""
    store = LoopBlockingStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store, close_timeout_s=3.0)
    ctl = stack.controller
    try:
        await serve_request(stack, list(range(8)), rid="a")
        await asyncio.sleep(0.05)  # the write blocks the I/O loop
        closing = asyncio.ensure_future(ctl.aclose())
        while ctl.state is not ControllerState.CLOSING:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        assert ctl._close_task is not None
        ctl._close_task.cancel()  # what the sweep does
        report = await asyncio.wait_for(closing, 15.0)
        assert time.monotonic() - t0 < 2.5
        assert not report.drained and ctl.state is ControllerState.CLOSED
    finally:
        store.unblock.set()
    await stack.aclose()


async def test_a_close_task_cancelled_before_its_first_step_still_closes_and_reports() -> None:
    """The close task was cancelled before its first step (a shutdown sweep right after the
    close began): the cancellation was thrown into a coroutine that never started, so nothing
    closed - the workers ran on, the I/O thread stayed alive - and the caller got
    CancelledError, every later one an empty drained=False. A cancellation only hurries a
    close: it now lands at the close's first await."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    before = {t.ident for t in threading.enumerate()}
    stack = make(store, close_timeout_s=5.0)
    ctl = stack.controller
    store.hang_now()
    await serve_request(stack, list(range(8)), rid="a")
    await ctl.drain_backups()  # on host: its storage write is queued (and hangs)
    first = asyncio.ensure_future(ctl.aclose())
    await asyncio.sleep(0)  # the caller's first step made the close task, which has not run yet
    task = ctl._close_task
    assert task is not None and not task.done()
    t0 = time.monotonic()
    task.cancel()
    report = await asyncio.wait_for(first, 10.0)
    assert time.monotonic() - t0 < 2.0  # hurried: not held for close_timeout_s
    assert ctl.state is ControllerState.CLOSED
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "hicache-storage-io"]
    assert not report.drained and report.unwritten_pages == 2
    store.release()
    await stack.aclose()


async def test_a_zero_timeout_close_hurries_the_close_already_running() -> None:
    """What a cancelled cache close falls back to (``aclose(timeout=0)``) waited for the
    running close's whole drain (up to close_timeout_s) instead of hurrying it."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store, close_timeout_s=5.0)
    ctl = stack.controller
    store.hang_now()
    await serve_request(stack, list(range(8)), rid="a")
    await ctl.drain_backups()
    first = asyncio.ensure_future(ctl.aclose())
    while ctl.state is not ControllerState.CLOSING:
        await asyncio.sleep(0)
    t0 = time.monotonic()
    hurried = await asyncio.wait_for(ctl.aclose(timeout=0.0), 10.0)
    assert time.monotonic() - t0 < 2.0
    report = await first  # the first caller owns the lists
    assert ctl.state is ControllerState.CLOSED
    assert not report.drained and report.unwritten_pages == 2 and not hurried.drained
    store.release()
    await stack.aclose()


async def test_a_zero_timeout_close_caps_each_wait_like_a_cancelled_one() -> None:
    """``aclose(timeout=0)`` (a cancelled cache close's fallback when the controller's close
    had not begun) cut the drain but still waited up to 1 s for the storage close and again
    for the I/O thread, a backend blocking its loop; a hurried close caps each at the grace."""
    store = LoopBlockingStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store, close_timeout_s=3.0)
    ctl = stack.controller
    try:
        await serve_request(stack, list(range(8)), rid="a")
        assert await asyncio.to_thread(store.entered.wait, 5)  # its storage write blocks the I/O loop
        t0 = time.monotonic()
        report = await asyncio.wait_for(ctl.aclose(timeout=0.0), 15.0)
        assert time.monotonic() - t0 < 0.9  # two waits of the 0.2 s grace, not of 1 s each
        assert not report.drained and ctl.state is ControllerState.CLOSED
    finally:
        store.unblock.set()
    await stack.aclose()
