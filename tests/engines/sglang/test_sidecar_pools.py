"""SGLang's sidecar KV pools (speculative decoding's draft model): what of them goes into the
namespace, and which of them are stored at all."""

from __future__ import annotations

import logging

import pytest
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PS = 16
KEYS = ["ab" * 32]


#: when the draft pool is registered: before the store opens (a runtime attach passes every
#: pool SGLang's controller holds) or after (start-up: SGLang registers its draft sidecar once
#: the storage is attached); neither may change what is shared
TIMINGS = pytest.mark.parametrize("late", [False, True], ids=["before-open", "after-open"])


def _server(root, draft_dtype, seed, late=False):
    cfg = helpers.storage_config(root, "target/model")
    kv = helpers.host_pool(helpers.device_pool(), "page_first")
    draft = helpers.host_pool(helpers.device_pool(layers=1, dtype=draft_dtype), "page_first")
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(kv, PoolName.KV)
    if not late:
        st.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    st.on_host_pools_registered()
    if late:
        st.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    g = torch.Generator().manual_seed(seed)
    draft.kv_buffer.copy_(torch.randint(0, 255, draft.kv_buffer.shape, generator=g, dtype=torch.uint8).view(draft.kv_buffer.dtype)
                          if draft.kv_buffer.dtype == torch.uint8 else torch.randn(draft.kv_buffer.shape, generator=g).to(draft.kv_buffer.dtype))
    return st, draft


@TIMINGS
def test_draft_pools_of_different_formats_never_share_pages(tmp_path, late):
    """Only the KV pool's signature went into the namespace: two servers of one target whose
    draft KV formats differ (fp8 e4m3 and e5m2, both stored as bytes) read each other's draft
    pages as valid. With no format to be read for a draft of bytes, the draft is not stored."""
    a, da = _server(tmp_path / "s", torch.float8_e4m3fn, 1, late)
    b, db = _server(tmp_path / "s", torch.float8_e5m2, 2, late)
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


#: what differs between two servers' drafts: the draft KV format (bytes either way), or the
#: draft model (the same dtype)
DRAFTS = pytest.mark.parametrize("setting, first, second", [
    ("speculative_draft_kv_cache_dtype", ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)),
    ("speculative_draft_model_path", ("org/draft-A", torch.bfloat16), ("org/draft-B", torch.bfloat16)),
], ids=["draft-format", "draft-model"])


@TIMINGS
@DRAFTS
def test_drafts_share_pages_only_when_their_named_settings_match(tmp_path, monkeypatch, late, setting, first, second):
    """With the draft's format and model known (the server's settings), drafts alike share
    pages, whenever each server registered its draft, and drafts that differ do not."""
    from hicache.integrations.sglang import storage as adapter

    fmt = {setting: first[0]}
    monkeypatch.setattr(adapter, "_draft_settings", lambda: dict(fmt))
    a, da = _server(tmp_path / "s", first[1], 1, late)
    b, db = _server(tmp_path / "s", first[1], 2, not late)  # the other timing: still shared
    fmt[setting] = second[0]
    c, dc = _server(tmp_path / "s", second[1], 3, late)
    try:
        idx = torch.arange(PS)
        assert a.batch_set_v2([PoolTransfer(PoolName.DRAFT, idx, keys=KEYS)])[PoolName.DRAFT] == [True]
        assert b.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx + PS, keys=KEYS)])[PoolName.DRAFT] == [True]
        assert c.batch_get_v2([PoolTransfer(PoolName.DRAFT, idx + PS, keys=KEYS)])[PoolName.DRAFT] == [False]
    finally:
        for st in (a, b, c):
            st.close()


def test_the_kv_namespace_does_not_depend_on_when_the_draft_was_registered(tmp_path):
    """At start-up SGLang registers its draft after the store opened; a runtime re-attach
    (its admin API passes every pool the controller holds) registers it before. The KV pages
    written before the detach are found after the re-attach."""
    a, _ = _server(tmp_path / "s", torch.bfloat16, 1, late=True)
    keys = ["%064x" % (i + 1) for i in range(4)]
    assert a.batch_set_v1(keys, torch.arange(4 * PS)) == [True] * 4
    a.close()
    b, _ = _server(tmp_path / "s", torch.bfloat16, 1, late=False)
    try:
        assert b.batch_exists(keys) == 4
    finally:
        b.close()


def test_a_pool_in_sglangs_own_bytes_registered_after_the_open_is_refused_once(tmp_path, caplog):
    """Its byte format would have to be in the namespace, fixed at the open: it is not stored,
    said once, and every call of it is a quiet miss (it was an ERROR at every call)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory as Factory

    kv = helpers.host_pool(helpers.device_pool(page_size=16, layers=4), "page_first")
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 8, dtype=torch.bfloat16),
                                conv=(torch.zeros(2, 8, 3, 8, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    cfg = helpers.storage_config(tmp_path, "m")
    st = Factory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.on_host_pools_registered()
    try:
        caplog.clear()  # what the open said (no server settings here) is not this pool's
        with caplog.at_level(logging.WARNING, logger="hicache.integrations.sglang"):
            st.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
            for _ in range(5):
                t = PoolTransfer(PoolName.MAMBA, torch.tensor([1]), keys=KEYS)
                assert st.batch_set_v2([t])[PoolName.MAMBA] == [False]
                assert st.batch_get_v2([t])[PoolName.MAMBA] == [False]
        said = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and "after the store opened" in said[0].getMessage()
    finally:
        st.close()


def _hybrid_server(root, draft_settings, monkeypatch, *, dtype=torch.bfloat16, packed=(), **extra_keys):
    """A hybrid (SWA) target's store; ``draft_settings``: the speculative draft the server runs
    (its published settings; empty: none); ``packed``: the pools (``kv``, ``swa``) into which
    SGLang packs one MTP draft layer after the target's."""
    from hicache.integrations.sglang import storage as adapter

    monkeypatch.setattr(adapter, "_draft_settings", lambda: dict(draft_settings))
    cfg = helpers.storage_config(root, "org/swa-model", extra=extra_keys)
    kv = _host(helpers.device_pool(dtype=dtype), "kv" in packed)
    swa = _host(helpers.device_pool(layers=2, dtype=dtype), "swa" in packed)
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(kv, PoolName.KV)
    st.register_mem_host_pool_v2(swa, PoolName.SWA)
    st.on_host_pools_registered()
    return st


def _host(dev, packs_draft):  # type: ignore[no-untyped-def]
    """SGLang's MHA host pool of ``dev``, with one MTP draft layer packed after the target's
    (as its hybrid pool assembler builds it from ``packed_draft_device_pools``)."""
    if not packs_draft:
        return helpers.host_pool(dev, "page_first")
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    draft = helpers.device_pool(layers=1, dtype=dev.dtype)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, dev.page_size, "page_first", pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
        draft_buffer_infos=(draft.get_device_pool_infos()[0].buffer_info,))


@pytest.mark.parametrize("dtype, keys", [
    (torch.bfloat16, {}),
    (torch.float8_e4m3fn, {"hicache_kv_cache_dtype": "fp8_e4m3"}),  # the draft's bytes: e5m2
], ids=["bf16", "fp8"])
def test_the_targets_swa_pages_do_not_depend_on_its_draft(tmp_path, monkeypatch, dtype, keys):
    """The target's own SWA pool was stored under a name carrying the draft's model and KV
    format: the same target restarted without its draft (or with another) found its KV but
    no SWA page, so every hybrid hit (TRAILING_PAGES on SWA) was 0."""
    keys2 = ["%064x" % (i + 1) for i in range(2)]
    draft = {"speculative_draft_model_path": "org/eagle-draft", "speculative_draft_kv_cache_dtype": "fp8_e5m2"}
    a = _hybrid_server(tmp_path / "s", draft, monkeypatch, dtype=dtype, **keys)
    b = _hybrid_server(tmp_path / "s", {}, monkeypatch, dtype=dtype, **keys)
    try:
        idx = torch.arange(2 * PS)
        assert a.batch_set_v1(keys2, idx) == [True, True]
        assert a.batch_set_v2([PoolTransfer(PoolName.SWA, idx, keys=keys2)])[PoolName.SWA] == [True, True]
        swa = [PoolTransfer(PoolName.SWA, keys=keys2, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert b.batch_exists_v2(keys2, swa).kv_hit_pages == 2
        assert b.batch_get_v2([PoolTransfer(PoolName.SWA, idx, keys=keys2)])[PoolName.SWA] == [True, True]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("pool", ["kv", "swa"])
def test_draft_layers_packed_into_a_target_pool_carry_the_draft(tmp_path, monkeypatch, pool):
    """SGLang packs MTP draft layers after the target's in its KV and SWA host pools: those
    pages hold draft KV, and a server of the same target with another draft read them as its
    own. Servers of one draft share them."""
    keys2 = ["%064x" % (i + 1) for i in range(2)]
    a = _hybrid_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-A"}, monkeypatch, packed=(pool,))
    b = _hybrid_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-A"}, monkeypatch, packed=(pool,))
    c = _hybrid_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-B"}, monkeypatch, packed=(pool,))
    try:
        idx = torch.arange(2 * PS)
        name = PoolName.KV if pool == "kv" else PoolName.SWA
        assert a.batch_set_v1(keys2, idx) == [True, True]
        assert a.batch_set_v2([PoolTransfer(name, idx, keys=keys2)])[name] == [True, True]
        assert b.batch_get_v2([PoolTransfer(name, idx, keys=keys2)])[name] == [True, True]
        assert c.batch_get_v2([PoolTransfer(name, idx, keys=keys2)])[name] == [False, False]
    finally:
        for st in (a, b, c):
            st.close()


def _mamba_server(root, draft_settings, monkeypatch):
    """A hybrid target whose Mamba host pool packs one MTP draft layer's state (a pool in
    SGLang's own bytes: its format is in the namespace)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    from hicache.integrations.sglang import storage as adapter

    monkeypatch.setattr(adapter, "_draft_settings", lambda: dict(draft_settings))

    def state(layers):  # type: ignore[no-untyped-def]
        return MambaStateBufferInfo(temporal=torch.zeros(layers, 8, 4, 8, dtype=torch.bfloat16),
                                    conv=(torch.zeros(layers, 8, 3, 8, dtype=torch.bfloat16),))

    mamba = MambaPoolHost(state(2), 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first",
                          mtp_draft_buffer_infos=(state(1),))
    cfg = helpers.storage_config(root, "org/hybrid")
    kv = helpers.host_pool(helpers.device_pool(), "page_first")
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    st.on_host_pools_registered()
    return st


def test_draft_state_packed_into_a_mamba_pool_carries_the_draft(tmp_path, monkeypatch):
    """The Mamba pool is stored in SGLang's own bytes, whose format (not the draft's weights)
    was in the namespace: a server with another MTP draft restored its draft state."""
    a = _mamba_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-A"}, monkeypatch)
    b = _mamba_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-A"}, monkeypatch)
    c = _mamba_server(tmp_path / "s", {"speculative_draft_model_path": "org/mtp-B"}, monkeypatch)
    try:
        t = PoolTransfer(PoolName.MAMBA, torch.tensor([1]), keys=KEYS)
        assert a.batch_set_v2([t])[PoolName.MAMBA] == [True]
        assert b.batch_get_v2([t])[PoolName.MAMBA] == [True]
        assert c.batch_get_v2([t])[PoolName.MAMBA] == [False]
    finally:
        for st in (a, b, c):
            st.close()
