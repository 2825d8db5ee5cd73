"""A circuit breaker: stop hammering an object store that is down, and notice when it is back.

States::

    closed ──N consecutive failures──> open ──cool-down elapsed──> half-open
      ^                                  ^                            │
      └────────── probe succeeds ────────┴───── probe fails ──────────┘

While open, requests are refused at once (the caller answers with a miss), so an outage costs
microseconds per call instead of a timeout each. After the cool-down exactly one request (a
user request or the backend's background prober) is let through as a probe; its outcome closes
or re-opens the breaker. Only *transient* failures count: a 404 or 403 means the service answered.

Thread-safe: a backend may be used from several event loops (the blocking facade runs its own).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; probes once per ``cooldown`` seconds."""

    def __init__(self, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1:
            raise ValueError("breaker threshold must be >= 1")
        if cooldown < 0:
            raise ValueError("breaker cooldown must be >= 0")
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_started = 0.0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a request may go out now (in half-open state: only the one probe)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if self._state is BreakerState.OPEN:
                if now - self._opened_at < self.cooldown:
                    return False
                self._state = BreakerState.HALF_OPEN
                self._probe_started = now
                return True
            # half-open with a probe in flight; a probe lost to cancellation must not wedge the
            # breaker, so after another cool-down the next caller becomes the probe
            if now - self._probe_started >= max(self.cooldown, 1e-3):
                self._probe_started = now
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._state = BreakerState.CLOSED

    def record_failure(self) -> bool:
        """Count a transient failure; ``True`` when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.threshold
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self.times_opened += 1
                return True
            if self._state is BreakerState.OPEN:
                # a request let through before the breaker opened failed late: restart the cool-down
                self._opened_at = self._clock()
            return False
