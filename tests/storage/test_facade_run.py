"""``HiCacheStorage.run``: an adapter's own coroutine on the facade's loop, under its timeout."""

from __future__ import annotations

import asyncio

import pytest

from hicache.errors import StorageStateError
from hicache.storage import HiCacheStorage, create_async_storage


def test_run_executes_on_the_backend_loop_and_returns_its_result() -> None:
    backend = create_async_storage("memory")
    facade = HiCacheStorage(backend)
    try:
        async def compose() -> tuple[int, bool]:
            await backend.open()
            return await backend.batch_exists(["a", "b"]), asyncio.get_running_loop() is facade._loop_thread.loop

        assert facade.run(compose()) == (0, True)
    finally:
        facade.close()


def test_run_times_out_cancels_and_waits() -> None:
    facade = HiCacheStorage(create_async_storage("memory"), call_timeout=0.05)
    finished: list[str] = []
    try:
        async def slow() -> None:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                finished.append("cancelled")
                raise

        with pytest.raises(TimeoutError):
            facade.run(slow())
        assert finished == ["cancelled"]  # the coroutine ended before run() returned
    finally:
        facade.close()
    with pytest.raises(StorageStateError):
        facade.run(asyncio.sleep(0))
