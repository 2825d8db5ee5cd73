"""Giving a session slot's KV up: its committed whole pages go to the tree, the rest is freed.

Why to the tree rather than freed (what SGLang's ``release_session`` does): the KV of a
conversation is what its next turn needs; once the inner radix tree owns the pages, every tier
rule of the tree applies to them (write-back to host and storage, demotion under pressure,
locking while a copy runs) and any later request with that history finds them with an ordinary
match. Only the partly filled last page and pages allocated past the committed length are
freed, plus pages the tree already had for the same tokens (duplicates).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from hicache.errors import quoted
from hicache.prefix_cache.radix import free_token_pages
from hicache.prefix_cache.types import DecLockRefParams, InsertParams, MatchPrefixParams, RadixKey
from hicache.session.slot import SessionSlot, ceil_align, floor_align
from hicache.session.writeback import WriteBackQueue

__all__ = ["free_row", "hand_over"]

logger = logging.getLogger("hicache.session")


def free_row(req_to_token_pool: Any, idx: int) -> None:
    """Return a ``req_to_token`` row (our pool checks double frees; SGLang's is a list)."""
    if callable(getattr(req_to_token_pool, "free", None)):
        req_to_token_pool.free(idx)
    else:
        req_to_token_pool.free_slots.append(idx)


def _match_quietly(inner: Any, params: MatchPrefixParams) -> Any:
    """Look the handed-over path up without counting a hit where the cache allows it (the
    insert counted one already; a second would skew eviction and selective write-through)."""
    if "count_hit" in inspect.signature(inner.match_prefix).parameters:
        return inner.match_prefix(params, count_hit=False)
    return inner.match_prefix(params)


def _give_to_tree(inner: Any, slot: SessionSlot, ours: Any, protected: int, writeback: WriteBackQueue,
                  refused: Callable[[], None] | None) -> tuple[int, int]:
    """Insert the slot's committed pages ``ours`` into the tree and queue their write-back;
    frees our duplicates of pages the tree had. Returns (tokens the tree now holds of the row,
    tokens handed to it); ``(protected, 0)`` when the tree refused them (see :func:`hand_over`)."""
    ps = inner.page_size
    aligned = int(ours.numel())
    key = RadixKey(list(slot.token_ids[:aligned]), slot.extra_key)
    try:
        # the first turn counted its hits on the protected part (its match, its own chunks):
        # counted again here, a history nobody reused looked reused to placement and eviction
        inner.insert(InsertParams(key=key, value=ours, priority=slot.priority, inserted_len=protected))
    except ValueError as exc:
        logger.warning("session %s: the tree refused its history (%s); its KV is freed, not kept",
                       quoted(slot.session_id), exc)
        if refused is not None:
            refused()
        return protected, 0
    m = _match_quietly(inner, MatchPrefixParams(key=key))
    theirs = m.device_indices.to(ours.device)
    if theirs.numel() < aligned:  # cannot happen: an inserted path is on device
        logger.error("session %s: the tree holds %d of %d inserted tokens", quoted(slot.session_id),
                     theirs.numel(), aligned)
    n = min(aligned, int(theirs.numel()))
    mine = ours[protected:n]
    dup = mine[mine != theirs[protected:n]]
    if dup.numel():  # positions the tree had already: our pages there are duplicates
        free_token_pages(inner.token_to_kv_pool_allocator, dup, ps)
    kept = max(protected, n)
    writeback.enqueue(slot.session_id, m.last_device_node, kept - protected)
    return kept, kept - protected - int(dup.numel())


def hand_over(inner: Any, slot: SessionSlot, *, tree: bool, writeback: WriteBackQueue,
              refused: Callable[[], None] | None = None) -> int:
    """Give ``slot``'s KV up: insert its committed whole pages into ``inner`` (when ``tree``)
    and queue their write-back, free every other page it owns, drop its tree lock, return its
    row and clear it. Returns the tokens handed to the tree.

    A tree refuses a key it cannot hold (a token id that is no uint32: storage keys hash them)
    with ``ValueError`` before it changes anything; the history is then freed like a tail,
    and ``refused()`` is called: one such session must not stop the others' hand-overs (the
    reaper, pressure relief) nor fail the request that needed the room. Any other error is
    raised once everything past the tree's part is let go (see the ``finally``)."""
    assert slot.req_pool_idx is not None
    ps = inner.page_size
    allocator = inner.token_to_kv_pool_allocator
    row = inner.req_to_token_pool.req_to_token[slot.req_pool_idx]
    protected = slot.cache_protected_len
    committed = min(slot.kv_committed_len, len(slot.token_ids))
    aligned = floor_align(committed, ps)
    end = ceil_align(max(slot.kv_allocated_len, committed), ps)
    kept = protected
    handed = 0
    try:
        if tree and aligned > protected:
            try:
                kept, handed = _give_to_tree(inner, slot, row[:aligned].clone(), protected, writeback, refused)
            except BaseException:
                # raised after the insert (queueing the write-back): the tree may own the
                # history now, and freeing it would free the tree's pages. Past it is ours.
                kept = max(kept, aligned)
                raise
    finally:
        # whatever the tree hand-off did, the rest is let go: a slot left half given up kept
        # its row, its tail pages and its tree lock until the reaper timed the session out
        if end > kept:
            free_token_pages(allocator, row[kept:end].clone(), ps)
        if slot.last_node is not None:
            if slot.swa_uuid_for_lock is not None:
                inner.dec_lock_ref(slot.last_node, DecLockRefParams(swa_uuid_for_lock=slot.swa_uuid_for_lock))
            else:
                inner.dec_lock_ref(slot.last_node)
        free_row(inner.req_to_token_pool, slot.req_pool_idx)
        slot.clear_kv()
    return handed
