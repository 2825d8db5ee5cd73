"""Storage eviction by the tree (``tiered``'s :class:`~hicache.placement.StoredPages`).

Invariants: storage never holds more than its capacity, never keeps a page whose parent it
lost when room is needed (prefix closure: leaves go first, orphans before them), never deletes
a page a prefetch is reading, and the directory matches what the backend really holds, on the
real stack with the memory backend.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from hicache.controller import ControllerConfig
from hicache.controller.jobs import StorageWriteJob
from hicache.errors import ConfigError
from hicache.placement import StoredPages, make_placement
from hicache.replay import serve_request
from hicache.stack import StackConfig, build_stack

PS = 4


def _chain(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:02d}".ljust(8, "0") for i in range(n)]


def _closed(stored: StoredPages) -> bool:
    """Every page that is not an orphan has its parent stored."""
    return all(stored.is_orphan(k) or stored.parent_of(k) is None or stored.parent_of(k) in stored
               for k in list(stored._pages))


def test_leaves_go_first_least_recently_used_in_any_tier() -> None:
    stored = StoredPages(5)
    a = _chain("a", 3)
    stored.add(a, None)  # a0 <- a1 <- a2
    stored.add(["b0000000"], a[0])  # a0 <- b0 (older leaf than a2? no: newer)
    stored.add(["c0000000"], None)
    stored.touch(["c0000000"])  # a hit on device or host: most recent now
    assert stored.make_room(1) == [a[2]]  # oldest leaf; a0 and a1 have stored children
    stored.landed(1, ["d0000000"], None)
    assert stored.make_room(2) == [a[1], "b0000000"]
    assert a[0] in stored and _closed(stored) and len(stored) + stored.reserved <= 5


def test_orphans_go_before_any_page_whose_prefix_is_stored() -> None:
    stored = StoredPages(4)
    a = _chain("a", 3)
    stored.add(a, None)
    stored.add(["z0000000"], None)
    stored.remove([a[0]])  # the backend dropped it by itself: a1, a2 cannot be hit any more
    assert stored.removed_pages == 1 and stored.is_orphan(a[1]) and stored.is_orphan(a[2])
    assert stored.make_room(3) == [a[2], a[1]]  # the orphans, leaf first; z stays
    assert "z0000000" in stored
    stored.add(["q0000000"], "gone0000")  # written after a parent storage no longer holds
    assert stored.is_orphan("q0000000")


def test_pinned_pages_are_never_chosen() -> None:
    stored = StoredPages(2)
    stored.add(["a0000000"], None)
    stored.add(["b0000000"], None)
    pinned = stored.pin(["a0000000", "b0000000", "nope0000"])
    assert pinned == ["a0000000", "b0000000"]
    assert stored.make_room(1) == []  # all pinned: the backend's own bound takes over
    stored.landed(1, [], None)
    stored.unpin(pinned)
    assert stored.make_room(1) == ["a0000000"]



def test_a_heap_rebuilt_while_room_is_made_is_the_one_popped() -> None:
    """A leaf hit again and again piles stale entries on the heap until a drop rebuilds it;
    room-making went on popping the old list, missed the leaves made since (the old chain's
    parents) and deleted the hottest leaf instead, then cut the write short."""
    for touches in (0, 1084):
        s = StoredPages(capacity=20)
        s.add([f"a{i}" for i in range(10)], None)  # the old chain: its leaf a9 is the LRU leaf
        s.add([f"b{i}" for i in range(10)], None)
        s.touch(["b9"] * touches)  # b9 hit again and again
        doomed, fits, pins = s.room_for_write(10, None)
        assert fits == 10, touches
        assert sorted(doomed) == sorted(f"a{i}" for i in range(10)), (touches, doomed)
        s.landed(fits, [f"n{i}" for i in range(fits)], None, pins)
        assert len(s) == 20

def test_without_a_capacity_nothing_is_evicted() -> None:
    stored = StoredPages(None)
    stored.add(_chain("a", 10), None)
    assert stored.make_room(5) == [] and len(stored) == 10
    with pytest.raises(ValueError, match="capacity"):
        StoredPages(0)


def test_random_operations_keep_capacity_closure_and_pins() -> None:
    rng = random.Random(3)
    cap = 20
    stored = StoredPages(cap)
    pins: list[list[str]] = []
    gone: list[str] = []
    origin: dict[str, str | None] = {}
    for step in range(3000):
        op = rng.random()
        keys = list(stored._pages)
        if op < 0.5 or not keys:
            parent = rng.choice(keys) if keys and rng.random() < 0.8 else None
            new = [f"k{step:05d}{j}" for j in range(rng.randint(1, 4))]
            rewrite = False
            if gone and rng.random() < 0.3:  # a page written again (its orphans are adopted)
                again = rng.choice(gone)
                if again not in stored and again in origin:  # a key names its prefix: same parent
                    new, parent, rewrite = [again], origin[again], True
            pinned_now = {k for p in pins for k in p}
            doomed = stored.make_room(len(new))
            gone.extend(doomed)
            pins = [[k for k in p if k in stored] for p in pins]  # a page's pins go with it
            assert not pinned_now & set(doomed)
            assert all(k not in stored for k in doomed)
            leaves = {k for k in stored._pages if not stored.children_of(k)}
            room = len(stored) + stored.reserved <= cap
            assert room or leaves <= pinned_now  # short of room only while every leaf is read
            written = rng.randint(0, len(new))
            if parent is not None and parent not in stored and not rewrite:
                parent = None if rng.random() < 0.5 else parent
            was = len(stored)
            for k, up in zip(new[:written], [parent, *new[: written - 1]]):
                origin.setdefault(k, up)
            stored.landed(len(new), new[:written], parent)
            assert not room or len(stored) <= cap or len(stored) == was
        elif op < 0.7:
            stored.touch(rng.sample(keys, min(3, len(keys))))
        elif op < 0.8:
            pins.append(stored.pin(rng.sample(keys, min(3, len(keys)))))
        elif op < 0.9 and pins:
            stored.unpin(pins.pop(rng.randrange(len(pins))))
        else:
            victim = rng.choice(keys)
            stored.remove([victim])
            gone.append(victim)
            pins = [[k for k in p if k != victim] for p in pins]
        assert _closed(stored) and _orphans_exact(stored)
        assert stored.reserved == 0
    assert len(stored._heap) <= 4 * len(stored) + 1025  # stale entries are compacted


def _stack(storage_pages: int = 24, **options):  # type: ignore[no-untyped-def]
    return build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=16, storage_pages=storage_pages,
        placement="tiered", placement_options={"long_prompt_tokens": 6 * PS, **options},
        req_slots=4, max_context_len=256,
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete")))


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(PS * rng.randint(2, 6))] for _ in range(6)]
    return [list(rng.choice(prefixes)) + [rng.randrange(1000) for _ in range(rng.randint(1, PS * 5))]
            for _ in range(n)]


def _medium_keys(stack) -> dict[str, None]:  # type: ignore[no-untyped-def]
    digest = stack.storage.namespace.digest
    return {k: None for (d, k, _), _ in stack.storage.medium.pages.items() if d == digest}


async def _serve(stack, prompts: list[list[int]]) -> int:  # type: ignore[no-untyped-def]
    failures = 0
    for i, tokens in enumerate(prompts):
        failures += (await serve_request(stack, tokens, rid=f"r{i}")).verify_failures
        await stack.controller.wait_prefetches()
        await stack.cache.drain()
        stored = stack.cache.placement.stored
        held = _medium_keys(stack)
        assert set(stored._pages) == set(held)  # the directory is what storage holds
        assert len(held) <= stack.config.storage_pages
        assert _closed(stored)
        stack.cache.sanity_check()
    return failures


async def test_tree_eviction_keeps_storage_in_bounds_and_prefix_closed() -> None:
    """The policy makes room before every write, so the backend never evicts by itself; every
    page served from storage verifies."""
    # 16 pages, not 24: since loaded storage hits shed their redundant host copies, host no
    # longer drops (and storage re-writes) as much, and 24 pages held this run without a delete
    stack = _stack(storage_pages=16)
    try:
        assert stack.cache._stored is stack.cache.placement.stored is not None
        assert await _serve(stack, _prompts(5, 150)) == 0
        counters = stack.controller.metrics.counters
        assert counters["storage_deleted_pages"] > 0 and counters["storage_delete_missed_pages"] == 0
        assert stack.storage.medium.evicted_pages == 0
        assert stack.controller.metrics.hit_tokens["storage"] > 0
        assert counters["worker_errors"] == 0
    finally:
        await stack.aclose()


async def test_removals_the_backend_makes_by_itself_reach_the_directory() -> None:
    """A medium smaller than the policy believes: the backend's LRU evicts, reports it, and
    the directory forgets those pages (its descendants become orphans, evicted first)."""
    stack = build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=16, storage_pages=24,
        storage_options={"max_bytes": 12 * 64},  # 12 pages of 64 bytes
        placement="tiered", placement_options={"long_prompt_tokens": 6 * PS, "storage_capacity_pages": 24},
        req_slots=4, max_context_len=256,
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete")))
    try:
        assert stack.config.page_nbytes == 64
        stored = stack.cache.placement.stored
        assert stored is not None and stored.capacity == 24
        for i, tokens in enumerate(_prompts(9, 150)):
            assert (await serve_request(stack, tokens, rid=f"r{i}")).verify_failures == 0
            await stack.controller.wait_prefetches()
            await stack.cache.drain()
            assert set(stored._pages) <= set(_medium_keys(stack))
        assert stored.removed_pages > 0 and stack.storage.medium.evicted_pages > 0
    finally:
        await stack.aclose()


async def test_backend_eviction_stays_a_choice() -> None:
    stack = _stack(storage_eviction="backend")
    try:
        assert stack.cache.placement.stored is None and stack.cache._stored is None
        assert await _serve_backend(stack) == 0
        assert stack.controller.metrics.counters["storage_deleted_pages"] == 0
    finally:
        await stack.aclose()
    with pytest.raises(ConfigError, match="storage_eviction"):
        make_placement("tiered", {"storage_eviction": "lfu"})
    assert make_placement("tiered", defaults={"storage_capacity_pages": 7}).stored.capacity == 7  # type: ignore[union-attr]
    assert make_placement("tiered").stored is None  # capacity unknown: the backend's bound


async def _serve_backend(stack) -> int:  # type: ignore[no-untyped-def]
    failures = 0
    for i, tokens in enumerate(_prompts(5, 60)):
        failures += (await serve_request(stack, tokens, rid=f"r{i}")).verify_failures
        await stack.cache.drain()
    return failures


async def test_a_backend_without_delete_keeps_its_own_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_backends.memory.backend import MemoryStorage

    from hicache.storage import AsyncHiCacheStorage

    monkeypatch.setattr(MemoryStorage, "_delete", AsyncHiCacheStorage._delete)
    stack = _stack()
    try:
        assert not stack.storage.supports_delete and stack.cache._stored is None
        assert await _serve_backend(stack) == 0
    finally:
        await stack.aclose()


async def test_a_write_back_never_deletes_the_prefix_it_chains_from() -> None:
    """Storage holds 3 pages; A (2 pages) is stored, then its 2-page child C is written back
    at host eviction. The room for C must not come from A's last page (C would land as an
    orphan no lookup reaches), nor from the backend's own bound (which evicts A's first page,
    the oldest): the page that does not fit is not sent, and A plus what fits of C stay
    reachable."""
    from hicache.prefix_cache import EvictParams

    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend="memory", storage_pages=3,
                      placement="tiered", placement_options={"reuse_hits": 1, "long_prompt_tokens": None},
                      controller=ControllerConfig(prefetch_threshold=PS))
    stack = build_stack(cfg)
    try:
        cache, stored = stack.cache, stack.cache._stored
        await serve_request(stack, list(range(8)), rid="a")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(8)
        await cache.drain()
        node_a = next(iter(cache.root_node.children.values()))
        a_keys = list(node_a.hash_value)
        assert node_a.storage_pages == 2 and all(k in stored for k in a_keys)
        await serve_request(stack, list(range(16)), rid="ac")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        node_c = next(iter(node_a.children.values()))
        c_keys = list(node_c.hash_value)
        cache.evict_host(8)  # C is the host-only leaf: written back, chained from A's last page
        await cache.drain()
        assert all(k in stored for k in a_keys) and _closed(stored)
        assert node_c.storage_pages == 1 and len(stored) <= 3
        assert stack.controller.metrics.counters["storage_writes_no_room_pages"] == 1
        # the page cut for room is no failure: not counted as one, nor barred from a later write-back
        assert stack.controller.metrics.counters.get("victim_write_failed_pages", 0) == 0
        assert c_keys[1] not in cache._victim_failed
        hit = await stack.controller._on_io(stack.storage.batch_exists_v2(a_keys + c_keys))
        assert hit.kv_hit_pages == 3
        assert stack.storage.medium.evicted_pages == 0  # the backend never had to evict
    finally:
        await stack.aclose()


def test_the_prefix_of_a_write_in_flight_is_kept_until_it_lands() -> None:
    """A write chained after stored page A is queued (room made, not landed); a second write's
    room-making must not pick A either, or the first lands as orphans no lookup reaches."""
    stored = StoredPages(4)
    stored.add(["A"], None)  # the older leaf
    stored.add(["Z"], None)
    stored.touch(["Z"])
    doomed, fit, pins = stored.room_for_write(1, "A")  # B after A: in flight
    assert doomed == [] and fit == 1
    doomed2, fit2, pins2 = stored.room_for_write(2, None)
    assert "A" not in doomed2 and doomed2 == ["Z"] and fit2 == 2
    stored.landed(fit, ["B"], "A", pins)
    assert "A" in stored and not stored.is_orphan("B") and _closed(stored)
    stored.landed(fit2, ["C", "D"], None, pins2)
    assert stored.reserved == 0 and stored._pages["A"].pins == 0


async def test_one_eviction_pass_never_orphans_its_own_write_backs() -> None:
    """One host-eviction pass writes back B (chained after A, which storage holds) and then C;
    C's room must not be made by deleting A while B is in flight."""
    from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey

    cfg = StackConfig(page_size=PS, device_pages=8, host_pages=32, storage_backend="memory", storage_pages=2,
                      placement="tiered", placement_options={"reuse_hits": 1, "long_prompt_tokens": None},
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete"))
    stack = build_stack(cfg)
    try:
        cache, stored = stack.cache, stack.cache.placement.stored
        a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
        await serve_request(stack, a, rid="a", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(PS)  # A written back
        await cache.drain()
        await serve_request(stack, a + b, rid="ab", prefetch=False)
        await serve_request(stack, c, rid="c", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(2 * PS)  # one pass: B's write-back, then C's
        await cache.drain()
        find = lambda t: cache.match_prefix(MatchPrefixParams(key=RadixKey(t)), count_hit=False).last_host_node  # noqa: E731
        ka, kb = find(a).hash_value[0], find(a + b).hash_value[0]
        assert not (kb in stored and ka not in stored)
        assert _closed(stored) and all(not stored.is_orphan(k) for k in stored._pages)
        assert all(p.pins == 0 for p in stored._pages.values())
    finally:
        await stack.aclose()


def _orphans_exact(stored: StoredPages) -> bool:
    """A page is an orphan exactly when some page on its way to the root is not stored."""
    for key in stored._pages:
        k, missing = key, False
        while (parent := stored.parent_of(k)) is not None:
            if parent not in stored:
                missing = True
                break
            k = parent
        if stored.is_orphan(key) != missing:
            return False
    return True


def test_a_parent_written_again_adopts_its_orphans() -> None:
    """The backend dropped P by itself (its bound, a corrupt page, a peer), leaving C and its
    child D orphans; P is written again: C and D are reachable again, P's children again
    (P was a childless 'leaf' that the next room-making could delete under them)."""
    stored = StoredPages(10)
    stored.add(["R", "P", "C", "D"], None)
    stored.remove(["P"])
    assert stored.is_orphan("C") and stored.is_orphan("D") and _orphans_exact(stored)
    stored.add(["P"], "R")
    assert stored.children_of("P") == {"C"} and not stored.is_orphan("C") and not stored.is_orphan("D")
    assert _closed(stored) and _orphans_exact(stored)
    doomed, fit, pins = stored.room_for_write(7, None)  # needs 1 page: the LRU leaf, never P
    assert doomed == ["D"] and fit == 7
    stored.landed(fit, [], None, pins)
    # written again below a page that is itself gone: still orphans
    stored.remove(["R"])
    stored.add(["Q"], None)
    assert stored.is_orphan("P") and stored.is_orphan("C") and _orphans_exact(stored)
    stored.remove(["C"])
    assert not stored._waiting.get("C") and _orphans_exact(stored)


def test_a_write_unpins_only_the_page_it_pinned() -> None:
    """A write's prefix was removed by the backend and written again while the write was in
    flight: the write's end took the pin of a later write on the new page (by key), whose
    prefix could then be evicted under it."""
    stored = StoredPages(3)
    stored.add(["A"], None)
    _, n1, pins1 = stored.room_for_write(1, "A")  # W1 after A, in flight
    stored.remove(["A"])  # the backend dropped it
    stored.add(["A"], None)  # written again: another entry
    _, n3, pins3 = stored.room_for_write(1, "A")  # W3 after the new A
    stored.landed(n1, [], "A", pins1)  # W1 ends
    assert stored._pages["A"].pins == 1  # still W3's
    stored.add(["X", "Y"], None)
    doomed, _, pins4 = stored.room_for_write(1, None)
    assert "A" not in doomed
    stored.landed(n3, ["B"], "A", pins3)
    assert stored._pages["A"].pins == 0


async def test_evictions_of_a_write_skipped_while_the_store_is_down_go_with_a_later_one() -> None:
    """The store goes down between a write's queueing and its turn: the job ends unwritten,
    and so do the deletions that made its room. The directory forgot those pages when it chose
    them, so they used to stay in storage unseen, past its capacity (the backend's own bound
    then evicted by itself); they go with the first write after the store is back, and the
    directory is again exactly what storage holds."""
    stack = _stack(storage_pages=16)
    try:
        prompts = _prompts(5, 150)
        assert await _serve(stack, prompts[:60]) == 0
        counters = stack.controller.metrics.counters
        assert counters["storage_deleted_pages"] > 0
        health = stack.controller.health
        submit = stack.controller.submit_storage_write
        tripped = []

        def submit_then_fail(job):  # type: ignore[no-untyped-def]
            queued = submit(job)
            if queued and job.delete_first and not tripped:
                tripped.append(list(job.delete_first))
                health.trip("test: the store went away")
            return queued

        stack.controller.submit_storage_write = submit_then_fail
        stored = stack.cache.placement.stored
        for i, tokens in enumerate(prompts[60:]):
            assert (await serve_request(stack, tokens, rid=f"d{i}")).verify_failures == 0
            await stack.controller.wait_prefetches()
            await stack.cache.drain()
            if tripped:
                break
        assert tripped and not health.up
        assert counters["storage_deletes_deferred_pages"] == len(tripped[0])
        assert set(tripped[0]) <= set(stack.cache.storage_writes.doomed)
        assert set(tripped[0]) <= set(_medium_keys(stack)) and not set(tripped[0]) & set(stored._pages)
        health.probe_passed()
        assert health.up
        # the deletions go with the next write (not sooner: until a write needs the room,
        # what the directory holds plus them is within capacity, as before the store went down)
        rest = prompts[60 + i + 1 :]
        while stack.cache.storage_writes.doomed:
            assert (await serve_request(stack, rest.pop(0), rid=f"u{len(rest)}")).verify_failures == 0
            await stack.controller.wait_prefetches()
            await stack.cache.drain()
            assert len(_medium_keys(stack)) <= stack.config.storage_pages
        assert await _serve(stack, rest) == 0  # the directory is what storage holds again
        assert stack.storage.medium.evicted_pages == 0
        assert counters["storage_delete_missed_pages"] == 0
    finally:
        await stack.aclose()


#: one job per storage worker turn (a hop of one page): the store can come back between jobs
ONE_JOB_PER_TURN = {"storage_batch_pages": 1, "storage_hop_bytes": 1}


async def _full_six_page_store(**controller):  # type: ignore[no-untyped-def]
    """A ``tiered`` stack whose storage holds six pages, five of them written and listed:
    chain ``a0``-``a3`` (its leaf ``a3`` is the next eviction) and ``c0``."""
    stack = build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=16, storage_pages=6,
        placement="tiered", placement_options={"long_prompt_tokens": 6 * PS},
        req_slots=4, max_context_len=256, controller=ControllerConfig(**controller)))
    a = [f"a{i}".ljust(8, "0") for i in range(4)]
    assert stack.cache.storage_writes.submit(_job(a, None))
    assert stack.cache.storage_writes.submit(_job(["c0000000"], None))
    await asyncio.wait_for(stack.controller._storage_q.join(), 5)
    assert set(stack.cache._stored._pages) == set(_medium_keys(stack)) == {*a, "c0000000"}
    return stack, a


def _job(keys: list[str], prior: str | None) -> StorageWriteJob:
    return StorageWriteJob(keys=list(keys), host_indices=torch.arange(len(keys) * PS), prior_key=prior,
                           on_done=lambda _: None)


async def test_a_deferred_deletion_waits_for_a_rewrite_queued_before_it() -> None:
    """A deletion deferred while the store was down names a page that a job queued behind it
    writes again: sent with the next write it would run after that write and delete the page
    the directory then holds. It waits for the write instead (then it is dropped: the page
    landed)."""
    stack, a = await _full_six_page_store(**ONE_JOB_PER_TURN)
    cache, ctl = stack.cache, stack.controller
    stored, health = cache._stored, ctl.health
    try:
        main = asyncio.get_running_loop()
        gate = threading.Event()
        orig = stack.storage.batch_set_v2

        def submit_j3() -> None:  # the tree writes something else while J2 is in flight
            assert cache.storage_writes.submit(_job(["d0000000"], None))
            gate.set()

        async def slow_set(transfers, info=None):  # type: ignore[no-untyped-def]
            if a[3] in transfers[0].keys:
                main.call_soon_threadsafe(submit_j3)
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, 5)
            return await orig(transfers, info)

        stack.storage.batch_set_v2 = slow_set
        health.trip("test: the store went away")
        j1 = _job(["b0000000", "b1000000"], None)  # room: a3 (the LRU leaf) is doomed
        assert cache.storage_writes.submit(j1) and j1.delete_first == [a[3]]
        done1 = j1.on_done

        def j1_done(n: int) -> None:  # skipped (store down); the store is back right after
            done1(n)
            health.probe_passed()

        j1.on_done = j1_done
        j2 = _job([a[3]], a[2])  # a3 written again (a host copy re-inserted), queued behind J1
        assert cache.storage_writes.submit(j2) and a[3] not in j2.delete_first
        await asyncio.wait_for(ctl._storage_q.join(), 5)
        assert gate.is_set() and health.up
        # J2 wrote a3 and the directory has it; J3 (queued after J2) deleted it: they disagree
        assert a[3] in stored
        assert set(stored._pages) == set(_medium_keys(stack)), (
            sorted(set(stored._pages) ^ set(_medium_keys(stack))))
    finally:
        await stack.aclose()


@pytest.mark.parametrize("path", ["hop", "job"])
async def test_an_interrupted_deletion_is_deferred_not_lost(path: str) -> None:
    """A deletion cut short (the store stopped answering; the call timed out and marked it
    down) was taken for sent: neither sent later nor deferred, the page stayed in storage
    unknown to the directory. It is deferred like a skipped one, whether it was sent in a hop
    or, for a job larger than a hop, on its own (``job``: a hop of one page)."""
    hop = {} if path == "hop" else ONE_JOB_PER_TURN
    stack, a = await _full_six_page_store(storage_io_timeout_s=0.3, storage_stall_s=0, **hop)
    cache, ctl = stack.cache, stack.controller
    stored = cache._stored
    try:
        async def hangs(keys):  # type: ignore[no-untyped-def]
            await asyncio.Event().wait()  # the store stopped answering

        stack.storage.batch_delete = hangs
        j1 = _job(["b0000000", "b1000000"], None)
        assert cache.storage_writes.submit(j1) and j1.delete_first == [a[3]]
        await asyncio.wait_for(ctl._storage_q.join(), 10)
        assert not ctl.health.up
        # the delete never ran: a3 is still in storage and the directory forgot it
        assert a[3] in set(_medium_keys(stack)) and a[3] not in stored
        assert a[3] in cache.storage_writes.doomed, "the deletion was lost (neither sent nor deferred)"
    finally:
        await stack.aclose()


@pytest.mark.parametrize("store_back", [True, False])
async def test_deletions_still_waiting_at_close_are_sent_or_reported(store_back: bool) -> None:
    """Deletions deferred while the store was down wait for the next write; the cache closed
    before one came and they were dropped: the pages stayed in a store that outlives the
    process, past the directory's capacity, unreported. At close they go on their own, or,
    the store still down, the close report counts them."""
    stack, a = await _full_six_page_store(**ONE_JOB_PER_TURN)
    cache, ctl = stack.cache, stack.controller
    stored = cache._stored
    closed = False
    try:
        ctl.health.trip("test: the store went away")
        j1 = _job(["b0000000", "b1000000"], None)  # room: a3 (the LRU leaf) is doomed
        assert cache.storage_writes.submit(j1) and j1.delete_first == [a[3]]
        await asyncio.wait_for(ctl._storage_q.join(), 5)
        assert cache.storage_writes.doomed == [a[3]] and a[3] in _medium_keys(stack)
        if store_back:
            ctl.health.probe_passed()
        report = await stack.aclose()
        closed = True
        if store_back:
            assert report.undeleted_storage_pages == 0
            assert set(_medium_keys(stack)) == set(stored._pages) == {*a[:3], "c0000000"}
        else:
            assert report.undeleted_storage_pages == 1
            assert a[3] in _medium_keys(stack)
    finally:
        if not closed:
            await stack.aclose()


async def test_a_close_that_times_out_on_the_deletions_reports_no_unwritten_pages() -> None:
    """The deletions sent at close wait behind a write that hangs past the close's timeout:
    their job, which writes nothing, was reported as an unwritten backup of 0 pages under an
    empty key (and logged as one); only the deletions are left, and the report counts them."""
    stack, a = await _full_six_page_store(close_timeout_s=0.3, storage_io_timeout_s=30, **ONE_JOB_PER_TURN)
    cache = stack.cache

    async def hangs(*args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()

    stack.storage.batch_set_v2 = hangs  # a write that never ends holds the worker
    assert cache.storage_writes.submit(_job(["e0000000"], None))
    await asyncio.sleep(0.05)
    cache._stored.remove([a[3]])  # a storage eviction still waiting for a write to ride with
    cache.storage_writes.doomed.append(a[3])
    report = await stack.aclose()
    assert not report.drained
    assert [(u.first_key, u.pages) for u in report.unwritten] == [("e0000000", 1)]
    assert report.undeleted_storage_pages == 1


@pytest.mark.parametrize("lost_by", ["directory", "clear"])
async def test_a_node_whose_pages_left_storage_is_written_again_before_its_children(lost_by: str) -> None:
    """A (a hot prefix) stays on device and host while its pages leave storage: the directory
    evicts them to make room for other writes, or the store is cleared. The tree still counted
    A as stored, so the write-back of its child C chained from A's missing pages and landed as
    an orphan no lookup reaches (and A was never written again). A is written again in C's
    chain now, ahead of C, and a later request for C is served from storage."""
    from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey

    stack = build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=32, storage_pages=4 if lost_by == "directory" else 64,
        placement="tiered", placement_options={"reuse_hits": 1, "long_prompt_tokens": None},
        req_slots=4, max_context_len=256,
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete")))
    cache, stored = stack.cache, stack.cache._stored

    async def serve_and_evict(tokens: list[int], rid: str) -> None:
        await serve_request(stack, tokens, rid=rid, prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)
        await cache.drain()

    try:
        a = list(range(100, 100 + 2 * PS))
        await serve_and_evict(a, "a")  # A written back
        await serve_request(stack, a, rid="a2")  # and back to device and host from storage
        await cache.drain()
        node_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(a)), count_hit=False).last_device_node
        ka = list(node_a.hash_value)
        assert node_a.storage_pages == 2 and all(k in stored for k in ka) and node_a.host_value is not None
        cache.inc_lock_ref(node_a)
        if lost_by == "directory":
            for i, other in enumerate((list(range(200, 200 + 2 * PS)), list(range(300, 300 + 2 * PS)))):
                await serve_and_evict(other, f"b{i}")  # storage holds 4 pages: A's make room
        else:
            await stack.controller._on_io(stack.storage.clear())
            await asyncio.sleep(0.05)  # the clear report reaches the cache's loop
        assert not any(k in stored for k in ka) and not set(ka) & set(_medium_keys(stack))
        c = a + list(range(400, 400 + PS))
        await serve_and_evict(c, "c")  # C's write-back writes A first, in the same job
        kc = cache.match_prefix(MatchPrefixParams(key=RadixKey(c)), count_hit=False).last_device_node.hash_value
        assert set(ka) <= set(_medium_keys(stack)) and all(k in stored for k in ka)
        assert not any(stored.is_orphan(k) for k in stored._pages) and _closed(stored)
        assert node_a.storage_pages == 2 and stack.controller.metrics.counters["storage_pages_lost"] == 2
        cache.dec_lock_ref(node_a)
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)
        await cache.drain()
        out = await serve_request(stack, c, rid="c2")
        assert (out.storage_hit, out.verify_failures) == (len(c), 0), (out, kc)
    finally:
        await stack.aclose()


@pytest.mark.parametrize("then", ["host_eviction", "shedding"])
async def test_a_node_whose_pages_left_storage_is_not_taken_as_storage_backed(then: str) -> None:
    """P was written back and is on device and host; the directory then evicts P's pages for
    Q's write. The tree still counted P as stored: shedding dropped P's host copy as redundant
    (its only copy below the device), and host eviction took P first, as storage-backed, and
    dropped it unwritten. P keeps its host copy now; host takes Q, which storage does hold,
    and writes P back when P's turn comes."""
    from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey

    stack = build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=32, storage_pages=2,
        placement="tiered", placement_options={"reuse_hits": 1, "long_prompt_tokens": None},
        req_slots=4, max_context_len=256,
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete")))
    cache, stored = stack.cache, stack.cache._stored
    find = lambda t: cache.match_prefix(MatchPrefixParams(key=RadixKey(t)), count_hit=False).last_host_node  # noqa: E731
    try:
        p, q = list(range(100, 100 + 2 * PS)), list(range(500, 500 + 2 * PS))
        await serve_request(stack, p, rid="p", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(1)  # P written back; it stays on host, storage-backed
        await cache.drain()
        node_p = find(p)
        kp = list(node_p.hash_value)
        assert node_p.host_value is not None and node_p.on_storage and set(kp) <= set(_medium_keys(stack))
        await serve_request(stack, p, rid="p2", prefetch=False)  # P on device too, kept there
        await cache.drain()
        cache.inc_lock_ref(node_p)
        await serve_request(stack, q, rid="q", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(1)  # Q written back: storage holds 2 pages, P's make the room
        await cache.drain()
        node_q = find(q)
        assert node_q.on_storage and not set(kp) & set(_medium_keys(stack))
        cache.dec_lock_ref(node_p)  # P on device, host and (it believed) storage: listed to shed
        if then == "shedding":
            cache._shed_host_copies(10**6)
            assert node_p.host_value is not None, "P's only copy below the device was shed as redundant"
            assert node_p.storage_pages == 0
            return
        cache.evict(EvictParams(num_tokens=10**6))  # P host-only again, older than Q
        assert cache.evict_host(2 * PS) == 2 * PS
        assert node_p.host_value is not None and node_q.host_value is None  # Q went, storage has it
        cache.evict_host(10**6)  # P's turn: written back, not dropped
        await cache.drain()
        assert set(kp) <= set(_medium_keys(stack)) and node_p.on_storage
        assert set(stored._pages) == set(_medium_keys(stack))
    finally:
        await stack.aclose()


def test_reachable_counts_the_leading_pages_a_lookup_can_reach() -> None:
    stored = StoredPages(10)
    stored.add(["R", "P", "C"], None)
    assert stored.reachable(["R", "P", "C"], 3) == 3 and stored.reachable(["R", "P", "C"], 2) == 2
    assert stored.reachable(["R", "P", "C"], 9) == 3 and stored.reachable([], 2) == 0
    stored.remove(["P"])  # C stays stored, but as an orphan no prefix lookup reaches
    assert stored.reachable(["R", "P", "C"], 3) == 1 and stored.reachable(["C"], 1) == 0


async def test_pages_a_prefetch_found_in_storage_are_not_counted_lost_nor_written_again() -> None:
    """A restarted server (or a peer) on the same store: its directory lists only its own
    writes, so the pages a prefetch found there were taken for lost at the next host eviction
    (``storage_pages_lost``), and a child's write-back wrote the parent's pages again. They
    count as held: only pages known deleted or removed lower a node's count."""
    from hicache.prefix_cache import EvictParams

    def config() -> StackConfig:
        return StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_pages=64, placement="tiered",
                           placement_options={"reuse_hits": 1, "long_prompt_tokens": None}, req_slots=4,
                           max_context_len=256, storage_backend="memory", storage_options={"store_id": "restored"},
                           controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete"))

    async def evict_all(stack) -> None:  # type: ignore[no-untyped-def]
        await stack.cache.drain()
        stack.cache.evict(EvictParams(num_tokens=10**6))
        stack.cache.evict_host(10**6)
        await stack.cache.drain()

    first = build_stack(config())
    second = build_stack(config())
    try:
        p = list(range(100, 100 + 3 * PS))
        await serve_request(first, p, rid="p", prefetch=False)
        await evict_all(first)  # P's three pages written back
        assert (await serve_request(second, p, rid="p2")).storage_hit == 3 * PS
        c = p + list(range(400, 400 + PS))
        await serve_request(second, c, rid="c1", prefetch=False)
        await serve_request(second, c, rid="c2", prefetch=False)  # C proved reuse: admitted
        await evict_all(second)
        counters = second.controller.metrics.counters
        assert counters.get("storage_pages_lost", 0) == 0
        assert counters.get("victim_write_pages", 0) == 1  # C alone, chained from P's pages
        out = await serve_request(first, c, rid="c3")  # C's page chains from P's in storage
        assert out.computed == 0 and out.storage_hit >= PS and out.verify_failures == 0
    finally:
        await second.aclose()
        await first.aclose()


async def test_a_drain_waits_for_the_write_back_that_room_for_a_deferred_backup_started() -> None:
    """A backup deferred for host room (the only host-only leaf, A, was locked) is retried by
    the drain once A is free: host eviction then writes A back (tiered) and the backup waits
    for that write. The drain returned with the write still queued and the backup not started:
    storage and the directory disagreed after it (a replay's next request ran beside the
    write), against "wait for every queued copy and the deferred backups they let start"."""
    from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey

    stack = build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=4, storage_backend="memory", storage_pages=16,
        placement="tiered", placement_options={"reuse_hits": 1, "long_prompt_tokens": None},
        controller=ControllerConfig(prefetch_threshold=PS)))
    try:
        cache = stack.cache
        find = lambda t: cache.match_prefix(MatchPrefixParams(key=RadixKey(t)), count_hit=False)  # noqa: E731
        a, b = list(range(100, 100 + 2 * PS)), list(range(200, 200 + 4 * PS))
        await serve_request(stack, a, rid="a", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        node_a = find(a).last_host_node
        assert node_a.value is None and node_a.host_value is not None and not node_a.storage_pages
        cache.inc_lock_ref(node_a)  # read by a request: not evictable from host
        await serve_request(stack, b, rid="b", prefetch=False)
        await cache.drain()
        node_b = find(b).last_device_node
        assert node_b.host_value is None  # deferred: host is A's and B's room is not there
        cache.dec_lock_ref(node_a)
        await cache.drain()
        assert stack.controller.storage_writes_pending == 0
        assert node_a.host_value is None and node_b.host_value is not None  # A written back, B backed up
        assert set(cache.placement.stored._pages) == set(_medium_keys(stack)) == set(node_a.hash_value)
        cache.sanity_check()
    finally:
        await stack.aclose()
