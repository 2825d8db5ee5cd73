"""Bad inputs and slow stores behind SGLang's controller: misses and clear errors, never a crash
of SGLang's I/O threads, never KV written after a call gave up."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import sgl_drive as drive
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

PAGE = 16
LAYERS = 4


def _ctl(backend: str = "memory", layout: str = "page_head", **extra):
    dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, layout)
    helpers.fill_random(host, 1)
    cfg = helpers.extra_config(backend)
    cfg.update(extra)
    return host, helpers.controller(dev, host, cfg)


def test_memory_backend_round_trip_in_one_server():
    host, ctl = _ctl("memory")
    try:
        drive.write_then_read(ctl, host, ctl, host, 4, LAYERS)
    finally:
        ctl.detach_storage_backend()


def test_a_call_past_the_timeout_is_a_miss_and_nothing_lands_late(monkeypatch):
    from hicache_backends.memory import MemoryStorage

    host, ctl = _ctl("memory", hicache_call_timeout=0.2)
    try:
        toks = drive.tokens(PAGE * 4)
        src = ctl.mem_pool_host.alloc(len(toks))
        assert drive.backup(ctl, toks, src) == len(toks)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        original = MemoryStorage._read

        async def slow_read(self, pages, buffers):
            await asyncio.sleep(1.5)
            return await original(self, pages, buffers)

        monkeypatch.setattr(MemoryStorage, "_read", slow_read)
        dst = ctl.mem_pool_host.alloc(len(toks))
        before = host.kv_buffer.clone()
        t0 = time.monotonic()
        assert ctl.storage_backend.batch_get_v1(keys, dst) == [False] * 4
        assert time.monotonic() - t0 < 1.2  # gave up at the timeout (0.2 s), not after the read (1.5 s)
        assert ctl.storage_backend.hicache_stats()["call_timeouts"] == 1  # counted, not only logged
        time.sleep(1.6)
        assert torch.equal(host.kv_buffer, before)  # the cancelled read never wrote into the pool
        monkeypatch.setattr(MemoryStorage, "_read", original)
        assert ctl.storage_backend.batch_get_v1(keys, dst) == [True] * 4
    finally:
        ctl.detach_storage_backend()


def test_malformed_requests_are_misses():
    host, ctl = _ctl("memory")
    st = ctl.storage_backend
    try:
        toks = drive.tokens(PAGE * 2)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        idx = ctl.mem_pool_host.alloc(len(toks))
        assert st.batch_set_v1(keys, idx[:-1]) == [False, False]  # wrong length
        shuffled = idx.clone()
        shuffled[3], shuffled[4] = idx[4], idx[3]
        assert st.batch_set_v1(keys, shuffled) == [False, False]  # first page not consecutive
        assert st.batch_set_v1(keys, idx) == [True, True]
        assert st.batch_get_v1(keys, torch.full((2 * PAGE,), 10**9)) == [False, False]  # out of range
        assert st.batch_exists([""]) == 0  # an invalid key is a miss
        assert st.batch_get_v2([PoolTransfer(PoolName.MAMBA, idx, keys=keys)]) == {PoolName.MAMBA: [False, False]}
    finally:
        ctl.detach_storage_backend()


def test_a_failed_write_stops_the_batch_and_says_so(monkeypatch):
    from hicache_backends.memory import MemoryStorage

    host, ctl = _ctl("memory", hicache_staging_mib=1)  # small chunks: several per batch
    try:
        original = MemoryStorage._write
        calls = {"n": 0}

        async def flaky_write(self, pages, buffers, parents):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError("disk gone")
            return await original(self, pages, buffers, parents)

        monkeypatch.setattr(MemoryStorage, "_write", flaky_write)
        toks = drive.tokens(PAGE * 40)
        src = ctl.mem_pool_host.alloc(len(toks))
        chunk = ctl.storage_backend._mover._area("set").chunk_pages
        assert chunk < 40
        assert drive.backup(ctl, toks, src) == 0  # SGLang counts a batch only when all of it is stored
        monkeypatch.setattr(MemoryStorage, "_write", original)
        done, dst = drive.prefetch(ctl, toks)  # the chunk before the failure is stored, nothing after it
        assert done == chunk * PAGE and drive.pages_equal(host, src[:done], host, dst[:done], LAYERS)
    finally:
        ctl.detach_storage_backend()


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_batches_larger_than_the_staging_area(layout, store_root):
    host, ctl = _ctl("file", layout, hicache_options={"root": store_root}, hicache_staging_mib=1)
    try:
        assert ctl.storage_backend._mover is not None
        drive.write_then_read(ctl, host, ctl, host, 40, LAYERS)
    finally:
        ctl.detach_storage_backend()


@contextlib.contextmanager
def _held_by_another_call(pool, index: int, staging: torch.Tensor):
    """Host page ``index`` bound to ``staging``, as an overlapping call would hold it."""
    assert pool.bind([(index, staging)]) == [index]
    try:
        yield
    finally:
        pool.unbind([index])


def test_a_page_another_call_holds_is_neither_read_into_nor_written_from():
    """A host page bound to another in-flight call's staging page (a get and a set of one page
    at once) must not route this call's I/O to that staging page: the run stops before it."""
    host, ctl = _ctl("memory", layout="page_head")
    try:
        backend = ctl.storage_backend
        pool = backend._kv
        assert pool is not None and not pool.has_live_pages
        toks = drive.tokens(PAGE * 4, seed=3)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        src = ctl.mem_pool_host.alloc(len(toks))
        foreign = torch.full((pool.page_nbytes,), 0xAB, dtype=torch.uint8)
        with _held_by_another_call(pool, int(src[2 * PAGE]), foreign):
            assert backend.batch_set_v1(keys, src) == [True, True, False, False]
        assert torch.all(foreign == 0xAB)
        dst = ctl.mem_pool_host.alloc(len(toks))
        assert backend.batch_get_v1(keys, dst) == [True, True, False, False]  # page 2 never stored
        assert drive.backup(ctl, toks, src) == len(toks)  # nothing held now: all four land
        with _held_by_another_call(pool, int(dst[1 * PAGE]), foreign):
            assert backend.batch_get_v1(keys, dst) == [True, False, False, False]
        assert torch.all(foreign == 0xAB)  # the other call's staging page was not read into
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        for i in range(4):
            assert torch.equal(host.get_data_page(int(src[i * PAGE])), host.get_data_page(int(dst[i * PAGE])))
    finally:
        ctl.detach_storage_backend()
