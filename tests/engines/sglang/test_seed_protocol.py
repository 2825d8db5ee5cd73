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


def _pool(layout: str, mla: bool, seed: int | None):
    dev = helpers.device_pool(page_size=PAGE, layers=4, head_dim=64, mla=mla)
    host = helpers.host_pool(dev, layout)
    if seed is not None:
        helpers.fill_random(host, seed)
    commits: list[int] = []
    own = host.set_from_flat_data_page

    def counted(index, data_page):
        commits.append(int(index))
        own(index, data_page)

    host.set_from_flat_data_page = counted
    return host, commits


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
