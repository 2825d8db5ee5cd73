"""The ``file`` backend across processes: a second process sharing the root, and writers killed
with SIGKILL at random moments (the store must stay readable and never serve torn pages)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

from hicache.testing.store_tests import NS_A
from hicache_backends.file import FileStorage

from _file_helpers import ForkServer, all_files, page_path, payload_for

NS = NS_A.to_dict()


@pytest.fixture(scope="module")
def forkserver():
    server = ForkServer()
    yield server
    server.close()


def store_at(root, **options) -> FileStorage:
    options.setdefault("min_free_bytes", 0)
    return FileStorage(None, root=str(root), namespace=NS, **options)


async def test_second_process_reads_exactly_what_we_wrote(forkserver, tmp_path) -> None:
    size = 12_345
    keys = [f"shared-{i}" for i in range(10)]
    async with store_at(tmp_path) as store:
        vals = [torch.frombuffer(bytearray(payload_for(k, size)), dtype=torch.uint8) for k in keys]
        assert await store.batch_set(keys, vals)
    out = tmp_path / "read.json"
    assert forkserver.run(op="read", root=str(tmp_path), ns=NS, keys=keys + ["absent"], size=size, out=str(out)) == 0
    got = json.loads(out.read_text())
    assert got == {**{k: True for k in keys}, "absent": None, "__exists__": len(keys)}


async def test_pages_written_by_another_process_are_found_while_open(forkserver, tmp_path) -> None:
    size = 4096
    keys = [f"theirs-{i}" for i in range(6)]
    async with store_at(tmp_path) as store:
        assert await store.wait_index_ready(10)
        assert await store.batch_exists(keys) == 0
        assert forkserver.run(op="write", root=str(tmp_path), ns=NS, keys=keys, size=size) == 0
        # index misses fall back to a stat, so the other process's pages are found and adopted
        assert await store.batch_exists(keys) == len(keys)
        assert store.get_stats()["stored_pages"] == len(keys)
        got = await store.batch_get(keys, [torch.empty(size, dtype=torch.uint8) for _ in keys])
        assert all(bytes(g.numpy()) == payload_for(k, size) for k, g in zip(keys, got))
        # another process evicts one: the read is a miss and the index forgets it
        os.unlink(page_path(tmp_path, store.namespace.digest, keys[3]))
        assert await store.exists(keys[3])  # still indexed...
        assert await store.get(keys[3], torch.empty(size, dtype=torch.uint8)) is None  # ...read finds it gone
        assert not await store.exists(keys[3])
        assert store.get_stats()["stored_pages"] == len(keys) - 1
        assert store.get_stats().get("corrupt_pages", 0) == 0


async def test_writers_killed_at_random_leave_a_readable_store(forkserver, tmp_path) -> None:
    """SIGKILL a writer (rewriting pages, evicting under max_bytes) many times; after each kill
    a reopened store returns, for every key, the exact bytes or a miss, and nothing is corrupt."""
    rng = random.Random(1234)
    size = 96 * 1024 + 7
    keys = [f"crash-{i}" for i in range(40)]
    page_bytes = size + 256
    kills = 18
    seen_hits = 0
    t_end = time.monotonic() + 25
    for round_no in range(kills):
        pid = forkserver.call(
            op="write", root=str(tmp_path), ns=NS, keys=keys, size=size, forever=True, max_bytes=24 * page_bytes
        )["pid"]
        time.sleep(rng.uniform(0.03, 0.3))
        os.kill(pid, signal.SIGKILL)
        status = forkserver.call(op="wait", pid=pid)["status"]
        assert status == -signal.SIGKILL, f"writer exited on its own with {status} in round {round_no}"
        async with store_at(tmp_path, max_bytes=None) as store:
            got = await store.batch_get(keys, [torch.empty(size, dtype=torch.uint8) for _ in keys])
            for k, g in zip(keys, got):
                if g is not None:
                    assert bytes(g.numpy()) == payload_for(k, size), f"wrong bytes for {k} in round {round_no}"
                    seen_hits += 1
            for k in rng.sample(keys, 4):  # the unknown-size path too
                raw = await store.get(k)
                assert raw is None or bytes(raw.numpy()) == payload_for(k, size)
            assert await store.wait_index_ready(10)
            assert store.get_stats().get("corrupt_pages", 0) == 0, f"torn page after kill {round_no}"
        # the reopened store's scan removed the dead writer's temporary files
        assert not [f for f in all_files(tmp_path) if f.endswith(".tmp")]
        assert time.monotonic() < t_end, "crash test over its time budget"
    assert seen_hits > 0, "the writer never got a page written: kills came too early"
