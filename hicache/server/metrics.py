"""Server-side metrics: requests, tokens, time-to-first-token and the scheduler's gauges.

Why the server counts anything when the cache has metrics: the cache knows pages and tiers, but
only the server knows requests, queueing and time-to-first-token, which is what prefix caching
is for. The numbers are kept as plain attributes (``snapshot()``, ``/health`` and the demo read
them) and every change also goes to ``prometheus_client`` families (``hicache_server_*``, with
the ``cache`` label of the cache the server runs, see :mod:`hicache.observability.metrics`).
The call sites keep the plain-attribute style (``requests["ok"] += 1``): the tallies below pass
each increase on. Everything here is touched from the event loop only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hicache.engine.runner import GenerateResult
from hicache.observability.metrics import InstanceMetrics

__all__ = ["OUTCOMES", "ServerMetrics", "TTFT_BUCKETS"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: every ``outcome`` of ``hicache_server_requests_total`` (see ``ServerMetrics.requests``)
OUTCOMES = ("ok", "bad_request", "rejected", "error", "abandoned")


class _Tally(Counter[str]):
    """A ``Counter`` whose increases also go to a labelled prometheus counter."""

    def __init__(self, owner: InstanceMetrics, name: str, doc: str, label: str) -> None:
        super().__init__()
        self._inc = lambda key, n: owner.child("counter", name, doc, {label: str(key)}).inc(n)

    def __setitem__(self, key: str, value: int) -> None:
        grew = value - self.get(key, 0)
        super().__setitem__(key, value)
        if grew > 0:
            self._inc(key, grew)


class ServerMetrics(InstanceMetrics):
    """Request, token and latency counters plus the scheduler's gauges.

    Args:
        label: the ``cache`` label value; the app passes its cache's, so one dashboard row
            joins the server's TTFT with the cache's tiers.
    """

    def __init__(self, label: str | None = None) -> None:
        super().__init__(label)
        # by outcome: ok, bad_request (4xx), rejected (503), error (500), abandoned; a failure is
        # labelled by the status it is answered with (scheduler.status_of), at submit or after
        self.requests: Counter[str] = _Tally(self, "server_requests", "generate requests by outcome", "outcome")
        self.prompt_tokens = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.hit_tokens: Counter[str] = _Tally(self, "server_hit_tokens", "prompt tokens served from cache, by tier", "tier")
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.queue_depth = 0
        self.active = 0
        self.reference_checks: Counter[str] = _Tally(self, "server_reference_checks",
                                                    "debug_reference comparisons by result", "result")
        self._memory_retries = 0
        self._ttft = self.child("histogram", "server_ttft_seconds", "time from request arrival to first token",
                                buckets=TTFT_BUCKETS)
        self._tokens = {
            kind: self.child("counter", f"server_{kind}_tokens", doc)
            for kind, doc in (("prompt", "prompt tokens received"),
                              ("prefill", "prompt tokens computed (not served from cache)"),
                              ("generated", "tokens generated"))
        }
        self._retries = self.child("counter", "server_memory_retries", "requests restarted after finding the device full")
        self.gauge("server_queue_depth", lambda: self.queue_depth, "requests waiting for the scheduler")
        self.gauge("server_active_requests", lambda: self.active, "requests being generated")
        # zeros from the start: a dashboard sees no gap, and the first error counts (rate() and
        # increase() take a series' first sample as its start: one born at 1 hid its first 500)
        for tier in ("device", "host", "storage"):
            self.child("counter", "server_hit_tokens", "prompt tokens served from cache, by tier", {"tier": tier})
        for outcome in OUTCOMES:
            self.child("counter", "server_requests", "generate requests by outcome", {"outcome": outcome})

    @property
    def memory_retries(self) -> int:
        """Requests restarted after finding the device full."""
        return self._memory_retries

    @memory_retries.setter
    def memory_retries(self, value: int) -> None:
        if value > self._memory_retries:
            self._retries.inc(value - self._memory_retries)
        self._memory_retries = value

    def observe(self, result: GenerateResult) -> None:
        self.requests["ok"] += 1
        self.prompt_tokens += result.prompt_tokens
        self.prefill_tokens += result.prefill_tokens
        self.generated_tokens += len(result.tokens)
        for kind, n in (("prompt", result.prompt_tokens), ("prefill", result.prefill_tokens),
                        ("generated", len(result.tokens))):
            if n > 0:
                self._tokens[kind].inc(n)
        for tier, n in result.hits.items():
            self.hit_tokens[tier] += int(n)
        self._ttft.observe(max(0.0, result.ttft_s))
        self.ttft_sum += result.ttft_s
        self.ttft_count += 1
        self.touched()

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated_tokens,
            "hit_tokens": dict(self.hit_tokens),
            "ttft_mean_s": self.ttft_sum / self.ttft_count if self.ttft_count else None,
            "queue_depth": self.queue_depth,
            "active": self.active,
            "reference_checks": dict(self.reference_checks),
            "memory_retries": self.memory_retries,
        }
