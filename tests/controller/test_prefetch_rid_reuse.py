"""A request aborted while its admit waits for its prefetch, and its rid reused by a request
whose own prefetch started meanwhile: the first one's wake-up leaves the second's prefetch
alone (it took it: no storage hit, host pages held until close, the rid unable to prefetch)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from _hicache_faults import FaultyStorage, seed_memory_store
from hicache.controller import ControllerConfig
from hicache.errors import RequestAbortedError
from hicache.prefix_cache import Req
from hicache.replay import StackConfig, build_stack
from hicache.storage.registry import register_backend

register_backend("faulty-memory", FaultyStorage)


async def test_a_wake_up_after_an_abort_leaves_the_reused_rids_prefetch_alone() -> None:
    store = uuid.uuid4().hex
    a, b = list(range(0, 16)), list(range(100, 116))
    await seed_memory_store(store, a, b, page_size=4)
    cfg = StackConfig(page_size=4, device_pages=16, host_pages=32, storage_backend="faulty-memory",
                      storage_options={"store_id": store},
                      controller=ControllerConfig(prefetch_threshold=4, prefetch_policy="wait_complete"))
    stack = build_stack(cfg)
    cache, host = stack.cache, stack.host_pool
    try:
        stack.storage.delay = 0.3  # a slow store
        one = Req(rid="r", origin_input_ids=a)
        cache.match_req(one)
        assert cache.start_prefetch(one)
        waiting = asyncio.ensure_future(cache.admit(one))
        await asyncio.sleep(0.05)  # one's admit waits for its prefetch
        cache.abort_req(one)
        two = Req(rid="r", origin_input_ids=b)  # the rid reused
        cache.match_req(two)
        assert cache.start_prefetch(two)
        with pytest.raises(RequestAbortedError):
            await waiting
        assert cache.is_prefetching("r")  # two's
        stack.storage.delay = 0.0
        res = await cache.admit(two)
        assert res.storage_hit == 16  # its whole prompt, from storage
        cache.abort_req(two)
        await stack.controller.wait_prefetches()
        await cache.drain()
        held = sum(int(n.host_value.numel()) for n in cache._nodes() if n.host_value is not None)
        assert host.size - host.available_size() == held  # nothing held beyond the tree
        assert not stack.controller._prefetcher._prefetches
    finally:
        await stack.aclose()
