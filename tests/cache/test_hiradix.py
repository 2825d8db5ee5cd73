"""The hierarchical cache: host and storage tiers behind the radix tree."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid

import pytest
import torch

from hicache.controller import ControllerConfig
from hicache.errors import LoopMisuseError
from hicache.keys import page_hashes
from hicache.prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    fast_page_hashes,
    namespace_seed,
)
from hicache.replay import StackConfig, build_stack, serve_request, verify_kv
from hicache.storage import create_async_storage
from hicache.testing.waiting import eventually

from _tiers import host_only

PS = 4


def cfg(**controller: object) -> StackConfig:
    base = dict(prefetch_threshold=PS, prefetch_policy="wait_complete")
    base.update(controller)
    return StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                       controller=ControllerConfig(**base))  # type: ignore[arg-type]


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


async def nothing_held_then_close(stack) -> None:  # type: ignore[no-untyped-def]
    """Once the copies land, no lock, host protection or prefetch hold is left; then close."""
    cache = stack.cache
    await cache.drain()
    assert all(n.host_ref == 0 and n.lock_ref == 0 for n in cache._nodes())
    assert not cache.prefetches.held and cache.protected_size() == 0
    cache.sanity_check()
    await stack.aclose()


def node_of(cache, tokens):  # type: ignore[no-untyped-def]
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_host_node


async def test_prefetch_skipped_threshold_counts_only_fetches_below_the_threshold() -> None:
    """Every request with nothing left to fetch (a full device hit) was counted as a prefetch
    skipped below the threshold, even with a threshold of 0."""
    for threshold, below in ((0, 0), (4 * PS, 1)):
        stack = build_stack(dataclasses.replace(cfg(prefetch_threshold=threshold), storage_backend="memory"))
        await stack.controller.open_storage()
        counters = stack.controller.metrics.counters
        prompt = toks(0, 8 * PS)
        await serve_request(stack, prompt, rid="a")
        await stack.cache.drain()
        for i in range(3):  # full device hits (and one partial page): nothing to fetch
            await serve_request(stack, prompt + [7], rid=f"hit{i}")
        assert counters["prefetch_skipped_threshold"] == 0, threshold
        await serve_request(stack, toks(1000, 2 * PS), rid="short")  # 2 pages to fetch, below 4 pages
        assert counters["prefetch_skipped_threshold"] == below, threshold
        await nothing_held_then_close(stack)


async def test_write_through_after_n_hits() -> None:
    stack = build_stack(cfg(write_policy="write_through_selective"))
    cache = stack.cache
    t = toks(0, 8)
    await serve_request(stack, t, rid="1")
    await cache.drain()
    node = cache.root_node.children[next(iter(cache.root_node.children))]
    assert node.host_value is None  # one hit (the insert): not yet
    await serve_request(stack, t, rid="2")  # the match is the second hit
    await cache.drain()
    assert node.backuped
    assert stack.controller.metrics.pages["d2h"] == 2
    await stack.aclose()


async def test_write_through_copies_on_insert() -> None:
    stack = build_stack(cfg(write_policy="write_through"))
    await serve_request(stack, toks(0, 8), rid="1")
    await stack.cache.drain()
    assert node_of(stack.cache, toks(0, 8)).backuped
    await stack.aclose()


async def test_demotion_match_through_evicted_and_exact_load_back() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    b = a[:8] + toks(500, 8)
    await serve_request(stack, a, rid="a")
    await serve_request(stack, b, rid="b")
    await cache.drain()
    # evict the leaf of a only: it becomes host-only, the shared prefix stays on device
    leaf_a = node_of(cache, a)
    cache.inc_lock_ref(node_of(cache, b))
    cache.evict(EvictParams(num_tokens=8))
    cache.dec_lock_ref(node_of(cache, b))
    assert leaf_a.value is None and leaf_a.host_value is not None
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    assert m.device_hit_length == 8 and m.host_hit_length == 8
    assert m.last_host_node is leaf_a and m.last_device_node is leaf_a.parent
    # evict everything: the whole tree is host-only now, and still matches
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.total_size() == 0
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    assert m.device_hit_length == 0 and m.host_hit_length == 16
    # load back: layer counters, exact KV
    new, node = cache.init_load_back(InitLoadBackParams(m.last_host_node, m.host_hit_length))
    handles = cache.ready_to_load_host_cache()
    assert len(handles) == 1 and node is leaf_a
    await handles[0].counter.wait(0)
    await handles[0].wait()
    assert verify_kv(stack.device_pool, new, torch.tensor(a)) == 0
    await cache.drain()
    out = await serve_request(stack, a, rid="again")
    assert (out.device_hit, out.verify_failures) == (16, 0)
    cache.sanity_check()
    await stack.aclose()


async def test_load_handles_nobody_takes_do_not_pile_up() -> None:
    """A caller that waits on its own load (the facade, the server) never calls
    ready_to_load_host_cache: the handles of ended loads must not pile up (a soak run of the
    demo server kept every load-back's handle, its counters and futures, for good)."""
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    for i in range(30):
        await serve_request(stack, a, rid=f"a{i}")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))  # host-only again: the next turn loads it back
    assert stack.controller.metrics.counters["load_back_skipped"] == 0
    assert stack.controller.metrics.ops["h2d"] >= 29  # every turn after the first loaded back
    assert len(cache.load_backs.new_handles) <= 1
    await stack.aclose()


async def test_load_back_is_all_or_nothing_under_quota() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    await host_only(stack, a, rid="a")
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    new, node = cache.init_load_back(InitLoadBackParams(m.last_host_node, m.host_hit_length, mem_quota=8))
    assert new.numel() == 0 and node is cache.root_node
    assert cache.total_size() == 0 and stack.controller.metrics.counters["load_back_skipped"] == 1
    req = Req(rid="q", origin_input_ids=a)
    cache.match_req(req)
    res = await cache.admit(req, mem_quota=8)
    assert res.prefix_len == 0  # falls back to compute, nothing half-loaded
    cache.dec_lock_ref(req.last_node)
    await stack.aclose()


async def test_host_leaf_eviction_lru_and_protection() -> None:
    stack = build_stack(dataclasses.replace(cfg(), host_pages=8))
    cache = stack.cache
    seqs = [toks(100 * i, 8) for i in range(4)]  # 4 x 2 pages = all of host
    for i, s in enumerate(seqs):
        await serve_request(stack, s, rid=str(i))
        await cache.drain()
    cache.evict(EvictParams(num_tokens=10**6))
    assert stack.host_pool.available_size() == 0
    cache.match_prefix(MatchPrefixParams(key=RadixKey(seqs[0])))  # seq 0 is recent now
    anchor = node_of(cache, seqs[1])
    cache._inc_host_ref(anchor)  # a prefetch anchor is never evicted
    assert cache.evict_host(16) == 16
    gone = [i for i, s in enumerate(seqs) if cache.match_prefix(MatchPrefixParams(key=RadixKey(s))).host_hit_length == 0]
    assert gone == [2, 3]
    cache._dec_host_ref(anchor)
    assert stack.host_pool.available_size() == 4 * PS
    cache.sanity_check()
    await stack.aclose()


def test_page_hashes_match_keys_module_and_namespaces_differ() -> None:
    tokens = list(range(1000, 1000 + 64))
    assert fast_page_hashes(tokens, 16) == page_hashes(tokens, 16)
    assert fast_page_hashes(tokens, 16, "ab" * 32) == page_hashes(tokens, 16, "ab" * 32)
    a = fast_page_hashes(tokens, 16, namespace_seed("tenant-a"))
    b = fast_page_hashes(tokens, 16, namespace_seed("tenant-b"))
    assert not set(a) & set(b) and not set(a) & set(page_hashes(tokens, 16))
    edge = [0, 1, 0xFFFFFFFF, 2**31, 7] * 8  # the whole uint32 range, a partial page dropped
    assert fast_page_hashes(edge, 16) == page_hashes(edge, 16)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [1.5] * 16, ["7"] * 16])
def test_page_hashes_reject_tokens_outside_uint32(bad: list) -> None:
    with pytest.raises(ValueError, match="uint32"):
        fast_page_hashes(bad, 16)


async def test_node_hashes_chain_from_parent() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 12)
    await serve_request(stack, a, rid="a", extra_key="ns")
    await serve_request(stack, a[:8] + toks(77, 4), rid="b", extra_key="ns")
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey(a, "ns"))).last_host_node
    chain = []
    n = leaf
    while n is not cache.root_node:
        chain = n.hash_value + chain
        n = n.parent
    assert chain == page_hashes(a, PS, namespace_seed("ns"))
    await stack.aclose()


async def test_write_back_copies_on_eviction() -> None:
    stack = build_stack(cfg(write_policy="write_back"))
    cache = stack.cache
    a = toks(0, 8)
    await serve_request(stack, a, rid="a")
    await cache.drain()
    assert stack.controller.metrics.pages["d2h"] == 0
    res = await cache.evict_async(EvictParams(num_tokens=8))
    assert res.num_tokens_evicted == 8
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    assert m.host_hit_length == 8
    out = await serve_request(stack, a, rid="b")
    assert (out.host_hit, out.verify_failures) == (8, 0)
    await stack.aclose()


async def test_storage_round_trip_between_two_caches() -> None:
    store = f"roundtrip-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store})
    first = build_stack(c)
    a = toks(0, 40)
    await serve_request(first, a, rid="w")
    await first.cache.drain()
    leaf = node_of(first.cache, a)
    assert leaf.on_storage
    second = build_stack(c)  # its own backend object over the same medium
    out = await serve_request(second, a, rid="r")
    assert out.storage_hit == 40 and out.computed == 0 and out.verify_failures == 0
    assert second.controller.metrics.pages["s2h"] == 10
    # continuing a partly shared prompt: device hit + storage for the rest
    out = await serve_request(second, a + toks(900, 8), rid="r2")
    assert out.device_hit == 40 and out.computed == 8
    await first.aclose()
    await second.aclose()


async def test_backup_continuity_from_root() -> None:
    """A child is written to storage only after its parent is: a page whose parent is missing
    can never be reached by a prefix lookup."""
    store = create_async_storage("memory", None, store_id=f"cont-{uuid.uuid4()}")
    stack = build_stack(cfg(storage_max_retries=0, storage_retry_base_s=0.0), storage=store)
    cache = stack.cache
    parent_keys = set(page_hashes(toks(0, 8), PS))
    real_write = store._write

    async def refuse_parent(pages, buffers, parents):  # type: ignore[no-untyped-def]
        flags = await real_write(pages, buffers, parents)
        return [f and p.key not in parent_keys for p, f in zip(pages, flags)]

    store._write = refuse_parent  # type: ignore[method-assign]
    await serve_request(stack, toks(0, 8), rid="p")
    await cache.drain()
    await serve_request(stack, toks(0, 8) + toks(50, 8), rid="c")
    await cache.drain()
    parent = node_of(cache, toks(0, 8))
    child = node_of(cache, toks(0, 8) + toks(50, 8))
    assert parent.storage_pages == 0 and child.storage_pages == 0
    assert stack.controller.metrics.counters["storage_write_failures"] >= 2
    assert not any(await store.exists_pages(page_hashes(toks(0, 8) + toks(50, 8), PS)[2:]))
    store._write = real_write  # type: ignore[method-assign]
    cache.match_prefix(MatchPrefixParams(key=RadixKey(toks(0, 8) + toks(50, 8))))  # a hit retries
    await cache.drain()
    assert parent.on_storage and child.on_storage
    await stack.aclose()


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "priority"])
async def test_policies_run_the_hierarchy(policy: str) -> None:
    stack = build_stack(dataclasses.replace(cfg(), eviction_policy=policy, device_pages=8))
    for i in range(12):
        out = await serve_request(stack, toks(1000 * (i % 5), 12), rid=str(i))
        assert out.verify_failures == 0
        await stack.cache.drain()
    stack.cache.sanity_check()
    await stack.aclose()


async def test_cancelled_admit_and_abort_release_everything() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    await host_only(stack, a, rid="a")
    req = Req(rid="c", origin_input_ids=a)
    cache.match_req(req)
    task = asyncio.ensure_future(cache.admit(req))
    await asyncio.sleep(0)  # admit has started the load and waits for it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await cache.drain()
    assert cache.protected_size() == 0 and all(n.lock_ref == 0 for n in cache._nodes())
    # abort after a match (and a request slot) only: nothing was locked, nothing released twice
    other = Req(rid="d", origin_input_ids=a)
    cache.match_req(other)
    other.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    cache.abort_req(other)
    assert cache.protected_size() == 0 and other.req_pool_idx is None
    # abort after admit: the lock is released
    third = Req(rid="e", origin_input_ids=a)
    cache.match_req(third)
    await cache.admit(third)
    assert cache.protected_size() == 16
    cache.abort_req(third)
    assert cache.protected_size() == 0
    cache.sanity_check()
    await stack.aclose()


@pytest.mark.parametrize("end", ["admitted", "cancelled", "aborted"])
async def test_pages_a_prefetch_attached_stay_protected_while_admit_makes_device_room(end: str) -> None:
    """admit waits for device room after the prefetch attached its pages; host pressure
    meanwhile (another task's backup, prefetch or session offload) used to drop them: they
    were recomputed, and the host hit before them was counted as the storage hit. They stay
    held until admit has used them, and a cancelled or aborted admit leaves no protection."""
    from hicache.errors import RequestAbortedError

    store = f"held-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store})
    first, second = build_stack(c), build_stack(c)
    a, b = toks(0, 8), toks(100, 8)
    await serve_request(first, a + b, rid="w")
    await first.cache.drain()
    await first.aclose()
    cache = second.cache
    await host_only(second, a)  # a on host, a + b in storage
    alloc = cache.token_to_kv_pool_allocator
    busy = alloc.alloc(alloc.available_size())  # running requests hold every device slot
    req = Req(rid="r", origin_input_ids=a + b)
    assert cache.match_req(req).host_hit_length == 8  # a is the host hit
    assert cache.start_prefetch(req)  # b comes from storage
    waiting, gate = asyncio.Event(), asyncio.get_running_loop().create_future()
    dropped: list[int] = []

    async def room(tokens: int) -> bool:
        waiting.set()
        dropped.append(cache.evict_host(len(b)))  # host pressure while admit waits
        if end != "admitted":
            await gate  # cancelled or aborted while it waits here
        alloc.free(busy)
        return True

    task = asyncio.ensure_future(cache.admit(req, make_room=room))
    await asyncio.wait_for(waiting.wait(), 10)
    assert dropped == [0]  # b, the host-only leaf, is held
    if end == "admitted":
        res = await task
        assert (res.device_hit, res.host_hit, res.storage_hit, res.prefix_len) == (0, 8, 8, 16)
        cache.abort_req(req)
    elif end == "cancelled":
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        alloc.free(busy)
    else:
        cache.abort_req(req)
        gate.set_result(None)
        with pytest.raises(RequestAbortedError):
            await task
    await nothing_held_then_close(second)


async def test_admit_whose_make_room_raises_leaves_nothing_locked_or_held() -> None:
    """``make_room`` is the caller's (the session cache passes its own) and may raise, e.g.
    ``CacheClosedError`` from a server shutting down: admit had locked the device prefix and
    released it only for a cancel, so the request, never admitted, could not release it (its
    abort unlocks only an admitted request's prefix): the lock, and the prefix, stayed for good."""
    from hicache.errors import CacheClosedError

    store = f"raise-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store})
    first, second = build_stack(c), build_stack(c)
    a, b, e = toks(0, 8), toks(100, 8), toks(200, 8)
    await serve_request(first, a + b + e, rid="w")
    await first.cache.drain()
    await first.aclose()
    cache = second.cache
    await host_only(second, a + b)  # a + b on host, a + b + e in storage
    await serve_request(second, a, rid="dev")  # a back on device: the prefix admit locks
    await cache.drain()
    alloc = cache.token_to_kv_pool_allocator
    busy = alloc.alloc(alloc.available_size())  # running requests hold every device slot
    req = Req(rid="r", origin_input_ids=a + b + e)
    m = cache.match_req(req)
    assert (m.device_hit_length, m.host_hit_length) == (8, 8)
    assert cache.start_prefetch(req)  # e comes from storage (held while admit waits)

    async def room(tokens: int) -> bool:
        raise CacheClosedError("the server is shutting down")

    with pytest.raises(CacheClosedError):
        await cache.admit(req, make_room=room)
    cache.abort_req(req)
    alloc.free(busy)
    await cache.drain()
    assert cache.protected_size() == 0
    assert all(n.host_ref == 0 and n.lock_ref == 0 for n in cache._nodes())
    assert not cache.prefetches.held
    cache.sanity_check()
    await second.aclose()


async def test_write_back_without_host_room_drops_instead_of_pinning() -> None:
    stack = build_stack(dataclasses.replace(cfg(write_policy="write_back"), host_pages=1))
    cache = stack.cache
    await serve_request(stack, toks(0, 8), rid="a")  # 2 pages: the host cannot take them
    await cache.drain()
    res = await cache.evict_async(EvictParams(num_tokens=8))
    assert res.num_tokens_evicted == 8 and cache.total_size() == 0
    assert stack.host_pool.available_size() == PS
    cache.sanity_check()
    await stack.aclose()


def test_no_page_of_a_chain_without_namespace_hashes_to_a_namespace_seed() -> None:
    """A page whose uint32 tokens spell ``hicache-namespace\\0`` + X hashed to X's seed, so the
    page after it got X's first key for the same tokens: X read another context's KV."""
    import struct

    from hicache.prefix_cache import fast_page_hashes, namespace_seed

    ps = 8
    for extra in ("tenant-b-salt1", "ab", "abc", "abcd", "abcde"):
        head = (b"hicache-namespace\x00" + extra.encode()).ljust(4 * ps, b"\x00")[: 4 * ps]
        spelled = list(struct.unpack(f"<{ps}I", head))
        tail = list(range(100, 100 + ps))
        assert fast_page_hashes(spelled + tail, ps)[1] != fast_page_hashes(tail, ps, namespace_seed(extra))[0]
        assert fast_page_hashes(spelled, ps)[0] != namespace_seed(extra)


@pytest.mark.parametrize("prompts", [1, 3])
async def test_pages_under_a_node_split_while_its_write_was_in_flight_reach_storage(prompts: int) -> None:
    """A storage write is in flight when another prompt diverges inside its node: the node is
    split, and the new branch hangs under the split-off upper half, waiting for it to be in
    storage (continuity). When the write lands, the upper half's other children get their turn
    too (only the written node's own children did: the new branch was never written, about 1%
    of the pages of a trace replay under write-through)."""
    store = create_async_storage("memory", None, store_id=f"split-{uuid.uuid4()}")
    stack = build_stack(dataclasses.replace(cfg(write_policy="write_through"), host_pages=64), storage=store)
    cache = stack.cache
    gate = threading.Event()  # the store's calls run on its own I/O thread and loop
    real_write = store._write

    async def gated(pages, buffers, parents):  # type: ignore[no-untyped-def]
        while not gate.is_set():
            await asyncio.sleep(0.002)
        return await real_write(pages, buffers, parents)

    store._write = gated  # type: ignore[method-assign]
    a = toks(0, 16)
    await serve_request(stack, a, rid="a")
    node = node_of(cache, a)
    await eventually(lambda: node.storage_op is not None)  # backed up to host, its write held
    branches = [toks(0, 8) + toks(100 * (i + 1), 8) for i in range(prompts)]
    for i, b in enumerate(branches):  # each diverges inside a's node while its write is held
        await serve_request(stack, b, rid=f"b{i}")
    await eventually(lambda: all(node_of(cache, b).backuped for b in branches))
    gate.set()
    await cache.drain()
    for b in [a, *branches]:
        assert node_of(cache, b).on_storage
        assert all(await store.exists_pages(page_hashes(b, PS)))
    await stack.aclose()


async def test_children_waiting_on_a_node_a_prefetch_makes_stored_get_their_storage_turn() -> None:
    """A prefetch brings pages storage holds into a node the device computed meanwhile (its
    host copy, adopted): the node is in storage from then on. Its children already on host
    waited for it to be there (continuity) and were never written until a later hit; now
    they get their turn when the prefetch lands, as when a write lands."""
    store = f"adopt-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(write_policy="write_back"), storage_backend="memory",
                            storage_options={"store_id": store}, host_pages=64)
    writer = dataclasses.replace(c, controller=ControllerConfig(
        write_policy="write_through", prefetch_threshold=PS, prefetch_policy="wait_complete"))
    first, second = build_stack(writer), build_stack(c)
    a, x, y = toks(0, 8), toks(100, 8), toks(200, 8)
    await serve_request(first, a, rid="w")  # storage holds a
    await first.cache.drain()
    await first.aclose()
    cache = second.cache
    store = second.storage
    gate = threading.Event()  # the store's calls run on its own I/O thread and loop
    real_read = store._read

    async def gated(pages, buffers):  # type: ignore[no-untyped-def]
        while not gate.is_set():
            await asyncio.sleep(0.002)
        return await real_read(pages, buffers)

    store._read = gated  # type: ignore[method-assign]
    req = Req(rid="r", origin_input_ids=a)
    cache.match_req(req)
    assert cache.start_prefetch(req)  # a comes from storage: its read is held
    await serve_request(second, a + x, rid="ax", prefetch=False)  # meanwhile the device computes a + x ...
    await serve_request(second, a + y, rid="ay", prefetch=False)  # ... and a + y: a is a node of its own
    cache.evict(EvictParams(num_tokens=8))  # write-back: x (or y) goes to host first
    await cache.drain_backups()  # (a full drain would wait for the held read)
    parent = node_of(cache, a)
    on_host = [n for n in parent.children.values() if n.host_value is not None]
    assert parent.host_value is None and not parent.on_storage and on_host
    assert not any(n.on_storage for n in on_host)  # waiting for a to be in storage
    gate.set()
    await eventually(lambda: cache.check_prefetch_progress("r"))
    assert parent.on_storage and parent.host_value is not None  # the prefetched pages, adopted
    await cache.drain()
    assert all(n.on_storage for n in on_host)
    cache.abort_req(req)
    cache.sanity_check()
    await second.aclose()


def _shed_stack(host_pages: int):  # type: ignore[no-untyped-def]
    """write_back over a memory store: host copies are made only by explicit backups and
    device eviction, so a test decides which host copies are redundant (device + storage)."""
    return build_stack(dataclasses.replace(
        cfg(write_policy="write_back"), host_pages=host_pages, storage_backend="memory",
        storage_options={"store_id": f"shed-{uuid.uuid4()}"}))


async def test_a_write_back_at_eviction_sheds_its_own_ancestors_redundant_host_copies() -> None:
    """Host is full of copies that device and storage both hold, all of them ancestors of the
    leaf that device eviction writes back. The copy takes its host room by shedding them, as
    any backup does; the backup's own lock (which covers every ancestor) must not keep them:
    it did, the backup was deferred and the leaf's KV dropped instead of demoted to host."""
    stack = _shed_stack(host_pages=2)
    cache = stack.cache
    a = toks(0, 8)
    await serve_request(stack, a, rid="a")
    await serve_request(stack, toks(0, 4) + toks(100, 4), rid="split")  # a: [0:4] then [4:8]
    lower = node_of(cache, a)
    upper = lower.parent
    assert cache.write_backup(upper) and cache.write_backup(lower)
    await cache.drain()
    assert upper.on_storage and lower.on_storage and stack.host_pool.available_size() == 0
    c = a + toks(200, 4)
    await serve_request(stack, c, rid="c")  # a device leaf under lower (and under upper)
    leaf = node_of(cache, c)
    await cache.evict_async(EvictParams(num_tokens=8))  # both leaves: "split" and c
    await cache.drain()
    assert stack.controller.metrics.counters["backup_deferred"] == 0
    assert leaf.parent is lower and leaf.host_value is not None  # demoted, not dropped
    out = await serve_request(stack, c, rid="c2")
    assert out.verify_failures == 0 and out.device_hit + out.host_hit == len(c)
    cache.sanity_check()
    await stack.aclose()


async def test_a_write_through_backup_sheds_its_own_ancestors_redundant_host_copies() -> None:
    """The write-through backup of an insert is marked (its path locked) when the insert makes
    it and takes its host room later, with the batch of the loop step. Host is full of a copy
    that device and storage both hold, the new node's own parent: the backup sheds it, as any
    backup does; its mark's lock must not keep it (the backup was deferred instead)."""
    stack = build_stack(dataclasses.replace(
        cfg(write_policy="write_through"), host_pages=2, storage_backend="memory",
        storage_options={"store_id": f"shed-{uuid.uuid4()}"}))
    cache = stack.cache
    a = toks(0, 8)
    await serve_request(stack, a, rid="a")
    await cache.drain()
    parent = node_of(cache, a)
    assert parent.on_storage and stack.host_pool.available_size() == 0
    deferred: list[int] = []
    defer = cache._defer_backup
    cache._defer_backup = lambda node, keep: (deferred.append(len(node.key)), defer(node, keep))  # type: ignore[method-assign]
    c = a + toks(200, 4)
    await serve_request(stack, c, rid="c")  # its new page's backup needs host room
    await asyncio.sleep(0)  # the loop step's backups start
    leaf = node_of(cache, c)
    assert leaf.parent is parent and leaf.host_value is not None
    assert len(leaf.key) not in deferred  # copied at its start, never deferred (the shed parent may be)
    assert parent.value is not None and stack.controller.metrics.counters["host_copies_shed_tokens"] == 8
    await cache.drain()
    assert leaf.on_storage
    cache.sanity_check()
    report = await stack.aclose()
    assert report.deferred_backup_pages == 0  # (a copy storage holds is never reported lost)


async def _redundant_on_host(stack, tokens: list[int]):  # type: ignore[no-untyped-def]
    """Serve ``tokens`` and back them up until host is full of their copy, which device and
    storage hold too (redundant: sheddable). Returns their node."""
    cache = stack.cache
    await serve_request(stack, tokens, rid="a")
    node = node_of(cache, tokens)
    assert cache.write_backup(node)
    await cache.drain()
    assert node.on_storage and stack.host_pool.available_size() == 0
    return node


async def test_a_redundant_host_copy_locked_when_room_was_wanted_is_shed_later() -> None:
    """A host copy that device and storage both hold is skipped by shedding while it is locked
    (a load or a request reads through it); once unlocked it is sheddable again. It was
    forgotten at the skip, and was never listed again: its host page stayed pinned."""
    stack = _shed_stack(host_pages=1)
    cache = stack.cache
    b = toks(500, 4)
    node_a = await _redundant_on_host(stack, toks(0, 4))
    await serve_request(stack, b, rid="b")
    node_b = node_of(cache, b)
    cache.inc_lock_ref(node_a)  # a request holds a
    assert not cache._backup(node_b)  # no room: a is locked
    cache.dec_lock_ref(node_a)
    assert cache._backup(node_b)  # a's redundant copy gives way now
    await cache.drain()
    assert node_b.backuped and node_a.host_value is None and node_a.value is not None
    cache.sanity_check()
    await stack.aclose()


async def test_both_halves_of_a_split_redundant_host_copy_can_be_shed() -> None:
    """A node whose host copy device and storage both hold is split (a request diverges inside
    it): the new upper half holds a redundant host copy too. It was never listed (only a
    storage write landing lists a node): its host page stayed pinned while a backup that
    needed the room was refused."""
    stack = _shed_stack(host_pages=2)
    cache = stack.cache
    b = toks(500, 8)
    node_a = await _redundant_on_host(stack, toks(0, 8))
    cache.match_prefix(MatchPrefixParams(key=RadixKey(toks(0, 4) + toks(100, 4))))  # split a at 4
    upper = node_a.parent
    assert len(upper.key) == 4 and upper.host_value is not None and upper.on_storage
    await serve_request(stack, b, rid="b")
    node_b = node_of(cache, b)
    assert cache._backup(node_b)  # both halves' copies give way: 2 pages
    await cache.drain()
    assert node_b.backuped and upper.host_value is None and node_a.host_value is None
    assert stack.controller.metrics.counters["backup_deferred"] == 0
    cache.sanity_check()
    await stack.aclose()


async def test_a_storage_hit_loaded_to_device_leaves_a_sheddable_host_copy() -> None:
    """A storage hit is fetched to host and loaded to device: device and storage both hold it
    then, its host copy redundant. Only a storage write landing listed a node for shedding, so
    this copy (the usual one after a storage hit) was never listed: its host page stayed
    pinned while the node sat on device, and a backup that needed the room was refused."""
    store = f"loaded-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(write_policy="write_back"), storage_backend="memory",
                            storage_options={"store_id": store})
    first, second = build_stack(c), build_stack(dataclasses.replace(c, host_pages=2))
    a, b = toks(0, 8), toks(500, 4)
    await serve_request(first, a, rid="a")
    assert first.cache.write_backup(node_of(first.cache, a))
    await first.cache.drain()
    await first.aclose()
    cache = second.cache
    out = await serve_request(second, a, rid="a2")
    assert out.storage_hit == 8
    await cache.drain()
    node_a = node_of(cache, a)
    assert node_a.value is not None and node_a.on_storage and second.host_pool.available_size() == 0
    await serve_request(second, b, rid="b")
    node_b = node_of(cache, b)
    assert cache._backup(node_b)  # a's redundant copy gives way
    await cache.drain()
    assert node_b.backuped and node_a.host_value is None and node_a.value is not None
    cache.sanity_check()
    await second.aclose()


async def test_a_backup_whose_host_allocation_raises_is_deferred_not_raised() -> None:
    """``_backup`` runs from loop callbacks (a finished backup retries the deferred ones): a
    host allocation that raises is logged and the backup deferred, as a failed start is."""
    stack = _shed_stack(host_pages=4)
    cache = stack.cache
    try:
        a = toks(0, 4)
        await serve_request(stack, a, rid="a")
        node = node_of(cache, a)

        def broken(num_tokens: int) -> None:
            raise RuntimeError("host pool gone")

        cache._alloc_host = broken  # type: ignore[method-assign, assignment]
        assert not cache.write_backup(node)
        assert node in cache._deferred and node.backup_op is None and node.host_value is None
        del cache._alloc_host
        assert cache._retry_deferred() == 1
        await cache.drain()
        assert node.host_value is not None
    finally:
        await stack.aclose()


@pytest.mark.parametrize("second_end", ["admitted", "aborted"])
async def test_a_reused_rid_does_not_take_the_prefetch_hold_or_the_prefetch_of_another_request(
        second_end: str) -> None:
    """Two requests share a rid: the first one's admit waits for device room holding the page
    its prefetch attached, when the second one's prefetch ends (its own hold replaced the
    first's: the first one's page became host-evictable while its admit still waited) or the
    second one is aborted (its cancel released the first one's hold, and a later request's
    running prefetch with it)."""
    store = f"reuse-{uuid.uuid4()}"
    c = dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store})
    first, second = build_stack(c), build_stack(c)
    a, b, e = toks(0, 8), toks(100, 8), toks(200, 8)
    await serve_request(first, a + b, rid="w1")
    await serve_request(first, a + e, rid="w2")
    await first.cache.drain()
    await first.aclose()
    cache = second.cache
    await host_only(second, a)  # a on host, a + b and a + e in storage
    alloc = cache.token_to_kv_pool_allocator
    busy = alloc.alloc(alloc.available_size())  # running requests hold every device slot
    one = Req(rid="r", origin_input_ids=a + b)
    assert cache.match_req(one).host_hit_length == 8
    assert cache.start_prefetch(one)  # b comes from storage
    waiting, gate = asyncio.Event(), asyncio.get_running_loop().create_future()

    async def room(tokens: int) -> bool:
        waiting.set()
        await gate
        alloc.free(busy)
        return True

    task = asyncio.ensure_future(cache.admit(one, make_room=room))
    await asyncio.wait_for(waiting.wait(), 10)
    b_node = node_of(cache, a + b)
    assert b_node.value is None and b_node.host_value is not None and b_node.host_ref == 1
    two = Req(rid="r", origin_input_ids=a + e)  # the rid is reused
    assert cache.match_req(two).host_hit_length == 8
    assert cache.start_prefetch(two)  # e comes from storage
    if second_end == "admitted":
        other = asyncio.get_running_loop().create_future()

        async def wait_room(tokens: int) -> bool:
            await other
            return False

        task2 = asyncio.ensure_future(cache.admit(two, make_room=wait_room))
        await eventually(lambda: not cache.is_prefetching("r"))
        assert cache.evict_host(10**6) == 0  # b is still held for the first request's admit
        other.set_result(None)
        await task2
        cache.abort_req(two)
    else:
        cache.abort_req(two)
        assert cache.evict_host(10**6) == 0  # two's abort leaves one's hold alone
    # and the first request's abort leaves a later request's prefetch alone
    three = Req(rid="r", origin_input_ids=a + e)
    cache.match_req(three)
    started = cache.start_prefetch(three)
    gate.set_result(None)
    res = await task
    assert (res.host_hit, res.storage_hit) == (8, 8)  # b was kept for it
    cache.abort_req(one)
    assert not started or cache.is_prefetching("r")
    if started:
        await cache.admit(three)
        cache.abort_req(three)
    await nothing_held_then_close(second)


async def test_abort_of_a_request_whose_rid_another_admitted_request_reused_unlocks_its_prefix() -> None:
    """Two admitted requests share a rid: the admitted-by-rid record names the later one, and
    the first one's abort took it for a request that had locked nothing: its prefix stayed
    locked for good, and with a request slot its prefix's device slots (the tree's) were freed
    as its own KV; an abort while its admit waited went unseen (it was admitted anyway)."""
    from hicache.errors import RequestAbortedError

    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    await serve_request(stack, a, rid="w")
    await cache.drain()
    one, two = Req(rid="r", origin_input_ids=a), Req(rid="r", origin_input_ids=a)
    cache.match_req(one)
    await cache.admit(one)
    cache.match_req(two)
    await cache.admit(two)
    cache.abort_req(one)
    cache.abort_req(two)
    assert cache.protected_size() == 0 and all(n.lock_ref == 0 for n in cache._nodes())
    # with request slots: the first one's abort, taking its prefix for its own KV, freed the
    # tree's device slots (handed out again while the tree still held them: wrong KV)
    one, two = Req(rid="r", origin_input_ids=a), Req(rid="r", origin_input_ids=a)
    for req in (one, two):
        cache.match_req(req)
        req.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
        await cache.admit(req)
        stack.req_to_token_pool.req_to_token[req.req_pool_idx, :16] = req.prefix_indices
        req.kv_allocated_len = req.kv_committed_len = 16
    cache.abort_req(one)
    cache.abort_req(two)
    alloc = stack.allocator
    assert alloc.available_size() + cache.all_device_indices().numel() == alloc.size
    assert cache.protected_size() == 0 and all(n.lock_ref == 0 for n in cache._nodes())
    # aborted while its admit waits, with a later request of its rid admitting meanwhile
    await host_only(stack, a)
    one, two = Req(rid="r", origin_input_ids=a), Req(rid="r", origin_input_ids=a)
    cache.match_req(one)
    task = asyncio.ensure_future(cache.admit(one))
    await asyncio.sleep(0)  # admit waits for its load
    cache.match_req(two)
    task2 = asyncio.ensure_future(cache.admit(two))
    await asyncio.sleep(0)
    cache.abort_req(one)
    with pytest.raises(RequestAbortedError):
        await task
    await task2
    cache.abort_req(two)
    await cache.drain()
    assert cache.protected_size() == 0 and all(n.lock_ref == 0 for n in cache._nodes())
    cache.sanity_check()
    await stack.aclose()


async def test_pages_host_drops_before_their_storage_write_starts_are_counted() -> None:
    """Write-through writes a page only after its prefix: a child waits while its parent's
    write is in flight, and host eviction may drop it meanwhile. It was dropped silently, so
    storage missed committed pages that no counter or close report named."""
    stack = build_stack(dataclasses.replace(cfg(), storage_backend="memory", storage_pages=64))
    cache, ctl = stack.cache, stack.controller
    a = toks(0, 8)
    first_key = fast_page_hashes(a, PS, cache.storage_prior_hash(cache.root_node, None))[0]
    gate = threading.Event()
    orig = stack.storage.batch_set_v2

    async def slow_set(transfers, info=None):  # type: ignore[no-untyped-def]
        if first_key in transfers[0].keys:  # the prefix's write hangs until the gate opens
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
        return await orig(transfers, info)

    stack.storage.batch_set_v2 = slow_set
    try:
        await serve_request(stack, a, rid="a")
        await cache.drain_backups()
        await serve_request(stack, a + toks(100, 8), rid="ab")  # the child: 2 pages after a
        await cache.drain_backups()
        cache.evict(EvictParams(num_tokens=10**6))  # both on host only now
        assert ctl.metrics.counters["storage_write_dropped_pages"] == 0
        assert cache.evict_host(8) == 8  # the parent's write is in flight: the child goes
        assert ctl.metrics.counters["storage_write_dropped_pages"] == 2
    finally:
        gate.set()
    report = await stack.aclose()
    # gone from every tier, so no longer the cache's to write at close: a lifetime loss
    assert report.lifetime_failed_storage_pages == 2 and report.failed_storage_pages == 0


@pytest.mark.parametrize("how", ["failed", "store_down"])
async def test_pages_whose_storage_write_was_sent_are_not_counted_again_when_host_drops_them(how: str) -> None:
    """Only a page whose write never started (it waited for its prefix's) is counted when host
    drops it. One whose write was sent and did not land was counted by the controller already
    (a failure, or skipped while the store was down), and the close report sums both: every
    such page was reported twice."""
    store = create_async_storage("memory", None, store_id=f"twice-{uuid.uuid4()}")
    stack = build_stack(cfg(storage_max_retries=0, storage_retry_base_s=0.0), storage=store)
    cache, ctl = stack.cache, stack.controller
    real_write = store._write

    async def refuse(pages, buffers, parents):  # type: ignore[no-untyped-def]
        await real_write(pages, buffers, parents)
        return [False] * len(pages)

    if how == "failed":
        store._write = refuse  # type: ignore[method-assign]
    else:
        ctl.health.trip("test: the store went away")
    await serve_request(stack, toks(0, 8), rid="a")  # 2 pages, written through: not landed
    await cache.drain()
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.evict_host(10**6) == 8
    assert ctl.metrics.counters.get("storage_write_dropped_pages", 0) == 0
    store._write = real_write  # type: ignore[method-assign]
    report = await stack.aclose()
    assert report.lifetime_failed_storage_pages == 2 and report.failed_storage_pages == 0


async def test_a_live_request_reusing_a_rid_neither_waits_for_nor_takes_anothers_prefetch() -> None:
    """A's pages are in storage only, B's on host; both use rid "same". A starts a prefetch
    (B's is refused: the rid is busy), and B is admitted first: B takes nothing of A's
    prefetch (its own host hit, no wait), and A then gets its pages as its storage hit."""
    store = f"rid-{uuid.uuid4()}"
    stack = build_stack(dataclasses.replace(cfg(prefetch_threshold=0), storage_backend="memory",
                                            storage_options={"store_id": store}))
    cache = stack.cache
    a_tokens, b_tokens = toks(100, 8), toks(200, 8)
    await serve_request(stack, a_tokens, rid="seed-a")
    await cache.drain()
    cache.evict(EvictParams(num_tokens=10**6))
    cache.evict_host(10**6)  # A: storage only
    await serve_request(stack, b_tokens, rid="seed-b")
    await cache.drain()
    cache.evict(EvictParams(num_tokens=10**6))  # B: host (and storage)
    a, b = Req(rid="same", origin_input_ids=a_tokens), Req(rid="same", origin_input_ids=b_tokens)
    cache.match_req(a)
    assert cache.start_prefetch(a)
    cache.match_req(b)
    assert not cache.start_prefetch(b)  # the rid is busy
    hits = {}
    for name, r in (("b", b), ("a", a)):
        r.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
        res = await asyncio.wait_for(cache.admit(r), 10)
        hits[name] = (res.host_hit, res.storage_hit)
        assert verify_kv(stack.device_pool, r.prefix_indices, torch.tensor(r.origin_input_ids[: res.prefix_len])) == 0
        cache.abort_req(r)
    assert hits == {"b": (8, 0), "a": (0, 8)}
    await nothing_held_then_close(stack)


async def _memory_store_holding(tokens: list[int], name: str) -> str:
    """A fresh ``memory`` store (its ``store_id``) that an earlier stack wrote ``tokens`` to."""
    store = f"{name}-{uuid.uuid4()}"
    first = build_stack(dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store}))
    await serve_request(first, tokens, rid="w")
    await first.cache.drain()
    await first.aclose()
    return store


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_queued_requests_prefetch_anchor_gives_its_device_room_to_a_running_request(policy: str) -> None:
    """A queued request matched ``a`` on device (no host copy: host was full) and its prefetch
    of ``b`` continues from it; the prefetch finished, its pages wait in host until admit. The
    anchor's ``host_ref`` kept ``a`` on device until the request was admitted, while the tree
    counted it as evictable: a running request needing the room got none (evict freed 0 with
    evictable_size 8). Device room wins: the prefetch is dropped (counted), which frees its
    host pages, ``a`` goes to host, and the queued request still gets correct KV."""
    a, b = toks(0, 8), toks(100, 8)
    store = await _memory_store_holding(a + b, "anchor")
    c = dataclasses.replace(cfg(write_policy=policy), storage_backend="memory", storage_options={"store_id": store})
    stack = build_stack(dataclasses.replace(c, device_pages=4, host_pages=2))
    cache, alloc, host = stack.cache, stack.allocator, stack.host_pool
    blocker = host.alloc(host.available_size())  # host full: a gets no host copy
    await serve_request(stack, a, rid="a", prefetch=False)
    await cache.drain()
    queued = Req(rid="q", origin_input_ids=a + b)
    assert cache.match_req(queued).device_hit_length == 8
    a_node = queued.last_host_node
    assert a_node.value is not None and a_node.host_value is None
    assert cache.start_prefetch(queued)  # anchored on a, on device only
    host.free(blocker)  # the prefetch takes it
    await asyncio.wait_for(stack.controller.wait_prefetches(), 10)  # b waits in host: host full
    assert host.available_size() == 0 and a_node.host_ref == 1
    running = alloc.alloc(alloc.available_size())  # a running request holds the rest
    assert cache.evictable_size() == 8  # a, which only the prefetch anchor keeps
    assert await asyncio.wait_for(cache.make_device_room(8), 10)  # a's room goes to the running request
    assert stack.controller.metrics.counters["prefetch_dropped_for_room"] == 1
    assert not cache.is_prefetching("q") and all(n.host_ref == 0 for n in cache._nodes())
    alloc.free(running)
    queued.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    res = await asyncio.wait_for(cache.admit(queued), 10)
    # the dropped prefetch freed host room for a's copy, so a went to host and is loaded back;
    # b, no longer fetched, is computed
    assert (res.device_hit, res.host_hit, res.storage_hit) == (0, 8, 0)
    assert verify_kv(stack.device_pool, queued.prefix_indices, torch.tensor(a[: res.prefix_len])) == 0
    cache.abort_req(queued)
    again = await asyncio.wait_for(serve_request(stack, a + b, rid="again"), 10)
    assert again.verify_failures == 0
    await nothing_held_then_close(stack)


async def test_a_prefetch_anchor_goes_last_and_without_a_host_copy_leaves_the_tree() -> None:
    """Host stays full, so neither ``a`` (a queued request's prefetch anchor, on device only)
    nor the older ``c`` can be copied there. An eviction takes ``c`` first and keeps the
    prefetch; one that finds nothing else drops the prefetch and deletes ``a`` (it freed 0
    before, with ``a`` counted as evictable). The queued request then misses and is computed."""
    a, b, other = toks(0, 8), toks(100, 8), toks(200, 8)
    store = await _memory_store_holding(a + b, "anchor-last")
    c = dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store})
    stack = build_stack(dataclasses.replace(c, device_pages=4, host_pages=2))
    cache, alloc, host = stack.cache, stack.allocator, stack.host_pool
    blocker = host.alloc(host.available_size())  # host full throughout
    await serve_request(stack, other, rid="c", prefetch=False)
    await serve_request(stack, a, rid="a", prefetch=False)
    await cache.drain()
    queued = Req(rid="q", origin_input_ids=a + b)
    assert cache.match_req(queued).device_hit_length == 8
    assert cache.start_prefetch(queued)  # anchored on a, on device only
    await asyncio.wait_for(stack.controller.wait_prefetches(), 10)
    counters = stack.controller.metrics.counters
    assert alloc.available_size() == 0 and cache.evictable_size() == 16
    assert cache.evict(8).num_tokens_evicted == 8  # c, the older leaf: the prefetch stays
    assert cache.is_prefetching("q") and counters.get("prefetch_dropped_for_room", 0) == 0
    assert cache.evict(8).num_tokens_evicted == 8  # nothing else left: a goes, its prefetch first
    assert not cache.is_prefetching("q") and counters["prefetch_dropped_for_room"] == 1
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    cache.sanity_check()
    queued.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    res = await asyncio.wait_for(cache.admit(queued), 10)
    assert res.prefix_len == 0  # a miss: computed
    cache.abort_req(queued)
    host.free(blocker)
    again = await asyncio.wait_for(serve_request(stack, a + b, rid="again"), 10)
    assert (again.storage_hit, again.verify_failures) == (8, 0)  # what host (2 pages) can take
    await nothing_held_then_close(stack)


async def test_write_back_copies_a_prefetch_anchor_to_host_rather_than_drop_its_prefetch() -> None:
    """With host room, device eviction under ``write_back`` copies a device-only prefetch
    anchor to host and demotes it, as any node: the anchor stays in the tree, so the prefetch
    goes on and its request gets both the host and the storage hit."""
    a, b = toks(0, 8), toks(100, 8)
    store = await _memory_store_holding(a + b, "anchor-wb")
    c = dataclasses.replace(cfg(write_policy="write_back"), storage_backend="memory",
                            storage_options={"store_id": store}, device_pages=4, host_pages=4)
    stack = build_stack(c)
    cache = stack.cache
    await serve_request(stack, a, rid="a", prefetch=False)
    queued = Req(rid="q", origin_input_ids=a + b)
    assert cache.match_req(queued).device_hit_length == 8
    assert cache.start_prefetch(queued)  # anchored on a, on device only
    assert (await asyncio.wait_for(cache.evict_async(8), 10)).num_tokens_evicted == 8
    a_node = queued.last_host_node
    assert a_node.value is None and a_node.backuped  # demoted, still the anchor
    assert cache.is_prefetching("q") and stack.controller.metrics.counters["prefetch_dropped_for_room"] == 0
    queued.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    res = await asyncio.wait_for(cache.admit(queued), 10)
    assert (res.host_hit, res.storage_hit) == (8, 8)
    assert verify_kv(stack.device_pool, queued.prefix_indices, torch.tensor((a + b)[: res.prefix_len])) == 0
    cache.abort_req(queued)
    await nothing_held_then_close(stack)


async def test_a_lock_taken_before_a_reset_and_released_after_it_leaves_the_new_trees_sizes_alone() -> None:
    """A request admitted (its device prefix locked) before a flush and aborted after it
    released its lock on nodes of the dropped tree, and the new tree counted their tokens:
    evictable_size() said 16 tokens could be freed that no node holds (a scheduler trusting
    it admits requests that then fail for memory), protected_size() went negative, and every
    eviction walked the whole tree looking for them."""
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    await serve_request(stack, a, rid="seed")
    await cache.drain()
    req = Req(rid="r", origin_input_ids=a + [99])
    cache.match_req(req)
    req.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    await cache.admit(req)
    assert cache.protected_size() == 16
    cache.reset()  # a flush: the server clears its pools with the cache
    stack.allocator.clear()
    stack.host_pool.clear()
    cache.abort_req(req)
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    cache.sanity_check()
    await serve_request(stack, toks(100, 8), rid="after")  # the new tree works as before
    await cache.drain()
    assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    cache.sanity_check()
    await stack.aclose()


async def test_a_prefetch_started_off_the_loops_thread_leaves_its_anchor_unheld() -> None:
    """The cache protects the prefetch's anchor (``host_ref``) before it asks the controller;
    a call from another thread raised there and the anchor stayed protected for good (never
    evicted, and ``_dec_host_ref`` of a later prefetch could not balance it)."""
    a, b = toks(0, 8), toks(100, 8)
    store = await _memory_store_holding(a + b, "off-thread")
    stack = build_stack(dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store}))
    cache = stack.cache
    await serve_request(stack, a, rid="a", prefetch=False)
    await cache.drain()
    req = Req(rid="q", origin_input_ids=a + b)
    cache.match_req(req)
    anchor = req.last_host_node
    assert anchor is not cache.root_node
    with pytest.raises(LoopMisuseError):
        await asyncio.to_thread(cache.start_prefetch, req)
    assert anchor.host_ref == 0 and not cache.is_prefetching("q")
    assert cache.start_prefetch(req)  # on the loop it starts
    await asyncio.wait_for(stack.controller.wait_prefetches(), 10)
    cache.cancel_prefetch("q")
    await nothing_held_then_close(stack)


async def test_finishing_an_admitted_request_that_never_got_a_row_releases_its_prefix() -> None:
    """A request whose whole prompt was a hit has nothing to compute; finished without a
    ``req_to_token`` row (``release_req``), its admit's lock was never released: the insert
    returns early without a row, and the request was forgotten, so not even an abort could
    release it. Its prefix stayed protected for good (never evictable)."""
    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    await serve_request(stack, a, rid="a")
    await cache.drain()  # the write-through backup's lock is gone
    req = Req(rid="full-hit", origin_input_ids=a)
    cache.match_req(req)
    res = await cache.admit(req)
    assert res.device_hit == 16 and cache.protected_size() == 16
    cache.release_req(req)  # nothing to compute: no row was ever taken
    assert cache.protected_size() == 0 and req.last_node is None
    cache.abort_req(req)  # a late abort releases nothing twice
    await nothing_held_then_close(stack)


@pytest.mark.parametrize("where", ["device", "host"])
async def test_an_abort_before_the_admit_task_ran_leaves_nothing_locked(where: str) -> None:
    """A server that runs ``admit`` as a task and aborts the request before the task's first
    step (a client gone in the same turn of the loop): the abort found the request neither
    admitting nor admitted, so it released nothing, and the admit then ran on the aborted
    request, loaded and locked its prefix and returned normally. Nobody would ever release
    that lock. The admit now raises RequestAbortedError and holds nothing."""
    from hicache.errors import RequestAbortedError

    stack = build_stack(cfg())
    cache = stack.cache
    a = toks(0, 16)
    if where == "host":
        await host_only(stack, a, rid="a")
    else:
        await serve_request(stack, a, rid="a")
        await cache.drain()
    req = Req(rid="gone", origin_input_ids=a + [99])
    cache.match_req(req)
    cache.start_prefetch(req)
    task = asyncio.ensure_future(cache.admit(req))
    cache.abort_req(req)  # before the task ran
    with pytest.raises(RequestAbortedError):
        await task
    assert req.last_node is None and not cache.is_admitted(req)
    await nothing_held_then_close(stack)


async def test_the_close_report_counts_the_prefetches_the_cache_close_cancelled() -> None:
    """A request's prefetch is still reading (its store slow) when the cache closes. The
    cache cancelled its prefetches before the controller's close counted them, so the report
    said ``cancelled_prefetches=0`` for every cache close, whatever was in flight."""
    a = toks(0, 8)
    store = await _memory_store_holding(a, "close-prefetch")
    stack = build_stack(dataclasses.replace(cfg(), storage_backend="memory", storage_options={"store_id": store}))
    cache = stack.cache
    gate = threading.Event()
    real_get = stack.storage.batch_get_v2

    async def slow_get(transfers, *args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
        return await real_get(transfers, *args, **kwargs)

    stack.storage.batch_get_v2 = slow_get  # type: ignore[method-assign]
    req = Req(rid="r", origin_input_ids=a)
    cache.match_req(req)
    assert cache.start_prefetch(req)
    op = stack.controller.prefetch_op("r")
    await eventually(lambda: op.found_pages == 2)  # reading now
    closing = asyncio.ensure_future(stack.aclose())
    await asyncio.sleep(0.05)
    gate.set()
    report = await asyncio.wait_for(closing, 10)
    assert report.cancelled_prefetches == 1
