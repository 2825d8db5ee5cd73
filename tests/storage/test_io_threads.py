"""I/O threads run torch's intra-op work serially; nobody else's threads change."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from hicache.storage import create_async_storage
from hicache.storage.io_threads import io_executor, serial_torch_thread

needs_threads = pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch already runs one intra-op thread")


def _in_new_thread(fn):  # type: ignore[no-untyped-def]
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@needs_threads
def test_io_executor_threads_are_torch_serial_and_others_keep_their_count() -> None:
    before = torch.get_num_threads()
    with io_executor(2, "test-io") as ex:
        counts = {f.result() for f in [ex.submit(torch.get_num_threads) for _ in range(8)]}
    assert counts == {1}
    assert torch.get_num_threads() == before  # the caller's thread
    assert _in_new_thread(torch.get_num_threads) == before  # and threads made later


@needs_threads
def test_serial_torch_thread_changes_only_the_thread_that_calls_it() -> None:
    before = torch.get_num_threads()

    def run() -> tuple[int, int]:
        serial_torch_thread()
        serial_torch_thread()  # twice is harmless
        return torch.get_num_threads(), int(torch.ones(1 << 16).sum().item())

    assert _in_new_thread(run) == (1, 1 << 16)  # torch still computes on it
    assert torch.get_num_threads() == before


@needs_threads
async def test_the_file_backend_moves_pages_on_torch_serial_threads(tmp_path: Path) -> None:
    store = create_async_storage("file", None, root=str(tmp_path), namespace={"model": "io-threads"})
    async with store:
        loop = asyncio.get_running_loop()
        counts = await asyncio.gather(*(loop.run_in_executor(store._threads.executor, torch.get_num_threads) for _ in range(8)))
        assert set(counts) == {1}
    assert torch.get_num_threads() >= 2


def test_copy_threads_is_the_usable_cores_plus_one_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.storage import io_threads

    monkeypatch.setattr(io_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert io_threads.usable_cores() == 2
    assert [io_threads.copy_threads(n) for n in (1, 2, 3, 4, 16)] == [1, 2, 3, 3, 3]
    assert io_threads.copy_threads(0) == 1

    def no_affinity(pid: int) -> set[int]:
        raise OSError("not here")

    monkeypatch.setattr(io_threads.os, "sched_getaffinity", no_affinity, raising=False)
    monkeypatch.setattr(io_threads.os, "cpu_count", lambda: None)
    assert io_threads.usable_cores() == 1 and io_threads.copy_threads(8) == 2
