"""Placement policies: each one's invariants on the real stack, and its admission rules.

Every test drives a real :func:`~hicache.stack.build_stack` (torch pools, copy engine, memory
backend) with random prompts over shared prefixes, and checks after every request that the tree
is consistent, that device residency is closed upwards (a parent is never evicted before its
children), that a locked prefix keeps its KV, and that no tier holds more than its capacity.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from hicache.controller import ControllerConfig
from hicache.errors import ConfigError
from hicache.placement import (
    PLACEMENT_POLICIES,
    GhostList,
    LruPlacement,
    TieredPlacement,
    make_placement,
)
from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey
from hicache.replay import serve_request
from hicache.stack import StackConfig, build_stack

PS = 4
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _stack(policy: str, controller: ControllerConfig | None = None, **options):  # type: ignore[no-untyped-def]
    return build_stack(StackConfig(page_size=PS, device_pages=16, host_pages=24, storage_pages=48,
                                   placement=policy, placement_options=options, req_slots=4, max_context_len=256,
                                   controller=controller or ControllerConfig()))


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(PS * rng.randint(1, 4))] for _ in range(4)]
    out = []
    for _ in range(n):
        p = list(rng.choice(prefixes))
        p += [rng.randrange(1000) for _ in range(rng.randint(1, PS * 6))]
        out.append(p)
    return out


def _check_tiers(stack) -> None:  # type: ignore[no-untyped-def]
    cache = stack.cache
    cache.sanity_check()
    for node in cache._nodes():
        if node.value is None:  # not on device: no child may be (parents go last)
            assert all(c.value is None for c in node.children.values()), node
    assert cache.total_size() <= stack.config.device_pages * PS
    assert cache.host_size() <= stack.config.host_pages * PS
    stats = stack.storage.get_stats()
    assert stats.get("stored_bytes", 0) <= stack.config.storage_pages * stack.config.page_nbytes


async def _serve_checked(stack, prompts: list[list[int]]) -> int:  # type: ignore[no-untyped-def]
    """Serve ``prompts`` one by one, letting every copy land and checking the tiers after each;
    returns the tokens whose reused KV failed verification."""
    failures = 0
    for i, tokens in enumerate(prompts):
        failures += (await serve_request(stack, tokens, rid=f"r{i}")).verify_failures
        await stack.controller.wait_prefetches()
        await stack.cache.drain()
        _check_tiers(stack)
    return failures


@pytest.mark.parametrize("policy", sorted(PLACEMENT_POLICIES))
async def test_invariants_hold_under_pressure(policy: str) -> None:
    stack = _stack(policy)
    try:
        assert await _serve_checked(stack, _prompts(7, 120)) == 0
        assert stack.controller.metrics.counters["worker_errors"] == 0
    finally:
        await stack.aclose()


@pytest.mark.parametrize("policy", sorted(PLACEMENT_POLICIES))
async def test_a_locked_prefix_is_never_evicted(policy: str) -> None:
    stack = _stack(policy)
    try:
        cache = stack.cache
        keep = list(range(5000, 5000 + 3 * PS))
        await serve_request(stack, keep, rid="keep")
        await cache.drain()
        from hicache.prefix_cache import MatchPrefixParams, RadixKey

        node = cache.match_prefix(MatchPrefixParams(key=RadixKey(keep))).last_device_node
        cache.inc_lock_ref(node)
        for i, tokens in enumerate(_prompts(3, 60)):
            await serve_request(stack, tokens, rid=f"r{i}")
            await cache.drain()
            cache.evict(EvictParams(num_tokens=10**6))
            cache.evict_host(10**6)
            n = node
            while n is not cache.root_node:
                assert n.value is not None and n.parent is not None, n  # still on device, still in the tree
                n = n.parent
        cache.dec_lock_ref(node)
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_reuse_writes_to_storage_only_what_was_reused() -> None:
    stack = _stack("reuse")
    try:
        once = list(range(100, 100 + 4 * PS))
        await serve_request(stack, once, rid="a")
        await stack.cache.drain()
        assert stack.controller.metrics.bytes["h2s"] == 0  # seen once: host only
        await serve_request(stack, once, rid="b")  # a hit on host: reuse proven
        await stack.cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 4
    finally:
        await stack.aclose()


async def test_a_ghost_hit_admits_the_recomputed_pages() -> None:
    stack = _stack("reuse")
    try:
        cache = stack.cache
        first = list(range(100, 100 + 3 * PS))
        await serve_request(stack, first, rid="a")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)  # dropped unwritten: its keys go to the ghost list
        assert len(cache.placement.ghost) == 3 and stack.controller.metrics.bytes["h2s"] == 0
        out = await serve_request(stack, first, rid="b")  # recomputed ...
        assert out.computed == len(first)
        await cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 3  # ... and written, since it came back
        assert cache.placement.ghost.hits == 3
    finally:
        await stack.aclose()


async def test_host_pages_dropped_with_their_device_parent_go_to_the_ghost_list() -> None:
    """A device parent without a host copy (shed: device and storage hold it) is evicted with
    its host-only child: the child's unwritten pages leave host as in evict_host, so the ghost
    list remembers them (the bulk drop used to forget them)."""
    from hicache.prefix_cache import MatchPrefixParams, RadixKey

    stack = _stack("reuse")
    try:
        cache = stack.cache
        a = list(range(100, 100 + 2 * PS))
        b = a + list(range(500, 500 + 3 * PS))
        await serve_request(stack, a, rid="a1")
        await serve_request(stack, a, rid="a2")  # a reused: written to storage
        await serve_request(stack, b, rid="b")  # b's tail seen once: host only
        await cache.drain()
        child = cache.match_prefix(MatchPrefixParams(key=RadixKey(b)), count_hit=False).last_host_node
        parent = child.parent
        assert parent.on_storage and child.storage_pages == 0
        cache.evict(EvictParams(num_tokens=3 * PS))  # the tail leaves device, stays on host
        assert child.value is None and child.host_value is not None
        assert cache._shed_host_copies(10**6) == 2 * PS and parent.host_value is None
        assert cache.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted == 2 * PS
        assert cache.host_size() == 0 and len(cache.placement.ghost) == 3
        out = await serve_request(stack, b, rid="again")  # the tail comes back: a ghost hit
        assert out.verify_failures == 0 and cache.placement.ghost.hits == 3
    finally:
        await stack.aclose()


async def test_tiered_admits_the_body_of_a_long_prompt_but_not_its_tail() -> None:
    stack = _stack("tiered", long_prompt_tokens=8 * PS, tail_tokens=2 * PS)
    try:
        cache = stack.cache
        await serve_request(stack, list(range(10 * PS)), rid="long")
        await serve_request(stack, list(range(20000, 20000 + 3 * PS)), rid="short")
        await cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 0  # written when host drops it, not before
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)
        await cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 8  # 10 pages, the last 2 held back
        cache.evict_host(10**6)  # now storage holds the body: host drops it, the tail goes to the ghost list
        assert cache.host_size() == 0 and len(cache.placement.ghost) == 2 + 3
    finally:
        await stack.aclose()


def _stored_keys(stack) -> set[str]:  # type: ignore[no-untyped-def]
    digest = stack.storage.namespace.digest
    return {k for (d, k, _), _ in stack.storage.medium.pages.items() if d == digest}


async def test_tiered_writes_at_host_eviction_with_its_ancestors_first() -> None:
    """A reused leaf whose parent storage lacks: host eviction writes parent and leaf in one job
    (parent first), keeps both on host until the write lands, then drops them first; a later
    request finds the whole chain in storage and every page verifies."""
    stack = _stack("tiered", ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete"),
                   long_prompt_tokens=None)
    try:
        cache, counters = stack.cache, stack.controller.metrics.counters
        prefix = list(range(100, 100 + 3 * PS))
        x, y = prefix + list(range(500, 500 + 2 * PS)), prefix + list(range(700, 700 + 2 * PS))
        for i, tokens in enumerate((x, y, y)):  # prefix reused, y reused, x seen once
            await serve_request(stack, tokens, rid=f"a{i}")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        assert stack.controller.metrics.pages["h2s"] == 0
        assert cache.evict_host(10**6) == 2 * PS  # x dropped; y and its parent wait for storage
        assert counters["victim_write_pages"] == 5 and cache.host_size() == 5 * PS
        await cache.drain()
        from hicache.prefix_cache import MatchPrefixParams, RadixKey

        chain = cache.match_prefix(MatchPrefixParams(key=RadixKey(y))).last_host_node
        keys = chain.parent.hash_value + chain.hash_value
        assert _stored_keys(stack) == set(keys)
        assert chain.on_storage and chain.parent.on_storage
        assert cache.evict_host(10**6) == 5 * PS  # storage holds them: host lets them go
        out = await serve_request(stack, y, rid="back")
        assert (out.storage_hit, out.verify_failures) == (5 * PS, 0)
        out = await serve_request(stack, x, rid="x")  # x's tail was dropped, its prefix is stored
        assert out.computed == 2 * PS
        assert counters["victim_writes_skipped_pages"] == 0
    finally:
        await stack.aclose()


async def test_tiered_write_back_is_bounded_and_counted() -> None:
    """Past ``victim_write_limit`` pages in flight, host drops an admitted page as before,
    remembers it as a ghost and counts it."""
    stack = _stack("tiered", long_prompt_tokens=None)
    try:
        cache, counters = stack.cache, stack.controller.metrics.counters
        for base in (100, 200):
            tokens = list(range(base, base + 3 * PS))
            await serve_request(stack, tokens, rid=f"a{base}")
            await serve_request(stack, tokens, rid=f"b{base}")  # reused: admitted
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.victim_write_limit = 2  # one job may always start, even past the limit
        assert cache.evict_host(10**6) == 3 * PS  # the older written, the newer dropped
        assert counters["victim_write_pages"] == 3 and counters["victim_writes_skipped_pages"] == 3
        assert len(cache.placement.ghost) == 3
        await cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 3
    finally:
        await stack.aclose()


async def test_tiered_host_evicts_pages_storage_holds_first() -> None:
    stack = _stack("tiered", long_prompt_tokens=None)
    try:
        cache = stack.cache
        stored = list(range(300, 300 + 2 * PS))
        await serve_request(stack, stored, rid="s1")
        await serve_request(stack, stored, rid="s2")  # hit: admitted
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)  # written to storage at host eviction ...
        await cache.drain()  # ... and still on host once written
        private = list(range(900, 900 + 2 * PS))
        await serve_request(stack, private, rid="p")  # only on host
        await serve_request(stack, stored, rid="s3")  # newer than private, and in storage
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        assert cache.evict_host(2 * PS) == 2 * PS
        from hicache.prefix_cache import MatchPrefixParams, RadixKey

        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(private))).host_hit_length == 2 * PS
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(stored))).host_hit_length == 0
    finally:
        await stack.aclose()


def test_lru_admits_everything_and_orders_by_recency() -> None:
    from hicache.prefix_cache import TreeNode

    node = TreeNode()
    node.hash_value = ["a", "b", "c"]
    node.last_access_time = 5
    assert LruPlacement().storage_pages(node) == 3 and LruPlacement().host_key(node) == (5,)
    tiered = TieredPlacement()
    assert tiered.storage_pages(node) == 0  # inserted once, never hit


def test_ghost_list_is_bounded() -> None:
    g = GhostList(3)
    g.add(["a", "b", "c", "d"])
    assert len(g) == 3 and "a" not in g and g.take("d") and not g.take("d") and g.hits == 1
    GhostList(0).add(["x"])
    with pytest.raises(ValueError):
        GhostList(-1)


def test_bad_policy_names_and_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="allowed"):
        make_placement("arc")
    with pytest.raises(ConfigError, match="ghost_pagez"):
        make_placement("tiered", {"ghost_pagez": 1})
    with pytest.raises(ConfigError, match="reuse_hits"):
        make_placement("reuse", {"reuse_hits": 0})
    assert make_placement("lru", defaults={"ghost_pages": 5}).name == "lru"  # defaults only where taken
    assert make_placement("tiered", defaults={"ghost_pages": 5}).ghost.capacity == 5
    from hicache.config import load_config

    with pytest.raises(ConfigError, match="placement"):
        load_config(CONFIGS / "default.toml", environ={"HICACHE__CACHE__PLACEMENT": "arc"})
    assert load_config(CONFIGS / "default.toml", environ={"HICACHE__CACHE__PLACEMENT": "tiered"}).cache.placement == "tiered"


@pytest.mark.parametrize("policy", ["reuse", "tiered"])
async def test_failing_storage_writes_leave_the_tree_consistent(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every storage write fails: admitted pages are never marked stored, hosts still evict, no
    worker dies, and every page served still verifies."""
    early = {"long_prompt_tokens": 6 * PS} if policy == "tiered" else {}
    stack = _stack(policy, ControllerConfig(storage_max_retries=0), **early)

    async def refuse(pages, buffers, parents):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(stack.storage, "_write", refuse)
    try:
        assert await _serve_checked(stack, _prompts(11, 60)) == 0
        assert all(n.storage_pages == 0 for n in stack.cache._nodes() if n.storage_op is None)
        assert stack.controller.metrics.counters["worker_errors"] == 0
        assert stack.controller.metrics.counters["storage_write_failures"] > 0
        if policy == "tiered":  # failed write-backs are counted and not retried at every eviction
            assert stack.controller.metrics.counters["victim_write_failed_pages"] > 0
    finally:
        await stack.aclose()


def test_write_back_bound_leaves_room_the_device_copies_do_not_take() -> None:
    """The default bound is a quarter of the host pages device copies cannot take, at least 1,
    and the stack's tree uses it (a small host next to a large device must keep prefetch room)."""
    from hicache.placement import default_victim_write_limit

    assert default_victim_write_limit(2196, 439) == (2196 - 439) // 4
    assert default_victim_write_limit(136, 64) == 18
    assert default_victim_write_limit(16, 64) == 1  # device larger than host: still one job
    assert default_victim_write_limit(0, 0) == 1
    stack = _stack("tiered")
    assert stack.cache.victim_write_limit == default_victim_write_limit(24, 16)


async def test_a_chunked_prefill_is_not_reuse_of_its_own_chunks() -> None:
    """One request prefilled in chunks inserts its earlier chunks again with every later one:
    those nodes are its own, not reused (SGLang's ``inserted_len``). They were counted as hits,
    so ``reuse`` wrote a page nobody else ever asked for to storage (and ``slru`` protected it,
    ``write_through_selective`` backed it up)."""
    import torch

    from hicache.prefix_cache import MatchPrefixParams, RadixKey, Req
    from hicache.replay import write_synthetic_kv

    stack = _stack("reuse", ControllerConfig(prefetch_threshold=PS))
    cache = stack.cache
    try:
        tokens = list(range(1000, 1000 + 4 * PS))
        req = Req(rid="only", origin_input_ids=tokens, fill_ids=tokens)
        cache.match_req(req)
        cache.start_prefetch(req)
        req.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
        await cache.admit(req)
        row = stack.req_to_token_pool.req_to_token[req.req_pool_idx]
        dev = stack.allocator.alloc(4 * PS)
        row[: 4 * PS] = dev
        write_synthetic_kv(stack.device_pool, dev, torch.tensor(tokens))
        req.kv_allocated_len = 4 * PS
        for end in (PS, 2 * PS, 3 * PS):  # three chunks, then the rest as the request finishes
            req.fill_ids, req.kv_committed_len = tokens[:end], end
            cache.cache_unfinished_req(req, chunked=True)
        req.fill_ids, req.kv_committed_len = tokens, 4 * PS
        cache.release_req(req)
        await cache.drain()
        for end in (PS, 2 * PS, 3 * PS, 4 * PS):
            node = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:end])), count_hit=False).last_device_node
            assert node.hit_count == 1, (end, node.hit_count)
        assert stack.controller.metrics.pages["h2s"] == 0  # seen by one request: host only
        await serve_request(stack, tokens, rid="again")  # a second request: reuse, admitted
        await stack.cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 4
    finally:
        await stack.aclose()


async def test_a_write_back_that_failed_at_an_ancestor_is_not_retried_through_a_sibling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """y's write-back (its unwritten parent first) fails at the parent's first page; the next
    host eviction picks y's sibling z, whose chain starts with the same parent: it is dropped
    as failed, not written (and failed) again at every eviction."""
    stack = _stack("tiered", ControllerConfig(prefetch_threshold=PS, storage_max_retries=0), long_prompt_tokens=None)
    calls = 0

    async def refuse(pages, buffers, parents):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        raise OSError("disk full")

    monkeypatch.setattr(stack.storage, "_write", refuse)
    try:
        cache, counters = stack.cache, stack.controller.metrics.counters
        prefix = list(range(100, 100 + 3 * PS))
        y, z = prefix + list(range(500, 500 + 2 * PS)), prefix + list(range(700, 700 + 2 * PS))
        for i, tokens in enumerate((y, y, z, z)):  # all reused: all admitted
            await serve_request(stack, tokens, rid=f"r{i}")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(PS)  # y (the older leaf): its chain's write-back, which fails
        await cache.drain()
        assert counters["victim_write_failed_pages"] > 0
        before = calls
        cache.evict_host(10**6)  # z, then the rest: nothing written again
        await cache.drain()
        assert calls == before
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_a_write_back_the_store_was_down_for_is_written_once_it_is_back() -> None:
    """The store goes down while a write-back is queued: the job ends unwritten (skipped, not
    refused). It was remembered as a failed write-back, so once the store was back every later
    eviction of the same pages dropped them unwritten, for good. Only a refusal is remembered
    now: the pages are host leaves again, and the next eviction with the store up writes them."""
    stack = _stack("tiered", ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete"),
                   reuse_hits=1, long_prompt_tokens=None)
    cache, ctl = stack.cache, stack.controller
    counters = ctl.metrics.counters
    submit = ctl.submit_storage_write

    def submit_then_outage(job):  # type: ignore[no-untyped-def]
        queued = submit(job)
        ctl.health.trip("test: a brief outage while the write-back is queued")
        ctl.submit_storage_write = submit
        return queued

    try:
        doc = list(range(100, 100 + 3 * PS))
        await serve_request(stack, doc, rid="a", prefetch=False)
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        ctl.submit_storage_write = submit_then_outage
        cache.evict_host(10**6)  # queued, then the store goes down before its turn
        await cache.drain()
        assert counters["storage_write_skipped_unhealthy"] == 3 and ctl.metrics.pages["h2s"] == 0
        assert counters["victim_write_failed_pages"] == 0 and len(cache._victim_failed) == 0
        assert cache.host_size() == 3 * PS  # still on host, a leaf host may take again
        ctl.health.probe_passed()
        assert ctl.health.up
        cache.evict_host(10**6)  # the store is back: written back now
        await cache.drain()
        assert ctl.metrics.pages["h2s"] == 3 and set(_stored_keys(stack)) == set(
            cache.match_prefix(MatchPrefixParams(key=RadixKey(doc)), count_hit=False).last_host_node.hash_value)
        cache.evict_host(10**6)
        out = await serve_request(stack, doc, rid="back")
        assert (out.storage_hit, out.verify_failures) == (len(doc), 0)
    finally:
        await stack.aclose()


@pytest.mark.parametrize("ghost_pages", [0, 8])
async def test_early_admission_does_not_depend_on_the_ghost_list(ghost_pages: int) -> None:
    """The keys of a long prompt's body were kept in a set bounded by ``ghost_pages``: a ghost
    list of 0 pages ("none") or shorter than the body admitted none of it, while
    ``early_admitted_pages`` still counted the whole body. The body is written at host
    eviction whatever the ghost list's size."""
    stack = _stack("tiered", long_prompt_tokens=8 * PS, tail_tokens=PS, ghost_pages=ghost_pages)
    try:
        cache = stack.cache
        await serve_request(stack, list(range(1000, 1000 + 12 * PS)), rid="long")  # seen once
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)
        await cache.drain()
        assert stack.controller.metrics.pages["h2s"] == 11  # 12 pages, the last one held back
        assert cache.placement.stats()["early_admitted_pages"] == 11
        assert cache.placement.ghost.capacity == ghost_pages
    finally:
        await stack.aclose()


def test_early_admission_counts_only_the_keys_it_keeps() -> None:
    """A body longer than the early-admission bound: its first pages are kept (admission is a
    leading run; adding the whole body kept its last pages, so none was admitted) and only
    they are counted as admitted."""
    from hicache.prefix_cache import TreeNode
    from hicache.prefix_cache.tokens import pack_tokens

    policy = TieredPlacement(ghost_pages=0, long_prompt_tokens=8 * PS, tail_tokens=PS)
    body = (1 << 16) + 100  # past the bound (the ghost list's is 0 here, and does not matter)
    node = TreeNode(parent=TreeNode(), key=pack_tokens(list(range((body + 1) * PS))))
    node.hash_value = [f"k{i:06d}" for i in range(body + 1)]
    policy.on_new_node(node)
    kept = policy.admitted_pages(node)
    assert 0 < kept < body and policy.stats()["early_admitted_pages"] == kept
    assert policy.victim_pages(node) == kept and policy.storage_pages(node) == 0


@pytest.mark.parametrize(("policy", "in_flight"), [("lru", "backup"), ("lru", "storage write"),
                                                   ("tiered", "write-back")])
async def test_a_reset_with_a_copy_in_flight_gives_back_its_host_pages(policy: str, in_flight: str) -> None:
    """reset() leaves the host pages of nodes a copy still reads or writes (a device->host
    backup, a write-through to storage, a write-back at host eviction) to that copy; its
    completion found the tree gone and returned, so nobody freed them: host lost them for good.
    The completion frees them now, once, and no page the new tree holds."""
    options = {"reuse_hits": 1, "long_prompt_tokens": None} if policy == "tiered" else {}
    stack = _stack(policy, **options)
    cache, host = stack.cache, stack.host_pool
    try:
        full = host.available_size()
        await serve_request(stack, list(range(100, 100 + 4 * PS)), rid="a", prefetch=False)
        if in_flight == "backup":
            await asyncio.sleep(0)  # the insert's backups start on the loop's next turn
            assert any(n.backup_op is not None and n.host_value is not None for n in cache._nodes())
        else:
            await cache.drain_backups()  # on host; its storage write (lru) still queued
            cache.evict(EvictParams(num_tokens=10**6))
            if policy == "tiered":
                cache.evict_host(10**6)  # queues the write-back, which keeps the pages on host
            assert stack.controller.storage_writes_pending
        old = list(cache._nodes())
        assert any(n.host_value is not None for n in old)
        cache.reset()
        await serve_request(stack, list(range(900, 900 + 3 * PS)), rid="b", prefetch=False)  # the new tree's
        await cache.drain()
        await stack.controller.drain()
        assert all(n.host_value is None for n in old)
        assert host.available_size() == full - cache.host_size() and cache.host_size() == 3 * PS
        cache.sanity_check()
    finally:
        await stack.aclose()
