"""The file backend's batches on its I/O threads: every call once, results in call order, and
a batch that waits for its threads whatever happens (real store on ``tmp_path``)."""

from __future__ import annotations

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
