"""``StorageHealth``: whether the L3 store answers, remembered between requests.

Why the controller keeps its own health and does not leave it to each backend: a backend that
hangs or keeps failing costs every request the whole prefetch wait and every write its retries,
and nothing but the S3 backend's breaker remembered that. The controller sees every storage
call of every backend, so it is the one place that can notice for all of them.

States::

    up  --(a call hangs: no answer within storage_stall_s, or the I/O timeout)-->  down
    up  --(storage_health_errors consecutive failing calls)---------------------->  down
    down --(a probe answers, after a backoff of base, 2*base, ... up to max)----->  up

A failing call is one that raised, timed out, or made the backend count a ``backend_errors``
(the base class turns a backend's exceptions into misses, so the count is the signal). A miss,
a refused write (full disk) or a page that fails verification is an answer, not a failure.

While down, no storage call is made: prefetches are not started (the request computes), write
jobs end at once as not written (their nodes stay on host and are offered again on a later hit),
and calls in flight when the store went down are interrupted. A probe (one ``exists`` of a key
nobody writes) runs after each backoff; requests never pay for it.

Everything here runs on the controller's loop; time comes from ``clock`` (tests pass their own).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

__all__ = ["HealthState", "StorageHealth"]

logger = logging.getLogger("hicache.controller")

#: the least wait after a failed probe (see :meth:`StorageHealth.probe_failed`)
_MIN_PROBE_BACKOFF_S = 0.05


class HealthState(enum.Enum):
    UP = "up"
    DOWN = "down"


class StorageHealth:
    """The up/down state of one store, with the probe backoff.

    Args:
        errors_to_trip: consecutive failing calls that mark the store down.
        probe_base_s, probe_max_s: backoff before the first probe, doubled after each failed
            probe up to the maximum.
        on_change: ``on_change(state)`` after every transition (the controller starts the
            prober and interrupts calls in flight on ``DOWN``).
        count: ``count(name)`` metrics callback.
    """

    def __init__(
        self,
        *,
        errors_to_trip: int,
        probe_base_s: float,
        probe_max_s: float,
        on_change: Callable[[HealthState], None] | None = None,
        count: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.errors_to_trip = errors_to_trip
        self.probe_base_s = probe_base_s
        self.probe_max_s = probe_max_s
        self._on_change = on_change or (lambda state: None)
        self._count = count or (lambda name: None)
        self._clock = clock
        self.state = HealthState.UP
        self.consecutive_errors = 0
        self.down_since: float | None = None
        self.reason = ""
        self._backoff = probe_base_s

    @property
    def up(self) -> bool:
        return self.state is HealthState.UP

    def next_probe_in(self) -> float:
        """Seconds to wait before the next probe (grows after each failed one)."""
        return self._backoff

    def succeeded(self) -> None:
        """A call answered (hits, misses or refusals: the store is there)."""
        self.consecutive_errors = 0

    def failed(self, why: str) -> None:
        """A call raised or made the backend count an error."""
        self.consecutive_errors += 1
        if self.consecutive_errors >= self.errors_to_trip:
            self.trip(f"{self.consecutive_errors} failing calls in a row (last: {why})")

    def trip(self, why: str) -> None:
        """The store does not answer (a hang, or errors): stop calling it until a probe passes."""
        if self.state is HealthState.DOWN:
            return
        self.state = HealthState.DOWN
        self.down_since = self._clock()
        self.reason = why
        self._backoff = self.probe_base_s
        self._count("storage_trips")
        logger.warning("storage marked unreachable: %s; skipping it, first probe in %.2f s", why, self._backoff)
        self._on_change(HealthState.DOWN)

    def probe_failed(self) -> None:
        self._count("storage_probes_failed")
        # doubled from at least a floor: a base of 0 (probe as soon as the store goes down) or
        # a maximum of 0 never grew, and a store that stayed down was probed back to back
        # (thousands of calls a second, the I/O thread and the loop kept busy by them)
        self._backoff = max(_MIN_PROBE_BACKOFF_S, min(self.probe_max_s, self._backoff * 2))
        logger.info("storage probe failed; next in %.2f s", self._backoff)

    def probe_passed(self) -> None:
        if self.state is HealthState.UP:
            return
        down_for = self._clock() - (self.down_since or self._clock())
        self.state = HealthState.UP
        self.consecutive_errors = 0
        self.down_since = None
        self.reason = ""
        self._count("storage_recoveries")
        logger.warning("storage answers again after %.1f s; using it again", down_for)
        self._on_change(HealthState.UP)
