"""Server-side counters, rendered in the Prometheus text format next to the cache's own.

Why the server counts anything when the cache has metrics: the cache knows pages and tiers, but
only the server knows requests, queueing and time-to-first-token, which is what prefix caching
is for. Everything here is touched from the event loop only, so plain ints suffice.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Any

from hicache.engine.runner import GenerateResult

__all__ = ["ServerMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Request, token and latency counters plus the scheduler's gauges."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # by outcome: ok, bad_request, rejected, error, abandoned
        self.prompt_tokens = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.hit_tokens: Counter[str] = Counter()  # by tier
        self.ttft_buckets: list[int] = [0] * len(_TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.queue_depth = 0
        self.active = 0
        self.reference_checks: Counter[str] = Counter()  # match, mismatch
        self.memory_retries = 0  # requests restarted after finding the device full

    def observe(self, result: GenerateResult) -> None:
        self.requests["ok"] += 1
        self.prompt_tokens += result.prompt_tokens
        self.prefill_tokens += result.prefill_tokens
        self.generated_tokens += len(result.tokens)
        for tier, n in result.hits.items():
            self.hit_tokens[tier] += int(n)
        i = bisect_left(_TTFT_BUCKETS, result.ttft_s)
        if i < len(self.ttft_buckets):
            self.ttft_buckets[i] += 1
        self.ttft_sum += result.ttft_s
        self.ttft_count += 1

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

    def prometheus_text(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {value}" for labels, value in samples)

        metric("hicache_server_requests_total", "counter", "Generate requests by outcome.",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())] or [('{outcome="ok"}', 0)])
        metric("hicache_server_prompt_tokens_total", "counter", "Prompt tokens received.", [("", self.prompt_tokens)])
        metric("hicache_server_prefill_tokens_total", "counter", "Prompt tokens computed (not served from cache).",
               [("", self.prefill_tokens)])
        metric("hicache_server_generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
        metric("hicache_server_hit_tokens_total", "counter", "Prompt tokens served from cache, by tier.",
               [(f'{{tier="{t}"}}', self.hit_tokens.get(t, 0)) for t in ("device", "host", "storage")])
        cumulative, samples = 0, []
        for bound, count in zip(_TTFT_BUCKETS, self.ttft_buckets):
            cumulative += count
            samples.append((f'_bucket{{le="{bound}"}}', cumulative))
        samples += [('_bucket{le="+Inf"}', self.ttft_count), ("_sum", self.ttft_sum), ("_count", self.ttft_count)]
        out.append("# HELP hicache_server_ttft_seconds Time from request arrival to first token.")
        out.append("# TYPE hicache_server_ttft_seconds histogram")
        out.extend(f"hicache_server_ttft_seconds{suffix} {value}" for suffix, value in samples)
        metric("hicache_server_memory_retries_total", "counter", "Requests restarted after finding the device full.",
               [("", self.memory_retries)])
        metric("hicache_server_queue_depth", "gauge", "Requests waiting for the scheduler.", [("", self.queue_depth)])
        metric("hicache_server_active_requests", "gauge", "Requests being generated.", [("", self.active)])
        if self.reference_checks:
            metric("hicache_server_reference_checks_total", "counter", "debug_reference comparisons by result.",
                   [(f'{{result="{k}"}}', v) for k, v in sorted(self.reference_checks.items())])
        return "\n".join(out) + "\n"
