"""Which SGLang ranks share pages, and which pools hicache may store, against SGLang's own
classes: DP-attention groups share pages, MLA ranks share their KV but not their TP-split
Mamba state, a pool with state outside its pages is never restored half, and a call timeout
too large for the clock means no limit."""

from __future__ import annotations

import pytest
import sgl_drive as drive
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.errors import ConfigError
from hicache.integrations.sglang.pages import CanonicalPagePool
from hicache.integrations.sglang.storage import SGLangAttachError

PS = 16
KEYS = ["ab" * 32, "cd" * 32]


def _config(extra: dict, *, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0, mla: bool = False,
            model: str = "deepseek/v3") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model, dp_rank=dp_rank, extra_config=extra)


def _store(root, **cfg):  # type: ignore[no-untyped-def]
    return StorageBackendFactory.create_backend("dynamic", _config(helpers.extra_config("file", root=str(root)), **cfg), None)


@pytest.mark.parametrize("mla", [False, True])
def test_dp_attention_groups_share_pages_as_in_sglangs_own_backend(tmp_path, mla) -> None:
    """Every DP group stored its own copy and never hit another group's pages (the DP rank was
    part of the namespace); SGLang's ``HiCacheFile`` keys leave it out."""
    ref = [HiCacheFile(_config({}, dp_rank=dp, mla=mla), file_path=str(tmp_path / "ref")) for dp in (0, 1)]
    for k in KEYS:
        ref[0].set(k, torch.zeros(4, dtype=torch.uint8))
    dev = helpers.device_pool(page_size=PS, layers=2, mla=mla)
    stores, hosts = [], []
    for dp in (0, 1):
        host = helpers.host_pool(dev, "page_first")
        helpers.fill_random(host, dp)
        st = _store(tmp_path / "s", dp_rank=dp, mla=mla)
        st.register_mem_pool_host(host)
        st.on_host_pools_registered()
        stores.append(st)
        hosts.append(host)
    try:
        assert stores[0].batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert stores[1].batch_exists(KEYS) == ref[1].batch_exists(KEYS) == 2
        assert stores[1].batch_get_v1(KEYS, torch.arange(2 * PS, 4 * PS)) == [True, True]
        assert torch.equal(hosts[1].get_data_page(2 * PS, flat=True), hosts[0].get_data_page(0, flat=True))
    finally:
        for st in stores:
            st.close()


def _mamba_host() -> MambaPoolHost:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 4), conv=(torch.zeros(2, 8, 3, 4),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout="page_first")


def test_mla_ranks_share_kv_but_each_reads_back_its_own_mamba_shard(tmp_path) -> None:
    """MLA leaves TP out of the namespace (the latent is whole on every rank), but SGLang backs
    up the Mamba/KDA state on every TP rank, each its own shard: rank 0 read rank 1's shard
    as a hit."""
    dev = helpers.device_pool(page_size=PS, layers=4, mla=True)
    ranks = []
    for tp in (0, 1):
        kv, mamba = helpers.host_pool(dev, "page_first"), _mamba_host()
        st = _store(tmp_path / "s", tp_rank=tp, tp_size=2, mla=True, model="kimi/linear")
        st.register_mem_pool_host(kv)
        st.register_mem_host_pool_v2(kv, PoolName.KV)
        st.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        st.on_host_pools_registered()
        ranks.append((st, kv, mamba))
    (r0, kv0, m0), (r1, kv1, m1) = ranks
    try:
        shards = [torch.full_like(m.get_dummy_flat_data_page(), v) for m, v in ((m0, 1), (m1, 2))]
        m0.set_from_flat_data_page(3, shards[0])
        m1.set_from_flat_data_page(3, shards[1])
        helpers.fill_random(kv0, 3)
        key = [KEYS[0]]
        assert r0.batch_set_v1(key, torch.arange(PS)) == [True]  # the KV: written once
        slot = torch.tensor([3])
        for st in (r0, r1):
            assert st.batch_set_v2([PoolTransfer(PoolName.MAMBA, slot, keys=key)])[PoolName.MAMBA] == [True]
        assert r1.batch_exists(key) == 1  # rank 1 reads the KV rank 0 wrote
        for st, mamba, mine in ((r0, m0, shards[0]), (r1, m1, shards[1])):
            got = st.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([5]), keys=key)])[PoolName.MAMBA]
            assert got == [True] and torch.equal(mamba.get_data_page(5, flat=True), mine)
    finally:
        r0.close()
        r1.close()


def _memory_store(extra=None, **cfg):  # type: ignore[no-untyped-def]
    extra = extra or helpers.extra_config("memory")
    return StorageBackendFactory.create_backend("dynamic", _config(extra, **cfg), None)


@pytest.mark.parametrize("extra", [helpers.extra_config("memory"),
                                   helpers.extra_config("fsspec", url="memory://hicache-ranks")])
def test_mla_ranks_on_a_store_of_one_process_fail_the_factory_naming_why(tmp_path, extra) -> None:
    """SGLang writes an MLA model's KV from TP rank 0 only (``is_storage_writer``) and every
    other rank, a process of its own, reads it there. The memory store keeps pages in the
    process that wrote them, so rank 1 never found one, and as SGLang takes the least hit over
    the ranks no rank ever had an L3 hit: the server stored every page for nothing, silently.
    Such a server now fails at the factory, naming a store that processes share."""
    with pytest.raises(ConfigError, match="memory.*file"):
        _memory_store(extra, tp_rank=1, tp_size=2, mla=True)
    # what it would have been: rank 0's pages are not rank 1's to find (two processes are two
    # media; two stores of one process without a store_id are too)
    dev = helpers.device_pool(page_size=PS, layers=2, mla=True)
    ranks = []
    for tp in (0, 1):
        host = helpers.host_pool(dev, "page_first")
        st = _memory_store(tp_rank=tp, tp_size=1, mla=True)  # TP 1: accepted, to show the miss
        st.register_mem_pool_host(host)
        st.on_host_pools_registered()
        ranks.append(st)
    try:
        assert ranks[0].batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert ranks[1].batch_exists(KEYS) == 0
    finally:
        for st in ranks:
            st.close()
    # every rank writes its own pages (MHA; MLA at TP 1 or one writer per DCP shard), or the
    # ranks share a store: accepted
    _memory_store(tp_rank=1, tp_size=2).close()
    _memory_store(tp_rank=0, tp_size=1, mla=True).close()
    _store(tmp_path / "s", tp_rank=1, tp_size=2, mla=True).close()


def _mxfp8_pool() -> MHATokenToKVPoolMXFP8Host:
    """SGLang's MXFP8 host pool needs CUDA kernels to build: a page_first MHA pool given its
    class and its scale buffers (per-page scales kept outside ``kv_buffer``)."""
    dev = helpers.device_pool(page_size=PS, layers=2, dtype=torch.float8_e4m3fn)
    host = helpers.host_pool(dev, "page_first")
    host.__class__ = MHATokenToKVPoolMXFP8Host
    host.k_sf_page_bytes = host.v_sf_page_bytes = 64
    host.k_scale_host = torch.zeros((host.page_num, host.layer_num, 64), dtype=torch.uint8)
    host.v_scale_host = torch.zeros((host.page_num, host.layer_num, 64), dtype=torch.uint8)
    return host


def test_a_pool_with_state_outside_its_pages_is_never_stored_half(tmp_path) -> None:
    """The adapter stored an MXFP8 pool's payload without its scales and reported reads of it
    as hits, restored beside another page's scales. SGLang gives it no flat pages: as the KV
    pool it fails the attach with a clear error (a store that could hold nothing)."""
    host = _mxfp8_pool()
    with pytest.raises(NotImplementedError):
        host.get_data_page(0)  # SGLang's own word on this pool
    st = StorageBackendFactory.create_backend(
        "dynamic", _config({**helpers.extra_config("file", root=str(tmp_path / "s")),
                            "hicache_kv_cache_dtype": "fp8_e4m3"}), None)
    st.register_mem_pool_host(host)
    try:
        with pytest.raises(SGLangAttachError, match="no flat storage pages"):
            st.on_host_pools_registered()
        assert st.batch_set_v1([KEYS[0]], torch.arange(PS)) == [False]
        assert st.batch_get_v1([KEYS[0]], torch.arange(PS, 2 * PS)) == [False]
    finally:
        st.close()


def test_a_layout_sglang_gives_no_pages_of_fails_the_attach_naming_it(tmp_path) -> None:
    """A pass-through pool whose ``get_data_page`` SGLang answers with ``ValueError`` ("Unsupported
    layout": MLA ``page_first_kv_split``, an NPU layout, built here from a page_first pool)
    attached, because only ``NotImplementedError`` from ``get_dummy_flat_data_page`` (the same
    for every layout) was taken as "no pages", and then every write failed. As the KV pool it
    now fails the attach, naming the layout."""
    dev = helpers.device_pool(page_size=PS, layers=2, mla=True)
    host = helpers.host_pool(dev, "page_first")
    host.layout = "page_first_kv_split"
    with pytest.raises(ValueError):
        host.get_data_page(0)  # SGLang's own word on this layout
    st = _store(tmp_path / "s", mla=True)
    st.register_mem_pool_host(host)
    try:
        with pytest.raises(SGLangAttachError, match="no flat storage pages.*'page_first_kv_split'"):
            st.on_host_pools_registered()
        assert st.batch_set_v1([KEYS[0]], torch.arange(PS)) == [False]
    finally:
        st.close()


def test_a_kv_anchor_that_holds_no_bytes_fails_the_attach_naming_it(tmp_path) -> None:
    """SGLang's DeepSeek V4 KV anchor (``LogicalHostPool``) holds no KV: its flat pages are
    empty. It attached, and then every KV write failed with an error in the log ("cannot say
    its page size"), so no KV page was ever stored and the server never had a hit. As the KV
    pool it now fails the attach, as a pool with no flat pages does."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor = LogicalHostPool(64 * PS, PS)
    assert anchor.get_dummy_flat_data_page().numel() == 0  # SGLang's own word: no bytes
    st = _store(tmp_path / "s", mla=True)
    st.register_mem_pool_host(anchor)
    st.register_mem_host_pool_v2(anchor, PoolName.KV)
    try:
        with pytest.raises(SGLangAttachError, match="LogicalHostPool.*no bytes"):
            st.on_host_pools_registered()
        assert st.batch_set_v1([KEYS[0]], torch.arange(PS)) == [False]
    finally:
        st.close()


@pytest.mark.parametrize("timeout", [1e10, float("inf")])
def test_a_call_timeout_beyond_the_clock_means_no_limit(tmp_path, timeout) -> None:
    """Accepted at start-up, then every call raised OverflowError and the attach failed as
    "could not open its store"."""
    dev = helpers.device_pool(page_size=PS, layers=2)
    host = helpers.host_pool(dev, "page_first")
    extra = {**helpers.extra_config("file", root=str(tmp_path / "s")), "hicache_call_timeout": timeout}
    ctl = helpers.controller(dev, host, extra)
    try:
        drive.write_then_read(ctl, host, ctl, host, 2, 2)
    finally:
        ctl.detach_storage_backend()


def test_a_mamba_state_of_another_dtype_is_never_restored(tmp_path) -> None:
    """``--mamba-ssm-dtype bfloat16`` and ``float16`` have one element size: the two servers
    shared the state pool's pages, and one restored the other's state, reinterpreted, as valid
    (wrong answers). Host pools of other sizes still share them."""
    root = str(tmp_path / "store")
    a, m_a = helpers.mamba_server(root, torch.bfloat16)
    b, m_b = helpers.mamba_server(root, torch.float16)
    c, m_c = helpers.mamba_server(root, torch.bfloat16, ratio=3.0)  # a bigger host pool, same format
    try:
        for t in m_a._iter_page_tensors(1):
            t.fill_(1.0)
        assert a.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([1]), keys=["k0"])])[PoolName.MAMBA] == [True]
        assert b.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([2]), keys=["k0"])])[PoolName.MAMBA] == [False]
        assert c.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([2]), keys=["k0"])])[PoolName.MAMBA] == [True]
        assert all(bool((t == 1.0).all()) for t in m_c._iter_page_tensors(2))
    finally:
        for st in (a, b, c):
            st.close()



def test_mamba_pools_with_and_without_a_side_state_keep_their_own_pages(tmp_path) -> None:
    """A Mamba pool that keeps a per-slot side state in each page (``extra_checkpoint_buffers``)
    has longer pages than one without, but the same format tag: two servers of one model, one
    with it, shared the pool's pages and overwrote each other's (each then read the other's
    page as a miss), so each lost the other's states. Each format has its own pages now."""
    root = str(tmp_path / "store")
    a, m_a = helpers.mamba_server(root)
    b, m_b = helpers.mamba_server(root, side_state=True)
    assert m_a.size_per_token != m_b.size_per_token
    try:
        def put(st, mamba, value):  # type: ignore[no-untyped-def]
            for t in mamba._iter_page_tensors(1):
                t.fill_(value)
            return st.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([1]), keys=["k0"])])[PoolName.MAMBA]

        assert put(a, m_a, 1.0) == [True]
        assert put(b, m_b, 2.0) == [True]
        for st, mamba, value in ((a, m_a, 1.0), (b, m_b, 2.0)):
            assert st.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([2]), keys=["k0"])])[PoolName.MAMBA] == [True]
            assert all(bool((t == value).all()) for t in mamba._iter_page_tensors(2))
    finally:
        a.close()
        b.close()

class _OwnPagesMLAHost(MLATokenToKVPoolHost):
    """SGLang's MLA host pool with page methods of its own (here SGLang's, called through), as a
    subclass that keeps state beyond ``kv_buffer`` has them: the adapter passes it through
    unchanged, in SGLang's own bytes and through SGLang's own page methods."""

    def get_data_page(self, index, flat: bool = True):  # type: ignore[no-untyped-def]
        return super().get_data_page(index, flat)

    def set_from_flat_data_page(self, index, data_page) -> None:  # type: ignore[no-untyped-def]
        super().set_from_flat_data_page(index, data_page)


def _dcp_rank(root, layout: str, backend: str, rank: int, logical_page: int,  # type: ignore[no-untyped-def]
              cls: type = MLATokenToKVPoolHost):
    """One decode-context-parallel rank of an MLA model (DCP 2): SGLang's MLA host pool holds
    ``logical_page / 2`` rows of each logical page, and SGLang's controller hands storage the
    logical host indices (``logical_page`` of them per page), as its allocator gives them."""
    dev = helpers.device_pool(page_size=logical_page // 2, layers=2, mla=True)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = cls(info, 2.0, 0, logical_page, layout, pin_memory=False, device="cpu", dcp_size=2,
               dcp_rank=rank, device_capacity_tokens=dev.size, start_layer=0, end_layer=1, target_layer_num=2)
    helpers.fill_random(host, rank + 1)
    extra = helpers.extra_config(backend, **({"root": str(root)} if backend == "file" else {}))
    cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="deepseek/v3", extra_config=extra, dcp_size=2, dcp_rank=rank,
                               logical_page_size=logical_page)
    st = StorageBackendFactory.create_backend("dynamic", cfg, host)
    st.register_mem_pool_host(host)
    st.on_host_pools_registered()
    return host, st


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("layout", helpers.MLA_LAYOUTS)
def test_dcp_ranks_store_and_read_their_shard_of_each_logical_page(tmp_path, layout, backend) -> None:
    """Under DCP, SGLang's host indices are logical (``logical_page_size`` per page, ``dcp_size``
    tokens to a host row) and its host pool maps them to its rows itself: the adapter took them
    as rows, so every write and read failed ("expects 48 host indices, got 96") and DCP servers
    stored nothing. Each rank now stores its shard of each logical page and reads it back into
    the rows SGLang's own page methods name, through the v1 and the v0 (flat page) paths."""
    _dcp_round_trip(*_dcp_rank(tmp_path / "s", layout, backend, 0, 2 * PS))


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("layout", helpers.MLA_LAYOUTS)
def test_dcp_pools_passed_through_count_pages_in_sglangs_index_space(tmp_path, layout, backend) -> None:
    """A DCP host pool the adapter passes through unchanged (not through the canonical pool:
    here one with page methods of its own) had the same index mismatch: hicache's storage took
    SGLang's logical host indices as rows of ``page_size`` ("expects 48 host indices, got 96"),
    so every write and read failed. Its pages are now counted in SGLang's logical index space
    and handed to SGLang's own page methods, which map them to the pool's rows."""
    host, st = _dcp_rank(tmp_path / "s", layout, backend, 0, 2 * PS, cls=_OwnPagesMLAHost)
    assert not isinstance(st._adapted["kv"], CanonicalPagePool)  # passed through
    _dcp_round_trip(host, st)


def _dcp_round_trip(host, st) -> None:  # type: ignore[no-untyped-def]
    lp = host.logical_page_size
    try:
        keys = [f"{i:02x}" * 32 for i in range(3)]
        host.alloc(2 * lp)  # pages past the first: the logical -> row mapping must hold off 0
        src = host.alloc(3 * lp)
        assert st.batch_set_v1(keys, src) == [True] * 3
        assert st.batch_exists(keys) == 3
        dst = host.alloc(3 * lp)
        assert st.batch_get_v1(keys, dst) == [True] * 3
        for a, b in zip(src[::lp].tolist(), dst[::lp].tolist()):
            assert torch.equal(host.get_data_page(b), host.get_data_page(a))
        # SGLang's generic path (interface_v1 0): its own flat pages, of the rows it holds
        flat = [f"{i:02x}" * 32 for i in range(3, 5)]
        assert st.batch_set(flat, [host.get_data_page(a) for a in src[: 2 * lp : lp].tolist()])
        got = st.batch_get(flat, [host.get_dummy_flat_data_page() for _ in flat])
        assert all(torch.equal(g, host.get_data_page(a)) for g, a in zip(got, src[: 2 * lp : lp].tolist()))
    finally:
        st.close()


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_dcp_page_unified_ranks_store_and_read_their_shard(tmp_path, backend) -> None:
    """An MLA ``page_unified`` pool under DCP, whose pages SGLang's own methods do not give: the
    canonical pool maps SGLang's logical indices to its page blocks, byte for byte."""
    host, st = _dcp_rank(tmp_path / "s", helpers.UNIFIED, backend, 0, 2 * PS)
    lp, ps = host.logical_page_size, host.page_size
    try:
        keys = [f"{i:02x}" * 32 for i in range(3)]
        host.alloc(2 * lp)
        src, dst = host.alloc(3 * lp), host.alloc(3 * lp)
        assert st.batch_set_v1(keys, src) == [True] * 3
        assert st.batch_get_v1(keys, dst) == [True] * 3
        for a, b in zip(src[::lp].tolist(), dst[::lp].tolist()):  # a host row is dcp_size indices
            assert torch.equal(host.kv_buffer[a // 2 // ps], host.kv_buffer[b // 2 // ps])
            assert not torch.equal(host.kv_buffer[a // 2 // ps], host.kv_buffer[0])
    finally:
        st.close()
