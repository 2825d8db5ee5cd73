"""SGLang's sidecar KV pools (speculative decoding's draft model): what of them goes into the
namespace, and which of them are stored at all."""

from __future__ import annotations

import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PS = 16
KEYS = ["ab" * 32]


def _server(root, draft_dtype, seed):
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="target/model", extra_config=helpers.extra_config("file", root=str(root)))
    kv = helpers.host_pool(helpers.device_pool(), "page_first")
    draft = helpers.host_pool(helpers.device_pool(layers=1, dtype=draft_dtype), "page_first")
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(kv, PoolName.KV)
    st.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    st.on_host_pools_registered()
    g = torch.Generator().manual_seed(seed)
    draft.kv_buffer.copy_(torch.randint(0, 255, draft.kv_buffer.shape, generator=g, dtype=torch.uint8).view(draft.kv_buffer.dtype)
                          if draft.kv_buffer.dtype == torch.uint8 else torch.randn(draft.kv_buffer.shape, generator=g).to(draft.kv_buffer.dtype))
    return st, draft


def test_draft_pools_of_different_formats_never_share_pages(tmp_path):
    """Only the KV pool's signature went into the namespace: two servers of one target whose
    draft KV formats differ (fp8 e4m3 and e5m2, both stored as bytes) read each other's draft
    pages as valid. With no format to be read for a draft of bytes, the draft is not stored."""
    a, da = _server(tmp_path / "s", torch.float8_e4m3fn, 1)
    b, db = _server(tmp_path / "s", torch.float8_e5m2, 2)
    try:
        idx = torch.arange(PS)
        assert a.batch_set_v2([PoolTransfer(PoolName.DRAFT, idx, keys=KEYS)])[PoolName.DRAFT] == [False]
        got = b.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx + PS, keys=KEYS)])[PoolName.DRAFT]
        assert got == [False]
        kv = b.batch_exists_v2(KEYS)  # the KV pool itself is stored as ever
        assert kv is not None
    finally:
        a.close()
        b.close()


def _mla_rank(root, tp):
    cfg = HiCacheStorageConfig(tp_rank=tp, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="deepseek/v3", extra_config=helpers.extra_config("file", root=str(root)))
    kv = helpers.host_pool(helpers.device_pool(mla=True), "page_first")
    draft = helpers.host_pool(helpers.device_pool(layers=1, heads=2), "page_first")  # an MHA draft: heads split by TP
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    st.on_host_pools_registered()
    helpers.fill_random(draft, tp + 10)
    return st, draft


def test_an_mha_draft_shard_under_an_mla_target_is_never_read_by_another_rank(tmp_path):
    """SGLang backs the draft up on the MLA writer rank only (should_backup), and every rank
    reads it: rank 1 restored rank 0's heads as its own. Such a draft is not stored."""
    (r0, d0), (r1, d1) = _mla_rank(tmp_path / "s", 0), _mla_rank(tmp_path / "s", 1)
    try:
        idx = torch.arange(PS)
        assert r0.batch_set_v2([PoolTransfer(PoolName.DRAFT, idx, keys=KEYS)])[PoolName.DRAFT] == [False]
        got = r1.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx, keys=KEYS)])[PoolName.DRAFT]
        assert got == [False]
    finally:
        r0.close()
        r1.close()


def test_draft_pools_of_the_named_formats_share_pages_only_when_they_match(tmp_path, monkeypatch):
    """With the draft format known (the server's settings), drafts of one format share pages
    and drafts of two formats do not."""
    from hicache.integrations.sglang import storage as adapter

    fmt = {"speculative_draft_kv_cache_dtype": "fp8_e4m3"}
    monkeypatch.setattr(adapter, "_draft_settings", lambda: dict(fmt))
    a, da = _server(tmp_path / "s", torch.float8_e4m3fn, 1)
    b, db = _server(tmp_path / "s", torch.float8_e4m3fn, 2)
    fmt["speculative_draft_kv_cache_dtype"] = "fp8_e5m2"
    c, dc = _server(tmp_path / "s", torch.float8_e5m2, 3)
    try:
        idx = torch.arange(PS)
        assert a.batch_set_v2([PoolTransfer(PoolName.DRAFT, idx, keys=KEYS)])[PoolName.DRAFT] == [True]
        assert b.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx + PS, keys=KEYS)])[PoolName.DRAFT] == [True]
        assert c.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx + PS, keys=KEYS)])[PoolName.DRAFT] == [False]
    finally:
        for st in (a, b, c):
            st.close()
