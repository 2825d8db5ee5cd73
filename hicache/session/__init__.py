"""Session-aware cache for streaming sessions (chat and agent servers).

A streaming session's KV stays in a slot between turns, so the next turn appends to it with no
prefix match; idle or released sessions hand their KV to the prefix tree, which writes it back
to host and storage, so device memory is never pinned by sessions nobody is using.

* :class:`SessionAwareCache` - the decorator around any prefix cache (see its module for the
  per-turn call sequence); it coordinates the collaborators below.
* ``turns.Turns`` - attaches a request to its session's slot and restores the slot into it.
* ``offload.Offloader`` - a session gives its KV up (release, idle, pressure, mismatch) or closes.
* ``room.Room`` - device memory and rows made free under pressure (``evict``, ``ensure_free``).
* ``extend.RowExtender`` - a request's row grown to a sequence length (``alloc_extend``).
* ``lifecycle.Lifecycle`` - the cache open or closed, and the owned idle reaper.
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
