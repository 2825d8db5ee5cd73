"""``ControllerConfig``: every knob of the controller, validated once.

Defaults follow SGLang where it has one (prefetch timeout 2.0 s + 0.1 s per 1Ki tokens, at most
30 s; prefetch threshold 256 tokens; write-through threshold 1, selective 2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hicache.errors import ConfigError
from hicache.options import check_option_types, options_from_dict

__all__ = ["ControllerConfig", "WRITE_POLICIES", "PREFETCH_POLICIES"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclasses.dataclass(kw_only=True)
class ControllerConfig:
    """Controller settings; unknown keys in :meth:`from_dict` are errors naming the allowed ones.

    write_policy: when device pages are copied to host. ``write_through`` on insert,
        ``write_through_selective`` once a node was hit ``write_through_threshold`` times,
        ``write_back`` only when the device copy is evicted.
    backup_queue_size / storage_queue_size: bounded queues; a full queue refuses new work
        (counted as ``backup_rejected``; the cache defers such a backup and starts it later)
        instead of growing without limit.
    storage_max_retries, storage_retry_base_s, storage_retry_max_s: a failed storage write is
        retried with exponential backoff, then reported as failed (never as written).
    storage_batch_pages: pages per storage write call.
    storage_hop_bytes: storage writes queued together (several small jobs, or the batches of
        one) go to the storage I/O thread in one hand-off, up to this many bytes (at least one
        batch, at most 16): each hand-off costs the loop two thread wake-ups.
    storage_io_timeout_s: one storage call that takes longer counts as failed; a positive
        number of seconds (0 is refused: no call could meet it).
    storage_stall_s: a storage call still unanswered after this long marks the store down
        (see :mod:`hicache.controller.health`); 0 leaves it to ``storage_io_timeout_s``.
    storage_health_errors: consecutive failing storage calls that mark the store down.
    storage_probe_base_s / storage_probe_max_s: while the store is down, a probe runs after
        this backoff, doubled after each failed probe up to the maximum, and never less than
        50 ms after a failed probe (a base of 0 probes at once, then backs off; a maximum
        below 50 ms, or 0, still waits 50 ms): a store that stays down is never probed back
        to back.
    prefetch_policy: ``best_effort`` (take what arrived), ``wait_complete`` or ``timeout``.
    prefetch_recompute_tokens_per_s: the engine's prefill throughput. Under ``timeout`` a
        request then stops waiting as soon as the pages it still lacks would be recomputed
        sooner than fetched, and never waits longer than recomputing them: a storage hit is
        never slower than a recompute. ``None``: learned from the prefills the engine reports
        (``HiCache.note_prefill``); until then only the fixed timeout applies.
    prefetch_threshold: fewer storage tokens than this are not worth a prefetch.
    max_inflight_prefetch_tokens: rate limit; prefetches beyond it are skipped.
    cancelled_io_grace_s: an interrupted (cancelled) storage call is always waited for until
        it has really returned, since the host pages it was given are not reused before then;
        one still running after this long is logged and counted as stuck.
    io_thread_nice: lower the CPU priority of the storage I/O thread, and of the threads it
        starts (the backend's copy threads), by this much (Linux; 0: unchanged). When page
        traffic keeps more threads runnable than there are cores, this lets the server's loop
        thread run first; storage I/O then gets the cores the loop leaves (see
        :mod:`hicache.controller.io_thread`).
    """

    write_policy: str = "write_through"
    write_through_threshold: int | None = None
    backup_queue_size: int = 1024
    backup_batch_pages: int = 512
    load_back_threshold: int = 0
    storage_queue_size: int = 4096
    storage_batch_pages: int = 64
    storage_hop_bytes: int = 64 << 20
    storage_max_retries: int = 3
    storage_retry_base_s: float = 0.05
    storage_retry_max_s: float = 2.0
    storage_io_timeout_s: float = 30.0
    storage_stall_s: float = 5.0
    storage_health_errors: int = 3
    storage_probe_base_s: float = 1.0
    storage_probe_max_s: float = 30.0
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_ki_token_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    prefetch_recompute_tokens_per_s: float | None = None
    prefetch_batch_pages: int = 64
    max_inflight_prefetch_tokens: int = 1 << 20
    max_concurrent_prefetches: int = 16
    cancelled_io_grace_s: float = 1.0
    close_timeout_s: float = 30.0
    io_thread_nice: int = 0

    def __post_init__(self) -> None:
        # types first, strictly: a replay's [controller] table and a vLLM connector's options
        # arrive as written, and int() let "64" and 1.5 through (a TypeError mid-run, a
        # fractional batch), inf and nan out as tracebacks
        check_option_types(self, "controller")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy {self.write_policy!r} unknown; allowed: {list(WRITE_POLICIES)}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(
                f"prefetch_policy {self.prefetch_policy!r} unknown; allowed: {list(PREFETCH_POLICIES)}"
            )
        rate = self.prefetch_recompute_tokens_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0):
            raise ConfigError(f"prefetch_recompute_tokens_per_s must be a positive number or None, got {rate!r}")
        if self.write_through_threshold is None:
            self.write_through_threshold = 2 if self.write_policy == "write_through_selective" else 1
        positive = (
            "backup_queue_size", "backup_batch_pages", "storage_queue_size", "storage_batch_pages",
            "prefetch_batch_pages", "max_inflight_prefetch_tokens", "max_concurrent_prefetches",
            "write_through_threshold", "storage_health_errors",
        )
        for name in positive:
            if not getattr(self, name) > 0:  # (types checked first: nan is refused here too)
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        non_negative = (
            "storage_max_retries", "storage_retry_base_s", "storage_retry_max_s", "prefetch_threshold",
            "prefetch_timeout_base_s", "prefetch_timeout_per_ki_token_s", "prefetch_timeout_max_s",
            "cancelled_io_grace_s", "close_timeout_s", "load_back_threshold",
            "io_thread_nice", "storage_hop_bytes", "storage_stall_s", "storage_probe_base_s", "storage_probe_max_s",
        )
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)!r}")
        # 0 (or NaN) is a limit no storage call can meet: every call would time out and mark the
        # store down before it was even made (and, before this check, the controller's wait loop
        # spun on it without ever yielding, freezing the server's event loop)
        timeout = self.storage_io_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"storage_io_timeout_s must be a positive number of seconds, got {timeout!r}")

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a request may wait for its prefetch under the ``timeout`` policy."""
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_ki_token_s * num_tokens / 1024
        return min(self.prefetch_timeout_max_s, t)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerConfig:
        return options_from_dict(cls, data, "controller")

