"""Seed-protocol pools read straight into ``get_data_page(flat=False)`` views once probed.

The file backend on real files under ``tmp_path``; pools laid out as SGLang's MHA host pools
(``kv_buffer`` (2, tokens, ...) for ``page_first``, (2, layers, tokens, ...) for
``layer_first``), answering the page protocol as those do.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.storage import PoolTransfer, create_async_storage
from hicache.storage.view_pages import MIN_RUN_BYTES, LivePageViews, runs_of

PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 64  # bf16: a (K/V, layer) run of a page is 4 KiB
PAGES = 12


class SeedPool:
    """SGLang's MHA host pool, as its storage code sees it: views for ``flat=False``, a flat
    copy where the page is not contiguous, every commit through ``set_from_flat_data_page``."""

    def __init__(self, layout: str = "page_first", *, copies: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size = PAGE
        self.layout = layout
        self.copies = copies
        size = PAGES * PAGE
        shape = (2, size, LAYERS, HEADS, DIM) if layout == "page_first" else (2, LAYERS, size, HEADS, DIM)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.commits: list[int] = []

    def indices(self, first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.kv_buffer.dtype))

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + PAGE]
        return self.kv_buffer[:, :, index : index + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        if flat:
            return page.flatten()
        return page.clone() if self.copies else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * LAYERS * PAGE * HEADS * DIM, dtype=self.kv_buffer.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.commits.append(index)
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def page_bytes(self, page: int) -> bytes:
        return self._page(page * PAGE).contiguous().view(torch.uint8).numpy().tobytes()


class ReversingPool(SeedPool):
    """A sound page protocol whose flat page is the view's elements reversed: reading the stored
    bytes into the view would put every element in the wrong place."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._page(index).flatten().flip(0) if flat else self._page(index)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.commits.append(index)
        page = self._page(index)
        page.copy_(data_page.flip(0).reshape(page.shape))


class OptedOutPool(SeedPool):
    hicache_view_reads = False


def _keys(n: int) -> list[str]:
    return [f"page-{i}" for i in range(n)]


async def _store_with(tmp_path: Path, src: SeedPool, n: int) -> Any:
    store = create_async_storage("file", None, root=str(tmp_path), namespace={"model": "view-test"})
    await store.open()
    store.register_mem_host_pool_v2(src, "kv")
    res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=_keys(n))])
    assert res["kv"] == [True] * n
    return store


async def _get(store: Any, pool: SeedPool, n: int, first_page: int = 0) -> list[bool]:
    store.register_mem_host_pool_v2(pool, "kv")
    got = await store.batch_get_v2([PoolTransfer("kv", host_indices=pool.indices(first_page, n), keys=_keys(n))])
    return got["kv"]


def test_runs_of_are_the_row_major_contiguous_runs() -> None:
    whole = torch.zeros(4, 1024, dtype=torch.float16)
    assert runs_of(whole) == (8192, [0])
    kv = torch.zeros(2, 64, 1024, dtype=torch.float16)  # page_first: a page's K and V apart
    assert runs_of(kv[:, 16:32]) == (16 * 2048, [0, 64 * 2048])
    lf = torch.zeros(2, 3, 64, 1024, dtype=torch.float16)  # layer_first: one run per (K/V, layer)
    run, offsets = runs_of(lf[:, :, 8:16])
    assert run == 8 * 2048 and offsets == [(c * 3 + l) * 64 * 2048 for c in range(2) for l in range(3)]
    assert runs_of(lf[:, :, 8:9, :1]) is None  # 2-byte runs: staging pays better
    assert runs_of(torch.zeros(1, 8192, dtype=torch.uint8).expand(3, 8192)) is None  # aliased rows
    assert runs_of(torch.zeros(0, 8192)) is None
    t = torch.zeros(8, 8, 2048, dtype=torch.float32).transpose(0, 1)  # runs out of address order
    run, offsets = runs_of(t)
    assert run == 2048 * 4 and len(offsets) == 64 and offsets[:2] == [0, 8 * 2048 * 4]
    assert MIN_RUN_BYTES <= 4096


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
async def test_reads_land_in_the_pool_views_without_commits(tmp_path: Path, layout: str, dtype: torch.dtype) -> None:
    n = 8
    src = SeedPool(layout, dtype=dtype)
    src.fill_random(1)
    store = await _store_with(tmp_path, src, n)
    try:
        dst = SeedPool(layout, dtype=dtype)
        assert await _get(store, dst, n) == [True] * n
        assert dst.commits == [0]  # the probe, on a page the read then overwrote
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        # the verdict is kept: a second batch asks nothing more of the pool
        dst.kv_buffer.zero_()
        assert await _get(store, dst, n - 2, first_page=2) == [True] * (n - 2)
        assert dst.commits == [0]
        assert [dst.page_bytes(i + 2) for i in range(n - 2)] == [src.page_bytes(i) for i in range(n - 2)]
        assert dst.page_bytes(0) == bytes(len(src.page_bytes(0)))  # nothing outside the targets
    finally:
        await store.aclose()


@pytest.mark.parametrize("pool_type", [ReversingPool, OptedOutPool])
async def test_pools_whose_views_are_not_what_commits_write_are_staged(tmp_path: Path, pool_type: type) -> None:
    n = 6
    src = pool_type()
    src.fill_random(2)
    store = await _store_with(tmp_path, src, n)
    try:
        dst = pool_type()
        assert await _get(store, dst, n) == [True] * n
        assert sorted(set(dst.commits)) == [i * PAGE for i in range(n)]  # every page committed
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
    finally:
        await store.aclose()


async def test_a_pool_handing_out_copies_is_staged_and_probed_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = 5
    src = SeedPool(copies=True)
    src.fill_random(3)
    store = await _store_with(tmp_path, src, n)
    try:
        dst = SeedPool(copies=True)
        with caplog.at_level(logging.INFO, logger="hicache.storage"):
            assert await _get(store, dst, n) == [True] * n
            assert await _get(store, dst, n) == [True] * n
        assert sorted(dst.commits) == sorted(2 * [i * PAGE for i in range(n)])
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        refused = [r for r in caplog.records if "through staging pages" in r.getMessage()]
        assert len(refused) == 1 and "returns copies" in refused[0].getMessage()
    finally:
        await store.aclose()


async def test_a_corrupt_page_is_a_counted_miss_and_the_others_land(tmp_path: Path) -> None:
    n = 6
    src = SeedPool()
    src.fill_random(4)
    store = await _store_with(tmp_path, src, n)
    try:
        victim = sorted(tmp_path.rglob("*.page"))[3]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        dst = SeedPool()
        got = await _get(store, dst, n)
        assert got.count(False) == 1 and store.get_stats()["corrupt_pages"] == 1
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n) if got[i])
    finally:
        await store.aclose()


async def test_a_pool_that_moves_its_memory_is_staged_then_probed_again(tmp_path: Path) -> None:
    n = 4
    src = SeedPool()
    src.fill_random(5)
    store = await _store_with(tmp_path, src, n)
    try:
        dst = SeedPool()
        assert await _get(store, dst, n) == [True] * n and dst.commits == [0]
        dst.kv_buffer = torch.zeros_like(dst.kv_buffer)  # new memory: the old views are stale
        dst.commits.clear()
        assert await _get(store, dst, n) == [True] * n
        assert sorted(dst.commits) == [i * PAGE for i in range(n)]  # this batch staged
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        dst.kv_buffer.zero_()
        dst.commits.clear()
        assert await _get(store, dst, n) == [True] * n and dst.commits == [0]  # probed again
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
    finally:
        await store.aclose()


async def test_a_page_outside_the_pool_fails_alone(tmp_path: Path) -> None:
    n = 3
    src = SeedPool()
    src.fill_random(6)
    store = await _store_with(tmp_path, src, n)
    try:
        dst = SeedPool()
        store.register_mem_host_pool_v2(dst, "kv")
        idx = torch.cat([dst.indices(0, 2), dst.indices(PAGES + 5, 1)])
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=_keys(n))])
        assert got["kv"] == [True, True, False]
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(2))
    finally:
        await store.aclose()


def test_the_probe_refuses_what_it_cannot_prove() -> None:
    views = LivePageViews()

    class NoTensors(SeedPool):
        def get_data_page(self, index: int, flat: bool = True) -> Any:
            return [0] * 8

    class Raises(SeedPool):
        def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
            raise RuntimeError("read-only pool")

    class WrongDummy(SeedPool):
        def get_dummy_flat_data_page(self) -> torch.Tensor:
            return torch.zeros(7, dtype=torch.bfloat16)

    for pool_type in (NoTensors, Raises, WrongDummy):
        pool = pool_type()
        assert views.read_segments(pool, [0, PAGE], None) is None, pool_type
        assert views.read_segments(pool, [0, PAGE], None) is None  # and it is not asked again
    pool = SeedPool()
    assert views.read_segments(pool, [0], 123) is None  # the pool's page size disagrees
    assert views.read_segments(SeedPool(), [], None) is None
    segs = views.read_segments(SeedPool(), [0, PAGE, 0], None)
    assert segs is not None and segs[2] is None  # the same memory twice: only the first is read


class RelocatingPool:
    """SGLang's unified host pool in miniature: ``get_data_page`` hands out a live view of a
    page's current physical slot, and the layout changes on every commit (another page moves
    to the spare slot). SGLang holds the pool's layout lease around each storage call, so a
    view is the page's memory until the call returns unless the call itself commits; only
    the probe commits here, before any view of the batch is taken."""

    ELEMS = 1024  # 16 tokens of 1024 fp16: 32 KiB pages, one contiguous run each

    def __init__(self, pages: int) -> None:
        self.page_size = PAGE
        self.physical = torch.zeros(pages + 1, PAGE * self.ELEMS, dtype=torch.float16)
        self.where = list(range(pages))
        self.spare = pages
        self.moves = 0

    def indices(self, first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.physical[self.where[index // PAGE]]
        return page if flat else page.view(PAGE, self.ELEMS)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE * self.ELEMS, dtype=torch.float16)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.physical[self.where[index // PAGE]].copy_(data_page.reshape(-1))
        move = (index // PAGE + 1) % len(self.where)
        self.physical[self.spare].copy_(self.physical[self.where[move]])
        self.where[move], self.spare = self.spare, self.where[move]
        self.moves += 1

    def logical_bytes(self, page: int) -> bytes:
        return self.physical[self.where[page]].view(torch.uint8).numpy().tobytes()


async def test_a_pool_that_relocates_on_commit_gets_every_page_in_its_own_slot(tmp_path: Path) -> None:
    n = 6
    src = RelocatingPool(n)
    src.physical.copy_(torch.randn(src.physical.shape).to(torch.float16))
    store = create_async_storage("file", None, root=str(tmp_path), namespace={"model": "view-test"})
    async with store:
        store.register_mem_host_pool_v2(src, "kv")
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=_keys(n))]))["kv"] == [True] * n
        dst = RelocatingPool(n)
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, n), keys=_keys(n))])
        assert got["kv"] == [True] * n and dst.moves == 1  # the probe's commit only
        assert [dst.logical_bytes(i) for i in range(n)] == [src.logical_bytes(i) for i in range(n)]
