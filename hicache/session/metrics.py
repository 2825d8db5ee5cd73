"""Per-session and aggregate counters of the session cache.

Why per session: a chat server wants to know which conversations are expensive (many turns
recomputed, resumed from storage) as well as the totals; both are plain dicts so any metrics
registry can take them. Everything is updated on the event loop thread.

Resume tiers: a turn of a session that already had turns is a *resume* (counted when the turn
is admitted, so a turn aborted later still counts; a caller that defers its counts, as the
facade does, counts it once it really starts, so a turn refused for room and retried counts
once); it is counted by where
its history came from: ``slot`` (the device slot, no lookup), ``device`` (the tree's device
pages after an offload), ``host``, ``storage`` (the deepest tier that contributed), or
``recompute`` (nothing reusable was found).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.session.slot import SessionSlot
    from hicache.session.writeback import WriteBackQueue

__all__ = ["RESUME_TIERS", "SessionMetrics", "SessionStats", "gauges", "resume_tier"]

RESUME_TIERS = ("slot", "device", "host", "storage", "recompute")

_COUNTERS = (
    "sessions_opened",
    "sessions_released",
    "sessions_expired",
    "sessions_reset",
    "turns",
    "aborts",
    "turns_aborted_at_close",
    "restored_tokens",
    "computed_tokens",
    "offloads_idle",
    "offloads_pressure",
    "offloads_mismatch",
    "offloaded_tokens",
    "freed_tokens",
    "busy_bypass",
    "preempted_queued_turns",
    "writeback_queued",
    "writeback_queued_tokens",
    "writeback_done",
    "writeback_lost",
    "writeback_dropped",
    "writeback_attempts",
    "reaper_errors",
    "release_errors",
)

#: reasons a session gives its KV up that count as an offload (a release does not)
_OFFLOAD_REASONS = ("idle", "pressure", "mismatch")


def resume_tier(*, device_hit: int, host_hit: int, storage_hit: int) -> str:
    """Where a resumed turn's history came back from, when not from its slot: the deepest tier
    that contributed, or ``recompute``."""
    return "storage" if storage_hit else "host" if host_hit else "device" if device_hit else "recompute"


def gauges(slots: Iterable[SessionSlot], page_size: int, writeback: WriteBackQueue) -> dict[str, int]:
    """The current gauges of ``slots`` and ``writeback``, safe to read from another thread (a
    metrics scrape runs off the loop): the slots are copied in one step (``list`` of a dict's
    values runs without letting go of the GIL) before they are summed, where iterating the live
    dict could meet a session opened or closed meanwhile and raise."""
    held = list(slots)
    return {
        "sessions_open": len(held),
        "sessions_holding_kv": sum(1 for s in held if s.is_holding_kv),
        "session_held_tokens": sum(s.held_tokens(page_size) for s in held),
        "writeback_pending": len(writeback),
        "writeback_pending_tokens": writeback.pending_tokens,
    }


@dataclasses.dataclass
class SessionStats:
    """Counters of one session (``held_tokens`` is filled in when a snapshot is taken)."""

    session_id: str
    turns: int = 0
    aborts: int = 0
    restored_tokens: int = 0
    computed_tokens: int = 0
    offloads: int = 0
    resumes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(RESUME_TIERS, 0))
    resume_tokens: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(RESUME_TIERS, 0))
    held_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SessionMetrics:
    """Aggregate counters plus the stats of open (and recently released) sessions."""

    def __init__(self, keep_closed: int = 1024) -> None:
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.resumes: dict[str, int] = dict.fromkeys(RESUME_TIERS, 0)
        self.resume_tokens: dict[str, int] = dict.fromkeys(RESUME_TIERS, 0)
        self.sessions: dict[str, SessionStats] = {}
        self._closed: OrderedDict[str, SessionStats] = OrderedDict()
        self._keep_closed = keep_closed

    def incr(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def session(self, session_id: str) -> SessionStats:
        """Stats of ``session_id``; a recently released session's stats come back to life."""
        stats = self.sessions.get(session_id)
        if stats is None:
            stats = self._closed.pop(session_id, None)
            if stats is None:
                stats = SessionStats(session_id)
            self.sessions[session_id] = stats
        return stats

    def opened(self, session_id: str) -> SessionStats:
        """A session was opened (a new slot): counted every time, a released or expired id
        coming back included. Counted with the stats instead, a reopened id whose stats the
        closed history still kept was never counted opened again, though its slot was and its
        next release or expiry was counted: more sessions closed than ever opened."""
        self.incr("sessions_opened")
        return self.session(session_id)

    def close(self, session_id: str) -> None:
        """Move a released session's stats to the bounded history."""
        stats = self.sessions.pop(session_id, None)
        if stats is None or self._keep_closed == 0:
            return
        stats.held_tokens = 0
        self._closed[session_id] = stats
        while len(self._closed) > self._keep_closed:
            self._closed.popitem(last=False)

    def resume(self, session_id: str, tier: str, tokens: int) -> None:
        stats = self.session(session_id)
        stats.resumes[tier] += 1
        stats.resume_tokens[tier] += tokens
        self.resumes[tier] += 1
        self.resume_tokens[tier] += tokens

    def admitted(self, session_id: str, prefix_len: int, tier: str | None) -> None:
        """A turn of ``session_id`` was admitted reusing ``prefix_len`` tokens; ``tier``: where
        a resumed history came from (``None``: not a resume)."""
        if tier is not None:
            self.resume(session_id, tier, prefix_len)
        stats = self.session(session_id)
        stats.restored_tokens += prefix_len
        self.incr("restored_tokens", prefix_len)

    def turn_saved(self, session_id: str, computed: int) -> None:
        """A turn finished into its slot, having computed ``computed`` tokens."""
        stats = self.session(session_id)
        stats.turns += 1
        stats.computed_tokens += computed
        self.incr("turns")
        self.incr("computed_tokens", computed)

    def aborted(self, session_id: str) -> None:
        stats = self.session(session_id)
        stats.aborts += 1
        self.incr("aborts")

    def gave_up(self, session_id: str, reason: str, *, handed: int, freed: int) -> None:
        """A session gave its KV up (``reason``): ``handed`` tokens to the tree, ``freed`` at once."""
        stats = self.session(session_id)
        if reason in _OFFLOAD_REASONS:
            stats.offloads += 1
            self.incr(f"offloads_{reason}")
        self.incr("offloaded_tokens", handed)
        self.incr("freed_tokens", freed)

    def report(self, slots: Mapping[str, SessionSlot], page_size: int,
               writeback: WriteBackQueue) -> dict[str, Any]:
        """:meth:`snapshot` plus the current :func:`gauges` and every open session's stats
        (on the loop: the stats' ``held_tokens`` are filled in from ``slots``)."""
        out = self.snapshot()
        out.update(gauges(slots.values(), page_size, writeback))
        sessions = {}
        for sid, stats in self.sessions.items():
            slot = slots.get(sid)
            stats.held_tokens = slot.held_tokens(page_size) if slot is not None else 0
            sessions[sid] = stats.as_dict()
        out["sessions"] = sessions
        return out

    def snapshot(self) -> dict[str, Any]:
        """Aggregate counters (``resumes_<tier>``, ``resume_tokens_<tier>`` flattened in)."""
        out: dict[str, Any] = dict(self.counters)
        for tier in RESUME_TIERS:
            out[f"resumes_{tier}"] = self.resumes[tier]
            out[f"resume_tokens_{tier}"] = self.resume_tokens[tier]
        return out
