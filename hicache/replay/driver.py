"""Serving one request against a cache stack the way a server would, minus the model.

match -> prefetch -> admit (wait, load back, lock) -> verify the reused KV -> "compute" the rest
(synthetic KV) -> insert. Used by the replay and by the tests, so both exercise the real path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from hicache.errors import HiCacheError
from hicache.prefix_cache.req import Req
from hicache.stack import CacheStack
from hicache.replay.synthetic import verify_kv, write_synthetic_kv

__all__ = ["RequestOutcome", "alloc_evicting", "serve_request", "OutOfDeviceMemory"]


class OutOfDeviceMemory(HiCacheError, RuntimeError):
    """The device pool cannot hold the request even after evicting everything evictable (and
    waiting for the copies in flight). A :class:`HiCacheError`: the CLI reports it in one line,
    exit status 2 (a traceback exited 1, the status of "restored KV differs")."""


@dataclasses.dataclass
class RequestOutcome:
    tokens: int
    device_hit: int
    host_hit: int
    storage_hit: int
    computed: int
    verify_failures: int
    #: hits per tier and misses per reason (``None`` when the stack's attribution is off)
    attribution: Any = None


async def alloc_evicting(stack: CacheStack, n: int) -> torch.Tensor | None:
    """``n`` device slots, evicting for them, and once more after the copies and loads in
    flight have landed; ``None`` when they still do not fit."""
    cache = stack.cache
    dev = stack.allocator.alloc(n)
    if dev is None:
        await cache.evict_async(n - stack.allocator.available_size())
        dev = stack.allocator.alloc(n)
    if dev is None:
        # device pages whose host copy or load is still in flight are not evictable yet (with
        # drain_between_requests = false the copies go on between requests): the room is
        # there once they land, so wait for them before calling it out of memory
        await stack.controller.wait_prefetches()
        await cache.drain()
        await cache.evict_async(n - stack.allocator.available_size())
        dev = stack.allocator.alloc(n)
    return dev


async def serve_request(
    stack: CacheStack,
    tokens: list[int],
    *,
    rid: str,
    extra_key: str | None = None,
    priority: int = 0,
    prefetch: bool = True,
    verify: bool = True,
    mem_quota: int | None = None,
) -> RequestOutcome:
    """Run one request through the cache; returns where its prefix came from."""
    cache = stack.cache
    ps = stack.config.page_size
    req = Req(rid=rid, origin_input_ids=tokens, fill_ids=tokens, extra_key=extra_key, priority=priority)
    token_tensor = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    cache.match_req(req)
    if prefetch:
        cache.start_prefetch(req)
    slots = stack.req_to_token_pool.alloc(1)
    if slots is None:
        cache.abort_req(req)
        raise RuntimeError("no free request slot")
    req.req_pool_idx = slots[0]
    res = await cache.admit(req, mem_quota=mem_quota)
    prefix = req.prefix_indices
    p = int(prefix.numel())
    failures = verify_kv(stack.device_pool, prefix, token_tensor[:p]) if verify and p else 0
    need = len(tokens) - p
    n_alloc = -(-need // ps) * ps
    dev = await alloc_evicting(stack, n_alloc)
    if dev is None:
        cache.abort_req(req)
        raise OutOfDeviceMemory(f"request {rid}: {n_alloc} tokens do not fit on device")
    row = stack.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[:p] = prefix
    row[p : p + n_alloc] = dev
    if need:
        write_synthetic_kv(stack.device_pool, dev[:need], token_tensor[p:])
    req.kv_committed_len = len(tokens)
    req.kv_allocated_len = p + n_alloc
    cache.release_req(req)
    return RequestOutcome(len(tokens), res.device_hit, res.host_hit, res.storage_hit, need, failures,
                          res.attribution)
