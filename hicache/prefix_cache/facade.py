"""The request-level flow a server drives: match, prefetch, admit, release, abort.

These wrap the SGLang-style primitives of :class:`~hicache.prefix_cache.hiradix.HiRadixCache`
(``match_prefix``, ``prefetch_from_storage``, ``init_load_back``, ``inc_lock_ref``,
``cache_finished_req``) into the few calls an asyncio server makes per request, and record
where each prefix came from (device, host, storage) in the request and the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from hicache.prefix_cache.req import Req
from hicache.prefix_cache.types import InitLoadBackParams, MatchPrefixParams, MatchResult, RadixKey

if TYPE_CHECKING:
    from hicache.prefix_cache.hiradix import HiRadixCache

__all__ = ["AdmitResult", "RequestFlowMixin"]


@dataclasses.dataclass
class AdmitResult:
    """Where the prefix of an admitted request came from, in tokens."""

    device_hit: int
    host_hit: int
    storage_hit: int
    prefix_len: int
    load_handle: Any = None


class RequestFlowMixin:
    """Per-request calls of :class:`HiRadixCache` (mixed in; uses its primitives)."""

    def match_req(self: HiRadixCache, req: Req, max_prefix_len: int | None = None) -> MatchResult:
        """Match ``req``'s tokens and record the result in its fields (no lock taken). Only
        the first match of a request until :meth:`admit` counts as a hit (eviction policies and
        selective write-through count hits)."""
        tokens = req.fill_ids or req.origin_input_ids
        if max_prefix_len is not None:
            tokens = tokens[:max_prefix_len]
        count = req.rid not in self._matched
        self._matched.add(req.rid)
        m = self.match_prefix(
            MatchPrefixParams(key=RadixKey(list(tokens), req.extra_key), req=req), count_hit=count
        )
        req.record_match(m)
        return m

    def start_prefetch(self: HiRadixCache, req: Req, max_prefix_len: int | None = None) -> bool:
        """After :meth:`match_req`: prefetch from storage what follows the host hit."""
        tokens = req.fill_ids or req.origin_input_ids
        if max_prefix_len is not None:
            tokens = tokens[:max_prefix_len]
        hit = req.last_matched_prefix_len
        return self.prefetch_from_storage(
            req.rid,
            req.last_host_node or self.root_node,
            list(tokens[hit:]),
            req.storage_prior_hash,
            prefix_tokens=list(tokens[:hit]),
            extra_key=req.extra_key,
        )

    async def admit(self: HiRadixCache, req: Req, *, mem_quota: int | None = None, wait_load: bool = True,
                    max_prefix_len: int | None = None) -> AdmitResult:
        """The scheduler picked ``req``: finish its prefetch (as the stop policy allows),
        re-match, load the host part to device (all or nothing) and lock the prefix.

        On return ``req.prefix_indices`` are device slots of the reusable prefix,
        ``req.last_node`` is locked and ``req.cache_protected_len`` is set. With
        ``wait_load=False`` the load may still be running: wait on ``result.load_handle``.
        A failed load falls back to the device hit alone. Cancelling ``admit`` releases
        what it locked (the load itself completes and its pages stay in the tree).
        """
        fetched = await self.wait_prefetch(req.rid) if req.rid in self._prefetching else 0
        m = self.match_req(req, max_prefix_len)
        while True:
            # Part of the device hit may be a prefix another request is still loading from
            # host (its nodes got their device slots when the load started): wait for those
            # loads before using their slots, then match again (a failed load drops them).
            pending = self.loads_in_flight(m.device_indices)
            if not pending:
                break
            await asyncio.wait(pending)
            m = self.match_req(req, max_prefix_len)
        device = m.device_hit_length
        host = m.host_hit_length
        handle = None
        node = m.last_device_node
        self.inc_lock_ref(node)  # hold the device prefix while making room for the load
        if host:
            new, loaded_node = self.init_load_back(InitLoadBackParams(m.last_host_node, host, mem_quota, req))
            if new.numel():
                handle = self._new_handles[-1] if self._new_handles else None
                load = self._loads[-1] if self._loads else None
                self.inc_lock_ref(loaded_node)
                self.dec_lock_ref(node)
                node = loaded_node
                req.prefix_indices = torch.cat([m.device_indices, new.to(m.device_indices.device)])
                host = int(new.numel())
                if wait_load and load is not None and load.done is not None:
                    try:
                        ok = await asyncio.shield(load.done)
                    except asyncio.CancelledError:
                        self.dec_lock_ref(node)  # the request is gone: nothing stays locked
                        self._matched.discard(req.rid)
                        req.last_node = None
                        raise
                    if not ok:
                        self.inc_lock_ref(m.last_device_node)
                        self.dec_lock_ref(node)
                        node, host, handle = m.last_device_node, 0, None
                        req.prefix_indices = m.device_indices
            else:
                host = 0
        self._matched.discard(req.rid)
        self._admitted[req.rid] = req
        storage = min(fetched, host)
        req.last_node = node
        req.cache_protected_len = int(req.prefix_indices.numel())
        req.host_hit_length = host - storage
        req.storage_hit_length = storage
        total = len(req.fill_ids or req.origin_input_ids)
        self.metrics.incr("requests")
        self.metrics.incr("prompt_tokens", total)
        self.metrics.incr("computed_tokens", total - req.cache_protected_len)
        self.metrics.hit("device", device)
        self.metrics.hit("host", host - storage)
        self.metrics.hit("storage", storage)
        return AdmitResult(device, host - storage, storage, req.cache_protected_len, handle)

    def release_req(self: HiRadixCache, req: Req, is_insert: bool = True) -> None:
        """:meth:`cache_finished_req`, then give the request's ``req_to_token`` slot back."""
        self.cache_finished_req(req, is_insert=is_insert)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None

    def abort_req(self: HiRadixCache, req: Req) -> None:
        """Abort: cancel the prefetch (its host pages are freed), drop the lock and free the
        request's own KV without inserting it. Safe at any point after :meth:`match_req`."""
        self._matched.discard(req.rid)
        if not self.is_admitted(req):  # match_req set last_node but locked nothing
            req.last_node = None
            req.cache_protected_len = 0
        if self.controller.abort_prefetch(req.rid) or req.rid in self._prefetching:
            state = self._prefetching.pop(req.rid, None)
            if state is not None:
                self._dec_host_ref(state.anchor)
        if req.req_pool_idx is not None:
            self.release_req(req, is_insert=False)
        elif req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None
        if self._admitted.get(req.rid) is req:
            del self._admitted[req.rid]

