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
from hicache.testing.store_tests import PAGE
from hicache_backends.s3.runs import decode_run, encode_run
from test_s3 import make_s3, raw_put


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
