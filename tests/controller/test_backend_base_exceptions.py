"""A backend that raises ``KeyboardInterrupt`` or ``SystemExit`` on the storage I/O thread.

asyncio re-raises those two out of the loop that runs the task: the I/O loop stopped for good
and the relayed exception then stopped the server's own loop (``asyncio.run`` raised). The
scenario runs under its own ``asyncio.run`` so that, without the fix, the test fails instead of
ending the test session.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
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
