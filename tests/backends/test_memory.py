"""The conformance suite on the ``memory`` backend, found through its entry point."""

from __future__ import annotations

import uuid

import pytest

from hicache.storage import AsyncHiCacheStorage, create_async_storage
from hicache.testing import StoreTests
from hicache_backends.memory import MemoryMedium


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        store_id = f"conformance-{uuid.uuid4().hex}"

        def make(namespace=None) -> AsyncHiCacheStorage:
            return create_async_storage("memory", None, store_id=store_id, namespace=namespace)

        yield make
        MemoryMedium.drop_shared(store_id)

    async def raw_payload(self, store, key, pool="kv"):
        return store.medium.pages.get((store.namespace.digest, key, pool))


async def test_lru_bound_holds() -> None:
    store = create_async_storage("memory", None, max_bytes=10_000)
    import torch

    async with store:
        for i in range(50):
            assert await store.set(f"k{i}", torch.zeros(1000, dtype=torch.uint8))
        stats = store.get_stats()
        assert stats["stored_bytes"] <= 10_000
        assert stats["evicted_pages"] == 40
        assert await store.batch_exists([f"k{i}" for i in range(40, 50)]) == 10
        assert not await store.exists("k0")
        assert not await store.set("huge", torch.zeros(20_000, dtype=torch.uint8))


def test_max_bytes_rejects_bool() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match="max_bytes"):
        create_async_storage("memory", None, max_bytes=True)


async def test_big_batches_round_trip_through_the_worker_thread() -> None:
    """A batch of at least OFFLOAD_MIN_BYTES is copied on a thread (it used to be copied on the
    event loop, hundreds of MiB for a batch of real pages)."""
    import torch

    from hicache.storage.offload import OFFLOAD_MIN_BYTES
    from hicache.testing import ArrayHostPool

    store = create_async_storage("memory", None)
    elems = OFFLOAD_MIN_BYTES // (4 * 2)
    src = ArrayHostPool(3, 4, token_elems=elems)
    src.fill_random(9)
    store.register_mem_pool_host(src)
    keys = ["a", "b", "c"]
    assert await store.batch_set_v1(keys, src.indices(0, 3)) == [True] * 3
    dst = ArrayHostPool(3, 4, token_elems=elems)
    store.register_mem_pool_host(dst)
    assert await store.batch_get_v1(keys, dst.indices(0, 3)) == [True] * 3
    assert torch.equal(dst.buffer, src.buffer)
    await store.aclose()


@pytest.mark.parametrize("seed", range(12))
def test_put_many_matches_puts_one_by_one(seed: int) -> None:
    """A batch put (one lock; one ``update`` when new pages fit) ends exactly as the puts one
    by one: same flags, pages in the same LRU order, evictions in order, same counters - with
    repeated keys in and across batches, replaced pages, evictions and oversized pages."""
    import random

    rng = random.Random(seed)
    cap = rng.choice([250, 1_000, 1 << 20])  # evicting often, sometimes, never
    one, many = MemoryMedium(cap), MemoryMedium(cap)
    for b in range(40):
        n = rng.randint(0, 10)
        if b % 3:  # keys seen before, repeated within the batch too
            entries = [("ns", f"k{rng.randint(0, 30)}", "kv") for _ in range(n)]
        else:  # new keys, the last few of them twice
            entries = [("ns", f"n{b}.{i}", "kv") for i in range(n)]
            entries += entries[: rng.randint(0, 2)]
        payloads = [bytes([b % 256]) * rng.choice([0, 1, 40, 120, 300]) for _ in entries]
        ev_one: list = []
        ev_many: list = []
        assert many.put_many(entries, payloads, ev_many) == [one.put(e, p, ev_one) for e, p in zip(entries, payloads)]
        assert ev_many == ev_one
        assert list(many.pages.items()) == list(one.pages.items())
        assert (many.nbytes, many.evicted_pages) == (one.nbytes, one.evicted_pages)


def test_put_many_needs_one_payload_per_entry() -> None:
    with pytest.raises(ValueError, match="2 entries but 1 payloads"):
        MemoryMedium(100).put_many([("ns", "a", "kv"), ("ns", "b", "kv")], [b"x"])


def _watched(store) -> list[tuple[str, tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    """The STORED and REMOVED events of ``store``'s storage tier, as (kind, keys), in order."""
    from hicache.observability.tier_events import ChangeKind, Tier

    seen: list[tuple[str, tuple[str, ...]]] = []
    store.tier_changes.subscribe(lambda c: seen.append((c.kind.name, tuple(c.keys))),
                                 wants={(ChangeKind.REMOVED, Tier.STORAGE), (ChangeKind.STORED, Tier.STORAGE)})
    return seen


async def test_a_batch_bigger_than_the_medium_stores_its_first_pages_and_says_so() -> None:
    """A chained batch bigger than the medium keeps the leading pages that fit and refuses the
    rest (counted as refused for room), evicting nothing for them. It used to evict its own
    first pages for its tail, answering them False: the tail it kept follows a prefix no
    lookup finds. Older pages it evicts for its first pages are reported REMOVED."""
    import torch

    store = create_async_storage("memory", None, max_bytes=10_000)
    seen = _watched(store)
    async with store:
        assert await store.batch_set(["old"], [torch.full((1000,), 99, dtype=torch.uint8)])
        seen.clear()
        keys = [f"k{i}" for i in range(50)]
        assert not await store.batch_set(keys, [torch.full((1000,), i, dtype=torch.uint8) for i in range(50)])
        stats = store.get_stats()
        assert (stats["stored_bytes"], stats["evicted_pages"], stats["rejected_pages_no_space"]) == (10_000, 1, 40)
        assert seen == [("REMOVED", ("old",)), ("STORED", tuple(keys[:10]))]
        assert await store.exists_pages(keys) == [True] * 10 + [False] * 40
        assert (await store.get("k5"))[0] == 5


async def test_evicted_bytes_are_counted_and_a_shared_medium_has_one_bound() -> None:
    """``evicted_bytes`` (a published counter) stayed 0; a second store on a store_id asking
    for another bound silently got the first one's."""
    import uuid

    import torch

    from hicache.errors import ConfigError

    sid = f"bound-{uuid.uuid4()}"
    first = create_async_storage("memory", None, store_id=sid, max_bytes=2_000)
    async with first:
        for i, key in enumerate("abc"):
            assert await first.batch_set([key], [torch.full((1000,), i, dtype=torch.uint8)])
        stats = first.get_stats()
        assert (stats["evicted_pages"], stats["evicted_bytes"]) == (1, 1000)
        with pytest.raises(ConfigError, match="already open with max_bytes=2000"):
            create_async_storage("memory", None, store_id=sid, max_bytes=1 << 30)
        joined = create_async_storage("memory", None, store_id=sid)  # no bound named: the medium's
        async with joined:
            assert joined.get_stats()["max_bytes"] == 2_000


async def test_a_page_stored_earlier_and_evicted_by_its_own_rewrite_is_reported_removed() -> None:
    """Every subscriber held it: the batch's answer False and no event left it "stored"."""
    import torch

    store = create_async_storage("memory", None, max_bytes=2_000)
    seen = _watched(store)
    async with store:
        assert await store.batch_set(["a"], [torch.full((1000,), 1, dtype=torch.uint8)])
        await store.batch_set(["a", "b", "c"], [torch.full((1000,), i, dtype=torch.uint8) for i in range(3)])
        held: set[str] = set()
        for kind, keys in seen:
            held = held | set(keys) if kind == "STORED" else held - set(keys)
        assert held == {k for k in "abc" if (await store.exists_pages([k]))[0]}


async def test_a_page_whose_old_copy_the_batch_evicted_and_put_again_is_stored() -> None:
    import torch

    from hicache.storage.types import PageKey

    store = create_async_storage("memory", None, max_bytes=2_000)
    async with store:
        assert await store.batch_set(["b"], [torch.full((1000,), 1, dtype=torch.uint8)])
        assert await store.batch_set(["x"], [torch.full((1000,), 2, dtype=torch.uint8)])
        ok = store._store([PageKey("a", "kv"), PageKey("b", "kv")], [memoryview(bytes([i]) * 1000) for i in range(2)])
        assert ok == await store.exists_pages(["a", "b"]) == [True, True]


async def test_a_chained_batch_of_big_pages_never_evicts_its_prefix_for_a_writer_in_between() -> None:
    """Big pages are put one by one, each under its own hold of the medium's lock; the batch
    decided whether it might evict (and so what to protect) before the first put, without the
    lock. Another writer filling the shared medium in between made the batch evict its own
    stored prefix, leaving its new pages behind a missing page."""
    from hicache.storage import create_async_storage
    from hicache.storage.types import PageKey

    page = 64 << 10  # big: the per-page put path
    a = create_async_storage("memory", None, max_bytes=8 * page, store_id="chain-race")
    b = create_async_storage("memory", None, max_bytes=8 * page, store_id="chain-race")
    await a.open()
    await b.open()
    try:
        keys = [PageKey(f"p{i}", "kv") for i in range(6)]
        bufs = [memoryview(bytes([i]) * page) for i in range(6)]
        assert a._store(keys[:4], bufs[:4], [None, *keys[:3]]) == [True] * 4
        medium = a.medium
        real_put = medium.put
        fired: list[int] = []

        def put(*args, **kwargs):  # type: ignore[no-untyped-def]
            if not fired:  # another writer's batch lands between the check and this batch's puts
                fired.append(1)
                b._store([PageKey(f"other{i}", "kv") for i in range(4)], [memoryview(b"x" * page)] * 4, [None] * 4)
            return real_put(*args, **kwargs)

        medium.put = put  # type: ignore[method-assign]
        assert a._store(keys[4:], bufs[4:], [keys[3], keys[4]]) == [True, True]
        medium.put = real_put  # type: ignore[method-assign]
        assert medium.present(list(a._entries(keys))) == [True] * 6
    finally:
        await a.aclose()
        await b.aclose()
