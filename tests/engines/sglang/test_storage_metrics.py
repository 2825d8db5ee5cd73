"""SGLang's storage metrics (``get_stats`` -> ``StorageMetrics``) from hicache's adapter, against
SGLang's own controller and pools: a backup counts only the pages the store wrote (the file
store skips a page it already holds), and a hybrid model's extra pools (Mamba state, through
the v2 calls) are recorded in the same lists, with their own page size, as SGLang's HF3FS
backend records its pools."""

from __future__ import annotations

import itertools
import types

import pytest
import sgl_drive as drive
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.observability.metrics_collector import StorageMetrics

import hicache.integrations.sglang.storage as adapter

PAGE = 16
LAYERS = 4
#: one KV page of helpers.device_pool's defaults: K and V x layers x tokens x 2 heads x 32 dims x bf16
KV_PAGE_BYTES = 2 * LAYERS * PAGE * 2 * 32 * 2
GIB = 1 << 30


@pytest.fixture
def one_second_calls(monkeypatch):
    """The adapter's clock advances one second a reading, so a call lasts exactly 1 s and its
    bandwidth is its bytes / 2**30 (GiB/s, as SGLang's backends): the bytes counted are checked, not the machine's speed."""
    ticks = itertools.count()
    monkeypatch.setattr(adapter, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def _stats(st) -> StorageMetrics:  # type: ignore[no-untyped-def]
    m = st.get_stats()
    assert isinstance(m, StorageMetrics)
    return m


def test_backup_counts_only_pages_the_file_store_wrote(store_root, one_second_calls) -> None:
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "page_first")
    helpers.fill_random(host)
    ctl = helpers.controller(dev, host, helpers.extra_config("file", root=store_root), metrics=True)
    st = ctl.storage_backend
    try:
        toks = drive.tokens(PAGE * 4)
        at = host.alloc(len(toks))
        assert drive.backup(ctl, toks[: PAGE * 2], at[: PAGE * 2]) == PAGE * 2
        m = _stats(st)
        assert m.backup_pgs == [2] and m.backup_bandwidth == [2 * KV_PAGE_BYTES / GIB]
        # the first two pages are in the store already: skip_existing writes only the last two
        assert drive.backup(ctl, toks, at) == PAGE * 4
        m = _stats(st)
        assert m.backup_pgs == [2] and m.backup_bandwidth == [2 * KV_PAGE_BYTES / GIB]
        # all four stored: SGLang is told they are (True each), nothing is written or counted
        assert drive.backup(ctl, toks, at) == PAGE * 4
        m = _stats(st)
        assert m.backup_pgs == [] and m.backup_bandwidth == []
        assert st.hicache_stats()["write_skipped_pages"] == 6
    finally:
        ctl.detach_storage_backend()


def test_extra_pool_io_is_recorded_with_its_own_page_size(store_root, one_second_calls) -> None:
    st, mamba = helpers.mamba_server(store_root, torch.float32, metrics=True, fill=True)
    dummy = mamba.get_dummy_flat_data_page()
    mamba_page_bytes = dummy.numel() * dummy.element_size()
    assert mamba_page_bytes != KV_PAGE_BYTES
    mamba.set_from_flat_data_page(3, torch.randn(dummy.shape).to(dummy.dtype))
    keys = ["ab" * 32, "cd" * 32]
    try:
        assert st.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
        got = st.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([3]), keys=keys[1:])], None)
        assert got[PoolName.MAMBA] == [True]
        got = st.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([5]), keys=keys[1:])], None)
        assert got[PoolName.MAMBA] == [True]
        m = _stats(st)
        # one entry per call (per pool transfer), in the order the calls ran
        assert m.backup_pgs == [2, 1] and m.prefetch_pgs == [1]
        assert m.backup_bandwidth == [2 * KV_PAGE_BYTES / GIB, mamba_page_bytes / GIB]
        assert m.prefetch_bandwidth == [mamba_page_bytes / GIB]
        # the same state again: the store skips it, so it is not counted as written
        got = st.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([3]), keys=keys[1:])], None)
        assert got[PoolName.MAMBA] == [True]
        m = _stats(st)
        assert m.backup_pgs == [] and m.backup_bandwidth == []
    finally:
        st.close()
