"""Controller metrics: counters and gauges, as a dict and in Prometheus text format.

Why plain counters and not a metrics library: the controller runs in someone else's server,
which already has its own registry; ``snapshot()`` feeds any of them and ``prometheus_text()``
serves a scrape endpoint without a dependency. Everything is updated on the event loop thread.

Directions: ``d2h`` device->host backup, ``h2d`` host->device load-back, ``h2s`` host->storage
backup, ``s2h`` storage->host prefetch.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ControllerMetrics", "DIRECTIONS", "TIERS"]

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
TIERS = ("device", "host", "storage")

_COUNTERS: dict[str, str] = {
    "requests": "requests matched",
    "prompt_tokens": "tokens looked up",
    "computed_tokens": "tokens that missed every tier",
    "backup_rejected": "device->host backups refused because the backup queue was full",
    "backup_deferred": "device->host backups deferred (no host page free after host eviction, or a full queue); started as room frees up",
    "host_copies_shed_tokens": "tokens of host copies dropped for room because device and storage hold them too",
    "backup_failures": "device->host copies that failed",
    "load_failures": "host->device loads that failed",
    "load_back_skipped": "load-backs skipped (quota or no device memory)",
    "storage_write_retries": "storage write attempts retried",
    "storage_write_failures": "pages whose storage write failed after all retries",
    "storage_read_failures": "storage read or exists calls that failed",
    "storage_timeouts": "storage calls that exceeded the I/O timeout",
    "storage_rejected": "storage backups refused because the queue was full",
    "storage_stalls": "storage calls unanswered after storage_stall_s (the store is marked down)",
    "storage_trips": "times the store was marked down (hung or failing)",
    "storage_probes": "health probes sent while the store was down",
    "storage_probes_failed": "health probes that got no answer",
    "storage_recoveries": "times a probe found the store answering again",
    "storage_calls_skipped": "storage calls not made: the store is marked down",
    "storage_write_skipped_unhealthy": "pages not written: the store is marked down",
    "prefetch_skipped_unhealthy": "prefetches not started: the store is marked down",
    "unwritten_on_close": "pages still unwritten when the controller closed",
    "prefetch_started": "prefetches started",
    "prefetch_skipped_threshold": "prefetches not started: below the token threshold",
    "prefetch_rate_limited": "prefetches not started: rate limit",
    "prefetch_aborted": "prefetches aborted",
    "prefetch_pages_done": "pages fetched from storage",
    "prefetch_pages_used": "fetched pages handed to requests",
    "host_evicted_tokens": "tokens evicted from host",
    "victim_write_pages": "pages host eviction queued for storage (write-back at eviction, unwritten ancestors included)",
    "victim_write_failed_pages": "pages of write-backs at host eviction that storage did not take (dropped from host later, not retried)",
    "victim_writes_skipped_pages": "pages the placement wanted written at host eviction but host dropped (write-back bound reached, an ancestor not writable now, or the queue full)",
    "device_evicted_tokens": "tokens evicted from device",
    "worker_errors": "unexpected errors caught in controller workers",
}


class ControllerMetrics:
    """Counters of the controller and its cache; gauges are read through callbacks."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {name: 0 for name in _COUNTERS}
        self.hit_tokens: dict[str, int] = {tier: 0 for tier in TIERS}
        self.bytes: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.pages: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.seconds: dict[str, float] = {d: 0.0 for d in DIRECTIONS}
        self.ops: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self._gauges: dict[str, Callable[[], float]] = {}

    def incr(self, name: str, amount: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def hit(self, tier: str, tokens: int) -> None:
        self.hit_tokens[tier] += int(tokens)

    def transfer(self, direction: str, pages: int, nbytes: int, seconds: float) -> None:
        self.pages[direction] += int(pages)
        self.bytes[direction] += int(nbytes)
        self.seconds[direction] += float(seconds)
        self.ops[direction] += 1

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        """Register a gauge read at snapshot time (queue depths, pages in use)."""
        self._gauges[name] = fn

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

    def prometheus_text(self, prefix: str = "hicache") -> str:
        """Prometheus exposition format (text 0.0.4)."""
        snap = self.snapshot()
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {prefix}_{name} {help_}")
            out.append(f"# TYPE {prefix}_{name} {kind}")
            for labels, value in samples:
                out.append(f"{prefix}_{name}{labels} {_fmt(value)}")

        family("hit_tokens_total", "counter", "prefix tokens served per tier",
               [(f'{{tier="{t}"}}', v) for t, v in snap["hit_tokens"].items()])  # type: ignore[union-attr]
        family("transfer_bytes_total", "counter", "bytes moved per direction",
               [(f'{{direction="{d}"}}', v) for d, v in snap["bytes"].items()])  # type: ignore[union-attr]
        family("transfer_pages_total", "counter", "pages moved per direction",
               [(f'{{direction="{d}"}}', v) for d, v in snap["pages"].items()])  # type: ignore[union-attr]
        family("transfer_seconds_total", "counter", "time spent moving pages per direction",
               [(f'{{direction="{d}"}}', v) for d, v in snap["seconds"].items()])  # type: ignore[union-attr]
        for name, value in snap["counters"].items():  # type: ignore[union-attr]
            family(f"{name}_total", "counter", _COUNTERS.get(name, name), [("", value)])
        for name, value in snap["gauges"].items():  # type: ignore[union-attr]
            family(name, "gauge", name.replace("_", " "), [("", value)])
        return "\n".join(out) + "\n"


def _fmt(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))
