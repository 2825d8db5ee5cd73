"""The facade's figures that live in other objects (pools, the storage backend, sessions),
published as metrics of the cache's own instance at every scrape.

Why read at scrape time and not counted where they change: the pools' free counts and the
backend's counters are already kept, thread-safely, by their owners; copying them at scrape
time costs the request path nothing. A backend's running totals become counters (they only
grow; a reset counts from zero again), its other figures gauges.

Families (all with the instance's ``cache`` label):

- ``hicache_device_{size,free,cached,evictable}_tokens``, ``hicache_host_{size,free}_tokens``,
  ``hicache_tier_change_subscriber_errors_total`` (a consumer of tier changes that raised)
- ``hicache_backend_<counter>_total{backend}`` for each of the backend's
  :class:`~hicache.storage.stats.StorageStats` counters (``read_bytes``, ``write_ok``,
  ``backend_errors``, ``evicted_pages``...) and the running totals it reports among its figures
  (the file store's ``journal_{dropped_lines,torn_lines,malformed_lines,missed_files,failed_removals}``: see
  ``_BACKEND_TOTALS``), ``hicache_backend_<figure>{backend}`` for its other
  numeric figures (``stored_pages``, ``stored_bytes``...; the store-wide ones also carry a
  ``store`` label naming the medium, which caches sharing one store report alike), and
  ``hicache_backend_breaker_state{backend}`` (0 closed, 1 half open, 2 open) for a backend with
  a circuit breaker (S3)
- ``hicache_session_<counter>_total`` and ``hicache_session_{sessions_open,...}`` gauges
- with KV events on: ``hicache_events_{published_batches,published_events,dropped_events,
  replay_requests,errors}_total`` and the ``hicache_events_queued`` gauge (the publisher's stats)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.observability.metrics import InstanceMetrics, numeric_items

__all__ = ["BREAKER_STATES", "export_cache_state"]

BREAKER_STATES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
# running totals some backends report among their figures (kept outside StorageStats, or in it
# only once counted): counters whichever backend reports them, from the first scrape on (a
# family's kind is fixed for the process by the first scrape that sees it: a total reported as
# 0 before its first count became a gauge, and its counter was then refused, stuck at 0)
_BACKEND_TOTALS = frozenset({"evicted_pages", "evicted_bytes", "corrupt_pages", "rejected_pages_no_space",
                             "rejected_pages_beyond_capacity", "oversized_pages",
                             "breaker_times_opened", "transit_errors", "write_late_pages", "pruned_pages",
                             # the file store's removal journal: lines given up, torn, malformed, files missed,
                             # removals failed
                             "journal_dropped_lines", "journal_missed_files", "journal_torn_lines",
                             "journal_malformed_lines", "journal_failed_removals"})
# StorageStats' well-known counters: published as zeros before a backend first counts one, so a
# dashboard sees "no errors", not "no data"
_BACKEND_COUNTERS = ("exists_calls", "exists_keys", "exists_hits", "read_pages", "read_hits", "read_misses",
                     "read_bytes", "write_pages", "write_ok", "write_failures", "write_bytes", "backend_errors",
                     "invalid_requests", "corrupt_pages", "stale_hits", "evicted_pages", "evicted_bytes")
_EVENT_COUNTERS = ("published_batches", "published_events", "dropped_events", "replay_requests", "replays_served",
                   "replays_refused", "replays_dropped", "replay_bytes", "errors")
# figures of the whole store, not of this process: several workers on one store each report
# them, so in multi-process mode they aggregate to the largest report, never the sum; and they
# carry a ``store`` label (the backend's ``store`` figure), so caches of one process on one store
# can be counted once too (``max by (instance, store)``; ``hicache stats`` does), not once per cache
_STORE_WIDE = frozenset({"stored_pages", "stored_bytes", "max_bytes", "min_free_bytes", "free_bytes"})
_SESSION_GAUGES = ("sessions_open", "sessions_holding_kv", "session_held_tokens", "writeback_pending",
                   "writeback_pending_tokens")


def export_cache_state(metrics: InstanceMetrics, stack: Any, sessions: Callable[[], Any] | None = None,
                       events: Callable[[], Any] | None = None) -> None:
    """Register the device, host, storage and session figures of a built stack on ``metrics``
    (``sessions()`` returns the session cache, ``events()`` the KV-event service; either may
    return None while there is none)."""
    alloc, tree, host = stack.allocator, stack.cache, stack.host_pool
    metrics.gauge("device_size_tokens", lambda: alloc.size, "device KV slots")
    metrics.gauge("device_free_tokens", alloc.available_size, "device KV slots free")
    metrics.gauge("device_cached_tokens", tree.total_size, "tokens the device prefix tree holds")
    metrics.gauge("device_evictable_tokens", tree.evictable_size, "device tokens evictable now")
    metrics.gauge("host_size_tokens", lambda: host.size, "host pool slots")
    metrics.gauge("host_free_tokens", host.available_size, "host pool slots free")
    hub = getattr(stack, "tier_changes", None)
    if hub is not None:  # a consumer of tier changes (events, attribution, placement) that raised
        metrics.on_refresh(lambda m: m.mirror("counter", "tier_change_subscriber_errors",
                                              float(hub.subscriber_errors),
                                              "tier-change consumers that raised (each logged)"))
    if stack.storage is not None:
        metrics.on_refresh(lambda m: _export_storage(m, stack.storage))
    if sessions is not None:
        metrics.on_refresh(lambda m: _export_sessions(m, sessions()))
    if events is not None:
        metrics.on_refresh(lambda m: _export_events(m, events()))


def _export_events(metrics: InstanceMetrics, service: Any) -> None:
    if service is None:
        return
    stats = service.stats()
    for key in _EVENT_COUNTERS:
        if key in stats:
            metrics.mirror("counter", f"events_{key}", float(stats[key]), f"kv events: {key.replace('_', ' ')}")
    if "queued" in stats:
        metrics.mirror("gauge", "events_queued", float(stats["queued"]), "kv events: event lists waiting to be published")
    if "replays_open" in stats:
        metrics.mirror("gauge", "events_replays_open", float(stats["replays_open"]),
                       "kv events: replay requests being answered")


def _export_storage(metrics: InstanceMetrics, storage: Any) -> None:
    stats = {name: 0 for name in _BACKEND_COUNTERS}
    stats.update(storage.get_stats())
    counters = set(storage.stats.snapshot()) | _BACKEND_TOTALS | set(_BACKEND_COUNTERS)
    labels = {"backend": str(stats.get("backend", "unknown")).lower()}
    store_wide = {**labels, "store": str(stats.get("store", ""))}
    for key, value in numeric_items(stats):
        kind = "counter" if key in counters else "gauge"
        wide = kind == "gauge" and key in _STORE_WIDE
        metrics.mirror(kind, f"backend_{key}", value, f"storage backend {key.replace('_', ' ')}",
                       store_wide if wide else labels, **({"mode": "livemax"} if wide else {}))
    state = stats.get("breaker_state")
    if isinstance(state, str) and state in BREAKER_STATES:
        metrics.mirror("gauge", "backend_breaker_state", BREAKER_STATES[state],
                       "storage backend circuit breaker: 0 closed, 1 half open, 2 open", labels, mode="livemax")


def _export_sessions(metrics: InstanceMetrics, cache: Any) -> None:
    if cache is None:
        return
    for key, value in numeric_items(cache.session_metrics.snapshot()):
        metrics.mirror("counter", f"session_{key}", value, f"sessions: {key.replace('_', ' ')}")
    figures = cache.gauges()  # not metrics(): this runs on the scrape's thread
    for key in _SESSION_GAUGES:
        if key in figures:
            metrics.mirror("gauge", f"session_{key}", float(figures[key]), f"sessions: {key.replace('_', ' ')}")
