"""Counters every backend keeps, so failures are visible rather than silent."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from collections.abc import Iterator

from hicache.observability.throttle import Throttle  # (re-exported: its users import it from here)

__all__ = ["WELL_KNOWN", "CallCounts", "StorageStats", "Throttle", "counting_call"]


class CallCounts:
    """Every counter a backend counted while one call ran (see :func:`counting_call`)."""

    __slots__ = ("counts", "outer")

    def __init__(self, outer: CallCounts | None) -> None:
        self.counts: Counter[str] = Counter()
        self.outer = outer

    @property
    def errors(self) -> float:
        """The call's ``backend_errors`` and ``unavailable`` (a backend that answers misses
        while its service is unreachable, as the ``s3`` backend's breaker does, says so there):
        whether *this* call failed. Without the second the controller's health held such a
        store up, its ``storage_up`` gauge 1, for as long as the service was gone."""
        return self.counts["backend_errors"] + self.counts["unavailable"]


_CALL_COUNTS: contextvars.ContextVar[CallCounts | None] = contextvars.ContextVar("hicache_call_counts", default=None)


@contextlib.contextmanager
def counting_call() -> Iterator[CallCounts]:
    """The backend counters of the calls made inside (and of the tasks they start, which copy
    the context), apart from every other call's: what one call did, where the backend's shared
    counters mix in every call in flight. Diffing the shared ``backend_errors`` before and after
    blamed every call in flight for one call's error (three concurrent reads, one raising,
    tripped the storage breaker at once); an engine's write metrics need the pages *this* write
    skipped (``write_skipped_pages``). Nested counts see their inner calls'."""
    box = CallCounts(_CALL_COUNTS.get())
    token = _CALL_COUNTS.set(box)
    try:
        yield box
    finally:
        _CALL_COUNTS.reset(token)


#: Counters every :meth:`StorageStats.snapshot` holds, 0 until counted (a reader may index them).
WELL_KNOWN = (
    "exists_calls", "exists_keys", "exists_hits", "read_pages", "read_hits", "read_misses", "read_bytes",
    "write_pages", "write_ok", "write_failures", "write_bytes", "backend_errors", "invalid_requests",
    "corrupt_pages", "evicted_pages", "evicted_bytes", "call_timeouts",
)


class StorageStats:
    """Thread-safe named counters (backends may run work on executor threads).

    The well-known names (:data:`WELL_KNOWN`) are in every snapshot; ``call_timeouts`` counts
    blocking facade calls cancelled at their ``call_timeout``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int | float] = {}

    def incr(self, name: str, value: int | float = 1) -> None:
        call = _CALL_COUNTS.get()
        with self._lock:  # a call's threads (run_to_completion copies its context) count at once
            self._counts[name] = self._counts.get(name, 0) + value
            while call is not None:
                call.counts[name] += value  # type: ignore[assignment]  # Counter is typed int-valued; incr also counts floats
                call = call.outer

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int | float]:
        """Every counter, the well-known ones at 0 until counted (``stats["backend_errors"]``
        of a store that never failed is 0, not a ``KeyError``)."""
        with self._lock:
            return {**dict.fromkeys(WELL_KNOWN, 0), **self._counts}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
