"""SGLang's own host pools, handed to hicache's storage as they are (no hicache adapter), the
way a third-party backend sees them: the seed page protocol alone.

Reads go straight into the pool's ``get_data_page(flat=False)`` views wherever a page's
contiguous runs are long enough, and through staging plus ``set_from_flat_data_page``
elsewhere; either way every page reads back exactly as SGLang's own protocol would leave it.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

import sgl_helpers as helpers
from hicache.storage import PoolTransfer, create_async_storage
from hicache.storage.view_pages import runs_of

PAGE = 16
PAGES = 6


def _counting_commits(host) -> list[int]:
    """The page indices ``host.set_from_flat_data_page`` is called with, from now on."""
    commits: list[int] = []
    own = host.set_from_flat_data_page

    def counted(index, data_page):
        commits.append(int(index))
        own(index, data_page)

    host.set_from_flat_data_page = counted
    return commits


def _pool(layout: str, mla: bool, seed: int | None):
    dev = helpers.device_pool(page_size=PAGE, layers=4, head_dim=64, mla=mla)
    host = helpers.host_pool(dev, layout)
    if seed is not None:
        helpers.fill_random(host, seed)
    return host, _counting_commits(host)


def _page(host, i: int) -> bytes:
    return host.get_data_page(i * PAGE, flat=True).view(torch.uint8).numpy().tobytes()


async def _round_trip(root: str, layout: str, mla: bool) -> tuple[list[bool], list[int], object, object]:
    src, _ = _pool(layout, mla, seed=1)
    dst, commits = _pool(layout, mla, seed=None)
    idx = torch.arange(0, PAGES * PAGE, dtype=torch.int64)
    keys = [f"k{i}" for i in range(PAGES)]
    store = create_async_storage("file", None, root=root, namespace={"model": "seed-protocol"})
    async with store:
        store.register_mem_host_pool_v2(src, "kv")
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=keys)]))["kv"] == [True] * PAGES
        store.register_mem_host_pool_v2(dst, "kv")
        got = (await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=keys)]))["kv"]
    return got, commits, src, dst


@pytest.mark.parametrize(
    "layout,mla",
    [(lay, False) for lay in helpers.MHA_LAYOUTS] + [(lay, True) for lay in helpers.MLA_LAYOUTS],
)
def test_sglang_pools_read_back_exactly_and_straight_where_runs_allow(store_root, layout, mla):
    got, commits, src, dst = asyncio.run(_round_trip(store_root, layout, mla))
    assert got == [True] * PAGES
    assert [_page(dst, i) for i in range(PAGES)] == [_page(src, i) for i in range(PAGES)]
    direct = runs_of(dst.get_data_page(0, flat=False)) is not None
    if direct:
        assert commits == [0, 0]  # the probe and its restore; every page then landed in the pool memory
    else:
        assert sorted(set(commits)) == [i * PAGE for i in range(PAGES)]


def test_page_first_mha_and_mla_pools_are_read_straight(store_root):
    """The common layouts of this geometry take the direct path (not only the staging one)."""
    for n, (layout, mla) in enumerate(itertools.product(("page_first", "page_first_direct"), (False, True))):
        got, commits, _, _ = asyncio.run(_round_trip(f"{store_root}-{n}", layout, mla))
        assert got == [True] * PAGES and commits == [0, 0], (layout, mla)


def _unified_host_pool():
    """SGLang's unified page-envelope host pool over a real CPU unified SWA device pool: the
    pool whose pages move (it compacts under its layout lease), which hicache's integration
    passes through unadapted."""
    from sglang.srt.mem_cache.pool_host.unified import UnifiedPageEnvelopeHostPool
    from sglang.srt.mem_cache.unified_memory_pool import init_unified_swa_pools

    bundle = init_unified_swa_pools(
        device="cpu", kv_cache_dtype=torch.float16, head_num=2, head_dim=64, v_head_dim=64,
        swa_head_num=2, swa_head_dim=64, swa_v_head_dim=64, page_size=PAGE, start_layer=0, end_layer=4,
        swa_attention_layer_ids=[2, 3], full_attention_layer_ids=[0, 1],
        full_max_total_num_tokens=32 * PAGE, swa_max_total_num_tokens=32 * PAGE,
        enable_memory_saver=False, need_sort=False, lazy_compaction=False, total_bytes=None,
    )
    host = UnifiedPageEnvelopeHostPool(
        bundle.token_to_kv_pool.full_kv_pool, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu"
    )
    return host, _counting_commits(host)


def test_sglang_unified_pool_reads_straight_into_its_page_envelopes(store_root):
    src, _ = _unified_host_pool()
    dst, commits = _unified_host_pool()
    src_idx, dst_idx = src.alloc(PAGES * PAGE), dst.alloc(PAGES * PAGE)
    g = torch.Generator().manual_seed(3)
    for i in range(PAGES):
        page = src.get_dummy_flat_data_page()
        page.view(torch.uint8).copy_(torch.randint(0, 256, (page.numel() * page.element_size(),), generator=g, dtype=torch.uint8))
        src.set_from_flat_data_page(int(src_idx[i * PAGE]), page)
    keys = [f"u{i}" for i in range(PAGES)]

    async def round_trip() -> list[bool]:
        store = create_async_storage("file", None, root=store_root, namespace={"model": "unified"})
        async with store:
            store.register_mem_host_pool_v2(src, "kv")
            assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src_idx, keys=keys)]))["kv"] == [True] * PAGES
            store.register_mem_host_pool_v2(dst, "kv")
            return (await store.batch_get_v2([PoolTransfer("kv", host_indices=dst_idx, keys=keys)]))["kv"]

    assert asyncio.run(round_trip()) == [True] * PAGES
    assert commits == [int(dst_idx[0])] * 2  # the probe and its restore: every page went straight in
    for i in range(PAGES):
        a = src.get_data_page(int(src_idx[i * PAGE])).view(torch.uint8)
        b = dst.get_data_page(int(dst_idx[i * PAGE])).view(torch.uint8)
        assert torch.equal(a, b), i
