"""What an S3 store claims about pages it cannot read: a store that is down (breaker open) and
pages removed behind this process's back (another process, a lifecycle rule).

Against moto's S3 server (port 0); the outage is a fault-injecting proxy in front of it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from hicache.storage import PoolTransfer
from hicache.observability.tier_events import ChangeKind
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import PAGE
from s3_proxy import FaultProxy
from s3_server import eventually, make_s3, raw_client
from test_s3_hostile import FAST, read_pages, write_pages
from test_s3_runs import _filled

@pytest.fixture
def prefix() -> str:
    return f"stale/{uuid.uuid4().hex}"


async def _read(store: Any, keys: list[str]) -> list[bool]:
    dst = ArrayHostPool(len(keys), PAGE, token_elems=4)
    store.register_mem_pool_host(dst)
    res = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, len(keys)), keys=keys)])
    return res["kv"]


def _delete(endpoint: str, path: str) -> None:
    """Remove one object as another process would (its own client, not this store)."""
    bucket, key = path.split("/", 1)
    raw_client(endpoint).delete_object(Bucket=bucket, Key=key)


async def test_prefix_lookup_is_a_clean_miss_while_the_breaker_is_open(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    async with FaultProxy(moto_endpoint) as proxy:
        # FAST, with room for a loaded machine: a timed-out HEAD would also be a miss
        async with make_s3(proxy.endpoint, moto_bucket, prefix, **{**FAST, "request_timeout": 4.0, "call_timeout": 8.0}) as store:
            keys = [f"down-{i}" for i in range(6)]
            await write_pages(store, keys, seed=6)  # (the proxy mangles HEADs: known from writes)
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 6  # known: no request
            proxy.outage = True
            assert (await read_pages(store, keys))[0] == [False] * 6  # opens the breaker
            assert store.get_stats()["breaker_state"] != "closed"
            before = store.get_stats()["exists_cache_hits"]
            # the prefix path (run index + waves) must not answer from the positive cache
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 0
            assert await store.exists_prefix(keys) == 0
            assert store.get_stats()["exists_cache_hits"] == before
            proxy.outage = False

            async def back() -> bool:
                return (await store.batch_exists_v2(keys)).kv_hit_pages == 6

            await eventually(back)  # the prober closes the breaker; the pages count again
            assert (await read_pages(store, keys))[0] == [True] * 6


async def test_a_page_deleted_elsewhere_is_one_counted_miss_then_never_a_hit(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    # a short TTL: the run index is read again on the next lookup, and it still lists the page
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4, exists_cache_ttl=0.2) as store:
        removed: list[Any] = []
        store.tier_changes.subscribe(removed.append)
        keys, _ = await _filled(store, 20, "gone")  # a fresh process: learns the chain from the index
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20
        victim = store.names.page(keys[10], "kv")
        _delete(moto_endpoint, victim)  # a lifecycle rule or another process; the index stays
        # bounded staleness: still claimed from the cache within the TTL...
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20
        # ...and the read that finds it missing is a clean miss, counted, reported, forgotten
        got = await _read(store, keys)
        assert got == [True] * 10 + [False] + [True] * 9
        stats = store.get_stats()
        assert stats["stale_hits"] == 1 and stats.get("corrupt_pages", 0) == 0
        gone = [c for c in removed if c.kind is ChangeKind.REMOVED]
        assert len(gone) == 1 and gone[0].reason == "vanished" and gone[0].origin == "peer"
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 10
        await asyncio.sleep(0.3)  # every entry expired: the index (which lists page 10) is read again
        for _ in range(2):
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 10
        assert await store.exists_pages([keys[10]]) == [False]
        # reading the gone page again is a miss, not a second stale hit
        assert (await _read(store, keys[10:11])) == [False]
        assert store.get_stats()["stale_hits"] == 1
        # the page written again (by anyone): the store's answer clears the mark
        src = ArrayHostPool(1, PAGE, token_elems=4)
        src.fill_random(99)
        store.register_mem_pool_host(src)
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 1), keys=keys[10:11])]))["kv"] == [True]
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20


async def test_a_page_this_store_deleted_is_never_claimed_again_from_its_run_index(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    # a short TTL: once the cache's entries expire, the run index (which still lists the page)
    # is read again; a delete of our own must be as final as a read that found the page gone
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4, exists_cache_ttl=0.2) as store:
        keys, _ = await _filled(store, 12, "own-delete")
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 12
        assert await store.batch_delete(keys[6:7]) == [True]
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 6
        await asyncio.sleep(0.3)  # every entry expired
        for _ in range(2):
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 6
            assert await store.exists_prefix(keys) == 6
        assert store.get_stats().get("stale_hits", 0) == 0  # never served, so never a stale hit


async def test_write_bodies_are_reused_and_payloads_unsigned(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4) as store:
        keys, src = await _filled(store, 12, "body")
        res = store._local.get()
        assert 0 < len(res.bodies) <= store.concurrency  # answered PUTs gave their buffers back
        client = res.ops.fs._s3
        assert client._client_config.s3["payload_signing_enabled"] is False
        assert await _read(store, keys) == [True] * 12
        # pages written again from reused buffers read back intact
        res2 = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 12), keys=keys)])
        assert res2["kv"] == [True] * 12
        dst = ArrayHostPool(12, PAGE, token_elems=4)
        store.register_mem_pool_host(dst)
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 12), keys=keys)])
        assert got["kv"] == [True] * 12 and dst.buffer.equal(src.buffer)


async def test_a_body_whose_put_timed_out_once_is_not_reused(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """The first PUT of a page hangs past the request timeout; the retry lands. The body's
    buffer was given back for the next page: on Python 3.12+ a transport keeps a view of what
    it has not sent yet (and a close goes on sending it), so the abandoned attempt, once the
    server read on, sent the next page's bytes as this page's (a lost write: a corrupt object
    replacing the good one). A body is reused only after an attempt that was answered alone."""
    async with FaultProxy(moto_endpoint) as proxy:
        hung: list[str] = []

        async def hang_first(request: Any) -> Any:
            if request.method == "PUT" and "/pages/" in request.path and "/runs/" not in request.path and not hung:
                hung.append(request.path)
                await asyncio.sleep(1.0)  # past request_timeout: the client gives this attempt up
            return None

        proxy.answer = hang_first
        async with make_s3(proxy.endpoint, moto_bucket, prefix, concurrency=4, request_timeout=0.3,
                           retry_backoff=0.0) as store:
            src = ArrayHostPool(1, PAGE, token_elems=4)
            src.fill_random(3)
            store.register_mem_pool_host(src)
            res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 1), keys=["hung"])])
            assert res["kv"] == [True] and hung and store.get_stats()["retries"] >= 1
            assert len(store._local.get().bodies) == 0  # dropped, never handed to another page
            await asyncio.sleep(1.0)  # (the abandoned attempt lands)


async def test_with_the_exists_cache_off_a_page_deleted_elsewhere_is_claimed_once(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """``exists_cache_size = 0`` (a fleet of writers) turned the gone marks off too: every
    lookup re-learned the deleted page from the run index and claimed the chain past it, one
    failed read after another, forever."""
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4, exists_cache_size=0) as store:
        keys, _ = await _filled(store, 20, "nocache")
        _delete(moto_endpoint, store.names.page(keys[10], "kv"))
        first = (await store.batch_exists_v2(keys)).kv_hit_pages  # the index still lists it
        assert first in (10, 20)
        got = await _read(store, keys[:first])
        assert got[:10] == [True] * 10 and (first == 10 or got[10] is False)
        for _ in range(3):
            assert (await store.batch_exists_v2(keys)).kv_hit_pages == 10
        src = ArrayHostPool(1, PAGE, token_elems=4)
        src.fill_random(7)
        store.register_mem_pool_host(src)
        assert (await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 1), keys=keys[10:11])]))["kv"] == [True]
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20  # written again: the mark goes


async def _read_into(store: Any, keys: list[str]) -> tuple[list[bool], ArrayHostPool]:
    """Read ``keys`` into a pool filled with non-zero bytes (a miss must leave its page zeroed)."""
    dst = ArrayHostPool(len(keys), PAGE, token_elems=4)
    dst.fill_random(12345)
    store.register_mem_pool_host(dst)
    res = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, len(keys)), keys=keys)])
    return res["kv"], dst


def _page(pool: ArrayHostPool, i: int) -> bytes:
    return pool.page_bytes(i * PAGE)


async def test_a_page_another_store_instance_deleted_is_one_clean_counted_miss(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """A run index written by one store lists a chain; another store on the same bucket and
    prefix (another process: its own exists cache, here through its own endpoint) deletes a page
    of it. A reader that learned the chain earlier, or learns it from the index afterwards,
    claims the page once: its read is a clean miss (a zeroed pool page, ``stale_hits``, no
    exception, no foreign byte), and its lookups stop there from then on."""
    async with FaultProxy(moto_endpoint) as elsewhere, FaultProxy(moto_endpoint) as third:
        writer = make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4, exists_cache_ttl=0.3)
        deleter = make_s3(elsewhere.endpoint, moto_bucket, prefix, concurrency=4)
        fresh = make_s3(third.endpoint, moto_bucket, prefix, concurrency=4)
        async with writer, deleter, fresh:
            assert writer.exists_cache is not deleter.exists_cache is not fresh.exists_cache
            keys, src = await _filled(writer, 20, "peer")
            assert (await writer.batch_exists_v2(keys)).kv_hit_pages == 20  # learned from the index
            assert await deleter.batch_delete(keys[10:11]) == [True]
            # the writer still claims the chain (its cache, within the TTL); the fresh store
            # learns it from the index, which vouches past the first wave's HEADs
            for store in (writer, fresh):
                assert (await store.batch_exists_v2(keys)).kv_hit_pages == 20
                got, dst = await _read_into(store, keys)
                assert got == [True] * 10 + [False] + [True] * 9
                assert _page(dst, 10) == bytes(len(_page(dst, 10)))  # zeroed, not garbage
                assert all(_page(dst, i) == _page(src, i) for i in range(20) if i != 10)
                stats = store.get_stats()
                assert stats["stale_hits"] == 1 and not stats.get("corrupt_pages") and not stats.get("backend_errors")
                assert (await store.batch_exists_v2(keys)).kv_hit_pages == 10  # the lookup stops there
                assert await store.get(keys[10]) is None
            await asyncio.sleep(0.4)  # the writer's entries expire: its lookup reads the index again
            for store in (writer, fresh):
                assert (await store.batch_exists_v2(keys)).kv_hit_pages == 10
                assert store.get_stats()["stale_hits"] == 1


async def test_a_delete_through_a_second_store_of_this_process_is_seen_at_once(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """Two stores of one process on the same location and namespace share the exists cache
    (and its gone marks): a delete through one is never claimed by the other."""
    async with make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4) as a, \
            make_s3(moto_endpoint, moto_bucket, prefix, concurrency=4) as b:
        keys, _ = await _filled(a, 20, "sibling")
        assert (await a.batch_exists_v2(keys)).kv_hit_pages == 20
        assert await b.batch_delete(keys[10:11]) == [True]
        assert (await a.batch_exists_v2(keys)).kv_hit_pages == 10
        assert (await _read(a, keys[:10])) == [True] * 10
        assert a.get_stats().get("stale_hits", 0) == 0
