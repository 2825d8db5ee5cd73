"""S3 prefix lookups through run indexes: one round trip for a chain written as one batch.

Against moto's S3 server (session fixture, port 0); requests are counted by the store's own
``requests`` counter.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from hicache.storage import HiCacheStorageExtraInfo, PoolTransfer
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from hicache_backends.s3.runs import decode_run, encode_run
from test_s3 import make_s3, raw_get, raw_put


def _keys(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}-{i:05d}" for i in range(n)]


async def _filled(store, n: int, tag: str = "p") -> tuple[list[str], ArrayHostPool]:  # type: ignore[no-untyped-def]
    keys = _keys(n, tag)
    src = ArrayHostPool(n, PAGE, token_elems=4)
    src.fill_random(n)
    store.register_mem_pool_host(src)
    res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=keys)])
    assert res["kv"] == [True] * n
    await store.wait_index_writes()
    store.exists_cache.clear()  # a fresh process: nothing known locally
    return keys, src


async def test_512_page_prefix_in_one_wave(moto_endpoint: str, moto_bucket: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=32) as store:
        keys, _ = await _filled(store, 512)
        before = store.get_stats()["requests"]
        hit = await store.batch_exists_v2(keys + ["absent-1", "absent-2"])
        stats = store.get_stats()
        assert hit.kv_hit_pages == 512
        # wave 1: the index (all 512) plus 31 HEADs; wave 2: the index of absent-1 + 2 HEADs
        assert stats["exists_waves"] == 2
        assert stats["requests"] - before == 2 * 1 + 31 + 2
        # the pages the index vouched for are now known: asking again costs no request
        again = await store.batch_exists_v2(keys)
        assert again.kv_hit_pages == 512 and store.get_stats()["requests"] == stats["requests"]


async def test_missing_page_ends_the_prefix_where_heads_find_it(moto_endpoint: str, moto_bucket: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=8) as store:
        keys, _ = await _filled(store, 40)
        fs = store._local.get().ops
        await fs.remove(store.names.page(keys[5], "kv"))
        await fs.remove(store.names.run_index(keys[0], "kv"))  # no index: HEAD waves alone
        hit = await store.batch_exists_v2(keys)
        assert hit.kv_hit_pages == 5


async def test_batches_of_several_writes_chain_their_indexes(moto_endpoint: str, moto_bucket: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=4) as store:
        keys = _keys(60)
        src = ArrayHostPool(60, PAGE, token_elems=4)
        src.fill_random(3)
        store.register_mem_pool_host(src)
        for a, b in ((0, 20), (20, 45), (45, 60)):  # three batches, each a chain
            prior = [keys[a - 1]] if a else None
            res = await store.batch_set_v2(
                [PoolTransfer("kv", host_indices=src.indices(a, b - a), keys=keys[a:b])],
                HiCacheStorageExtraInfo(prefix_keys=prior),
            )
            assert all(res["kv"])
        await store.wait_index_writes()
        store.exists_cache.clear()
        hit = await store.batch_exists_v2(keys)
        assert hit.kv_hit_pages == 60
        assert store.get_stats()["exists_waves"] == 3  # one per batch, not 60 / 3 HEAD waves


async def test_a_stale_index_costs_a_clean_read_miss(moto_endpoint: str, moto_bucket: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=4) as store:
        keys, src = await _filled(store, 30)
        fs = store._local.get().ops
        await fs.remove(store.names.page(keys[20], "kv"))  # past the HEADs of the first wave
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 30  # the index vouches for it
        dst = ArrayHostPool(30, PAGE, token_elems=4)
        store.register_mem_pool_host(dst)
        got = await store.batch_get_v1(keys, dst.indices(0, 30))
        assert got[20] is False and sum(got) == 29
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20  # the miss was forgotten


async def test_foreign_or_garbled_indexes_are_ignored(moto_endpoint: str, moto_bucket: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=4) as store:
        keys, _ = await _filled(store, 12)
        path = store.names.run_index(keys[0], "kv")
        for body in (b"not json", b'{"v": 99, "pages": []}', encode_run(["ffff"] * 12)):
            await asyncio.to_thread(raw_put, moto_endpoint, path, body)
            store.exists_cache.clear()
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 12  # HEADs still answer
        await store.clear()
        store.exists_cache.clear()
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 0


@pytest.mark.parametrize("body", [b"", b"[]", b'{"v": 1, "pages": [1, 2]}', b"\xff" * 10])
def test_decode_rejects_what_is_not_an_index(body: bytes) -> None:
    assert decode_run(body) is None


def test_encode_decode_round_trip() -> None:
    names = [f"{i:032x}" for i in range(100)]
    assert decode_run(encode_run(names)) == names


async def test_a_page_a_head_found_missing_is_not_cached_from_the_index(moto_endpoint: str, moto_bucket: str) -> None:
    """Another process deleted page 3; the index under page 0 still lists it. The lookup stops
    at page 3, and neither a second lookup nor ``exists_pages`` claims it afterwards."""
    async with make_s3(moto_endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=8) as store:
        keys, _ = await _filled(store, 30)
        await store._local.get().ops.remove(store.names.page(keys[3], "kv"))  # not through the store
        assert await store.exists_prefix(keys) == 3
        assert await store.exists_prefix(keys) == 3
        assert await store.exists_pages([keys[3]]) == [False]


async def test_deleting_a_chain_removes_its_run_index(moto_endpoint: str, moto_bucket: str) -> None:
    """``batch_delete`` of a chain's first page takes the index stored under it: no orphan
    index is left in the bucket, and none vouches for the chain when it is written anew."""
    prefix = f"runs/{uuid.uuid4().hex}"
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=8) as store:
        keys, src = await _filled(store, 30)
        index = store.names.run_index(keys[0], "kv")
        ops = store._local.get().ops
        assert await ops.size(index)
        assert await store.batch_delete(keys) == [True] * 30
        assert await ops.size(index) is None
        # written again as two batches (page 0 alone, then 1..6): another process asks
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 1), keys=keys[:1])])
        assert res["kv"] == [True]
        res = await store.batch_set_v2(
            [PoolTransfer("kv", host_indices=src.indices(1, 6), keys=keys[1:7])],
            HiCacheStorageExtraInfo(prefix_keys=keys[:1]),
        )
        assert res["kv"] == [True] * 6
        await store.wait_index_writes()
        store.exists_cache.clear()
        assert await store.exists_prefix(keys) == 7


def test_an_answer_older_than_a_removal_does_not_bring_the_page_back() -> None:
    """A HEAD answered before this process deleted the page, processed after: refused; an
    answer to a request made after the delete (the page written again) is taken."""
    from hicache_backends.s3.cache import ExistsCache

    cache = ExistsCache(16, ttl=300.0)
    before = cache.generation
    cache.mark_gone("bucket/p")  # the delete
    cache.add("bucket/p", before)  # the stale answer lands
    assert not cache.contains("bucket/p") and cache.is_gone("bucket/p")
    after = cache.generation
    cache.add("bucket/p", after)
    assert cache.contains("bucket/p") and not cache.is_gone("bucket/p")
    ticket = cache.generation
    cache.clear()
    cache.add("bucket/q", ticket)  # a lookup that started before a clear
    assert not cache.contains("bucket/q")


async def test_a_clear_racing_a_write_leaves_no_index_that_claims_the_pages_it_removed(
        moto_endpoint, moto_bucket, monkeypatch) -> None:
    """A write batch is in flight (its first pages slow) when a clear removes the pages that
    had landed. The batch's run index, stored after the clear's listing, vouched for them: a
    lookup answered 16 pages where 7 are stored. It is not written for a batch a clear raced."""
    from hicache_backends.s3.fs import S3ObjectOps

    prefix = f"race/{uuid.uuid4().hex}"
    n, early = 16, 7
    keys = keys_for(n, salt=77)
    src = ArrayHostPool(n, PAGE)
    src.fill_random(5)
    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A, concurrency=8)
    async with store:
        store.register_mem_pool_host(src)
        slow = {store.names.page(k, "kv") for k in keys[:early]}
        gate = asyncio.Event()
        real_put = S3ObjectOps.put

        async def put(self, path, data):  # type: ignore[no-untyped-def]
            if path in slow:
                await gate.wait()
            return await real_put(self, path, data)

        monkeypatch.setattr(S3ObjectOps, "put", put)
        write = asyncio.create_task(store.batch_set_v1(keys, src.indices(0, n)))
        for _ in range(250):  # the fast pages have landed
            await asyncio.sleep(0.02)
            if all(raw_get(moto_endpoint, store.names.page(k, "kv")) for k in keys[early:]):
                break
        assert await store.clear() is True
        gate.set()
        assert await write == [True] * n
        await store.wait_index_writes()
        assert store.get_stats()["writes_racing_clear"] == 1
    assert [raw_get(moto_endpoint, store.names.page(k, "kv")) is not None for k in keys] == [True] * early + [False] * (n - early)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A, concurrency=8) as reader:
        assert await reader.exists_prefix(keys) == early


@pytest.mark.parametrize("race", ["write starts during the clear", "index lands during a peer's clear"])
async def test_a_clear_that_overlaps_a_run_index_write_leaves_no_index_behind(
        moto_endpoint, moto_bucket, monkeypatch, race: str) -> None:
    """A clear's listing misses a run index that lands after it, while the pages the index
    names went with the clear: the index stayed, vouching for removed pages. Two ways the
    check for a clear since the write began let it through: the write started while the clear
    ran (its ticket postdated the clear's start), or another store of this process (sharing the
    exists cache, not waiting for this store's indexes) cleared while the index's PUT was in
    flight. Neither leaves an index now."""
    from hicache_backends.s3.fs import S3ObjectOps

    prefix = f"race/{uuid.uuid4().hex}"
    n = 12
    keys = keys_for(n, salt=78)
    src = ArrayHostPool(n, PAGE)
    src.fill_random(6)
    during = race.startswith("write")
    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A, concurrency=8)
    peer = make_s3(moto_endpoint, moto_bucket, prefix, NS_A, concurrency=8)
    async with store, peer:
        store.register_mem_pool_host(src)
        index = store.names.run_index(keys[0], "kv")
        sending, listed = asyncio.Event(), asyncio.Event()
        real_put, real_remove_tree = S3ObjectOps.put, S3ObjectOps.remove_tree

        async def put(self, path, data):  # type: ignore[no-untyped-def]
            if path == index:  # the index lands after the clear's listing
                sending.set()
                await listed.wait()
            return await real_put(self, path, data)

        async def remove_tree(self, prefix):  # type: ignore[no-untyped-def]
            if during:  # the write starts (and its pages land) once the clear has begun
                assert await store.batch_set_v1(keys, src.indices(0, n)) == [True] * n
            try:
                return await real_remove_tree(self, prefix)
            finally:
                listed.set()

        monkeypatch.setattr(S3ObjectOps, "put", put)
        monkeypatch.setattr(S3ObjectOps, "remove_tree", remove_tree)
        if during:
            assert await store.clear() is True
        else:
            assert await store.batch_set_v1(keys, src.indices(0, n)) == [True] * n
            await sending.wait()  # the index is on its way
            assert await peer.clear() is True
        await store.wait_index_writes()
        assert store.get_stats()["writes_racing_clear"] == 1
    assert [raw_get(moto_endpoint, store.names.page(k, "kv")) for k in keys] == [None] * n
    assert raw_get(moto_endpoint, index) is None


async def test_a_page_named_twice_in_one_delete_is_deleted_and_counted_once(moto_endpoint, moto_bucket) -> None:
    """As the memory backend answers: ``[True, False]``, one page counted, one REMOVED key."""
    async with make_s3(moto_endpoint, moto_bucket, f"dup/{uuid.uuid4().hex}", NS_A) as store:
        keys = keys_for(2, salt=3)
        src = ArrayHostPool(2, PAGE)
        src.fill_random(1)
        store.register_mem_pool_host(src)
        assert await store.batch_set_v1(keys, src.indices(0, 2)) == [True, True]
        removed: list[str] = []
        store.tier_changes.subscribe(lambda change: removed.extend(change.keys))
        assert await store.batch_delete([keys[0], keys[0]]) == [True, False]
        assert store.get_stats()["deleted_pages"] == 1 and removed == [keys[0]]
        assert await store.exists_prefix(keys) == 0


async def test_a_huge_object_at_an_index_name_is_not_downloaded(moto_endpoint: str, moto_bucket: str) -> None:
    """An object that is no index of ours (a foreign upload, 24 MiB) sits where a chain's run
    index goes. A lookup downloaded it whole (held twice in memory, joined) before finding it
    is no index; a big enough one outlasted the request timeout on every lookup, was retried
    and fed the breaker. An index is at most ``64 * MAX_RUN`` bytes: no more is asked for."""
    from hicache_backends.s3.runs import MAX_RUN
    from s3_proxy import FaultProxy

    async with FaultProxy(moto_endpoint) as proxy:
        async with make_s3(proxy.endpoint, moto_bucket, f"runs/{uuid.uuid4().hex}", concurrency=4) as store:
            keys, _ = await _filled(store, 12)
            path = store.names.run_index(keys[0], "kv")
            await asyncio.to_thread(raw_put, moto_endpoint, path, b"{" * (24 << 20))
            try:
                proxy.served.clear()
                assert await store.exists_prefix(keys) == 12  # the HEAD waves answer
                got = [n for method, p, n in proxy.served if method == "GET" and p.endswith(path.split("/", 1)[1])]
                assert got and max(got) <= 64 * MAX_RUN + 1
                stats = store.get_stats()
                assert not stats.get("timeouts") and not stats.get("transient_errors")
            finally:
                await store.clear()
