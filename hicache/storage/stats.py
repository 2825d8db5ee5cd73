"""Counters every backend keeps, so failures are visible rather than silent."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["StorageStats"]


class StorageStats:
    """Thread-safe named counters (backends may run work on executor threads).

    Well-known names: ``exists_calls``, ``exists_keys``, ``exists_hits``, ``read_pages``,
    ``read_hits``, ``read_misses``, ``read_bytes``, ``write_pages``, ``write_ok``,
    ``write_failures``, ``write_bytes``, ``backend_errors``, ``invalid_requests``,
    ``corrupt_pages``, ``evicted_pages``, ``evicted_bytes``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, name: str, value: int | float = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
