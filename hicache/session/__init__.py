"""Session-aware cache for streaming sessions (chat and agent servers).

A streaming session's KV stays in a slot between turns, so the next turn appends to it with no
prefix match; idle or released sessions hand their KV to the prefix tree, which writes it back
to host and storage, so device memory is never pinned by sessions nobody is using.

* :class:`SessionAwareCache` - the decorator around any prefix cache (see its module for the
  per-turn call sequence).
* :class:`SessionConfig` - idle offload, session timeout, reaper period, write-back retries.
* :class:`SessionSlot`, :class:`VirtualNode` - a session's held KV, and its lock stand-in.
* :class:`WriteBackQueue` - follows handed-over KV until its host copy exists.
* :class:`SessionMetrics`, :class:`SessionStats` - aggregate and per-session counters.
* :class:`Reaper` - the owned background task that reaps idle sessions.
* :class:`ForwardingCache` - the transparent decorator base (forwards the whole interface).
* :func:`hand_over` - gives a slot's KV to the tree (kept pages) and frees the rest.
"""

from hicache.session.cache import SessionAwareCache, TurnAdmit
from hicache.session.config import SessionConfig
from hicache.session.forward import ForwardingCache
from hicache.session.handover import hand_over
from hicache.session.metrics import RESUME_TIERS, SessionMetrics, SessionStats
from hicache.session.reaper import Reaper
from hicache.session.slot import SessionSlot, VirtualNode
from hicache.session.writeback import WriteBackQueue

__all__ = [
    "ForwardingCache",
    "RESUME_TIERS",
    "Reaper",
    "SessionAwareCache",
    "SessionConfig",
    "SessionMetrics",
    "SessionSlot",
    "SessionStats",
    "TurnAdmit",
    "VirtualNode",
    "WriteBackQueue",
    "hand_over",
]
