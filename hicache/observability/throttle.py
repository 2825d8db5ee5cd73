"""Throttled reporting: one log line a period for an event that repeats, with its count.

A module of its own, with nothing of hicache imported, so that every layer can use it: the
tier-change hub (:mod:`hicache.observability.tier_events`), which the storage layer imports,
as well as the storage layer itself (:mod:`hicache.storage.stats` re-exports it).
"""

from __future__ import annotations

import threading
import time

__all__ = ["Throttle"]


class Throttle:
    """At most one report per ``period`` seconds, counting the events in between: a failure
    that repeats for every page (a full disk, a flaky link) logs one line a minute, not one per
    page, and the line says how many it stands for. Thread-safe."""

    def __init__(self, period: float = 60.0) -> None:
        self.period = period
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._pending = 0

    def due(self, n: int = 1) -> int:
        """Record ``n`` events; returns how many to report now (0: stay quiet)."""
        with self._lock:
            self._pending += n
            now = time.monotonic()
            if now - self._last < self.period:
                return 0
            self._last = now
            count, self._pending = self._pending, 0
            return count
