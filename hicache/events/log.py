"""``take_events()``: the events since the last call, for engines that poll (SGLang's scheduler
calls ``tree_cache.take_events()`` every step and publishes them itself).

Why bounded and lazy: an engine that never polls must not make the cache hold every event, so
the log subscribes to the hub on the first :meth:`EventLog.take` (which returns nothing yet) and
keeps at most ``maxlen`` events; older ones are dropped and counted (``dropped``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from hicache.events.convert import HashFormat, to_event
from hicache.events.schema import KVEvent
from hicache.observability.tier_events import TierChange, TierChangeHub

__all__ = ["EventLog"]


class EventLog:
    """A bounded log of the events of ``hub``; see the module docstring."""

    def __init__(self, hub: TierChangeHub, *, maxlen: int = 100_000, hash_format: HashFormat = "bytes") -> None:
        self._hub = hub
        self._events: deque[KVEvent] = deque()
        self._maxlen = maxlen
        self._fmt: HashFormat = hash_format
        self._lock = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = None
        self.dropped = 0

    def _on_change(self, change: TierChange) -> None:
        event = to_event(change, self._fmt)
        if event is None:
            return
        with self._lock:
            if len(self._events) >= self._maxlen:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)

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
