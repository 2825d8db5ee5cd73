"""``RowExtender``: a request's ``req_to_token`` row and pages grown to cover a sequence length.

Why through its host's ``ensure_free`` and ``ensure_req_slots``: room is made before anything
is allocated, so idle sessions are offloaded rather than the request failing; only the memory
of *running* turns cannot be reclaimed, and then the caller gets ``None`` and must abort or
requeue a request. Making room may wait (write-backs that pin pages), so the cache may close,
or the request be aborted, meanwhile; nothing this call took may stay then.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hicache.errors import RequestAbortedError, quoted
from hicache.prefix_cache.radix import free_token_pages
from hicache.prefix_cache.req import Req
from hicache.session.handover import free_row
from hicache.session.lifecycle import Lifecycle
from hicache.session.slot import ceil_align

__all__ = ["ExtendHost", "RowExtender"]


class ExtendHost(Protocol):
    """What :class:`RowExtender` uses of its cache (a :class:`~hicache.session.SessionAwareCache`)."""

    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int

    def ensure_req_slots(self, n: int = 1) -> bool: ...
    async def ensure_free(self, num_tokens: int) -> bool: ...


class RowExtender:
    """Grows requests' rows for ``host``; ``lifecycle`` says whether the cache closed meanwhile."""

    def __init__(self, host: ExtendHost, lifecycle: Lifecycle) -> None:
        self._host = host
        self._lifecycle = lifecycle

    async def alloc_extend(self, req: Req, seq_len: int) -> torch.Tensor | None:
        """Make ``req``'s row cover token positions ``[0, seq_len)`` and return those slots.

        A request without a row gets one (its prefix slots copied in); pages past the ones the
        row already has are allocated, reusing the partly filled last page. Room is made first
        (:meth:`ensure_free`, :meth:`ensure_req_slots`), so idle sessions are offloaded rather
        than the request failing. ``None`` when the memory cannot be found even so (nothing
        of this call stays allocated; the request keeps what it had). A negative ``seq_len``,
        or one past the row's ``max_context_len``, is a :class:`ValueError`.
        """
        self._lifecycle.check_open()
        host = self._host
        pool = host.req_to_token_pool
        ps = host.page_size
        if seq_len < 0:
            # refused before anything is allocated: -1 needed no page and returned row[:-1], the
            # row's slots mostly unallocated or another request's (garbage KV to the caller)
            raise ValueError(f"seq_len must not be negative, got {seq_len}")
        need = ceil_align(seq_len, ps)
        if need > pool.max_context_len:
            # rows hold whole pages: the last page of this length would not fit (past the limit,
            # or a max_context_len that is no multiple of the page size), refused before
            # anything is allocated
            raise ValueError(f"seq_len {seq_len} exceeds max_context_len {pool.max_context_len}: it needs {need} "
                             f"slots in whole pages of {ps}")
        new_row = req.req_pool_idx is None
        if new_row:
            if not host.ensure_req_slots(1):
                return None
            got = pool.alloc(1)
            if not got:
                return None
            req.req_pool_idx = got[0]
            n = int(req.prefix_indices.numel())
            row = pool.req_to_token[req.req_pool_idx]
            if n:
                row[:n] = req.prefix_indices.to(row.device)
            req.kv_allocated_len = n
            req.kv_committed_len = n
        idx = req.req_pool_idx
        if idx is None:  # given one above when it had none
            raise RuntimeError(f"request {quoted(req.rid)} has no req_to_token row")
        row = pool.req_to_token[idx]
        have = ceil_align(int(req.kv_allocated_len), ps)
        want = ceil_align(seq_len, ps)
        if want > have:
            alloc = host.token_to_kv_pool_allocator
            new = None
            for _ in range(8):  # another coroutine may take the room made while we waited
                if not await host.ensure_free(want - have):
                    break
                new = alloc.alloc(want - have)
                if new is not None:
                    break
            if self._lifecycle.closed or req.req_pool_idx != idx:
                # Closed, or aborted, while room was made (aclose aborts every running session
                # turn: its row and pages are freed and req.req_pool_idx is None): the row is no
                # longer the request's to write or free, and nothing this call took may stay.
                if new is not None:
                    free_token_pages(alloc, new, ps)
                if new_row and req.req_pool_idx == idx:  # closed, not aborted: as it came
                    free_row(pool, idx)
                    req.req_pool_idx = None
                    req.kv_allocated_len = req.kv_committed_len = 0
                self._lifecycle.check_open()
                raise RequestAbortedError(f"request {quoted(req.rid)} was aborted while it waited for device room")
            if new is None:
                if new_row:  # leave the request as it came
                    free_row(pool, idx)
                    req.req_pool_idx = None
                    req.kv_allocated_len = req.kv_committed_len = 0
                return None
            row[have:want] = new.to(row.device)
        req.kv_allocated_len = max(int(req.kv_allocated_len), seq_len)
        return row[:seq_len].clone()
