"""``Turns``: which request runs on which session slot, and the restore of a slot into it.

Why a job of its own: every per-request call of the session cache first asks the same
question (is ``req`` the running turn of a session, and does its slot hold KV to restore?),
and the answer must stay consistent from the match to the finish or abort. A session has at
most one running turn: a second request of the session arriving meanwhile (a protocol error of
the client), or one arriving while the session closes, is *bypassed* and served as a plain
request by the inner cache until it finishes or aborts.

Restoring is idempotent (a turn rejected by the scheduler and retried restores again), and an
aborted restored turn returns its slot to the state before the turn (see :meth:`Turns.roll_back`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hicache.errors import quoted
from hicache.prefix_cache.base import BasePrefixCache
from hicache.prefix_cache.radix import free_token_pages
from hicache.prefix_cache.req import Req
from hicache.prefix_cache.types import MatchResult
from hicache.session.metrics import SessionMetrics
from hicache.session.offload import Offloader
from hicache.session.slot import SessionSlot, ceil_align, take_restore_back

__all__ = ["Turns", "session_id_of"]

logger = logging.getLogger("hicache.session")


def session_id_of(req: Req | None) -> str | None:
    """The streaming session of ``req``, or ``None`` for everything that passes through."""
    if req is None or req.session is None or not req.session.streaming:
        return None
    return req.session.session_id


class Turns:
    """Attaches streaming requests to their sessions' slots and restores the slots' KV.

    Args:
        inner: the wrapped prefix cache (its ``req_to_token_pool`` holds the slots' rows).
        slots: the session cache's slots by session id (a new session's slot is added here).
        metrics: where sessions opened and bypassed requests are counted.
        offloader: gives up a slot whose next turn does not continue it, and closes a session
            released while its turn ran, once the turn is over.
        clock: monotonic seconds (``last_used`` of the slots).
    """

    def __init__(self, inner: BasePrefixCache, slots: dict[str, SessionSlot], metrics: SessionMetrics,
                 offloader: Offloader, clock: Callable[[], float]) -> None:
        self._inner = inner
        self._slots = slots
        self._metrics = metrics
        self._offloader = offloader
        self._clock = clock
        self.bypass: set[str] = set()  # rids served as plain requests (see the module docstring)

    def slot_for(self, req: Req) -> SessionSlot | None:
        """The slot whose turn ``req`` is (attached to it), or ``None``: ``req`` goes to the
        inner cache."""
        sid = session_id_of(req)
        if sid is None or req.rid in self.bypass:
            return None
        slot = self._slots.get(sid)
        if slot is None or slot.attached_rid != req.rid:
            return None
        return slot

    def restored(self, req: Req) -> SessionSlot | None:
        """The slot ``req`` was restored from (attached, holding KV), or ``None``."""
        slot = self.slot_for(req)
        if slot is not None and slot.is_holding_kv:
            return slot
        return None

    def restorable(self, req: Req | None, key_len: int | None = None) -> SessionSlot | None:
        """Attach a streaming request to its session; the slot if it holds KV to restore.

        ``key_len``: the length of the key matched (the request's tokens capped by a
        ``max_prefix_len``). A key no longer than the tree-protected part cannot be restored in
        place: the prefix would have to cover tree-owned positions past the cap (the caller
        asked for at most ``key_len``; positions past it would be silently skipped), or the
        turn would rewrite them. The slot is given up then, as for a turn that does not
        continue its history, and the inner cache matches with the cap."""
        sid = session_id_of(req)
        if sid is None:
            return None
        assert req is not None
        slot = self.attach(req, sid)
        if slot is None or not slot.is_holding_kv:
            return None
        if key_len is not None and key_len <= slot.cache_protected_len:
            self._give_up_for_key(req, slot, key_len)
            return None
        return slot

    def _give_up_for_key(self, req: Req, slot: SessionSlot, key_len: int) -> None:
        """Give ``slot`` up because ``req``'s key is too short to restore it (see
        :meth:`restorable`); a restore ``req`` got from an earlier match is taken back first,
        as pressure takes back a queued turn's. Once admitted (the server holds the restored
        prefix, may have written past it) the slot cannot be taken back: a clear error."""
        if req.req_pool_idx == slot.req_pool_idx:
            if slot.admitted or int(req.kv_allocated_len) > slot.kv_allocated_len:
                raise ValueError(
                    f"session {quoted(slot.session_id)}: request {quoted(req.rid)} was admitted with a prefix of "
                    f"{slot.turn_prefix_len} tokens restored from its slot; it cannot be matched again "
                    f"with a key of {key_len} (max_prefix_len) inside the {slot.cache_protected_len} "
                    f"tree-protected tokens")
            take_restore_back(req)
            slot.turn_prefix_len = 0
        self._offloader.give_up(slot, reason="mismatch")

    def attach(self, req: Req, sid: str) -> SessionSlot | None:
        """Make ``req`` the running turn of ``sid``; ``None`` when another turn runs already
        (a protocol error of the client: this request then passes through as a plain one)."""
        if req.rid in self.bypass:
            return None
        slot = self._slots.get(sid)
        if slot is None:
            slot = self._slots[sid] = SessionSlot(sid, last_used=self._clock())
            self._metrics.opened(sid)
        if slot.attached_rid is None:
            if slot.closing:
                self._bypass_req(req, sid)
                return None
            slot.attached_rid = req.rid
            slot.attached_req = req
            slot.last_used = self._clock()
            if slot.is_holding_kv and not self._history_matches(slot, req):
                self._offloader.give_up(slot, reason="mismatch")
            return slot
        if slot.attached_rid == req.rid:
            return slot
        self._bypass_req(req, sid)
        return None

    def _bypass_req(self, req: Req, sid: str) -> None:
        logger.warning("session %s: request %s arrived while another turn runs or the session "
                       "closes; served as a plain request", quoted(sid), quoted(req.rid))
        self._metrics.incr("busy_bypass")
        self.bypass.add(req.rid)

    @staticmethod
    def _history_matches(slot: SessionSlot, req: Req) -> bool:
        """Can ``req`` continue the slot in place? Its tokens must start with the slot's
        committed history (same namespace), and the turn must not rewrite tree-owned positions."""
        tokens = req.fill_ids or req.origin_input_ids
        n = slot.kv_committed_len
        if req.extra_key != slot.extra_key or len(tokens) <= slot.cache_protected_len:
            return False
        return tokens[:n] == slot.token_ids

    def restore(self, req: Req, slot: SessionSlot, key_len: int) -> MatchResult:
        """Hand the slot's row to ``req``; the committed KV is the prefix (at least one token
        of the ``key_len`` matched is left to compute, for the logits). Only for a slot
        :meth:`restorable` returned for this ``key_len``."""
        assert slot.req_pool_idx is not None
        keep = req.req_pool_idx == slot.req_pool_idx  # same request again (a retry)
        # never longer than the key (a max_prefix_len cap is honoured like the inner cache's);
        # never inside the tree-protected part either: restorable() gave such a slot up
        prefix_len = min(slot.kv_committed_len, key_len - 1)
        if prefix_len < slot.cache_protected_len:
            raise ValueError(f"session {quoted(slot.session_id)}: a key of {key_len} tokens cannot restore a slot "
                             f"whose first {slot.cache_protected_len} tokens the tree protects")
        slot.restore_to_req(req, keep_allocated=keep)
        slot.turn_prefix_len = prefix_len
        indices = slot.row(self._inner.req_to_token_pool.req_to_token)[:prefix_len].to(torch.int64)
        vn = slot.virtual_node
        return MatchResult(
            device_indices=indices,
            last_device_node=vn,
            last_host_node=vn,
            best_match_node=vn,
            cache_protected_len=slot.cache_protected_len,
            full_kv_hit_length=prefix_len,
        )

    def roll_back(self, req: Req, slot: SessionSlot) -> None:
        """An aborted turn restored from ``slot``: free only the pages this turn added and
        return the slot to its state before the turn (an abort before the turn ran frees
        nothing). The caller detaches the slot."""
        inner = self._inner
        ps = inner.page_size
        start = ceil_align(slot.kv_allocated_len, ps)
        end = ceil_align(int(req.kv_allocated_len), ps)
        if end > start:
            free_token_pages(inner.token_to_kv_pool_allocator,
                             slot.row(inner.req_to_token_pool.req_to_token)[start:end].clone(), ps)
        # positions from the restored prefix on may have been overwritten by this turn
        slot.truncate(slot.turn_prefix_len)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        req.last_node = None

    def detach(self, slot: SessionSlot, *, fire: bool = True) -> None:
        """The slot's turn is over (or preempted); ``fire``: close the session now if it was
        released meanwhile (see :meth:`after_detach`)."""
        slot.attached_rid = None
        slot.attached_req = None
        slot.turn_prefix_len = 0
        slot.admitted = False
        slot.uncounted = None  # a turn given up before it started is not counted
        slot.last_used = self._clock()
        if fire:
            self.after_detach(slot)

    def after_detach(self, slot: SessionSlot) -> None:
        """A session released while its turn ran closes once the turn is over."""
        if slot.closing and slot.attached_rid is None:
            self._offloader.close(slot, expired=False)
