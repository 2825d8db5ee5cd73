"""Controller metrics: ``snapshot()`` dicts for code and tests, ``prometheus_client`` families
for scrapes.

Why both: code in this repository (replay, the demo, tests) reads per-instance numbers as plain
dicts, while a scrape wants process-wide families; every update goes to both. The families and
the per-instance ``cache`` label are explained in :mod:`hicache.observability.metrics`.
Everything is updated on the event loop thread.

Directions: ``d2h`` device->host backup, ``h2d`` host->device load-back, ``h2s`` host->storage
backup, ``s2h`` storage->host prefetch. Each moves pages out of one tier and into another, so a
transfer also counts ``hicache_tier_{bytes,pages}_total{tier, io="read"|"written"}``.
Latency histograms (``hicache_operation_seconds{op, tier}``): ``exists``, ``get``, ``set``
(one storage call), ``backup`` (``host``: one device->host batch; ``storage``: one job's pages,
retries included), ``load_back`` (host->device, all layers), ``prefetch`` (one request's whole
storage fetch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.observability import metrics as obs

__all__ = ["ControllerMetrics", "DIRECTIONS", "OPERATIONS", "TIERS"]

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
TIERS = ("device", "host", "storage")
OPERATIONS = ("exists", "get", "set", "backup", "load_back", "prefetch")
# direction -> (tier read, tier written)
_ENDS: dict[str, tuple[str, str]] = {
    "d2h": ("device", "host"), "h2d": ("host", "device"), "h2s": ("host", "storage"), "s2h": ("storage", "host"),
}
# gauges whose sum over workers means nothing (multi-process aggregation)
_GAUGE_MODES = {"storage_up": "livemin", "tasks": "livemax", "recompute_tokens_per_s": "livemax"}

_COUNTERS: dict[str, str] = {
    "requests": "requests matched",
    "prompt_tokens": "tokens looked up",
    "computed_tokens": "tokens that missed every tier",
    "backup_rejected": "device->host backups refused because the backup queue was full",
    "backup_deferred": "device->host backups deferred (no host page free after host eviction, or a full queue); started as room frees up",
    "host_copies_shed_tokens": "tokens of host copies dropped for room because device and storage hold them too",
    "backup_failures": "device->host copies that failed",
    "kept_backups_given_up": "copies of KV that must be written (a handed-over session history) that failed every try; no longer kept on device",
    "load_failures": "host->device loads that failed",
    "load_back_skipped": "load-backs skipped (quota or no device memory)",
    "storage_write_retries": "storage write attempts retried",
    "storage_write_failures": "pages whose storage write failed after all retries",
    "storage_write_no_space_pages": "pages of storage writes left unwritten because the store cannot hold them beside their prefix (a write longer than it holds, or a page bigger than it): refused, or after a refused page of the same write; its leading pages kept, the rest not retried",
    "storage_read_failures": "storage read or exists calls that failed",
    "storage_timeouts": "storage calls that exceeded the I/O timeout",
    "storage_calls_stuck": "cancelled storage calls still running after cancelled_io_grace_s (their host pages stay out of use until they return)",
    "storage_rejected": "storage backups refused because the queue was full",
    "storage_stalls": "storage calls unanswered after storage_stall_s (the store is marked down)",
    "storage_trips": "times the store was marked down (hung or failing)",
    "storage_probes": "health probes sent while the store was down",
    "storage_probes_failed": "health probes that got no answer",
    "storage_recoveries": "times a probe found the store answering again",
    "storage_calls_skipped": "storage calls not made: the store is marked down",
    "storage_write_skipped_unhealthy": "pages not written: the store is marked down",
    "prefetch_skipped_unhealthy": "prefetches not started: the store is marked down",
    "prefetch_promised_while_down": "reads an engine had already counted as hits, tried while the store was marked down",
    "unwritten_on_close": "pages still unwritten when the controller closed",
    "prefetch_started": "prefetches started",
    "prefetch_skipped_threshold": "prefetches not started, or stopped after the lookup: below the token threshold",
    "take_events_dropped": "KV events dropped from the take_events() log, oldest first: the engine polled too rarely",
    "prefetch_rate_limited": "prefetches not started: rate limit",
    "prefetch_aborted": "prefetches aborted",
    "prefetch_dropped_for_room": "prefetches of waiting requests aborted because device eviction needed the prefix they continue from (no host copy); the request computes those pages",
    "prefetch_cut_recompute": "prefetch waits ended because the missing pages would be recomputed sooner than fetched",
    "prefetch_pages_done": "pages fetched from storage",
    "prefetch_pages_used": "fetched pages handed to requests",
    "host_evicted_tokens": "tokens evicted from host",
    "victim_write_pages": "pages host eviction queued for storage (write-back at eviction, unwritten ancestors included)",
    "victim_write_failed_pages": "pages of write-backs at host eviction that storage did not take (dropped from host later, not retried)",
    "victim_writes_skipped_pages": "pages the placement wanted written at host eviction but host dropped (write-back bound reached, an ancestor not writable now, or the queue full)",
    "device_evicted_tokens": "tokens evicted from device",
    "storage_deleted_pages": "pages a placement policy evicted from storage (batch_delete ahead of a write)",
    "storage_delete_missed_pages": "pages a placement policy asked storage to delete that it did not (absent, busy, or the delete failed)",
    "storage_deletes_deferred_pages": "storage evictions a placement policy chose that went with a later write (the store was down when their own write's turn came)",
    "storage_write_dropped_pages": "pages the placement wanted in storage that host dropped before their write could start (it waited for their prefix's write)",
    "storage_writes_reoffered": "writes that landed short (failed, refused, skipped while the store was down) offered again once the store was back",
    "storage_writes_no_room_pages": "pages a placement policy did not send to storage: no room without evicting the write's own prefix or a page being read",
    "storage_pages_lost": "pages the tree counted as stored that storage no longer holds (evicted, removed by the backend, cleared): written again when needed",
    "worker_errors": "unexpected errors caught in controller workers",
}


class ControllerMetrics(obs.InstanceMetrics):
    """Counters of the controller and its cache; gauges are read through callbacks.

    Args:
        label: the ``cache`` label value of this instance's families (default: the next
            per-process number, see :mod:`hicache.observability.metrics`).
    """

    def __init__(self, label: str | None = None) -> None:
        super().__init__(label)
        self.counters: dict[str, float] = {name: 0 for name in _COUNTERS}
        self.hit_tokens: dict[str, int] = {tier: 0 for tier in TIERS}
        self.bytes: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.pages: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.seconds: dict[str, float] = {d: 0.0 for d in DIRECTIONS}
        self.ops: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self._gauges: dict[str, Callable[[], float]] = {}
        # the children of each hot-path update, looked up once: a transfer updates seven
        # series, and each lookup in InstanceMetrics.child sorts its labels first (a transfer
        # cost ~9 us, run for every copy and storage batch); forgotten on close (see _hot)
        self._hot_children: dict[object, object] = {}
        # every family exists from the start, so a scrape (and a dashboard) sees zeros, not gaps;
        # children are looked up in InstanceMetrics.child's memo, the only one
        for name in _COUNTERS:
            self._counter(name)
        for tier in TIERS:
            self._hit_child(tier)
        for d in DIRECTIONS:
            self._transfer_children(d)

    def _hot(self, key: object, lookup: Callable[[], object]) -> Any:
        """``lookup()``, remembered under ``key`` while this owner is open. Once closed an
        update looks up again and gets InstanceMetrics.child's dropped stand-in, as it did
        before anything was remembered: a late update writes to no series."""
        if self._closed:
            return lookup()
        have = self._hot_children.get(key)
        if have is None:
            have = self._hot_children[key] = lookup()
        return have

    def _counter(self, name: str) -> object:
        return self.child("counter", name, _COUNTERS.get(name, name.replace("_", " ")))

    def _hit_child(self, tier: str) -> object:
        return self.child("counter", "hit_tokens", "prefix tokens served per tier", {"tier": tier})

    def _transfer_children(self, direction: str) -> tuple[object, ...]:
        src, dst = _ENDS[direction]
        d = {"direction": direction}
        return (
            self.child("counter", "transfer_bytes", "bytes moved per direction", d),
            self.child("counter", "transfer_pages", "pages moved per direction", d),
            self.child("counter", "transfer_seconds", "time spent moving pages per direction", d),
            self.child("counter", "tier_bytes", "bytes read from / written to each tier", {"tier": src, "io": "read"}),
            self.child("counter", "tier_pages", "pages read from / written to each tier", {"tier": src, "io": "read"}),
            self.child("counter", "tier_bytes", "bytes read from / written to each tier", {"tier": dst, "io": "written"}),
            self.child("counter", "tier_pages", "pages read from / written to each tier", {"tier": dst, "io": "written"}),
        )

    def incr(self, name: str, amount: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount
        if amount > 0:
            self._counter(name).inc(amount)  # type: ignore[attr-defined]
        self.touched()

    def hit(self, tier: str, tokens: int) -> None:
        self.hit_tokens[tier] += int(tokens)
        if tokens > 0:
            self._hit_child(tier).inc(int(tokens))  # type: ignore[attr-defined]

    def transfer(self, direction: str, pages: int, nbytes: int, seconds: float) -> None:
        self.pages[direction] += int(pages)
        self.bytes[direction] += int(nbytes)
        self.seconds[direction] += float(seconds)
        self.ops[direction] += 1
        b, p, s, rb, rp, wb, wp = self._hot(direction, lambda: self._transfer_children(direction))
        for child, value in ((b, nbytes), (p, pages), (s, seconds), (rb, nbytes), (rp, pages), (wb, nbytes), (wp, pages)):
            if value > 0:
                child.inc(value)  # type: ignore[attr-defined]
        self.touched()

    def observe(self, op: str, tier: str, seconds: float) -> None:
        """One latency sample of ``op`` (see :data:`OPERATIONS`) on ``tier``."""
        child = self._hot((op, tier), lambda: self.child("histogram", "operation_seconds",
                                                        "latency of cache operations per tier", {"op": op, "tier": tier}))
        child.observe(max(0.0, float(seconds)))

    def gauge(self, name: str, fn: Callable[[], float], doc: str = "", mode: str | None = None,  # type: ignore[override]
              labels: dict[str, str] | None = None) -> None:
        """Register a gauge read at snapshot and scrape time (queue depths, pages in use)."""
        self._gauges[name] = fn
        super().gauge(name, fn, doc or name.replace("_", " "), mode or _GAUGE_MODES.get(name, "livesum"), labels)

    def snapshot(self) -> dict[str, object]:
        gauges: dict[str, float] = {}
        for name, fn in self._gauges.items():
            try:
                gauges[name] = float(fn())
            except Exception:  # noqa: BLE001 - a broken gauge must not break scraping
                gauges[name] = float("nan")
        return {
            "counters": dict(self.counters),
            "hit_tokens": dict(self.hit_tokens),
            "bytes": dict(self.bytes),
            "pages": dict(self.pages),
            "seconds": dict(self.seconds),
            "ops": dict(self.ops),
            "gauges": gauges,
        }

    def prometheus_text(self) -> str:
        """The process's scrape (every registered family, this instance's included)."""
        return obs.exposition_text()
