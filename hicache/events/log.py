"""``take_events()``: the events since the last call, for engines that poll (SGLang's scheduler
calls ``tree_cache.take_events()`` every step and publishes them itself).

Why bounded and lazy: an engine that never polls must not make the cache hold every event, so
the log subscribes to the hub on the first :meth:`EventLog.take` (which returns nothing yet) and
keeps at most ``maxlen`` events; older ones are dropped and counted (``dropped``, and the
``count`` callback: the cache's ``take_events_dropped`` metric), with one warning: an engine
polling too rarely must see that its consumers missed events.

``hash_format`` and ``tiers`` are the config's ``[events]`` settings, as the publisher
(:class:`~hicache.events.service.KVEventService`) applies them: an engine that publishes what it
takes sends its router the same hashes and tiers the config names.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable

from hicache.events.convert import HashFormat, to_event
from hicache.events.schema import KVEvent
from hicache.observability.tier_events import Tier, TierChange, TierChangeHub

__all__ = ["EventLog"]

logger = logging.getLogger(__name__)


class EventLog:
    """A bounded log of the events of ``hub``; see the module docstring."""

    def __init__(self, hub: TierChangeHub, *, maxlen: int = 100_000, hash_format: HashFormat = "bytes",
                 tiers: Iterable[Tier | str] | None = None, count: Callable[[int], None] | None = None) -> None:
        if hash_format not in ("bytes", "int"):
            raise ValueError(f"hash_format must be 'bytes' or 'int', got {hash_format!r}")
        self._hub = hub
        self._tiers = frozenset(Tier(t) for t in tiers) if tiers is not None else frozenset(Tier)
        self._events: deque[KVEvent] = deque()
        self._maxlen = maxlen
        self._fmt: HashFormat = hash_format
        self._lock = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = None
        self.dropped = 0
        self._count = count

    def _on_change(self, change: TierChange) -> None:
        if change.tier not in self._tiers:
            return
        event = to_event(change, self._fmt)
        if event is None:
            return
        dropped = False
        with self._lock:
            if len(self._events) >= self._maxlen:
                self._events.popleft()
                self.dropped += 1
                dropped = True
            self._events.append(event)
        if dropped:
            # seen before only on the log object: an engine polling too rarely never knew its
            # consumers missed events
            if self._count is not None:
                self._count(1)
            if self.dropped == 1:
                logger.warning("take_events: %d events were not taken; the oldest are dropped (poll more often)",
                               self._maxlen)

    def take(self) -> list[KVEvent]:
        """Events since the last call, oldest first (the first call starts the log)."""
        if self._unsubscribe is None:
            self._unsubscribe = self._hub.subscribe(self._on_change)
            return []
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
