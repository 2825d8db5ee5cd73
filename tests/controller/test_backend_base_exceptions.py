"""A backend that raises ``KeyboardInterrupt`` or ``SystemExit`` on the storage I/O thread.

asyncio re-raises those two out of the loop that runs the task: the I/O loop stopped for good
and the relayed exception then stopped the server's own loop (``asyncio.run`` raised). The
scenario runs under its own ``asyncio.run`` so that, without the fix, the test fails instead of
ending the test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import uuid
import warnings

import pytest

from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
from hicache.controller.io_thread import IoThread
from hicache.replay import StackConfig, build_stack, serve_request

PS = 4


class RaisingStorage(FaultyStorage):
    exc: type[BaseException] = SystemExit

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        raise self.exc("injected by the test")


async def _scenario(exc: type[BaseException]) -> None:
    store = RaisingStorage(store_id=f"faulty-{uuid.uuid4()}")
    store.exc = exc
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_io_timeout_s=2.0, storage_stall_s=0,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=1.0))
    stack = build_stack(cfg, storage=store)
    await serve_request(stack, list(range(8)), rid="a")
    await asyncio.wait_for(stack.controller.drain(), 5.0)
    io = stack.controller._io
    assert io is not None and io.running  # the I/O loop survived the backend
    thread = io._thread
    await serve_request(stack, list(range(100, 108)), rid="b")  # storage still answers (or is down)
    await asyncio.wait_for(stack.controller.drain(), 5.0)
    assert io._thread is thread  # the same thread: no new loop the backend is not bound to
    report = await asyncio.wait_for(stack.aclose(), 10.0)
    assert report.drained and not report.unwritten
    assert report.failed_storage_pages == 4  # every page meant for storage is accounted for
    assert not [t for t in threading.enumerate() if t.name == "hicache-storage-io" and t.is_alive()]


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_a_backend_raising_a_base_exception_fails_its_call_not_the_loops(exc: type[BaseException]) -> None:
    try:
        asyncio.run(_scenario(exc))
    except (KeyboardInterrupt, SystemExit) as escaped:
        pytest.fail(f"{type(escaped).__name__} from the backend reached the server's loop")


def test_a_storage_call_cancelled_before_it_started_is_closed_not_left_unawaited() -> None:
    """The I/O loop's task wraps the call (see ``_contained``): cancelled before its first
    step, it never started the call, which was then collected with a "coroutine ... was never
    awaited" warning."""

    async def work() -> int:
        return 1

    async def main() -> None:
        io = IoThread()
        io.start()
        call = asyncio.ensure_future(io.run(work()))
        await asyncio.sleep(0)  # run() queued the call on the I/O loop
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await io.stop(1.0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_the_backends_traceback_is_logged_where_its_base_exception_is_converted(
        caplog: pytest.LogCaptureFixture) -> None:
    async def exits() -> None:
        raise SystemExit("from the backend")

    async def main() -> None:
        io = IoThread()
        try:
            with pytest.raises(RuntimeError):
                await io.run(exits())
        finally:
            await io.stop(1.0)

    with caplog.at_level(logging.ERROR, logger="hicache.controller"):
        asyncio.run(main())
    [record] = [r for r in caplog.records if "raised SystemExit" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is SystemExit
