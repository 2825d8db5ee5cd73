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
        out = await store._run_chunked(call, [(i,) for i in range(40)], BIG)
    assert out == [i * i for i in range(40)]
    assert sorted(seen) == list(range(40)) and len(threads) > 1


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
            await store._run_chunked(call, [(i,) for i in range(24)], BIG)
        assert running == 0 and most > 1  # nothing of the batch still runs once it raised
        assert await store._run_chunked(call, [(5,), (6,)], BIG) == [5, 6]  # the threads live on
