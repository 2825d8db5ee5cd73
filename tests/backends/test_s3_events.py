"""S3 deletions reach the tier-change hub: a corrupt object deleted, a namespace cleared."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest

from hicache.observability import ChangeKind, Tier, TierChange
from hicache.testing import ArrayHostPool, eventually
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from s3_server import make_s3, raw_client, raw_get, raw_put


async def test_s3_deletions_and_clears_are_reported(moto_endpoint: str, moto_bucket: str) -> None:
    keys = keys_for(4, salt=17)
    async with make_s3(moto_endpoint, moto_bucket, f"t/{uuid.uuid4().hex}", NS_A) as store:
        seen: list[TierChange] = []
        store.tier_changes.subscribe(seen.append)
        pool = ArrayHostPool(len(keys), PAGE)
        pool.fill_random(3)
        store.register_mem_pool_host(pool)
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        stored = [c for c in seen if c.kind is ChangeKind.STORED]
        assert [k for c in stored for k in c.keys] == keys and {c.backend for c in stored} == {"s3"}
        good = raw_get(moto_endpoint, store.names.page(keys[1], "kv"))
        assert good is not None
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        raw_put(moto_endpoint, store.names.page(keys[1], "kv"), bytes(flipped))
        seen.clear()
        assert await store.batch_get_v1(keys[1:2], pool.indices(1, 1)) == [False]
        assert [(c.kind, c.tier, c.keys, c.reason) for c in seen] == [
            (ChangeKind.REMOVED, Tier.STORAGE, (keys[1],), "corrupt")]
        seen.clear()
        assert await store.clear()
        assert [(c.kind, c.tier) for c in seen] == [(ChangeKind.CLEARED, Tier.STORAGE)]


async def test_s3_pages_written_again_are_announced_stored_once(moto_endpoint: str, moto_bucket: str) -> None:
    """Pages this process wrote and writes again (a cache reset, the same prompt served again)
    were announced stored each time: a router counting BlockStored against BlockRemoved held
    them stored after their one removal. Now what the exists cache knows is not announced again;
    a page removed here (reported) is announced when written again."""
    keys = keys_for(4, salt=19)
    counts: Counter[str] = Counter()

    def apply(c: TierChange) -> None:
        counts.update({k: 1 if c.kind is ChangeKind.STORED else -1 for k in c.keys})

    async with make_s3(moto_endpoint, moto_bucket, f"t/{uuid.uuid4().hex}", NS_A) as store:
        store.tier_changes.subscribe(apply)
        pool = ArrayHostPool(len(keys), PAGE)
        pool.fill_random(4)
        store.register_mem_pool_host(pool)
        for _ in range(3):
            assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        assert counts == Counter(dict.fromkeys(keys, 1))
        assert await store.batch_delete(keys[2:]) == [True, True]
        assert +counts == Counter(dict.fromkeys(keys[:2], 1))
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        assert counts == Counter(dict.fromkeys(keys, 1))


async def test_s3_a_page_a_lookup_finds_expired_is_not_announced_stored_again(moto_endpoint: str,
                                                                              moto_bucket: str) -> None:
    """A lookup past the exists cache's TTL dropped the page's entry, so the store forgot it
    had announced the page: written again, it was announced a second time, and a router
    counting BlockStored against BlockRemoved held it after its one removal. An expired entry
    is asked about again (its HEAD), but still known as announced. Here the object went behind
    the store's back (a lifecycle rule), so the HEAD does not bring the entry back either."""
    keys = keys_for(2, salt=23)
    counts: Counter[str] = Counter()

    def apply(c: TierChange) -> None:
        counts.update({k: 1 if c.kind is ChangeKind.STORED else -1 for k in c.keys})

    async with make_s3(moto_endpoint, moto_bucket, f"t/{uuid.uuid4().hex}", NS_A, exists_cache_ttl=0.0) as store:
        store.tier_changes.subscribe(apply)
        pool = ArrayHostPool(len(keys), PAGE)
        pool.fill_random(5)
        store.register_mem_pool_host(pool)
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        bucket, key = store.names.page(keys[1], "kv").split("/", 1)
        raw_client(moto_endpoint).delete_object(Bucket=bucket, Key=key)
        assert await store.exists_pages(keys) == [True, False]  # every entry expired (TTL 0): HEADs
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        assert counts == Counter(dict.fromkeys(keys, 1))
        # our own removal of both: each counted down once, to nothing
        assert await store.batch_delete(keys) == [True, True]
        assert +counts == Counter()


async def test_s3_pages_a_racing_clear_removed_are_not_announced_stored(moto_endpoint: str, moto_bucket: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write batch in flight when the store is cleared: the pages that had landed went with
    the clear, and the batch (answered written, as designed) announced them stored after the
    clear: a router believed the store held pages it did not, and no removal followed. A batch
    a clear raced announces none of its pages (the store cannot tell which landed before the
    clear's listing): a router misses a hint, never believes in a page that is gone."""
    from hicache_backends.s3.fs import S3ObjectOps

    keys = keys_for(4, salt=29)
    counts: Counter[str] = Counter()

    def apply(c: TierChange) -> None:  # a router: a clear without pages forgets all
        if c.kind is ChangeKind.CLEARED and not c.keys_complete:
            counts.clear()
        counts.update({k: 1 if c.kind is ChangeKind.STORED else -1 for k in c.keys})

    async with make_s3(moto_endpoint, moto_bucket, f"t/{uuid.uuid4().hex}", NS_A, concurrency=8) as store:
        store.tier_changes.subscribe(apply)
        pool = ArrayHostPool(len(keys), PAGE)
        pool.fill_random(6)
        store.register_mem_pool_host(pool)
        slow = store.names.page(keys[0], "kv")
        gate = asyncio.Event()
        real_put = S3ObjectOps.put

        async def put(self, path, data):  # type: ignore[no-untyped-def]
            if path == slow:  # lands after the clear
                await gate.wait()
            return await real_put(self, path, data)

        monkeypatch.setattr(S3ObjectOps, "put", put)
        write = asyncio.create_task(store.batch_set_v1(keys, pool.indices(0, len(keys))))
        await eventually(lambda: all(raw_get(moto_endpoint, store.names.page(k, "kv")) for k in keys[1:]))
        assert await store.clear() is True
        gate.set()
        assert await write == [True] * len(keys)
        held = {k for k in keys if raw_get(moto_endpoint, store.names.page(k, "kv")) is not None}
        assert held == {keys[0]}
        assert set(+counts) <= held, +counts


async def test_s3_a_page_deleted_while_its_write_is_answered_is_not_announced_after_its_removal(
        moto_endpoint: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's PUT landed, and before its answer came back a delete (a placement policy's
    eviction) found it, removed it and reported the removal; then the write announced it
    stored: a router, reading the events in order, held a page the store no longer had, and
    nothing would ever remove it. A page removed here since its write began is not announced.
    Forced order: the PUT lands, the delete runs, the PUT answers."""
    from hicache_backends.s3.fs import S3ObjectOps

    keys = keys_for(2, salt=31)
    held: set[str] = set()

    def apply(c: TierChange) -> None:  # a router: what the store holds, in event order
        if c.kind is ChangeKind.STORED:
            held.update(c.keys)
        else:
            held.difference_update(c.keys)

    async with make_s3(moto_endpoint, moto_bucket, f"t/{uuid.uuid4().hex}", NS_A, concurrency=8) as store:
        store.tier_changes.subscribe(apply)
        pool = ArrayHostPool(len(keys), PAGE)
        pool.fill_random(7)
        store.register_mem_pool_host(pool)
        slow = store.names.page(keys[1], "kv")
        landed, gate = asyncio.Event(), asyncio.Event()
        real_put = S3ObjectOps.put

        async def put(self, path, data):  # type: ignore[no-untyped-def]
            await real_put(self, path, data)
            if path == slow:  # landed; its answer waits
                landed.set()
                await gate.wait()

        monkeypatch.setattr(S3ObjectOps, "put", put)
        write = asyncio.create_task(store.batch_set_v1(keys, pool.indices(0, len(keys))))
        await landed.wait()
        assert await store.batch_delete(keys[1:]) == [True]
        gate.set()
        assert await write == [True, True]
        assert raw_get(moto_endpoint, slow) is None
        assert held == {keys[0]}
