"""Seed-protocol pools read straight into ``get_data_page(flat=False)`` views once probed.

The file backend on real files under ``tmp_path``; pools laid out as SGLang's MHA host pools
(``kv_buffer`` (2, tokens, ...) for ``page_first``, (2, layers, tokens, ...) for
``layer_first``), answering the page protocol as those do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.storage import PoolTransfer, create_async_storage
from hicache.storage.view_pages import MIN_RUN_BYTES, PROBE_ATTEMPTS, LivePageViews, runs_of, trusted
from hicache.testing.pools import RelocatingPool

PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 64  # bf16: a (K/V, layer) run of a page is 4 KiB
PAGES = 12


class SeedPool:
    """SGLang's MHA host pool, as its storage code sees it: views for ``flat=False``, a flat
    copy where the page is not contiguous, every commit through ``set_from_flat_data_page``.
    Not an SGLang class, so it vouches for itself as SGLang's ``HostKVCache`` pools need not."""

    hicache_view_reads = True

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


@contextlib.asynccontextmanager
async def _stored(tmp_path: Path, n: int, seed: int, make: Callable[[], Any] = SeedPool) -> AsyncIterator[tuple[Any, Any]]:
    """An open file store holding pages ``page-0..n-1`` of a random pool made by ``make``."""
    src = make()
    src.fill_random(seed)
    store = create_async_storage("file", None, root=str(tmp_path), namespace={"model": "view-test"})
    async with store:
        store.register_mem_host_pool_v2(src, "kv")
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=_keys(n))])
        assert res["kv"] == [True] * n
        yield store, src


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


@pytest.mark.parametrize(
    "layout,dtype",
    [(lay, dt) for lay in ("page_first", "layer_first") for dt in (torch.bfloat16, torch.float16, torch.float32)]
    + [("page_first", torch.float8_e4m3fn)],  # 1-byte layer_first runs are too short: they stage
)
async def test_reads_land_in_the_pool_views_without_commits(tmp_path: Path, layout: str, dtype: torch.dtype) -> None:
    n = 8
    async with _stored(tmp_path, n, 1, lambda: SeedPool(layout, dtype=dtype)) as (store, src):
        dst = SeedPool(layout, dtype=dtype)
        assert await _get(store, dst, n) == [True] * n
        assert dst.commits == [0, 0]  # the probe and the page's own bytes put back
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        # the verdict is kept: a second batch asks nothing more of the pool
        dst.kv_buffer.zero_()
        assert await _get(store, dst, n - 2, first_page=2) == [True] * (n - 2)
        assert dst.commits == [0, 0]
        assert [dst.page_bytes(i + 2) for i in range(n - 2)] == [src.page_bytes(i) for i in range(n - 2)]
        assert dst.page_bytes(0) == bytes(len(src.page_bytes(0)))  # nothing outside the targets


class UnvouchedPool(SeedPool):
    """A third party's pool that says nothing: its commit might do more than place bytes."""

    hicache_view_reads = None


class UnhashablePool(SeedPool):
    """A pool no verdict can be kept for (it cannot be a weak dictionary's key)."""

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("pool_type", [ReversingPool, OptedOutPool, UnvouchedPool, UnhashablePool])
async def test_pools_refuted_unvouched_or_without_a_verdict_are_staged(tmp_path: Path, pool_type: type) -> None:
    n = 6
    async with _stored(tmp_path, n, 2, pool_type) as (store, src):
        dst = pool_type()
        assert await _get(store, dst, n) == [True] * n
        assert sorted(set(dst.commits)) == [i * PAGE for i in range(n)]  # every page committed
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))


async def test_a_pool_handing_out_copies_is_staged_and_probed_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = 5
    async with _stored(tmp_path, n, 3, lambda: SeedPool(copies=True)) as (store, src):
        dst = SeedPool(copies=True)
        with caplog.at_level(logging.INFO, logger="hicache.storage"):
            assert await _get(store, dst, n) == [True] * n
            assert await _get(store, dst, n) == [True] * n
        assert sorted(dst.commits) == sorted(2 * [i * PAGE for i in range(n)])
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        refused = [r for r in caplog.records if "through staging pages" in r.getMessage()]
        assert len(refused) == 1 and "returns copies" in refused[0].getMessage()


async def test_a_corrupt_page_is_a_counted_miss_and_the_others_land(tmp_path: Path) -> None:
    n = 6
    async with _stored(tmp_path, n, 4) as (store, src):
        victim = sorted(tmp_path.rglob("*.page"))[3]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        dst = SeedPool()
        got = await _get(store, dst, n)
        assert got.count(False) == 1 and store.get_stats()["corrupt_pages"] == 1
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n) if got[i])


async def test_a_pool_that_moves_its_memory_stages_from_then_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = 4
    async with _stored(tmp_path, n, 5) as (store, src):
        dst = SeedPool()
        assert await _get(store, dst, n) == [True] * n and dst.commits == [0, 0]  # probe + restore
        dst.kv_buffer = torch.zeros(2, dst.kv_buffer.shape[1] * 2, *dst.kv_buffer.shape[2:], dtype=dst.kv_buffer.dtype)
        dst.commits.clear()
        with caplog.at_level(logging.INFO, logger="hicache.storage"):
            for _ in range(2):
                dst.kv_buffer.zero_()
                assert await _get(store, dst, n) == [True] * n
                assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(n))
        assert sorted(dst.commits) == sorted(2 * [i * PAGE for i in range(n)])  # both batches staged
        assert len([r for r in caplog.records if "no longer a view" in r.getMessage()]) == 1


async def test_a_page_outside_the_pool_fails_alone(tmp_path: Path) -> None:
    n = 3
    async with _stored(tmp_path, n, 6) as (store, src):
        dst = SeedPool()
        store.register_mem_host_pool_v2(dst, "kv")
        idx = torch.cat([dst.indices(0, 2), dst.indices(PAGES + 5, 1)])
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=_keys(n))])
        assert got["kv"] == [True, True, False]
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(2))


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


#: 16 tokens of 1024 fp16: 32 KiB pages, one contiguous run each (read straight into)
RELOCATING_ELEMS = 1024


async def test_a_pool_that_relocates_on_commit_gets_every_page_in_its_own_slot(tmp_path: Path) -> None:
    """Only the probe commits, before any view of the batch is taken: every page lands in the
    slot it has when the call returns (SGLang's layout lease keeps it there for the call)."""
    n = 6
    src = RelocatingPool(n, PAGE, RELOCATING_ELEMS)
    src.physical.copy_(torch.randn(src.physical.shape).to(torch.float16))
    store = create_async_storage("file", None, root=str(tmp_path), namespace={"model": "view-test"})
    async with store:
        store.register_mem_host_pool_v2(src, "kv")
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=_keys(n))]))["kv"] == [True] * n
        dst = RelocatingPool(n, PAGE, RELOCATING_ELEMS)
        dst.hicache_view_reads = True  # it only places bytes (and moves another page)
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, n), keys=_keys(n))])
        assert got["kv"] == [True] * n and dst.moves == 2  # the probe's commits only
        assert [dst.logical_bytes(i) for i in range(n)] == [src.logical_bytes(i) for i in range(n)]


def test_sglang_host_pools_are_trusted_by_class() -> None:
    def page_method(module: str) -> Any:
        def method(self: Any, *args: Any) -> None: ...

        method.__module__ = module
        return method

    sglang = "sglang.srt.mem_cache.pool_host.mha"
    own = {"get_data_page": page_method(sglang), "set_from_flat_data_page": page_method(sglang)}
    HostKVCache = type("HostKVCache", (), {"__module__": "sglang.srt.mem_cache.pool_host.base"})
    Elsewhere = type("HostKVCache", (), {"__module__": "someone.else"})
    assert trusted(type("MHAPool", (HostKVCache,), own)())
    assert not trusted(type("MHAPool", (Elsewhere,), own)())
    assert not trusted(type("MHAPool", (HostKVCache,), {**own, "hicache_view_reads": False})())
    fork = {**own, "set_from_flat_data_page": page_method("someone.fork")}  # may do more: not by class
    assert not trusted(type("ForkPool", (HostKVCache,), fork)())
    assert trusted(type("ForkPool", (HostKVCache,), {**fork, "hicache_view_reads": True})())
    assert not trusted(UnvouchedPool()) and trusted(SeedPool())


async def test_a_probe_page_whose_read_misses_keeps_its_bytes(tmp_path: Path) -> None:
    async with _stored(tmp_path, 2, 8) as (store, src):
        dst = SeedPool()
        dst.kv_buffer.fill_(1.5)
        before = dst.page_bytes(0)
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 2), keys=["absent", "page-1"])])
        assert got["kv"] == [False, True] and dst.commits == [0, 0]  # probed on the missing page
        assert dst.page_bytes(0) == before and dst.page_bytes(1) == src.page_bytes(1)


async def test_a_probe_that_raises_is_tried_again_on_a_later_batch(tmp_path: Path) -> None:
    class FlakyPool(SeedPool):
        fail = 1

        def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
            if self.fail:
                self.fail -= 1
                raise RuntimeError("pool still setting up")
            super().set_from_flat_data_page(index, data_page)

    async with _stored(tmp_path, 3, 9) as (store, src):
        dst = FlakyPool()
        got = await _get(store, dst, 3)
        assert got == [True] * 3 and sorted(dst.commits) == [0, 0, PAGE, 2 * PAGE]  # restored, then staged
        dst.commits.clear()
        dst.kv_buffer.zero_()
        assert await _get(store, dst, 3) == [True] * 3 and dst.commits == [0, 0]  # probed, then direct
        assert all(dst.page_bytes(i) == src.page_bytes(i) for i in range(3))
    views = LivePageViews()
    always = FlakyPool()
    always.fail = 10**6
    for _ in range(PROBE_ATTEMPTS):
        assert views.may_read(always) and views.read_segments(always, [0], None) is None
    assert not views.may_read(always)  # given up: staged from now on, without a thread hop


async def test_a_bad_first_index_does_not_cost_the_pool_its_probe(tmp_path: Path) -> None:
    async with _stored(tmp_path, 3, 10) as (store, src):
        dst = SeedPool()
        store.register_mem_host_pool_v2(dst, "kv")
        idx = torch.cat([dst.indices(PAGES + 5, 1), dst.indices(1, 2)])  # the first page is outside
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=_keys(3))])
        assert got["kv"] == [False, True, True] and dst.commits == [PAGE, PAGE]  # probed on the second
        assert [dst.page_bytes(1), dst.page_bytes(2)] == [src.page_bytes(1), src.page_bytes(2)]


def test_the_probe_restores_its_page_when_its_commit_raises_half_way() -> None:
    class HalfWay(SeedPool):
        calls = 0

        def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 1:  # the probe's random page: half written, then an error
                page = self._page(index)
                page[0] = data_page.reshape(page.shape)[0]  # the K half lands, the V half does not
                raise RuntimeError("disk full")
            super().set_from_flat_data_page(index, data_page)

    pool = HalfWay()
    pool.fill_random(11)
    before = pool.page_bytes(0)
    assert LivePageViews().read_segments(pool, [0], None) is None  # this batch stages
    assert pool.page_bytes(0) == before
