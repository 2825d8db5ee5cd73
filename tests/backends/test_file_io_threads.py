"""The file backend's batches on its I/O threads: every call once, results in call order, and
a batch that waits for its threads whatever happens (real store on ``tmp_path``)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from hicache.storage import create_async_storage

BIG = 1 << 30  # bytes that make a batch worth every I/O thread


def _store(root: Path):  # type: ignore[no-untyped-def]
    return create_async_storage("file", None, root=str(root), io_threads=4, namespace={"model": "io-batches"})


async def test_calls_run_once_each_on_several_threads_and_come_back_in_order(tmp_path: Path) -> None:
    seen: list[int] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def call(i: int) -> int:
        time.sleep(0.02 if i % 5 == 0 else 0.001)  # uneven calls: free threads take the rest
        with lock:
            seen.append(i)
            threads.add(threading.get_ident())
        return i * i

    async with _store(tmp_path) as store:
        out = await store._threads.run_chunked(call, [(i,) for i in range(40)], BIG)
    assert out == [i * i for i in range(40)]
    assert sorted(seen) == list(range(40)) and len(threads) > 1


async def test_a_batch_of_small_pages_runs_on_one_thread(tmp_path: Path) -> None:
    """Small pages are mostly Python under the GIL: spread over four threads they only pass the
    GIL around (more CPU per page than one thread). 64 x 32 KiB pages (2 MiB, which the bytes
    alone would give two threads, the per-file cost four) run on one; 4 MiB pages on several."""
    threads: set[int] = set()
    lock = threading.Lock()

    def call(i: int) -> int:
        time.sleep(0.002)
        with lock:
            threads.add(threading.get_ident())
        return i

    async with _store(tmp_path) as store:
        out = await store._threads.run_chunked(call, [(i,) for i in range(64)], 64 * (32 << 10), 4 * (32 << 10))
        assert out == list(range(64)) and len(threads) == 1
        threads.clear()
        out = await store._threads.run_chunked(call, [(i,) for i in range(16)], 16 * (4 << 20))
        assert out == list(range(16)) and len(threads) > 1


async def test_a_raising_call_fails_the_batch_after_every_thread_stopped(tmp_path: Path) -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def call(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.005)
            if i == 3:
                raise OSError("disk said no")
            return i
        finally:
            with lock:
                running -= 1

    async with _store(tmp_path) as store:
        with pytest.raises(OSError, match="disk said no"):
            await store._threads.run_chunked(call, [(i,) for i in range(24)], BIG)
        assert running == 0 and most > 1  # nothing of the batch still runs once it raised
        assert await store._threads.run_chunked(call, [(5,), (6,)], BIG) == [5, 6]  # the threads live on


async def test_staged_reads_run_on_at_most_cores_plus_one_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed-protocol pages are copied into their pool on the I/O threads: CPU work that more
    threads than cores only slow down, so such a batch runs on ``copy_threads`` threads (here
    one usable core: 2), while the store keeps its 4 threads for other batches."""
    import torch

    from hicache.storage import PoolTransfer, io_threads
    from hicache.testing import ArrayHostPool

    running = most = 0
    lock = threading.Lock()

    class SlowCommitPool(ArrayHostPool):
        def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            try:
                time.sleep(0.005)  # long enough that every thread of the batch overlaps
                super().set_from_flat_data_page(index, data_page)
            finally:
                with lock:
                    running -= 1

    monkeypatch.setattr(io_threads, "usable_cores", lambda: 1)
    n = 24
    src = ArrayHostPool(n, 4, 64 << 10, direct=False)  # 512 KiB pages: a batch worth 4 threads
    src.fill_random(3)
    dst = SlowCommitPool(n, 4, 64 << 10, direct=False)
    keys = [f"p{i}" for i in range(n)]
    async with _store(tmp_path) as store:
        store.register_mem_host_pool_v2(src, "kv")
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=keys)]))["kv"] == [True] * n
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, n), keys=keys)])
        assert got["kv"] == [True] * n
        assert store.io_threads == 4 and 1 <= most <= 2
    for i in range(n):
        assert dst.page_bytes(i * 4) == src.page_bytes(i * 4)


async def test_a_batch_first_step_runs_once_before_any_call_and_its_last_after_all(tmp_path: Path) -> None:
    """``first`` runs once, before any call of any of the batch's threads; ``last`` once, after
    every call, on one of the batch's threads, given the results."""
    log: list[str] = []
    lock = threading.Lock()

    def first() -> bool:
        time.sleep(0.02)  # the batch's other threads must wait for it
        log.append("first")
        return True

    def call(i: int) -> int:
        time.sleep(0.002)
        with lock:
            log.append(f"call{i}")
        return i

    def last(results: list[int]) -> tuple[str, int]:
        with lock:
            log.append("last")
        return threading.current_thread().name, sum(results)

    async with _store(tmp_path) as store:
        batch = await store._threads.run_batch(call, [(i,) for i in range(24)], BIG, first=first, last=last)
    assert batch.results == list(range(24)) and not batch.declined and not batch.cancelled
    assert log[0] == "first" and log[-1] == "last" and log.count("first") == log.count("last") == 1
    assert batch.after[0].startswith("hicache-file-io") and batch.after[1] == sum(range(24))


async def test_a_declined_or_failing_first_step_runs_no_call(tmp_path: Path) -> None:
    ran: list[int] = []

    def call(i: int) -> int:
        ran.append(i)
        return i

    def broken() -> bool:
        raise RuntimeError("ledger bug")

    async with _store(tmp_path) as store:
        batch = await store._threads.run_batch(call, [(i,) for i in range(8)], BIG, first=lambda: False,
                                               last=lambda r: "settled")
        assert batch.declined and batch.results is None and batch.after is None and ran == []
        with pytest.raises(RuntimeError, match="ledger bug"):
            await store._threads.run_batch(call, [(i,) for i in range(8)], BIG, first=broken)
        assert ran == []


async def test_a_failing_last_step_keeps_the_results(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The calls' results are facts about the disk (pages written): a last step that raises
    loses none of them; ``after`` stays ``None`` so the caller does that step itself."""
    def last(results: list[int]) -> str:
        raise RuntimeError("settle bug")

    async with _store(tmp_path) as store:
        batch = await store._threads.run_batch(lambda i: i, [(i,) for i in range(4)], last=last)
    assert batch.results == [0, 1, 2, 3] and batch.after is None
    assert "last step of an I/O batch failed" in caplog.text


async def test_a_shared_write_reserves_and_settles_on_its_own_io_thread(tmp_path: Path) -> None:
    """With the shared usage ledger, a write batch's reservation and settlement run on the
    thread that writes its pages (no round trips of their own); the ledger ends where it
    would have: the pages' bytes counted, nothing left in flight."""
    from hicache_backends.file.ledger import LEDGER_NAME, read_usage

    async with create_async_storage("file", None, root=str(tmp_path), io_threads=4, max_bytes=64 << 20,
                                    namespace={"model": "io-batches"}) as store:
        await store.wait_background()
        ledger = store._space.ledger
        real_add = ledger.add
        calls: list[tuple[str, int]] = []

        def add(delta: int, **kw):  # type: ignore[no-untyped-def]
            calls.append((threading.current_thread().name, kw.get("inflight", 0)))
            return real_add(delta, **kw)

        ledger.add = add
        import torch

        values = [torch.full((32 << 10,), i, dtype=torch.uint8) for i in range(16)]
        assert await store.batch_set([f"k{i}" for i in range(16)], values) is True
        assert [inflight > 0 for _, inflight in calls] == [True, False]  # one reservation, one settlement
        assert all(name.startswith("hicache-file-io") for name, _ in calls)
        usage = read_usage(f"{store.layout.ns_dir}/{LEDGER_NAME}")
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert usage is not None and usage.used == on_disk
        assert await store.batch_exists([f"k{i}" for i in range(16)]) == 16


async def test_a_cancellation_landing_as_the_batch_ends_keeps_its_results(tmp_path: Path) -> None:
    """The caller is cancelled after the batch's threads finished but before it woke: the
    results are still returned (pages written must be indexed), flagged cancelled. They were
    dropped as if the work itself had been cancelled."""
    async with _store(tmp_path) as store:
        loop = asyncio.get_running_loop()
        real = loop.run_in_executor
        task: asyncio.Future[object] | None = None

        def run_in_executor(executor, fn, *args):  # type: ignore[no-untyped-def]
            fut = real(executor, fn, *args)
            # one loop turn after the thread's future ends: the batch's gather is done by then,
            # the caller's wake-up not yet run
            fut.add_done_callback(lambda _: loop.call_soon(task.cancel))  # type: ignore[union-attr]
            return fut

        loop.run_in_executor = run_in_executor  # type: ignore[method-assign]
        try:
            task = asyncio.ensure_future(store._threads.run_batch(lambda i: 2 * i, [(i,) for i in range(3)]))
            batch = await task
        finally:
            del loop.run_in_executor
    assert batch.cancelled and batch.results == [0, 2, 4]


async def test_a_batch_stopped_on_cancel_runs_its_last_step_after_the_calls_that_started(tmp_path: Path) -> None:
    """A write batch stops between pages when its caller gives up (``stop_on_cancel``); its
    last step (the shared ledger's settlement) must still run, once, after the calls that
    started, given ``None`` for those that never did: it ran only when *every* call returned,
    so a stopped batch would have left its whole reservation in the ledger."""
    gate = threading.Event()
    ran: list[int] = []
    lasts: list[list[int | None]] = []

    def call(i: int) -> int:
        ran.append(i)
        if i == 0:
            gate.wait(5)
        return i

    def last(results: list[int | None]) -> str:
        lasts.append(list(results))
        return "settled"

    async with _store(tmp_path) as store:
        task = asyncio.ensure_future(store._threads.run_batch(
            call, [(i,) for i in range(6)], threads=1, stop_on_cancel=True, first=lambda: True, last=last))
        while not ran:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation reaches the batch while call 0 runs
        gate.set()
        batch = await task
    assert ran == [0] and batch.cancelled and not batch.declined
    assert lasts == [[0, None, None, None, None, None]] and batch.after == "settled"


async def test_a_batch_stopped_before_its_first_step_runs_nothing(tmp_path: Path) -> None:
    """Stopped while its thread was still queued: neither ``first`` (a reservation in the shared
    ledger) nor any call nor ``last`` runs; the batch is declined, with nothing to settle."""
    steps: list[str] = []
    busy = threading.Event()
    async with create_async_storage("file", None, root=str(tmp_path), io_threads=1,
                                    namespace={"model": "io-batches"}) as store:
        blocker = asyncio.get_running_loop().run_in_executor(store._threads.executor, busy.wait, 5)
        task = asyncio.ensure_future(store._threads.run_batch(
            lambda i: steps.append(f"call{i}"), [(i,) for i in range(3)], stop_on_cancel=True,
            first=lambda: steps.append("first") is None, last=lambda r: steps.append("last")))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        busy.set()
        await blocker
        batch = await task
    assert steps == [] and batch.declined and batch.cancelled and batch.results is None and batch.after is None
