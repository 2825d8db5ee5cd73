"""Reading a Prometheus scrape back: samples by name and labels, and quantiles of histograms.

Why a module of our own on top of ``prometheus_client.parser``: ``hicache stats`` and the tests
ask the same questions of a scrape (one value, a sum over some labels, a figure several series
repeat counted once, a percentile of a histogram), and the parser answers none of them directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "Scrape", "histogram_quantile"]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


class Scrape:
    """The samples of one exposition, searchable by sample name and a subset of labels."""

    def __init__(self, text: str) -> None:
        self.samples: list[Sample] = []
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples.append(Sample(s.name, dict(s.labels), float(s.value)))
        self.names: set[str] = {s.name for s in self.samples}

    def select(self, name: str, **labels: str) -> list[Sample]:
        """Samples named ``name`` whose labels include ``labels``."""
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def select_live(self, name: str, **labels: str) -> list[Sample]:
        """:meth:`select` without infinite samples: a closed cache's min/max gauges in
        multi-process mode (they cannot leave the scrape; see
        ``InstanceMetrics._neutral_gauges``). NaN stays: a gauge that failed."""
        return [s for s in self.select(name, **labels) if not math.isinf(s.value)]

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the live matching samples (:meth:`select_live`); None when none matches."""
        found = self.select_live(name, **labels)
        return sum(s.value for s in found) if found else None

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Matching samples summed per value of ``label``."""
        out: dict[str, float] = {}
        for s in self.select_live(name, **labels):
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
        return out

    def once_per(self, name: str, label: str, **labels: str) -> float | None:
        """The live matching samples summed with one sample per value of ``label``, its largest:
        a figure that every reporter of one thing gives alike (a store's size, reported by each
        cache on it) counts once. A sample without ``label`` (or with it empty) counts on its
        own. None when none matches."""
        found = self.select_live(name, **labels)
        if not found:
            return None
        largest: dict[str, float] = {}
        alone = 0.0
        for s in found:
            key = s.labels.get(label, "")
            if key:
                largest[key] = max(largest.get(key, s.value), s.value)
            else:
                alone += s.value
        return alone + sum(largest.values())

    def quantile(self, q: float, name: str, **labels: str) -> float | None:
        """The ``q`` quantile of histogram ``name`` (its ``_bucket`` samples summed over the
        labels not given), as Prometheus' ``histogram_quantile`` estimates it."""
        buckets: dict[float, float] = {}
        for s in self.select(f"{name}_bucket", **labels):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        return histogram_quantile(q, buckets.items())


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Linear interpolation inside the bucket holding rank ``q * count`` (cumulative buckets,
    ``(upper bound, count)``). None for an empty histogram; the highest finite bound when the
    rank falls in ``+Inf``."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
