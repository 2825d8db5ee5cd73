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


def test_close_ends_the_calls_other_threads_are_still_in() -> None:
    """close() while other threads wait in calls the store does not answer: each call is
    cancelled (and waited for) and its thread gets StorageStateError at once. The loop used to
    stop with the calls pending, and their threads waited until call_timeout (for ever
    without one)."""
    import threading
    import time

    backend = create_async_storage("memory")
    facade = HiCacheStorage(backend)  # no call_timeout: a lost call would wait for ever
    entered = threading.Semaphore(0)
    cancelled: list[int] = []

    async def never_answers(i: int) -> None:
        entered.release()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    outcomes: list[BaseException | None] = [None] * 3

    def caller(i: int) -> None:
        try:
            facade.run(never_answers(i))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            outcomes[i] = exc

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert entered.acquire(timeout=5)
    t0 = time.monotonic()
    facade.close()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - t0 < 5
    assert all(isinstance(o, StorageStateError) for o in outcomes), outcomes
    assert sorted(cancelled) == [0, 1, 2]  # ended, not abandoned
    with pytest.raises(StorageStateError):
        facade.run(asyncio.sleep(0))


def test_a_call_that_ended_as_the_loop_stopped_keeps_its_result() -> None:
    """A call whose coroutine ends in the loop's last turn before a stop: its result callback was
    still queued, and the stop failed it with StorageStateError although it completed."""
    from hicache.storage.sync import LoopThread

    lt = LoopThread()

    async def work() -> int:
        # the loop stops as this call ends (here: asked on the loop's own thread, as the
        # facade's finalizer does when the collector runs there; or close() from another thread)
        asyncio.get_running_loop().stop()
        return 42

    try:
        assert lt.call(work(), timeout=5) == 42
    finally:
        lt.stop()


def test_a_close_refused_inside_a_running_loop_leaves_the_facade_to_close_later(tmp_path) -> None:
    """``close()`` inside ``async def`` raised the misuse error but marked the facade closed:
    the later close from a thread did nothing, and the file store's threads, files and
    locks stayed open for good."""
    from hicache.errors import LoopMisuseError
    from hicache.storage import StorageState, create_storage

    facade = create_storage("file", root=str(tmp_path))
    facade.batch_exists(["a"])  # opened

    async def misuse() -> None:
        with pytest.raises(LoopMisuseError, match="close"):
            facade.close()

    asyncio.run(misuse())
    assert facade.backend.state is StorageState.OPEN
    facade.close()
    assert facade.backend.state is StorageState.CLOSED
