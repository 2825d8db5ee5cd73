"""The conformance suite on the ``memory`` backend, found through its entry point."""

from __future__ import annotations

import uuid
from collections import OrderedDict

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


# ---------------------------------------------------------------- eviction: leaves first


async def _chain(store, keys: list[str], fill: int, size: int = 1000) -> bool:  # type: ignore[no-untyped-def]
    """Store ``keys`` as one chained batch (each page's parent the key before it)."""
    import torch

    return await store.batch_set(keys, [torch.full((size,), fill, dtype=torch.uint8)] * len(keys))


async def test_eviction_trims_a_chain_from_its_tail_and_keeps_its_root() -> None:
    """Plain LRU evicted a chain's root first (written first, so oldest), orphaning every later
    page: they stayed stored, taking room, but no lookup (a prefix walk from the first page)
    could reach them. Now the chain's leaves go first: the prefix left is still a hit."""
    store = create_async_storage("memory", None, max_bytes=10_000)
    seen = _watched(store)
    async with store:
        a = [f"a{i}" for i in range(6)]
        assert await _chain(store, a, 1)
        assert await _chain(store, ["b0", "b1", "b2", "b3"], 2)
        seen.clear()
        assert await _chain(store, ["c0", "c1"], 3)
        assert seen == [("REMOVED", ("a5", "a4")), ("STORED", ("c0", "c1"))]
        assert await store.exists_pages(a) == [True] * 4 + [False] * 2
        assert await store.batch_exists(a) == 4  # the prefix left is reachable
        stats = store.get_stats()
        assert (stats["evicted_pages"], stats["evicted_bytes"], stats["stored_bytes"]) == (2, 2000, 10_000)


async def test_interleaved_chains_are_each_trimmed_from_the_tail_least_recently_used_first() -> None:
    """Two chains written page by page, interleaved. Chain B read since: A's tail goes first
    and A's prefix is still a hit (plain LRU took a0 and a1, leaving a2 and a3 unreachable);
    then A's prefix read: B's tail goes next."""
    from hicache.storage.types import PageKey

    store = create_async_storage("memory", None, max_bytes=8_000)
    async with store:
        for i in range(4):
            for name in "ab":
                parent = [PageKey(f"{name}{i - 1}", "kv")] if i else [None]
                assert store._store([PageKey(f"{name}{i}", "kv")], [memoryview(b"x" * 1000)], parent) == [True]
        a, b = [f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]
        for key in b:  # a read of all of B: the most recently used chain now
            assert (await store.get(key)) is not None
        evicted: list = []
        medium, digest = store.medium, store.namespace.digest
        for i in range(2):
            assert medium.put((digest, f"u{i}", "kv"), b"u" * 1000, evicted)
        assert [k for _, k, _ in evicted] == ["a3", "a2"]
        assert (await store.batch_exists(a), await store.batch_exists(b)) == (2, 4)
        for key in a[:2]:
            assert (await store.get(key)) is not None
        for i in range(2, 4):
            assert medium.put((digest, f"u{i}", "kv"), b"u" * 1000, evicted)
        assert [k for _, k, _ in evicted[2:]] == ["b3", "b2"]
        assert (await store.batch_exists(a), await store.batch_exists(b)) == (2, 2)


def test_a_parent_left_a_leaf_keeps_its_own_last_use() -> None:
    """A page whose last child is evicted becomes a leaf at the place its own last use gives
    it, not at the front: a hot shared root stays while idle pages go."""
    m = MemoryMedium(4)
    root, child = ("ns", "root", "kv"), ("ns", "child", "kv")
    assert m.put_many([root, child], [b"r", b"c"], parents=[None, root]) == [True, True]
    assert m.put(("ns", "f1", "kv"), b"1") and m.put(("ns", "f2", "kv"), b"2")
    assert m.get(root) == b"r"  # used last: the child is the oldest leaf, then f1, f2, root
    evicted: list = []
    for i in range(3):
        assert m.put(("ns", f"n{i}", "kv"), b"n", evicted)
    assert [k for _, k, _ in evicted] == ["child", "f1", "f2"]
    assert m.has(root)


def test_unchained_pages_are_evicted_in_plain_lru_order() -> None:
    import random

    rng = random.Random(7)
    m = MemoryMedium(10)
    order: OrderedDict = OrderedDict()  # the model: least recently used first
    evicted: list = []
    for step in range(500):
        e = ("ns", f"k{rng.randint(0, 25)}", "kv")
        if rng.random() < 0.4:
            if m.get(e) is not None:
                order.move_to_end(e)
            continue
        before = list(order)
        assert m.put(e, b"x", evicted)
        order.pop(e, None)
        order[e] = None
        while len(order) > 10:
            assert evicted.pop(0) == before.pop(0) == order.popitem(last=False)[0], step
    assert list(order) == list(m.pages)


def test_a_chain_longer_than_the_medium_written_batch_by_batch_keeps_its_prefix() -> None:
    """Batches continuing one chain never evict its earlier pages: the chain fills the medium
    (after an unrelated chain, evicted from its tail) and the rest is refused."""
    m = MemoryMedium(10)
    other = [("ns", f"o{i}", "kv") for i in range(3)]
    assert m.put_many(other, [b"o"] * 3, parents=[None, *other[:-1]]) == [True] * 3
    chain = [("ns", f"c{i}", "kv") for i in range(15)]
    evicted: list = []
    flags: list[bool] = []
    for start in (0, 5, 10, 10):
        batch = chain[start:start + 5]
        parents = [chain[start - 1] if start else None, *batch[:-1]]
        flags += m.put_many(batch, [b"c"] * len(batch), evicted, parents)
    assert flags == [True] * 10 + [False] * 10
    assert evicted == other[::-1]
    assert set(m.pages) == set(chain[:10]) and m.evicted_pages == 3


async def test_a_shared_medium_trims_each_namespace_from_its_tails_and_reports_only_its_own() -> None:
    """Eviction on a medium two namespaces share: leaves of both, least recently used first;
    the writer reports only its own pages removed, and counts the evictions its write made
    (of either namespace's pages); the other store, which evicted nothing, counts none."""
    import torch

    sid = f"leaves-{uuid.uuid4()}"
    a = create_async_storage("memory", None, store_id=sid, max_bytes=5_000, namespace={"model": "a"})
    b = create_async_storage("memory", None, store_id=sid, namespace={"model": "b"})
    seen_b = _watched(b)
    try:
        async with a, b:
            assert await a.batch_set(["p0", "p1", "p2"], [torch.zeros(1000, dtype=torch.uint8)] * 3)
            assert await b.batch_set(["p0", "p1"], [torch.ones(1000, dtype=torch.uint8)] * 2)
            assert (await a.get("p0")) is not None  # used: b's p1 is older now
            seen_b.clear()
            assert await b.batch_set(["q0", "q1", "q2"], [torch.ones(1000, dtype=torch.uint8)] * 3)
            # a's chain is the oldest: trimmed from its tail (p2, p1), then b's p1, older than a's p0
            assert seen_b == [("REMOVED", ("p1",)), ("STORED", ("q0", "q1", "q2"))]
            assert await a.batch_exists(["p0", "p1", "p2"]) == 1
            assert await b.batch_exists(["p0", "p1"]) == 1
            stats = b.get_stats()
            assert (stats["evicted_pages"], stats["evicted_bytes"], stats["stored_bytes"]) == (3, 3000, 5000)
            assert (a.get_stats()["evicted_pages"], a.get_stats()["evicted_bytes"]) == (0, 0)
    finally:
        MemoryMedium.drop_shared(sid)


async def test_a_batch_repeating_a_key_makes_no_loop_that_could_never_be_evicted() -> None:
    """``batch_set(["a", "b", "a"])`` chains a to b and b to a: a loop, in which no page is
    ever a leaf. Linked, those pages could never be evicted and the medium refused every
    later write; the link that would close the loop is not made."""
    import torch

    store = create_async_storage("memory", None, max_bytes=2_000)
    async with store:
        assert await store.batch_set(["a", "b", "a"], [torch.zeros(1000, dtype=torch.uint8)] * 3)
        for i in range(3):
            assert await store.set(f"k{i}", torch.zeros(1000, dtype=torch.uint8))
        assert await store.exists_pages(["k1", "k2", "a", "b"]) == [True, True, False, False]


class _LeavesFirstModel:
    """The rule, the slow way: each victim the least recently used page no other page chains
    from (after the put: the page put chains from its parent), never the page put nor one of
    ``protect``; the victims found before any goes, else the put is refused."""

    def __init__(self, cap: int) -> None:
        self.cap, self.clock = cap, 0
        self.pages: dict = {}  # entry -> [payload, parent, last use]
        self.evicted_pages = 0

    def touch(self, e) -> None:  # type: ignore[no-untyped-def]
        self.clock += 1
        self.pages[e][2] = self.clock

    def loops(self, e, parent) -> bool:  # type: ignore[no-untyped-def]
        up = parent
        while up is not None:
            if up == e:
                return True
            up = self.pages[up][1] if up in self.pages else None
        return False

    def put(self, e, payload, evicted, parent=None, protect=None) -> bool:  # type: ignore[no-untyped-def]
        if len(payload) > self.cap:
            return False
        if parent is not None and self.loops(e, parent):
            parent = None
        old = self.pages.get(e)
        need = sum(len(p[0]) for p in self.pages.values()) - (len(old[0]) if old else 0) + len(payload) - self.cap
        chosen: list = []
        while need > 0:
            left = [k for k in self.pages if k not in chosen]
            linked = {(parent if k == e else self.pages[k][1]) for k in left} | {parent}
            leaves = [k for k in left if k not in linked and k != e and not (protect and k in protect)]
            if not leaves:
                return False
            victim = min(leaves, key=lambda k: self.pages[k][2])
            chosen.append(victim)
            need -= len(self.pages[victim][0])
        for victim in chosen:
            del self.pages[victim]
            evicted.append(victim)
            self.evicted_pages += 1
        self.pages[e] = [payload, parent, 0]
        self.touch(e)
        return True

    def put_many(self, entries, payloads, evicted, parents) -> list[bool]:  # type: ignore[no-untyped-def]
        from hicache_backends.memory.backend import put_in_order

        if parents is None:
            return [self.put(e, p, evicted) for e, p in zip(entries, payloads)]
        keep = None
        if sum(len(p[0]) for p in self.pages.values()) + sum(map(len, payloads)) > self.cap:
            keep = self.chain_of(entries, parents)
        return put_in_order(entries, parents, lambda i: self.put(entries[i], payloads[i], evicted, parents[i], keep))

    def chain_of(self, entries, parents) -> set:  # type: ignore[no-untyped-def]
        keep = set(entries)
        for parent in parents:
            while parent is not None and parent not in keep and parent in self.pages:
                keep.add(parent)
                self.touch(parent)
                parent = self.pages[parent][1]
        return keep


def _check_medium(m: MemoryMedium) -> None:
    """The medium's own books agree with its pages."""
    from collections import Counter

    assert set(m.stamps) == set(m.pages) and set(m.links) <= set(m.pages)
    assert m.children == Counter(p for p in m.links.values() if p is not None)
    assert m.nbytes == sum(map(len, m.pages.values()))
    first = {}
    for stamp, e in m._leaves:
        first[e] = min(stamp, first.get(e, stamp))
    for e in m.pages:
        if e not in m.children:
            assert first[e] <= m.stamps[e]  # every leaf is in the heap, no later than its use


@pytest.mark.parametrize("seed", range(16))
def test_eviction_matches_the_leaves_first_rule(seed: int) -> None:
    """Random puts (chained to held pages, to pages not held, to themselves, in batches or one
    by one, big pages with a protected chain), reads, removes and namespace drops: the medium
    stores, refuses and evicts (in order) exactly what the slow rule does."""
    import random

    rng = random.Random(seed)
    cap = rng.choice([8, 20, 60])
    m, model = MemoryMedium(cap), _LeavesFirstModel(cap)

    def key() -> tuple:
        return (rng.choice("xy"), f"k{rng.randint(0, 40)}", "kv")

    for step in range(400):
        op = rng.random()
        ev_m: list = []
        ev_model: list = []
        if op < 0.35:  # a chained batch, continuing a held page or not
            n = rng.randint(1, 8)
            ns = rng.choice("xy")
            held = [e for e in m.pages if e[0] == ns]
            first = rng.choice([None, *held[-5:], *held[:3], (ns, f"k{rng.randint(0, 40)}", "kv")])
            entries = [(ns, f"k{rng.randint(0, 60)}" if rng.random() < 0.3 else f"s{step}.{i}", "kv") for i in range(n)]
            parents = [first, *entries[:-1]]
            payloads = [b"p" * rng.choice([1, 1, 2, 3]) for _ in entries]
            assert m.put_many(entries, payloads, ev_m, parents) == model.put_many(entries, payloads, ev_model, parents), step
        elif op < 0.5:  # unchained batch
            entries = [key() for _ in range(rng.randint(1, 5))]
            payloads = [b"u" * rng.choice([1, 2]) for _ in entries]
            assert m.put_many(entries, payloads, ev_m) == model.put_many(entries, payloads, ev_model, None), step
        elif op < 0.62:  # one page, chained to anything (itself too), maybe a protected chain
            e = key()
            parent = rng.choice([None, key(), e, *list(m.pages)[-3:]])
            keep = m.chain_of([e], [parent]) if rng.random() < 0.5 else None
            mkeep = model.chain_of([e], [parent]) if keep is not None else None
            assert keep == mkeep
            size = rng.choice([1, 2, cap + 1])
            assert m.put(e, b"q" * size, ev_m, parent=parent, protect=keep) == model.put(e, b"q" * size, ev_model, parent, mkeep), step
        elif op < 0.85:
            e = rng.choice([*m.pages, key()]) if m.pages else key()
            got = m.get(e)
            assert got == (model.pages[e][0] if e in model.pages else None)
            if got is not None:
                model.touch(e)
        elif op < 0.97:
            e = rng.choice([*m.pages, key()]) if m.pages else key()
            assert m.remove(e) == (model.pages.pop(e, None) is not None)
        else:
            ns = rng.choice("xy")
            assert len(m.drop_namespace(ns)) == len([e for e in model.pages if e[0] == ns])
            model.pages = {e: v for e, v in model.pages.items() if e[0] != ns}
        assert ev_m == ev_model, step
        assert set(m.pages) == set(model.pages), step
        assert {e: p for e, p in m.links.items() if p is not None} == {e: v[1] for e, v in model.pages.items() if v[1] is not None}
        assert m.evicted_pages == model.evicted_pages
        _check_medium(m)


async def test_a_store_whose_pages_a_sharer_of_its_medium_evicts_is_told() -> None:
    """Stores sharing one medium (one ``store_id``): a write by one evicts another's pages for
    room. Only the writer reported its own evictions, so the other store's subscribers (the
    tree's storage directory, vLLM's KV events) went on believing those pages stored. Each
    store now hears of its pages evicted, as a peer's removal, small pages and big alike (the
    big ones are written on a worker thread), and one in the same namespace hears too."""
    import torch

    sid = f"told-{uuid.uuid4()}"
    big = 64 << 10
    a = create_async_storage("memory", None, store_id=sid, max_bytes=4 * big, namespace={"model": "a"})
    twin = create_async_storage("memory", None, store_id=sid, namespace={"model": "a"})
    b = create_async_storage("memory", None, store_id=sid, namespace={"model": "b"})
    from hicache.observability.tier_events import ChangeKind, Tier

    changes: list = []
    a.tier_changes.subscribe(changes.append, wants={(ChangeKind.REMOVED, Tier.STORAGE)})
    seen_a, seen_twin, seen_b = _watched(a), _watched(twin), _watched(b)
    try:
        async with a, twin, b:
            assert await a.batch_set(["s0", "s1"], [torch.zeros(1000, dtype=torch.uint8)] * 2)
            assert await a.batch_set(["a0", "a1", "a2"], [torch.zeros(big, dtype=torch.uint8)] * 3)
            seen_a.clear(), seen_twin.clear(), changes.clear()
            # b's two big pages need room: a's leaves go (its chain's tail, then its small chain's)
            assert await b.batch_set(["b0", "b1"], [torch.ones(big, dtype=torch.uint8)] * 2)
            gone = {k for k in ["s0", "s1", "a0", "a1", "a2"] if not (await a.exists_pages([k]))[0]}
            assert gone
            for seen in (seen_a, seen_twin):
                assert [kind for kind, _ in seen] == ["REMOVED"] * len(seen)
                assert {k for _, keys in seen for k in keys} == gone
            assert {(c.reason, c.origin) for c in changes} == {("evicted", "peer")}
            assert [kind for kind, _ in seen_b] == ["STORED"]  # b lost nothing of its own
            seen_a.clear()
            # the twin (same namespace) writes: a hears of its namespace's pages it evicted
            held = [k for k in ["s0", "s1", "a0", "a1", "a2"] if k not in gone]
            assert await twin.batch_set(["t0", "t1"], [torch.ones(big, dtype=torch.uint8)] * 2)
            gone_now = {k for k in held if not (await a.exists_pages([k]))[0]}
            gone_b = {k for k in ["b0", "b1"] if not (await b.exists_pages([k]))[0]}
            assert gone_now or gone_b
            assert {k for _, keys in seen_a if _ == "REMOVED" for k in keys} == gone_now
            assert {k for kind, keys in seen_b if kind == "REMOVED" for k in keys} == gone_b
    finally:
        MemoryMedium.drop_shared(sid)


async def test_a_delete_or_clear_by_a_store_sharing_the_medium_and_namespace_is_told_to_the_others() -> None:
    """Two caches sharing one medium and namespace (what the controller suggests instead of
    sharing a backend object): one's delete or clear removed pages the other's subscribers
    went on believing stored. The others now hear of them as a peer's removal or clear (the
    file store's peers hear the same through its removal journal)."""
    import torch

    from hicache.observability.tier_events import ChangeKind, Tier

    sid = f"twins-{uuid.uuid4()}"
    a = create_async_storage("memory", None, store_id=sid, namespace={"model": "m"})
    b = create_async_storage("memory", None, store_id=sid, namespace={"model": "m"})
    other = create_async_storage("memory", None, store_id=sid, namespace={"model": "o"})
    seen: list = []
    b.tier_changes.subscribe(seen.append, wants={(ChangeKind.REMOVED, Tier.STORAGE), (ChangeKind.CLEARED, Tier.STORAGE)})
    seen_other = _watched(other)
    try:
        async with a, b, other:
            assert await a.batch_set(["x", "y"], [torch.zeros(100, dtype=torch.uint8)] * 2)
            assert await other.batch_set(["x"], [torch.zeros(100, dtype=torch.uint8)])
            seen_other.clear()
            assert await a.batch_delete(["x", "nothing"]) == [True, False]
            assert [(c.kind.name, c.keys, c.reason, c.origin) for c in seen] == [("REMOVED", ("x",), "deleted", "peer")]
            seen.clear()
            assert await a.clear()
            # naming the pages it dropped (a vLLM-schema router reads a clear without pages as
            # "this replica holds nothing", on every tier)
            assert [(c.kind.name, c.keys, c.keys_complete, c.origin) for c in seen] == [("CLEARED", ("y",), True, "peer")]
            assert await b.exists_pages(["y"]) == [False]
            assert seen_other == [] and await other.exists_pages(["x"]) == [True]
    finally:
        MemoryMedium.drop_shared(sid)
