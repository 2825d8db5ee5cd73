"""``SessionConfig``: the session cache's knobs, validated once."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hicache.errors import ConfigError
from hicache.options import check_option_types, options_from_dict

__all__ = ["SessionConfig"]


@dataclasses.dataclass(kw_only=True)
class SessionConfig:
    """Settings of :class:`~hicache.session.SessionAwareCache`.

    idle_offload_s: a session whose slot has had no running turn for this long gives its KV to
        the tree (written back to host/storage by the controller, device pages freed once the
        tree evicts them); the session stays open. ``None``: only under memory pressure.
    session_timeout_s: a session idle this long is released entirely (as ``release_session``).
        ``None``: sessions live until released.
    reap_interval_s: period of the owned reaper task started by ``start()``; ``None``: no task,
        the server calls ``reap_idle()`` from its own loop.
    writeback_max_attempts: a write-back whose backups keep being refused (host full, queue
        full) is retried this many times, then given up (the KV stays in the tree, unsaved).
    keep_closed_stats: per-session metrics kept for this many released sessions, so that a
        conversation resumed under the same id is counted as a resume.
    release_on_close: ``aclose()`` releases (writes back) every open session first.
    preempt_queued_turns: under memory pressure, a session whose next turn was matched on
        arrival but not admitted yet gives its KV up too (after every idle session). A server
        that matches requests on arrival would otherwise pin the KV of every queued session
        (the SGLang #27024 deadlock again). Needs a server that re-matches at admission, as
        :meth:`SessionAwareCache.admit` does; turn it off for a scheduler that reuses the
        arrival match. A turn whose matched node the scheduler locked (``inc_lock_ref``: SGLang
        takes it into a batch) is admitted and never taken back.
    """

    idle_offload_s: float | None = None
    session_timeout_s: float | None = None
    reap_interval_s: float | None = None
    writeback_max_attempts: int = 4
    keep_closed_stats: int = 1024
    release_on_close: bool = True
    preempt_queued_turns: bool = True

    def __post_init__(self) -> None:
        # types first: true or 2.5 was taken as a count, "false" as a true flag, and a string
        # failed below as a raw TypeError that named no field
        check_option_types(self, "session")
        for name in ("idle_offload_s", "session_timeout_s", "reap_interval_s"):
            value = getattr(self, name)
            # NaN passed a "< 0" check: a reaper sleeping NaN seconds never woke and "idle > nan"
            # is never true, so no session was offloaded or expired, without a word; inf is
            # refused as the deployment schema refuses it (None says "never")
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number of seconds (None: never), got {value!r}")
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, got {value!r}")
        if self.reap_interval_s == 0:
            raise ConfigError("reap_interval_s must be positive (or None for no reaper task)")
        if self.writeback_max_attempts <= 0:
            raise ConfigError(f"writeback_max_attempts must be positive, got {self.writeback_max_attempts!r}")
        if self.keep_closed_stats < 0:
            raise ConfigError(f"keep_closed_stats must not be negative, got {self.keep_closed_stats!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionConfig:
        return options_from_dict(cls, data, "session")
