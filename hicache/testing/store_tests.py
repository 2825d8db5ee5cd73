"""``StoreTests``: the conformance suite every storage backend's tests subclass.

Usage in a backend's test module::

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store_factory(self, tmp_path):
            def make(namespace=None):
                return MyStorage(None, root=tmp_path, namespace=namespace)
            return make                     # unopened stores that share one medium

        async def raw_payload(self, store, key, pool="kv"):
            ...                             # payload bytes read from the medium directly

Results are checked against the medium through ``raw_payload``, not only through the store.
Tests are marked ``asyncio`` explicitly so the suite runs in strict and auto mode alike. To skip
a test a medium cannot support, override it with ``pytest.mark.skip(reason=...)``, never with a
body that passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
import torch

from hicache.errors import InvalidKeyError, LoopMisuseError, StorageStateError
from hicache.keys import Namespace, page_hashes
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from hicache.testing.pools import ArrayHostPool, UncheckedHostPool

__all__ = ["StoreTests", "reference_v2_hits"]

PAGE = 4
NS_A = Namespace(model="conformance/model-a", kv_dtype="float16", page_size=PAGE)
NS_B = Namespace(model="conformance/model-b", kv_dtype="float16", page_size=PAGE)
ODD_KEYS = [
    "a/b/c",
    "../../../../etc/passwd",
    "..",
    ".",
    "/absolute/path",
    "C:\\windows\\system32",
    "spaces and\ttabs\nnewline",
    "ünïcødé-键-🙂",
    "x" * 1000,
    "%2e%2e%2f",
    "~",
]
BAD_KEYS: list[Any] = ["", "nul\x00byte", "y" * 1025, 42, None, b"bytes"]


def keys_for(n: int, salt: int = 0) -> list[str]:
    """``n`` chained page keys, like a real prefix."""
    return page_hashes(list(range(salt * 1000, salt * 1000 + n * PAGE)), PAGE)


def reference_v2_hits(
    present: set[tuple[str, str]], keys: list[str], transfers: list[PoolTransfer]
) -> PoolTransferResult:
    """The v2 hit policy written the slow, obvious way, to check backends against: a length is
    usable when every pool can restore it (all pages before it, or its trailing N pages)."""
    kv = 0
    while kv < len(keys) and (keys[kv], "kv") in present:
        kv += 1
    hits = {"kv": kv} if kv else {}
    usable = list(range(1, kv + 1))
    for t in transfers:
        if not usable:
            break
        name = t.name.value if isinstance(t.name, PoolName) else t.name
        n = kv if t.hit_policy == PoolHitPolicy.ALL_PAGES else max(1, len(t.keys or ()))
        ok = [p for p in range(1, kv + 1) if all((keys[i], name) in present for i in range(max(0, p - n), p))]
        if ok:
            hits[name] = ok[-1]
        usable = [p for p in usable if p in ok]
    return PoolTransferResult(usable[-1] if usable else 0, hits, usable)


@pytest.mark.hicache_conformance
class StoreTests:
    """Conformance suite; see the module docstring for what a subclass supplies."""

    # -- what a backend's test class supplies -------------------------------------------------

    @pytest.fixture
    def store_factory(self) -> Callable[..., AsyncHiCacheStorage]:
        raise NotImplementedError("subclass StoreTests and define the store_factory fixture")

    async def raw_payload(self, store: AsyncHiCacheStorage, key: str, pool: str = "kv") -> bytes | None:
        raise NotImplementedError("subclass StoreTests and define raw_payload")

    # -- fixtures ------------------------------------------------------------------------------

    @pytest_asyncio.fixture
    async def store(self, store_factory: Callable[..., AsyncHiCacheStorage]):
        s = store_factory(namespace=NS_A)
        await s.open()
        try:
            yield s
        finally:
            await s.aclose()

    @staticmethod
    def pools(store: AsyncHiCacheStorage, direct: bool = True) -> tuple[ArrayHostPool, ArrayHostPool]:
        """A source pool full of data and an empty destination pool, both registered as KV."""
        src = ArrayHostPool(16, PAGE, direct=direct)
        src.fill_random(1)
        dst = ArrayHostPool(16, PAGE, direct=direct)
        store.register_mem_pool_host(src)
        return src, dst

    async def _put(self, store: AsyncHiCacheStorage, pool: ArrayHostPool, keys: list[str], first_page: int = 0, name: str = "kv") -> dict[str, list[bool]]:
        store.register_mem_host_pool_v2(pool, name)
        t = PoolTransfer(name, host_indices=pool.indices(first_page, len(keys)), keys=keys)
        return await store.batch_set_v2([t])

    # -- v2 round trips --------------------------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
    async def test_v2_round_trip_checked_against_medium(self, store: AsyncHiCacheStorage, direct: bool) -> None:
        src, dst = self.pools(store, direct)
        keys = keys_for(5)
        assert (await self._put(store, src, keys, first_page=2))["kv"] == [True] * 5
        for i, k in enumerate(keys):
            assert await self.raw_payload(store, k) == src.page_bytes((2 + i) * PAGE)
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(7, 5), keys=keys)])
        assert got == {"kv": [True] * 5}
        for i in range(5):
            assert dst.page_bytes((7 + i) * PAGE) == src.page_bytes((2 + i) * PAGE)
        # untouched pages keep their zeros
        assert dst.page_bytes(0) == bytes(src.page_nbytes)

    @pytest.mark.asyncio
    async def test_v2_extra_pool_round_trip(self, store: AsyncHiCacheStorage) -> None:
        kv_src, kv_dst = self.pools(store)
        mamba_src = ArrayHostPool(8, 1, token_elems=32, dtype=torch.float32)
        mamba_src.fill_random(7)
        mamba_dst = ArrayHostPool(8, 1, token_elems=32, dtype=torch.float32)
        keys = keys_for(3)
        store.register_mem_host_pool_v2(mamba_src, PoolName.MAMBA)
        res = await store.batch_set_v2(
            [
                PoolTransfer(PoolName.KV, host_indices=kv_src.indices(0, 3), keys=keys),
                PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[-1:],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES),
            ]
        )
        assert res == {"kv": [True] * 3, "mamba": [True]}
        assert await self.raw_payload(store, keys[-1], "mamba") == mamba_src.page_bytes(5)
        assert await self.raw_payload(store, keys[0], "mamba") is None
        store.register_mem_host_pool_v2(kv_dst, PoolName.KV)
        store.register_mem_host_pool_v2(mamba_dst, PoolName.MAMBA)
        hit = await store.batch_exists_v2(
            keys, [PoolTransfer(PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        )
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (3, {"kv": 3, "mamba": 3})
        got = await store.batch_get_v2(
            [
                PoolTransfer(PoolName.KV, host_indices=kv_dst.indices(0, 3), keys=keys),
                PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys[-1:]),
            ]
        )
        assert got == {"kv": [True] * 3, "mamba": [True]}
        assert mamba_dst.page_bytes(2) == mamba_src.page_bytes(5)

    @pytest.mark.asyncio
    async def test_v1_round_trip(self, store: AsyncHiCacheStorage) -> None:
        src, dst = self.pools(store)
        keys = keys_for(4, salt=3)
        assert await store.batch_set_v1(keys, src.indices(0, 4)) == [True] * 4
        store.register_mem_pool_host(dst)
        assert await store.batch_get_v1(keys, dst.indices(4, 4)) == [True] * 4
        for i in range(4):
            assert dst.page_bytes((4 + i) * PAGE) == src.page_bytes(i * PAGE)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
    async def test_cancelled_read_leaves_no_writer_behind(self, store: AsyncHiCacheStorage, direct: bool) -> None:
        """Once a cancelled ``batch_get_v2`` has unwound, nothing writes into the pool any more:
        the caller frees those pages at once (a backend that fills buffers on threads must wait
        for them). Large pages (256 KiB, 2 MiB a batch) so that backends offload the copies."""
        elems = 32 * 1024
        src = ArrayHostPool(8, PAGE, token_elems=elems)
        src.fill_random(11)
        store.register_mem_pool_host(src)
        keys = keys_for(8, salt=81)
        assert (await store.batch_set_v1(keys, src.indices(0, 8))) == [True] * 8
        dst = ArrayHostPool(8, PAGE, token_elems=elems, direct=direct)
        store.register_mem_pool_host(dst)
        for delay in (0.0, 0.001, 0.005):
            dst.buffer.zero_()
            task = asyncio.ensure_future(
                store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 8), keys=keys)])
            )
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            snapshot = dst.buffer.clone()
            await asyncio.sleep(0.02)
            assert torch.equal(dst.buffer, snapshot), f"pool written after cancellation (delay {delay})"
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 8), keys=keys)])
        assert got == {"kv": [True] * 8}
        assert torch.equal(dst.buffer, src.buffer)

    # -- v0 --------------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_v0_get_set_exists(self, store: AsyncHiCacheStorage) -> None:
        value = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
        assert await store.set("v0-key", value)
        assert await store.exists("v0-key")
        assert not await store.exists("v0-other")
        assert await self.raw_payload(store, "v0-key") == value.numpy().tobytes()
        into = torch.empty(3, 5)
        got = await store.get("v0-key", into)
        assert got is into and torch.equal(into, value)
        strided = torch.empty(5, 3).t()  # non-contiguous target goes through a staging copy
        got = await store.get("v0-key", strided)
        assert got is strided and torch.equal(strided, value)
        raw = await store.get("v0-key")
        assert raw is not None and raw.dtype == torch.uint8
        assert bytes(raw.numpy()) == value.numpy().tobytes()
        assert await store.get("v0-missing") is None
        assert await store.get("v0-missing", torch.empty(3, 5)) is None
        assert await store.get("v0-key", torch.empty(2)) is None  # wrong size is a miss

    @pytest.mark.asyncio
    async def test_v0_tensors_without_usable_memory_fail_cleanly(self, store: AsyncHiCacheStorage) -> None:
        """A value with no bytes (meta, sparse) is a counted ``False``, not an exception; a
        target that cannot hold a page (meta: no memory; expanded or overlapping: elements
        sharing memory) is a counted miss, never a hit holding other bytes than the page's."""
        value = torch.arange(20, dtype=torch.float32)
        assert await store.set("v0-usable", value)
        before = store.get_stats()["invalid_requests"]
        assert await store.set("v0-meta", torch.empty(4, device="meta")) is False
        assert await store.set("v0-sparse", torch.ones(4).to_sparse()) is False
        assert await store.exists_pages(["v0-meta", "v0-sparse"]) == [False, False]
        for target in (
            torch.empty(20, device="meta"),
            torch.empty(1).expand(20),
            torch.empty(11).as_strided((10, 2), (1, 1)),
        ):
            assert await store.get("v0-usable", target) is None
        assert store.get_stats()["invalid_requests"] == before + 5
        got = await store.get("v0-usable", torch.empty(20))
        assert got is not None and torch.equal(got, value)

    @pytest.mark.asyncio
    async def test_v0_batches(self, store: AsyncHiCacheStorage) -> None:
        keys = keys_for(3, salt=9)
        vals = [torch.full((8,), float(i)) for i in range(3)]
        assert await store.batch_set(keys, vals)
        assert await store.batch_exists(keys + ["nope"]) == 3
        assert await store.batch_exists(["nope"] + keys) == 0
        got = await store.batch_get(keys + ["nope"], [torch.empty(8) for _ in range(4)])
        assert [g is not None for g in got] == [True, True, True, False]
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, vals))
        assert not await store.batch_set(keys, vals[:2])  # mismatched lengths: False, no raise

    # -- hit policies ---------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_hit_policies_every_combination(self, store: AsyncHiCacheStorage) -> None:
        n = 3
        src, _ = self.pools(store)
        extra = ArrayHostPool(16, PAGE, direct=True)
        extra.fill_random(5)
        store.register_mem_host_pool_v2(extra, "indexer")
        store.register_mem_host_pool_v2(extra, "mamba")
        # Every pattern of present/missing KV pages (2^3) against every pattern of present/missing
        # extra-pool pages (2^3), under each policy mix, on distinct key sets in one store. The
        # pure hit-policy function is checked on longer random chains in tests/storage.
        scenarios = list(itertools.product(range(1 << n), range(1 << n)))
        # All scenarios are written in one batch per pool and checked concurrently: the same
        # assertions, without paying a medium's round trip (an object store's) per step.
        kv_keys_all: list[str] = []
        kv_idx_all: list[torch.Tensor] = []
        ex_keys_all: list[str] = []
        ex_idx_all: list[torch.Tensor] = []
        cases = []
        for case, (kv_mask, ex_mask) in enumerate(scenarios):
            keys = keys_for(n, salt=100 + case)
            kv_keys = [k for i, k in enumerate(keys) if kv_mask >> i & 1]
            kv_idx = [i for i in range(n) if kv_mask >> i & 1]
            ex_keys = [k for i, k in enumerate(keys) if ex_mask >> i & 1]
            ex_idx = [i for i in range(n) if ex_mask >> i & 1]
            kv_keys_all += kv_keys
            kv_idx_all += [src.indices(i, 1) for i in kv_idx]
            ex_keys_all += ex_keys
            ex_idx_all += [extra.indices(i, 1) for i in ex_idx]
            present = {(k, "kv") for k in kv_keys} | {(k, p) for k in ex_keys for p in ("indexer", "mamba")}
            cases.append((keys, present, kv_mask, ex_mask))
        ex_idx_cat = torch.cat(ex_idx_all)
        res = await store.batch_set_v2(
            [
                PoolTransfer("kv", host_indices=torch.cat(kv_idx_all), keys=kv_keys_all),
                PoolTransfer("indexer", host_indices=ex_idx_cat, keys=ex_keys_all),
                PoolTransfer("mamba", host_indices=ex_idx_cat, keys=ex_keys_all),
            ]
        )
        assert all(all(v) for v in res.values())

        async def check(keys: list[str], present: set[tuple[str, str]], kv_mask: int, ex_mask: int, policy_set: list[PoolTransfer]) -> None:
            got = await store.batch_exists_v2(keys, policy_set)
            want = reference_v2_hits(present, keys, policy_set)
            assert (got.kv_hit_pages, got.extra_pool_hit_pages) == (
                want.kv_hit_pages,
                want.extra_pool_hit_pages,
            ), (kv_mask, ex_mask, policy_set)

        checks = []
        for keys, present, kv_mask, ex_mask in cases:
            for policy_set in (
                [],
                [PoolTransfer("indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)],
                [PoolTransfer("mamba", keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                [PoolTransfer("mamba", keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                [
                    PoolTransfer("indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
                    PoolTransfer("mamba", keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                ],
            ):
                checks.append(check(keys, present, kv_mask, ex_mask, policy_set))
        await asyncio.gather(*checks)

    # -- partial, empty and malformed batches -------------------------------------------------

    @pytest.mark.asyncio
    async def test_partial_batch_reports_per_page(self, store: AsyncHiCacheStorage) -> None:
        src, dst = self.pools(store)
        keys = keys_for(6, salt=7)
        await self._put(store, src, [keys[0], keys[2], keys[5]])
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 6), keys=keys)])
        assert got["kv"] == [True, False, True, False, False, True]
        assert await store.exists_pages(keys) == got["kv"]
        assert dst.page_bytes(0) == src.page_bytes(0)
        assert dst.page_bytes(2 * PAGE) == src.page_bytes(1 * PAGE)

    @pytest.mark.asyncio
    async def test_a_lookup_on_the_callers_thread_agrees_with_the_loop(self, store: AsyncHiCacheStorage) -> None:
        """``exists_prefix_now`` (asked from another thread, as a blocking caller does) answers
        ``None`` or exactly what the loop answers."""
        src, _ = self.pools(store)
        keys = keys_for(6, salt=8)
        await self._put(store, src, [keys[0], keys[1], keys[3]])
        for ask in (keys, keys[1:], keys[3:], keys[2:], []):
            now = await asyncio.to_thread(store.exists_prefix_now, ask)
            assert now is None or now == await store.exists_prefix(ask)

    @pytest.mark.asyncio
    async def test_empty_batches(self, store: AsyncHiCacheStorage) -> None:
        src, _ = self.pools(store)
        empty = torch.empty(0, dtype=torch.int64)
        assert await store.batch_set_v2([PoolTransfer("kv", host_indices=empty, keys=[])]) == {"kv": []}
        assert await store.batch_get_v2([PoolTransfer("kv", host_indices=empty, keys=[])]) == {"kv": []}
        assert await store.batch_get_v2([]) == {}
        res = await store.batch_exists_v2([])
        assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (0, {})
        assert await store.batch_exists([]) == 0
        assert await store.batch_get_v1([], empty) == []
        assert await store.batch_set([], []) is True
        assert await store.batch_get([]) == []

    @pytest.mark.asyncio
    async def test_mismatched_lengths_fail_cleanly(self, store: AsyncHiCacheStorage) -> None:
        src, _ = self.pools(store)
        keys = keys_for(3, salt=11)
        before = store.get_stats().get("invalid_requests", 0)
        bad = [src.indices(0, 2), src.indices(0, 3)[:-1], None, torch.arange(13)]
        for idx in bad:
            assert await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=keys)]) == {"kv": [False] * 3}
            assert await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=keys)]) == {"kv": [False] * 3}
        assert store.get_stats()["invalid_requests"] == before + 2 * len(bad)
        assert await store.exists_pages(keys) == [False] * 3
        # an index outside the pool fails that page only
        idx = torch.cat([src.indices(0, 1), torch.arange(10_000, 10_000 + PAGE), src.indices(2, 1)])
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=keys)]))["kv"] == [True, False, True]
        with pytest.raises(StorageStateError, match="register"):
            await store.batch_get_v2([PoolTransfer("unregistered", host_indices=src.indices(0, 1), keys=keys[:1])])

    @pytest.mark.asyncio
    async def test_pages_past_an_unchecked_pool_end_fail_alone(self, store: AsyncHiCacheStorage) -> None:
        """SGLang's pools slice without a bounds check: host indices past the end (or running
        over it) give an empty or short page. Such a page is a counted failure, never stored
        (a stored one would be reported present and could never be read back), and a read
        there is a counted miss; the other pages of the batch move."""
        src = UncheckedHostPool(4, PAGE)
        src.fill_random(13)
        store.register_mem_pool_host(src)
        keys = keys_for(3, salt=91)
        idx = torch.cat([src.indices(0, 1), torch.arange(4 * PAGE, 5 * PAGE), torch.arange(4 * PAGE - 2, 5 * PAGE - 2)])
        def failures(*names: str) -> int | float:
            stats = store.get_stats()
            return sum(stats[n] for n in ("invalid_requests", *names))

        before = failures("write_failures")
        assert await store.batch_set_v1(keys, idx) == [True, False, False]
        assert failures("write_failures") >= before + 1
        assert await store.exists_pages(keys) == [True, False, False]
        assert [await self.raw_payload(store, k) for k in keys[1:]] == [None, None]
        before, held = failures("read_misses"), src.buffer.clone()
        assert await store.batch_get_v1(keys[:1], torch.arange(4 * PAGE, 5 * PAGE)) == [False]
        assert failures("read_misses") >= before + 1
        assert torch.equal(src.buffer, held)

    @pytest.mark.asyncio
    async def test_odd_keys_round_trip(self, store: AsyncHiCacheStorage) -> None:
        src, dst = self.pools(store)
        keys = ODD_KEYS[:10]
        assert (await self._put(store, src, keys))["kv"] == [True] * len(keys)
        store.register_mem_host_pool_v2(dst, "kv")
        assert (await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 10), keys=keys)]))["kv"] == [True] * 10
        for i, k in enumerate(keys):
            assert await self.raw_payload(store, k) == src.page_bytes(i * PAGE)
        assert await store.batch_exists(ODD_KEYS[10:]) == 0

    @pytest.mark.asyncio
    @pytest.mark.parametrize("bad", BAD_KEYS, ids=["empty", "nul", "too-long", "int", "none", "bytes"])
    async def test_invalid_keys_are_clear_errors(self, store: AsyncHiCacheStorage, bad: Any) -> None:
        src, _ = self.pools(store)
        with pytest.raises(InvalidKeyError):
            await store.exists(bad)
        with pytest.raises(InvalidKeyError):
            await store.batch_exists_v2(["ok", bad])
        with pytest.raises(InvalidKeyError):
            await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 1), keys=[bad])])

    # -- concurrency, clear, namespaces, stats -------------------------------------------------

    @pytest.mark.asyncio
    async def test_concurrent_sets_of_one_key(self, store: AsyncHiCacheStorage) -> None:
        values = [torch.full((4096,), float(i)) for i in range(12)]
        results = await asyncio.gather(*(store.set("contended", v) for v in values))
        assert all(results)
        payload = await self.raw_payload(store, "contended")
        assert payload in {v.numpy().tobytes() for v in values}
        got = await store.get("contended", torch.empty(4096))
        assert got is not None and any(torch.equal(got, v) for v in values)

    @pytest.mark.asyncio
    async def test_concurrent_batches_of_overlapping_keys(self, store: AsyncHiCacheStorage) -> None:
        src, dst = self.pools(store)
        keys = keys_for(6, salt=21)
        res = await asyncio.gather(*(self._put(store, src, keys[i : i + 3], first_page=i) for i in range(4)))
        assert all(all(r["kv"]) for r in res)
        store.register_mem_host_pool_v2(dst, "kv")
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 6), keys=keys)])
        assert got["kv"] == [True] * 6

    @contextlib.asynccontextmanager
    async def _stored_in_two_namespaces(
        self, store: AsyncHiCacheStorage, store_factory: Callable[..., AsyncHiCacheStorage], n: int, *, salt: int
    ) -> AsyncIterator[tuple[AsyncHiCacheStorage, Any, list[str]]]:
        """The same ``n`` keys stored in ``store`` (from page 0) and in a second, open store of
        namespace ``NS_B`` (from page 4): what a test needs to prove an operation keeps to its own
        namespace."""
        other = store_factory(namespace=NS_B)
        async with other:
            src, _ = self.pools(store)
            other.register_mem_pool_host(src)
            keys = keys_for(n, salt=salt)
            await self._put(store, src, keys)
            await self._put(other, src, keys, first_page=4)
            yield other, src, keys

    @pytest.mark.asyncio
    async def test_batch_delete_removes_only_the_named_pages(self, store: AsyncHiCacheStorage, store_factory: Callable[..., AsyncHiCacheStorage]) -> None:
        """The eviction a placement policy chooses: named pages of this namespace go, every other
        page (of this and other namespaces) stays readable; an absent key answers ``False``. A
        backend without ``_delete`` answers ``None`` and keeps every page."""
        async with self._stored_in_two_namespaces(store, store_factory, 4, salt=41) as (other, src, keys):
            absent = keys_for(1, salt=42)[0]
            flags = await store.batch_delete([keys[1], keys[3], absent])
            if not store.supports_delete:
                assert flags is None
                assert await store.exists_pages(keys) == [True] * 4
                return
            assert flags == [True, True, False]
            assert await store.exists_pages(keys) == [True, False, True, False]
            assert [await self.raw_payload(store, k) is None for k in keys] == [False, True, False, True]
            assert await other.exists_pages(keys) == [True] * 4
            assert await self.raw_payload(store, keys[2]) == src.page_bytes(2 * PAGE)
            assert await store.batch_delete([keys[1]]) == [False]  # already gone
            assert await store.batch_delete([]) == []
            # a deleted page can be written again
            await self._put(store, src, [keys[1]], first_page=1)
            assert await store.exists_pages([keys[1]]) == [True]
            assert store.get_stats()["deleted_pages"] == 2

    @pytest.mark.asyncio
    async def test_batch_delete_rejects_bad_keys(self, store: AsyncHiCacheStorage) -> None:
        with pytest.raises(InvalidKeyError):
            await store.batch_delete([""])

    @pytest.mark.asyncio
    async def test_clear_removes_only_this_namespace(self, store: AsyncHiCacheStorage, store_factory: Callable[..., AsyncHiCacheStorage]) -> None:
        async with self._stored_in_two_namespaces(store, store_factory, 3, salt=31) as (other, src, keys):
            assert await store.clear() is True
            assert await store.exists_pages(keys) == [False] * 3
            assert [await self.raw_payload(store, k) for k in keys] == [None] * 3
            assert await other.exists_pages(keys) == [True] * 3
            assert await self.raw_payload(other, keys[0]) == src.page_bytes(4 * PAGE)

    @pytest.mark.asyncio
    async def test_namespaces_never_read_each_other(self, store: AsyncHiCacheStorage, store_factory: Callable[..., AsyncHiCacheStorage]) -> None:
        src, dst = self.pools(store)
        keys = keys_for(2, salt=41)
        await self._put(store, src, keys)
        async with store_factory(namespace=NS_B) as other:
            other.register_mem_pool_host(dst)
            assert await other.exists_pages(keys) == [False, False]
            assert (await other.batch_exists_v2(keys)).kv_hit_pages == 0
            assert await other.batch_get_v1(keys, dst.indices(0, 2)) == [False, False]
        async with store_factory(namespace=NS_A) as same:
            same.register_mem_pool_host(dst)
            assert await same.batch_get_v1(keys, dst.indices(0, 2)) == [True, True]

    @pytest.mark.asyncio
    async def test_stats_count_traffic(self, store: AsyncHiCacheStorage) -> None:
        src, dst = self.pools(store)
        keys = keys_for(2, salt=51)
        await self._put(store, src, keys)
        store.register_mem_host_pool_v2(dst, "kv")
        await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 3), keys=keys + ["missing"])])
        s = store.get_stats()
        assert s["write_ok"] >= 2 and s["write_bytes"] >= 2 * src.page_nbytes
        assert s["read_hits"] >= 2 and s["read_misses"] >= 1
        assert s["read_bytes"] >= 2 * src.page_nbytes
        assert s["namespace"] == store.namespace.digest

    @pytest.mark.asyncio
    async def test_lifecycle(self, store_factory: Callable[..., AsyncHiCacheStorage]) -> None:
        s = store_factory(namespace=NS_A)
        assert await s.batch_exists(["lazy-open"]) == 0  # first use opens
        await s.aclose()
        await s.aclose()  # idempotent
        with pytest.raises(StorageStateError):
            await s.exists("after-close")

    # -- the blocking facade ---------------------------------------------------------------------

    def test_sync_facade(self, store_factory: Callable[..., AsyncHiCacheStorage]) -> None:
        facade = HiCacheStorage(store_factory(namespace=NS_A))
        try:
            src = ArrayHostPool(8, PAGE)
            src.fill_random(2)
            dst = ArrayHostPool(8, PAGE)
            facade.register_mem_pool_host(src)
            keys = keys_for(3, salt=61)
            assert facade.batch_set_v1(keys, src.indices(0, 3)) == [True] * 3
            assert facade.batch_exists(keys) == 3
            assert facade.batch_exists_v2(keys).kv_hit_pages == 3
            facade.register_mem_pool_host(dst)
            assert facade.batch_get_v1(keys, dst.indices(1, 3)) == [True] * 3
            assert dst.page_bytes(PAGE) == src.page_bytes(0)
            assert facade.set("s", torch.ones(4)) and facade.exists("s")
            got_s = facade.get("s", torch.empty(4))
            assert got_s is not None and torch.equal(got_s, torch.ones(4))
            assert facade.batch_get(["s", "t"], [torch.empty(4), torch.empty(4)])[1] is None
            assert facade.batch_set(["t"], [torch.zeros(4)])
            assert facade.get_stats()["write_ok"] >= 4
            assert facade.clear() is True and not facade.exists("s")

            async def inside_loop() -> None:
                facade.exists("s")

            with pytest.raises(LoopMisuseError, match="async"):
                asyncio.run(inside_loop())
        finally:
            facade.close()
            facade.close()
        with pytest.raises(StorageStateError):
            facade.exists("s")

    @pytest.mark.asyncio
    async def test_prefix_keys_extra_info_accepted(self, store: AsyncHiCacheStorage) -> None:
        src, _ = self.pools(store)
        keys = keys_for(4, salt=71)
        await self._put(store, src, keys[:2])
        store.register_mem_host_pool_v2(src, "kv")
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(2, 2), keys=keys[2:])], info)
        assert res == {"kv": [True, True]}
        assert await store.batch_exists(keys) == 4
