"""``Offloader``: a session gives its KV up, or closes.

Why one place for it: a slot's KV is given up for four reasons (the client released the
session, it idled past ``idle_offload_s``, memory pressure picked it, its next turn did not
continue its history) and each must do the same thing, :func:`~hicache.session.handover.hand_over`
to the tree with its write-back started, counted the same way. Giving KV up never throws it
away: the next turn of the conversation (or a restart, with storage) finds it with an ordinary
match, from whichever tier it is on.
"""

from __future__ import annotations

import logging

from hicache.errors import quoted
from hicache.prefix_cache.base import BasePrefixCache
from hicache.session.handover import hand_over
from hicache.session.metrics import SessionMetrics
from hicache.session.slot import SessionSlot
from hicache.session.writeback import WriteBackQueue

__all__ = ["Offloader"]

logger = logging.getLogger("hicache.session")


class Offloader:
    """Gives slots' KV to ``inner`` (the tree) and closes sessions.

    Args:
        inner: the wrapped prefix cache; without a usable tree the KV given up is freed.
        slots: the session cache's slots by session id (a closed session leaves it).
        metrics: where offloads and releases are counted.
        writeback: follows the handed-over KV until its host copy exists.
    """

    def __init__(self, inner: BasePrefixCache, slots: dict[str, SessionSlot], metrics: SessionMetrics,
                 writeback: WriteBackQueue) -> None:
        self._inner = inner
        self._slots = slots
        self._metrics = metrics
        self._writeback = writeback

    def _is_tree(self) -> bool:
        inner = self._inner
        return (
            not inner.disable
            and inner.is_tree_cache()
            and callable(getattr(inner, "insert", None))
            and getattr(inner, "root_node", None) is not None
        )

    def give_up(self, slot: SessionSlot, *, reason: str) -> int:
        """Hand the slot's KV to the tree (see :func:`hand_over`); returns device tokens freed
        at once (pages handed to the tree are freed later, by the tree's eviction)."""
        if not slot.is_holding_kv:
            return 0
        alloc = self._inner.token_to_kv_pool_allocator
        before = alloc.available_size()
        handed = hand_over(self._inner, slot, tree=self._is_tree(), writeback=self._writeback,
                           refused=lambda: self._metrics.incr("release_errors"))
        freed = alloc.available_size() - before
        self._metrics.gave_up(slot.session_id, reason, handed=handed, freed=freed)
        if logger.isEnabledFor(logging.DEBUG):  # quoted only when logged: this runs every release
            logger.debug("session %s: KV given up (%s): %d token(s) to the tree, %d freed",
                         quoted(slot.session_id), reason, handed, freed)
        return freed

    def offload(self, session_id: str, *, reason: str) -> bool:
        """Give an idle session's KV up now; ``False`` when it holds none or a turn runs on it."""
        slot = self._slots.get(session_id)
        if slot is None or not slot.is_idle:
            return False
        self.give_up(slot, reason=reason)
        return True

    def release(self, session_id: str) -> bool:
        """Close the session now, or (a turn running) once its turn finishes or aborts.
        Returns whether the session existed."""
        slot = self._slots.get(session_id)
        if slot is None:
            return False
        if slot.attached_rid is not None:
            slot.closing = True
            return True
        self.close(slot, expired=False)
        return True

    def close(self, slot: SessionSlot, *, expired: bool) -> None:
        """Give the KV up and forget the session (its stats go to the bounded history).

        A hand-over that raises still closes the session (it let go of what it could; see
        :func:`hand_over`), then the error goes to the caller, who counts and reports it: left
        open, the session held its row and pages until ``session_timeout_s``, and a later turn
        of the id resumed a half-given-up slot."""
        try:
            self.give_up(slot, reason="release")
        finally:
            self._slots.pop(slot.session_id, None)
            self._metrics.incr("sessions_expired" if expired else "sessions_released")
            self._metrics.close(slot.session_id)
