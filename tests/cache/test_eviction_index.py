"""The incremental eviction index: the same victims, in the same order, as a walk of the whole tree
would pick, while random work changes the tree; and no candidate is ever left out."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hicache.controller import ControllerConfig
from hicache.memory import PagedTokenAllocator, ReqToTokenPool
from hicache.prefix_cache import EvictParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey
from hicache.prefix_cache.eviction_index import EvictionIndex
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.policy import EVICTION_POLICIES
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.testing import inject_load_faults

PS = 4


def _node(t: int) -> TreeNode:
    n = TreeNode()
    n.last_access_time = t
    return n


def test_pops_in_key_order_and_requeues_nodes_used_since() -> None:
    alive: set[TreeNode] = set()
    index = EvictionIndex(lambda n: n in alive, lambda n: (n.last_access_time,))
    a, b, c = _node(3), _node(1), _node(2)
    alive |= {a, b, c}
    for n in (a, b, c):
        index.note(n)
    index.note(a)  # noting twice queues once
    assert len(index) == 3
    b.last_access_time = 9  # used after it was queued: goes last
    assert [index.pop(), index.pop(), index.pop(), index.pop()] == [c, a, b, None]


def test_nodes_that_stop_being_candidates_are_dropped_until_noted_again() -> None:
    alive: set[TreeNode] = set()
    index = EvictionIndex(lambda n: n in alive, lambda n: (n.last_access_time,))
    a, b = _node(1), _node(2)
    alive |= {a, b}
    index.note(a)
    index.note(b)
    alive.discard(a)  # locked, say
    assert index.pop() is b
    alive.discard(b)  # evicted
    assert index.pop() is None and a not in index
    alive.add(a)
    assert index.missing([a, b]) == [a]  # nobody noted it yet
    index.note(a)
    assert index.pop() is a
    index.note(b)
    index.discard(b)
    assert index.pop() is None


def test_compaction_and_rebuild_keep_exactly_the_candidates() -> None:
    nodes = [_node(i) for i in range(500)]
    alive = set(nodes)
    index = EvictionIndex(lambda n: n in alive, lambda n: (n.last_access_time,))
    for n in nodes:
        index.note(n)
    for n in nodes[:400]:  # many dead entries: the heap compacts on later pushes
        index.discard(n)
        alive.discard(n)
    for n in nodes[:50]:
        alive.add(n)
        index.note(n)
    assert len(index._heap) <= 2 * len(index) + 64
    got = [index.pop() for _ in range(150)]
    assert got == nodes[:50] + nodes[400:] and index.pop() is None
    assert index.rebuild(nodes) == 150 and index.rebuilds == 1  # popped, but still candidates
    alive.clear()
    alive.add(nodes[7])
    assert index.rebuild(nodes) == 1 and index.pop() is nodes[7] and index.pop() is None


def _full_scan_victim(cache: RadixCache) -> TreeNode | None:
    leaves = [n for n in cache._nodes() if cache._is_device_leaf(n)]
    return min(leaves, key=lambda n: (cache._evict_key(n), n.id), default=None)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_radix_evicts_what_a_full_scan_would(policy: str) -> None:
    """Random inserts (shared prefixes, so splits), matches (touches), locks and evictions: each
    eviction of one page takes exactly the leaf a walk of the whole tree would take first."""
    rng = random.Random(policy)
    alloc = PagedTokenAllocator(64 * PS, PS)
    cache = RadixCache(req_to_token_pool=ReqToTokenPool(4, 512), token_to_kv_pool_allocator=alloc,
                       page_size=PS, eviction_policy=policy)
    prefixes = [[rng.randrange(1000) for _ in range(PS * rng.randint(1, 3))] for _ in range(6)]
    locked: list[TreeNode] = []
    evictions = 0
    for step in range(600):
        op = rng.random()
        if op < 0.45:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(PS * rng.randint(0, 3))]
            n = len(tokens)
            if alloc.available_size() < n:
                cache.evict(EvictParams(num_tokens=n))
            value = alloc.alloc(n)
            if value is None:
                continue
            res = cache.insert(InsertParams(key=RadixKey(tokens), value=value, priority=rng.randrange(3)))
            if res.prefix_len:
                alloc.free(value[: res.prefix_len])
        elif op < 0.65:
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(rng.choice(prefixes) + [1, 2, 3, 4])))
            if rng.random() < 0.3 and m.last_device_node is not cache.root_node:
                cache.inc_lock_ref(m.last_device_node)
                locked.append(m.last_device_node)
        elif op < 0.8 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            want = _full_scan_victim(cache)
            got = cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted
            if want is None:
                assert got == 0
            else:
                assert got == len(want.key) and want.value is None, (step, want)
                evictions += 1
        cache.sanity_check()
    assert evictions > 50 and cache.eviction_index_repairs == 0


def _host_victim(cache) -> TreeNode | None:  # type: ignore[no-untyped-def]
    nodes = [n for n in cache._nodes() if cache._host_evictable(n)]
    return min(nodes, key=lambda n: (n.last_access_time, n.id), default=None)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_hierarchy_keeps_both_indexes_complete(write_policy: str) -> None:
    """Requests through the real stack (backups, load-backs, device and host eviction under
    pressure): after every step no device or host candidate is missing from its index, and
    host eviction takes the least recently used host-only leaf."""
    rng = random.Random(write_policy)
    cfg = StackConfig(page_size=PS, device_pages=12, host_pages=24, storage_backend=None,
                      controller=ControllerConfig(write_policy=write_policy))  # type: ignore[arg-type]
    stack = build_stack(dataclasses.replace(cfg))
    cache = stack.cache
    prefixes = [[rng.randrange(5000) for _ in range(PS * rng.randint(1, 2))] for _ in range(5)]
    host_evictions = 0
    for i in range(120):
        tokens = rng.choice(prefixes) + [rng.randrange(5000) for _ in range(PS * rng.randint(0, 2))]
        out = await serve_request(stack, tokens, rid=str(i))
        assert out.verify_failures == 0
        if rng.random() < 0.5:
            await cache.drain()
        if rng.random() < 0.3:
            cache.evict(EvictParams(num_tokens=PS * rng.randint(1, 6)))
        if rng.random() < 0.3:
            want = _host_victim(cache)
            freed = cache.evict_host(1)
            if want is not None:
                assert freed == len(want.key) and want.parent is None and want.host_value is None
                host_evictions += 1
        cache.sanity_check()
    assert host_evictions > 5 and cache.eviction_index_repairs == 0
    await stack.aclose()


def test_a_missed_note_is_repaired_and_counted() -> None:
    """If some change ever forgets to note a candidate, an eviction that finds the index empty
    while evictable tokens remain rebuilds it from the tree (and counts it), instead of failing
    to free memory."""
    alloc = PagedTokenAllocator(16 * PS, PS)
    cache = RadixCache(req_to_token_pool=ReqToTokenPool(4, 64), token_to_kv_pool_allocator=alloc, page_size=PS)
    value = alloc.alloc(2 * PS)
    cache.insert(InsertParams(key=RadixKey(list(range(2 * PS))), value=value))
    cache._device_index.discard(next(iter(cache.root_node.children.values())))  # simulate the bug
    with pytest.raises(AssertionError, match="never noted"):
        cache.sanity_check()
    assert cache.evict(EvictParams(num_tokens=PS)).num_tokens_evicted == 2 * PS
    assert cache.eviction_index_repairs == 1
    cache.sanity_check()


@pytest.mark.timeout(30)
async def test_a_leaf_noted_again_by_its_own_failed_eviction_is_tried_once() -> None:
    """write_back with a full backup queue: evicting leaf K starts a backup, which is refused and
    unlocks K again (noting it). K is still the smallest key; it must not be tried again in the
    same call (that looped forever), and the call must go on to the next victim."""
    from hicache.prefix_cache import InsertParams, Req

    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                      controller=ControllerConfig(write_policy="write_back", backup_queue_size=1))
    stack = build_stack(cfg)
    cache = stack.cache
    p, q, s, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 22, 23]
    await serve_request(stack, p + q, rid="a")  # one node p+q, device only
    cache.match_prefix(MatchPrefixParams(key=RadixKey(p + [99, 98, 97, 96])))  # split: K=p, C=q
    await cache.evict_async(EvictParams(num_tokens=PS))  # C: backed up, then demoted to host
    await cache.drain()
    await serve_request(stack, z, rid="z")  # an unrelated device node
    k = cache.root_node.children[cache._child_key(None, p, 0)]
    c = k.children[cache._child_key(None, q, 0)]
    assert k.value is not None and c.value is None and c.host_value is not None
    # a load-back of C that fails, with an insert below C while it runs: C loses its device
    # slots but its new child G keeps its own, so K's eviction can neither demote nor drop K
    restore = inject_load_faults(stack.copy_engine, fail=True)
    req = Req(rid="r", origin_input_ids=p + q + s + [0])
    cache.match_req(req)
    await cache.admit(req, wait_load=False)
    dev = stack.allocator.alloc(3 * PS)
    res = cache.insert(InsertParams(key=RadixKey(p + q + s), value=dev))
    stack.allocator.free(dev[: res.prefix_len])
    await cache.drain()
    cache.abort_req(req)
    restore()
    g = c.children[cache._child_key(None, s, 0)]
    assert c.value is None and g.value is not None and k.lock_ref == 0
    cache.sanity_check()
    assert cache.write_backup(cache.root_node.children[cache._child_key(None, z, 0)])  # the queue is full now
    assert cache.evict(EvictParams(num_tokens=PS)).num_tokens_evicted == PS  # G goes instead
    assert g.value is None and k.value is not None
    cache.sanity_check()  # K is queued again for the next call
    await cache.drain()
    await stack.aclose()


async def test_a_lock_released_after_reset_does_not_reach_the_new_tree() -> None:
    stack = build_stack(StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                                    controller=ControllerConfig(write_policy="write_through")))
    cache = stack.cache
    from hicache.prefix_cache import Req

    await serve_request(stack, list(range(8)), rid="a")
    req = Req(rid="b", origin_input_ids=list(range(8)) + [50])
    cache.match_req(req)
    await cache.admit(req)  # locks a node of the tree about to be dropped
    await cache.drain()
    cache.reset()
    cache.dec_lock_ref(req.last_node)  # released late, on the old tree
    assert len(cache._device_index) == 0
    assert cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 0
    await stack.aclose()
