"""``Lifecycle``: the session cache open or closed, and idle sessions reaped over time.

Why together: idle sessions must give their device memory up even when no request arrives to
trigger it, so the cache owns one background task (:class:`~hicache.session.reaper.Reaper`)
from ``start()`` on; closing the cache is what stops and awaits that task, so the task and
the open/closed state share one owner and no task outlives the cache.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from hicache.errors import CacheClosedError, quoted
from hicache.session.config import SessionConfig
from hicache.session.metrics import SessionMetrics
from hicache.session.offload import Offloader
from hicache.session.reaper import Reaper
from hicache.session.slot import SessionSlot
from hicache.session.writeback import WriteBackQueue

logger = logging.getLogger("hicache.session")

__all__ = ["Lifecycle"]


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """Open/closed state, idle-session reaping and the owned reaper task.

    Args:
        slots: the session cache's slots by session id.
        config: ``idle_offload_s``, ``session_timeout_s`` and ``reap_interval_s``.
        offloader: offloads idle sessions and closes expired ones.
        writeback: pumped after each reap (refused write-backs are restarted).
        metrics: where reaper errors are counted.
        clock: monotonic seconds.
    """

    def __init__(self, slots: dict[str, SessionSlot], config: SessionConfig, offloader: Offloader,
                 writeback: WriteBackQueue, metrics: SessionMetrics, clock: Callable[[], float]) -> None:
        self._slots = slots
        self._config = config
        self._offloader = offloader
        self._writeback = writeback
        self._metrics = metrics
        self._clock = clock
        self.reaper: Reaper | None = None
        self._state = _State.OPEN

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise CacheClosedError("the session cache is closed")

    def reap_idle(self, now: float | None = None) -> int:
        """Offload sessions idle longer than ``idle_offload_s`` and release those idle longer
        than ``session_timeout_s``; restart refused write-backs. Returns sessions acted on."""
        now = self._clock() if now is None else now
        cfg = self._config
        acted = 0
        for slot in list(self._slots.values()):
            if slot.attached_rid is not None:
                continue
            idle = now - slot.last_used
            try:
                if cfg.session_timeout_s is not None and idle > cfg.session_timeout_s:
                    self._offloader.close(slot, expired=True)
                    acted += 1
                elif cfg.idle_offload_s is not None and slot.is_holding_kv and idle > cfg.idle_offload_s:
                    self._offloader.give_up(slot, reason="idle")
                    acted += 1
            except Exception:  # noqa: BLE001 - one session's failure must not stop the others'
                self._metrics.incr("release_errors")
                logger.exception("session %s: the reaper could not let it go", quoted(slot.session_id))
        self._writeback.pump()
        return acted

    def _reaper_error(self) -> None:
        self._metrics.incr("reaper_errors")

    def start(self) -> None:
        """Start the owned reaper task (when ``reap_interval_s`` is set) on the running loop."""
        self.check_open()
        if self._config.reap_interval_s is None:
            return
        if self.reaper is None:
            self.reaper = Reaper(self.reap_idle, self._config.reap_interval_s, on_error=self._reaper_error)
        self.reaper.start()

    async def close(self) -> bool:
        """Mark the cache closed, then stop the reaper task and wait for it. ``False`` when it
        was closed already (nothing done). Callers of the session cache's ``aclose`` do not ask
        this: they all wait for its one close task, which calls it first."""
        if self._state is _State.CLOSED:
            return False
        self._state = _State.CLOSED
        if self.reaper is not None:
            await self.reaper.aclose()
        return True
