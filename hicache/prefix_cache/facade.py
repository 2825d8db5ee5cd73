"""The request-level flow a server drives: match, prefetch, admit, release, abort.

These wrap the SGLang-style primitives of :class:`~hicache.prefix_cache.hiradix.HiRadixCache`
(``match_prefix``, ``prefetch_from_storage``, ``init_load_back``, ``inc_lock_ref``,
``cache_finished_req``) into the few calls an asyncio server makes per request, and record
where each prefix came from (device, host, storage) in the request and the metrics.

Why a collaborator the cache owns (``cache.flow``) and not a base class: the flow needs only a
narrow slice of the cache, spelled out as :class:`FlowHost`, so this module does not import the
cache class, and the per-request bookkeeping (which requests were matched, which admitted) lives
here, next to the calls that change it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from hicache.errors import RequestAbortedError, quoted
from hicache.prefix_cache.req import Req
from hicache.prefix_cache.types import (
    DecLockRefResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)

__all__ = ["AdmitResult", "FlowHost", "LoadBack", "RequestFlow"]


@dataclasses.dataclass
class AdmitResult:
    """Where the prefix of an admitted request came from, in tokens."""

    device_hit: int
    host_hit: int
    storage_hit: int
    prefix_len: int
    load_handle: Any = None
    #: (ours) a :class:`~hicache.observability.attribution.RequestAttribution` when the cache
    #: has an attributor
    attribution: Any = None


@dataclasses.dataclass
class LoadBack:
    """A host->device load of a matched prefix: the device slots it fills, the node now
    deepest on device, the completion future (``None`` off a loop) and the engine's handle.
    One that could not start for want of device memory has no slots and says how many
    tokens it needed (``lacking``)."""

    indices: torch.Tensor
    node: Any
    done: asyncio.Future[bool] | None = None
    handle: Any = None
    lacking: int = 0

    @property
    def started(self) -> bool:
        return self.lacking == 0 and self.indices.numel() > 0


#: ``make_room(tokens) -> bool``: free that many device slots, waiting if need be
MakeRoom = Callable[[int], Awaitable[bool]]

#: how often admit makes room and tries a load-back again (another turn may take the room
#: while it waits; each try re-matches, so what it loads is always what the tree holds then)
LOAD_BACK_TRIES = 4


class FlowHost(Protocol):
    """What :class:`RequestFlow` uses of its cache (a :class:`~hicache.prefix_cache.HiRadixCache`)."""

    root_node: Any
    req_to_token_pool: Any
    metrics: Any

    def match_prefix(self, params: MatchPrefixParams, *, count_hit: bool = True) -> MatchResult: ...
    def prefetch_from_storage(self, req_id: str, last_host_node: Any, new_input_tokens: list[int],
                              last_hash: str | None = None, *, prefix_tokens: list[int] | None = None,
                              extra_key: str | None = None, owner: object = None) -> bool: ...
    def is_prefetching(self, req_id: str) -> bool: ...
    async def wait_prefetch(self, req_id: str, *, hold: object = None) -> int: ...
    def release_prefetched(self, req_id: str, holder: object = None) -> None: ...
    def cancel_prefetch(self, req_id: str, holder: object = None) -> None: ...
    def loads_in_flight(self, indices: torch.Tensor) -> list[asyncio.Future[bool]]: ...
    def start_load_back(self, params: InitLoadBackParams) -> LoadBack | None: ...
    def inc_lock_ref(self, node: Any) -> IncLockRefResult: ...
    def dec_lock_ref(self, node: Any) -> DecLockRefResult: ...
    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None: ...
    async def make_device_room(self, num_tokens: int) -> bool: ...


def remember_aborted(aborted: weakref.WeakSet[Any], req: Any) -> None:
    """Note ``req`` in ``aborted`` (requests whose admit must refuse them), where its type can
    be weakly referenced (an engine's own request type may use ``__slots__``)."""
    try:
        aborted.add(req)
    except TypeError:
        pass


class RequestFlow:
    """Per-request calls of a tiered cache, over the primitives of :class:`FlowHost`."""

    def __init__(self, cache: FlowHost) -> None:
        self.cache = cache
        self.matched: set[str] = set()  # rids whose hit was counted by match_req
        # requests admit() locked a prefix for, by the Req itself (not its rid): requests
        # reusing a rid may overlap, and none is mistaken for another (one holding a lock)
        self.admitted: set[Req] = set()
        # requests inside admit(), and those of them aborted meanwhile (by another task):
        # admit releases its lock and raises instead of recording them as admitted
        self.admitting: set[Req] = set()
        self._aborted: set[Req] = set()
        # requests aborted before their admit began (an admit task that had not run yet): that
        # admit refuses them (weak: an aborted request that is dropped is forgotten with it)
        self._aborted_early: weakref.WeakSet[Req] = weakref.WeakSet()

    def forget(self, req: Any) -> None:
        """``req`` is over (finished, or its lock taken over by a decorator)."""
        rid = req.rid
        self.admitted.discard(req)
        self.matched.discard(rid)

    def is_admitted(self, req: Any) -> bool:
        """Whether :meth:`admit` locked a prefix for this very request."""
        return req in self.admitted

    def match_req(self, req: Req, max_prefix_len: int | None = None) -> MatchResult:
        """Match ``req``'s tokens and record the result in its fields (no lock taken). Only
        the first match of a request until :meth:`admit` counts as a hit (eviction policies and
        selective write-through count hits)."""
        tokens = req.fill_ids or req.origin_input_ids
        if max_prefix_len is not None:
            tokens = tokens[:max_prefix_len]
        count = req.rid not in self.matched
        self.matched.add(req.rid)
        m = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(list(tokens), req.extra_key), req=req), count_hit=count
        )
        req.record_match(m)
        return m

    def start_prefetch(self, req: Req, max_prefix_len: int | None = None) -> bool:
        """After :meth:`match_req`: prefetch from storage what follows the host hit."""
        tokens = req.fill_ids or req.origin_input_ids
        if max_prefix_len is not None:
            tokens = tokens[:max_prefix_len]
        hit = req.last_matched_prefix_len
        return self.cache.prefetch_from_storage(
            req.rid,
            req.last_host_node or self.cache.root_node,
            list(tokens[hit:]),
            req.storage_prior_hash,
            prefix_tokens=list(tokens[:hit]),
            extra_key=req.extra_key,
            owner=req,
        )

    async def admit(self, req: Req, *, mem_quota: int | None = None, wait_load: bool = True,
                    max_prefix_len: int | None = None, make_room: MakeRoom | None = None) -> AdmitResult:
        """The scheduler picked ``req``: finish its prefetch (as the stop policy allows),
        re-match, load the host part to device (all or nothing) and lock the prefix.

        On return ``req.prefix_indices`` are device slots of the reusable prefix,
        ``req.last_node`` is locked and ``req.cache_protected_len`` is set. With
        ``wait_load=False`` the load may still be running: wait on ``result.load_handle``.
        A failed load falls back to the device hit alone. Cancelling ``admit`` releases
        what it locked (the load itself completes and its pages stay in the tree).

        When eviction alone cannot find device slots for the host part, ``make_room`` (default:
        the cache's ``make_device_room``; the session cache passes one that offloads idle
        sessions) is awaited and the load tried again on a fresh match, up to
        :data:`LOAD_BACK_TRIES` times: concurrent turns then take turns with the room instead
        of recomputing histories that sit on host.
        """
        if req in self._aborted_early:
            # nothing was taken yet: the request is gone, its admit must not lock a prefix
            # nobody would release (the abort released what there was)
            raise RequestAbortedError(f"request {quoted(req.rid)} was aborted before it was admitted")
        self.admitting.add(req)
        try:
            return await self._admit(req, mem_quota, wait_load, max_prefix_len, make_room)
        finally:
            # the fetched pages were held from the prefetch's end; by now they are locked by the
            # load (or not used, or the request is gone): returned, aborted or cancelled alike
            self.cache.release_prefetched(req.rid, req)
            self.admitting.discard(req)
            self._aborted.discard(req)

    async def _admit(self, req: Req, mem_quota: int | None, wait_load: bool,
                     max_prefix_len: int | None, make_room: MakeRoom | None) -> AdmitResult:
        cache = self.cache
        explain = getattr(cache, "explain_admit", None)
        pending = explain.before_wait(req) if explain is not None else None
        # hold=req: the pages the prefetch attaches stay protected while the match below waits
        # for loads and the load-back waits for device room (admit's exit releases them)
        fetched = await cache.wait_prefetch(req.rid, hold=req) if cache.is_prefetching(req.rid) else 0
        room = make_room or cache.make_device_room
        m = await self._settled_match(req, max_prefix_len)
        node = m.last_device_node
        cache.inc_lock_ref(node)  # hold the device prefix while making room for the load
        load: LoadBack | None = None
        try:
            for attempt in range(LOAD_BACK_TRIES):
                if not m.host_hit_length:
                    break
                params = InitLoadBackParams(m.last_host_node, m.host_hit_length, mem_quota, req)
                load = cache.start_load_back(params)
                if load is None or load.started or attempt == LOAD_BACK_TRIES - 1:
                    break
                if not await room(load.lacking):
                    break
                m = await self._settled_match(req, max_prefix_len)  # the tree moved meanwhile
                load = None
                cache.inc_lock_ref(m.last_device_node)
                cache.dec_lock_ref(node)
                node = m.last_device_node
        except BaseException:
            # cancelled, or ``make_room`` (the caller's: the session cache passes its own)
            # raised: the request was never admitted, so its abort does not unlock this prefix
            # (only an admitted one's): released here or the lock stays for good
            cache.dec_lock_ref(node)  # the request is gone: nothing stays locked
            self.matched.discard(req.rid)
            req.last_node = None
            raise
        device = m.device_hit_length
        host = 0
        handle = None
        if load is not None and load.started:
            handle = load.handle
            cache.inc_lock_ref(load.node)
            cache.dec_lock_ref(node)
            node = load.node
            req.prefix_indices = torch.cat([m.device_indices, load.indices.to(m.device_indices.device)])
            host = int(load.indices.numel())
            if wait_load and load.done is not None:
                try:
                    ok = await asyncio.shield(load.done)
                except asyncio.CancelledError:
                    cache.dec_lock_ref(node)  # the request is gone: nothing stays locked
                    self.matched.discard(req.rid)
                    req.last_node = None
                    raise
                if not ok:
                    cache.inc_lock_ref(m.last_device_node)
                    cache.dec_lock_ref(node)
                    node, host, handle = m.last_device_node, 0, None
                    req.prefix_indices = m.device_indices
        elif load is not None:
            cache.metrics.incr("load_back_skipped")
        self.matched.discard(req.rid)
        if req in self._aborted:  # aborted while admit waited: nothing stays locked
            cache.dec_lock_ref(node)
            req.last_node = None
            req.prefix_indices = m.device_indices[:0]
            req.cache_protected_len = 0
            raise RequestAbortedError(f"request {quoted(req.rid)} was aborted while it was being admitted")
        self.admitted.add(req)
        storage = min(fetched, host)
        req.last_node = node
        req.cache_protected_len = int(req.prefix_indices.numel())
        req.host_hit_length = host - storage
        req.storage_hit_length = storage
        total = len(req.fill_ids or req.origin_input_ids)
        counts = (total, total - req.cache_protected_len, device, host - storage, storage)
        if req.defer_counts:
            req.pending_counts = counts
        else:
            self._count(counts)
        if explain is not None:
            req.attribution = explain.after_admit(req, pending, m, device, host - storage, storage)
        return AdmitResult(device, host - storage, storage, req.cache_protected_len, handle, req.attribution)

    def count_admitted(self, req: Req) -> None:
        """Count an admitted request whose counts admit deferred (``req.defer_counts``)."""
        counts, req.pending_counts = req.pending_counts, None
        if counts is not None:
            self._count(counts)

    def _count(self, counts: tuple[int, int, int, int, int]) -> None:
        total, computed, device, host, storage = counts
        metrics = self.cache.metrics
        metrics.incr("requests")
        metrics.incr("prompt_tokens", total)
        metrics.incr("computed_tokens", computed)
        metrics.hit("device", device)
        metrics.hit("host", host)
        metrics.hit("storage", storage)

    async def _settled_match(self, req: Req, max_prefix_len: int | None) -> MatchResult:
        """Match, waiting first for loads that still write into the device hit: another
        request's load gives its nodes their device slots when it *starts*, so their KV is
        valid only once it ends (a failed load drops them; the match after shows that).

        The returned match is only good until the next suspension: callers lock its nodes
        (``inc_lock_ref``) before any ``await``, or another request may evict them between."""
        m = self.match_req(req, max_prefix_len)
        while True:
            pending = self.cache.loads_in_flight(m.device_indices)
            if not pending:
                return m
            await asyncio.wait(pending)
            m = self.match_req(req, max_prefix_len)

    def release_req(self, req: Req, is_insert: bool = True) -> None:
        """:meth:`cache_finished_req`, then give the request's ``req_to_token`` slot back."""
        self.cache.cache_finished_req(req, is_insert=is_insert)
        if req.req_pool_idx is not None:
            self.cache.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None

    def abort_req(self, req: Req) -> None:
        """Abort: cancel the prefetch (its host pages are freed), drop the lock and free the
        request's own KV without inserting it. Safe at any point after :meth:`match_req`,
        also while its :meth:`admit` waits (that admit then releases what it locked and raises
        :class:`~hicache.errors.RequestAbortedError`), or before it began (an admit task that
        had not run yet raises so too, having taken nothing)."""
        if req in self.admitting:
            self._aborted.add(req)
        elif not self.is_admitted(req):
            remember_aborted(self._aborted_early, req)
        self.matched.discard(req.rid)
        if not self.is_admitted(req):  # match_req set last_node but locked nothing
            req.last_node = None
            req.cache_protected_len = 0
        self.cache.cancel_prefetch(req.rid, req)
        if req.req_pool_idx is not None:
            self.release_req(req, is_insert=False)
        elif req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
            req.last_node = None
        self.admitted.discard(req)

