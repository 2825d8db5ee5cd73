"""Host->device loads seen by other requests: a prefix being loaded is not usable until the
copy ends, and a failed load takes back every slot it handed out, even after splits."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from hicache.controller import ControllerConfig
from hicache.prefix_cache import MatchPrefixParams, RadixKey, Req
from hicache.replay import StackConfig, build_stack, serve_request, verify_kv
from hicache.testing import inject_load_faults

from _tiers import host_only

PS = 4


def make():  # type: ignore[no-untyped-def]
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS))
    return build_stack(cfg)



async def _abort_and_close(stack: Any, *reqs: Req) -> None:
    """Abort ``reqs``, drain, check nothing stays locked and the tree is sound, then close."""
    cache = stack.cache
    for req in reqs:
        cache.abort_req(req)
    await cache.drain()
    assert cache.protected_size() == 0
    cache.sanity_check()
    await stack.aclose()

async def test_admit_waits_for_a_load_of_its_prefix_started_by_another_request() -> None:
    stack = make()
    cache = stack.cache
    a = list(range(16))
    await host_only(stack, a)
    inject_load_faults(stack.copy_engine, delay=0.03)
    first = Req(rid="first", origin_input_ids=a + [99])
    cache.match_req(first)
    r1 = await cache.admit(first, wait_load=False)
    assert r1.host_hit == 16 and r1.load_handle is not None
    second = Req(rid="second", origin_input_ids=a + [98])
    cache.match_req(second)
    r2 = await cache.admit(second, wait_load=False)
    assert r2.device_hit == 16 and r2.load_handle is None
    # second got no handle to wait on: its prefix must be loaded already
    assert verify_kv(stack.device_pool, second.prefix_indices, torch.tensor(a)) == 0
    await _abort_and_close(stack, first, second)


async def test_failed_load_drops_slots_of_nodes_split_during_the_load() -> None:
    stack = make()
    cache = stack.cache
    a = list(range(16))
    await host_only(stack, a)
    restore = inject_load_faults(stack.copy_engine, delay=0.02, fail=True)
    req = Req(rid="r", origin_input_ids=a + [99])
    cache.match_req(req)
    res = await cache.admit(req, wait_load=False)
    assert res.load_handle is not None
    # another request's match diverges inside the loading node: the node is split
    cache.match_prefix(MatchPrefixParams(key=RadixKey(a[:8] + [500, 501, 502, 503])))
    upper = cache.match_prefix(MatchPrefixParams(key=RadixKey(a[:8]))).last_host_node
    assert len(upper.key) == 8
    await cache.drain()  # the load fails
    assert upper.value is None, "the split-off half still serves slots that were never loaded"
    cache.abort_req(req)
    await cache.drain()
    tree = cache.all_device_indices()
    assert tree.numel() == 0 or stack.allocator.is_allocated(tree)
    assert stack.allocator.available_size() + tree.numel() == stack.allocator.size
    cache.sanity_check()
    # a later request loads the prefix from host correctly
    restore()
    out = await serve_request(stack, a + [7], rid="later")
    assert out.verify_failures == 0 and out.host_hit == 16
    await stack.aclose()


async def second_admit_behind_a_load(stack):  # type: ignore[no-untyped-def]
    """A host-only prefix; ``first`` starts loading it (slowly), ``second`` matches the same
    prefix and is about to be admitted behind that load."""
    cache = stack.cache
    a = list(range(16))
    await host_only(stack, a)
    inject_load_faults(stack.copy_engine, delay=0.03)
    first = Req(rid="first", origin_input_ids=a + [99])
    cache.match_req(first)
    await cache.admit(first, wait_load=False)
    second = Req(rid="second", origin_input_ids=a + [98])
    cache.match_req(second)
    return cache, first, second


async def test_cancelled_admit_waiting_for_another_load_holds_nothing() -> None:
    stack = make()
    cache, first, second = await second_admit_behind_a_load(stack)
    task = asyncio.ensure_future(cache.admit(second, wait_load=False))
    await asyncio.sleep(0.005)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    cache.abort_req(second)
    await _abort_and_close(stack, first)


async def test_insert_through_a_revived_node_frees_every_duplicate() -> None:
    """After a failed load a host-only node may have a device child (inserted during the
    load). A later insert revives the node with the request's slots; the request's slots under
    the device child are duplicates too and must be freed, not leaked."""
    stack = make()
    cache = stack.cache
    a = list(range(16))
    await serve_request(stack, a, rid="seed")
    await cache.drain()
    cache.match_prefix(MatchPrefixParams(key=RadixKey(a[:8] + [500, 501, 502, 503])))  # split at 8
    upper = cache.match_prefix(MatchPrefixParams(key=RadixKey(a[:8]))).last_host_node
    assert len(upper.key) == 8 and upper.backuped
    cache._free(cache._drop_device(upper))  # what a failed load leaves: host-only above device
    out = await serve_request(stack, a + [1, 2, 3, 4], rid="again", prefetch=False)
    assert out.device_hit == 0
    await cache.drain()
    tree = cache.all_device_indices()
    assert stack.allocator.is_allocated(tree)
    assert stack.allocator.available_size() + tree.numel() == stack.allocator.size, "duplicates leaked"
    cache.sanity_check()
    await stack.aclose()


async def test_reset_during_a_load_wakes_whoever_waits_for_it() -> None:
    stack = make()
    cache, first, second = await second_admit_behind_a_load(stack)
    waiting = asyncio.ensure_future(cache.admit(second, wait_load=False))
    await asyncio.sleep(0.005)
    assert not waiting.done()
    cache.reset()  # a flush: the load completes into a tree that no longer exists
    res = await asyncio.wait_for(waiting, 2.0)
    assert res.prefix_len == 0
    await stack.controller.drain()
    await stack.aclose()


async def test_reset_during_a_load_keeps_the_host_pages_it_reads_until_it_ends() -> None:
    """reset() freed every host page of the dropped tree but those a backup or storage write
    still used, not those a load to device was reading: the new tree's backups were handed
    them while the load ran, and it copied their writes to the device as KV. Now the load's
    end frees them."""
    stack = make()
    cache = stack.cache
    a = list(range(16))
    await host_only(stack, a)
    read = torch.cat([n.host_value for n in cache._nodes() if n.host_value is not None])
    inject_load_faults(stack.copy_engine, delay=0.05)
    req = Req(rid="loading", origin_input_ids=a + [99])
    cache.match_req(req)
    res = await cache.admit(req, wait_load=False)
    assert res.load_handle is not None and not res.load_handle.counter.all_done()
    cache.reset()  # a flush while the load runs
    stack.allocator.clear()
    host = stack.host_pool.allocator
    assert host.is_allocated(read), "the pages a running load reads were freed"
    await res.load_handle.counter.wait_all()
    await stack.controller.drain()
    assert host.available_size() == host.size, "the load's end did not free the dropped tree's pages"
    await stack.aclose()


async def test_a_device_node_left_below_a_failed_load_is_never_the_start_of_a_load() -> None:
    """A load of P fails after another request's insert hung R+S (its own, valid KV) below P's
    node: P is host-only again, R+S on device below it. S demoted to host, a request for
    P+R+S used to load S alone after no device prefix and get S's KV at P's positions."""
    from hicache.replay.synthetic import write_synthetic_kv

    stack = make()
    cache = stack.cache
    p, r, s = list(range(8)), list(range(100, 104)), list(range(200, 204))
    await host_only(stack, p)
    b = Req(rid="B", origin_input_ids=p + r + s, fill_ids=p + r + s)  # computes everything itself
    cache.match_req(b)
    b.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    await cache.admit(b, mem_quota=0)
    dev = stack.allocator.alloc(16)
    stack.req_to_token_pool.req_to_token[b.req_pool_idx][:16] = dev
    write_synthetic_kv(stack.device_pool, dev, torch.tensor(p + r + s))
    b.kv_committed_len = b.kv_allocated_len = 16
    restore = inject_load_faults(stack.copy_engine, delay=0.1, fail=True)
    a = Req(rid="A", origin_input_ids=p, fill_ids=p)
    cache.match_req(a)
    a.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    await cache.admit(a, wait_load=False)  # P's load in flight...
    cache.release_req(b)  # ...while B inserts P+R+S through it
    await cache.drain()  # the load fails: P loses its device copy, R+S keep theirs
    restore()
    cache.abort_req(a)
    cache.match_prefix(MatchPrefixParams(key=RadixKey(p + r)), count_hit=False)  # splits R | S
    cache.evict(PS)  # S, a device leaf, demoted to host
    await cache.drain()
    c = Req(rid="C", origin_input_ids=p + r + s, fill_ids=p + r + s)
    cache.match_req(c)
    c.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
    await cache.admit(c)
    n = int(c.prefix_indices.numel())
    assert verify_kv(stack.device_pool, c.prefix_indices, torch.tensor(p + r + s)[:n]) == 0
    cache.abort_req(c)
    cache.sanity_check()
    await stack.aclose()


async def test_an_abort_while_admit_waits_for_its_load_leaves_nothing_locked() -> None:
    """``abort_req`` from another task (a client gone) while the request's ``admit`` waits for
    its host->device load: admit then releases its lock and raises instead of admitting (the
    prefix stayed locked for good: never evictable)."""
    import pytest

    from hicache.errors import RequestAbortedError
    from hicache.prefix_cache import EvictParams

    stack = build_stack(StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                                    controller=ControllerConfig(prefetch_threshold=PS)))
    cache = stack.cache
    try:
        toks = list(range(100, 116))
        await serve_request(stack, toks, rid="seed")
        await cache.drain()
        cache.evict(EvictParams(num_tokens=10**6))  # the prefix is on host only
        restore = inject_load_faults(stack.copy_engine, delay=0.05)
        try:
            req = Req(rid="r", origin_input_ids=toks)
            cache.match_req(req)
            req.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
            task = asyncio.ensure_future(cache.admit(req))
            await asyncio.sleep(0.01)  # admit waits for the load
            cache.abort_req(req)
            with pytest.raises(RequestAbortedError):
                await task
            await cache.drain()
        finally:
            restore()
        assert cache.protected_size() == 0 and not cache.is_admitted(req)
        assert req.last_node is None and req.req_pool_idx is None
        again = await serve_request(stack, toks, rid="again")  # the rid is reusable, the pages too
        assert again.verify_failures == 0 and again.computed == 0
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_another_loads_failure_landing_mid_bookkeeping_does_not_fail_a_new_load(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A new load-back prunes the handles of ended loads. It asked a handle's counter whether
    it had failed, then whether it was done: a failure landing on the copy thread between the
    two made the second question raise that other load's error, and the new request's admit
    failed with it (its load started but never handed out)."""
    from hicache.memory.layer_counter import LayerDoneCounter

    stack = make()
    cache = stack.cache
    a, b = list(range(16)), list(range(100, 116))
    await host_only(stack, a, rid="a")
    await host_only(stack, b, rid="b")
    go = threading.Event()
    calls = iter([True])  # the first layer of the first load waits for its cue, then fails

    def fail_first() -> bool:
        first_call = next(calls, False)
        return first_call and go.wait(5)

    inject_load_faults(stack.copy_engine, fail=fail_first)
    first = Req(rid="first", origin_input_ids=a + [99])
    cache.match_req(first)
    r1 = await cache.admit(first, wait_load=False)
    assert r1.load_handle is not None
    counter = r1.load_handle.counter
    all_done = LayerDoneCounter.all_done

    def preempted(self: LayerDoneCounter) -> bool:
        if self is counter and not go.is_set():  # the copy thread fails the load right here
            go.set()
            deadline = time.monotonic() + 5
            while self.exception is None and time.monotonic() < deadline:
                time.sleep(0.001)
        return all_done(self)

    monkeypatch.setattr(LayerDoneCounter, "all_done", preempted)
    second = Req(rid="second", origin_input_ids=b + [98])
    cache.match_req(second)
    r2 = await cache.admit(second)
    assert r2.host_hit == 16 and verify_kv(stack.device_pool, second.prefix_indices, torch.tensor(b)) == 0
    await _abort_and_close(stack, first, second)
