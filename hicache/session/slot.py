"""``SessionSlot``: where a streaming session's KV waits between turns.

Why a slot and not the tree: a streaming session's next turn always extends the exact history
of the previous one, so its KV is known without looking anything up. Keeping the request's
``req_to_token`` row alive between turns lets the next turn reuse it by position (no radix walk,
no hashing, no split), and lets the turn append in place, including into the partly filled last
page.

Ownership inside a held row (positions are token positions of the conversation):

* ``[0, cache_protected_len)`` - pages of the tree, matched by the first turn and locked through
  ``last_node`` until the slot gives its KV up; never written by a later turn.
* ``[cache_protected_len, ceil(kv_allocated_len))`` - pages owned by the slot (whole pages).

A slot is *attached* while one request of the session runs on it (from its match to its finish
or abort). Only a detached slot may be offloaded, released or reaped, because the attached
request reads and writes the row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hicache.prefix_cache.req import Req

__all__ = ["SessionSlot", "VirtualNode", "ceil_align", "floor_align"]


#: Mamba state a slot carries between turns for SGLang interface parity (not interpreted here)
MAMBA_FIELDS = (
    "mamba_pool_idx",
    "mamba_ping_pong_track_buffer",
    "mamba_next_track_idx",
    "mamba_last_track_seqlen",
    "mamba_branching_seqlen",
)


def _copy_fields(src: object, dst: object, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(dst, name, getattr(src, name))


def ceil_align(n: int, page_size: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // page_size) * page_size


def floor_align(n: int, page_size: int) -> int:
    """``n`` rounded down to a whole number of pages."""
    return n // page_size * page_size


class VirtualNode:
    """Stands in for a tree node in a restored turn's match result.

    The scheduler locks and unlocks whatever node a match hands it; for a restored turn the KV
    is protected by the slot itself, so locks on this node are no-ops, and the wrapper tells it
    apart from a real node by type.
    """

    __slots__ = ("session_id",)

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"VirtualNode(session={self.session_id!r})"


@dataclasses.dataclass(eq=False)
class SessionSlot:
    """The KV state of one streaming session between (and during) its turns."""

    session_id: str
    virtual_node: VirtualNode = dataclasses.field(init=False)

    # the held row (None: the slot holds no KV; its history lives in the tree, if anywhere)
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    extra_key: str | None = None
    priority: int = 0

    # the first turn's tree match, locked until the slot gives its KV up
    last_node: Any = None
    cache_protected_len: int = 0

    # interface parity with SGLang's slot (sliding window, mamba); carried, not interpreted
    swa_uuid_for_lock: Any = None
    swa_evicted_seqlen: int = 0
    mamba_pool_idx: Any = None
    mamba_ping_pong_track_buffer: Any = None
    mamba_next_track_idx: Any = None
    mamba_last_track_seqlen: Any = None
    mamba_branching_seqlen: Any = None

    # the running turn
    attached_rid: str | None = None
    attached_req: Req | None = None
    turn_prefix_len: int = 0
    admitted: bool = False
    #: the admitted turn's session counts (prefix length, resume tier) its caller deferred
    #: (``Req.defer_counts``) until it really starts (``count_admitted``)
    uncounted: tuple[int, str | None] | None = None
    closing: bool = False
    last_used: float = 0.0

    def __post_init__(self) -> None:
        self.virtual_node = VirtualNode(self.session_id)

    @property
    def is_holding_kv(self) -> bool:
        """Whether the slot holds a ``req_to_token`` row (and the pages listed in it)."""
        return self.req_pool_idx is not None

    @property
    def is_idle(self) -> bool:
        """Holding KV with no request running on it: may be offloaded."""
        return self.is_holding_kv and self.attached_rid is None

    def held_tokens(self, page_size: int) -> int:
        """Device token slots the slot owns beyond the tree-protected prefix (whole pages)."""
        if not self.is_holding_kv:
            return 0
        return ceil_align(self.kv_allocated_len, page_size) - self.cache_protected_len

    def save_from_req(self, req: Req, *, is_first: bool) -> None:
        """Take over a finished turn's row. On the first turn the request's tree lock moves to
        the slot too (``last_node``, ``cache_protected_len``). The request no longer owns the
        row afterwards (``req.req_pool_idx`` becomes ``None``), so the server does not free it."""
        committed = int(req.kv_committed_len)
        self.req_pool_idx = req.req_pool_idx
        self.kv_committed_len = committed
        self.kv_allocated_len = max(int(req.kv_allocated_len), committed)
        self.token_ids = req.full_ids[:committed]
        self.extra_key = req.extra_key
        self.priority = req.priority
        self.swa_evicted_seqlen = req.swa_evicted_seqlen
        if is_first:
            self.last_node = req.last_node
            self.cache_protected_len = int(req.cache_protected_len)
            self.swa_uuid_for_lock = req.swa_uuid_for_lock
        _copy_fields(req, self, MAMBA_FIELDS)
        req.req_pool_idx = None
        req.mamba_pool_idx = None
        req.last_node = None

    def restore_to_req(self, req: Req, *, keep_allocated: bool) -> None:
        """Hand the held row to ``req``. The slot keeps its fields: a turn rejected by the
        scheduler and retried restores again, and an abort returns to exactly this state.
        ``keep_allocated``: the same request is restored again after it already reserved more
        of the row; its larger ``kv_allocated_len`` stays so those pages remain accounted."""
        req.req_pool_idx = self.req_pool_idx
        req.kv_committed_len = self.kv_committed_len
        allocated = self.kv_allocated_len
        if keep_allocated:
            allocated = max(allocated, int(req.kv_allocated_len))
        req.kv_allocated_len = allocated
        _copy_fields(self, req, ("swa_evicted_seqlen", "swa_uuid_for_lock", *MAMBA_FIELDS))

    def truncate(self, length: int) -> None:
        """Forget committed KV past ``length`` (an aborted turn may have overwritten it)."""
        if length < self.kv_committed_len:
            self.kv_committed_len = length
            del self.token_ids[length:]

    def clear_kv(self) -> None:
        """The slot gave its row and pages up (released or offloaded)."""
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.token_ids = []
        self.last_node = None
        self.cache_protected_len = 0
        self.swa_uuid_for_lock = None
        self.swa_evicted_seqlen = 0
        self.mamba_pool_idx = None
        self.turn_prefix_len = 0

    def row(self, req_to_token: torch.Tensor) -> torch.Tensor:
        assert self.req_pool_idx is not None
        return req_to_token[self.req_pool_idx]


def take_restore_back(req: Req) -> None:
    """Undo on ``req`` what restoring a session slot into it set (its row, prefix, tree
    nodes, lengths): it matches afresh when it is next matched. Used where a queued turn's
    restore is taken back (pressure preempting it, a re-match with a shorter key)."""
    req.req_pool_idx = None
    req.prefix_indices = torch.empty((0,), dtype=torch.int64)
    req.last_node = req.last_host_node = req.best_match_node = None
    req.kv_committed_len = req.kv_allocated_len = 0
    req.cache_protected_len = 0
    req.last_matched_prefix_len = 0
