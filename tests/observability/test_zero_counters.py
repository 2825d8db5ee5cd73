"""Every well-known storage counter is published as zero before a backend first counts one, so a
dashboard reads "none yet", not "no data" (``stale_hits``: an S3 index vouched for a page that
was gone)."""

from __future__ import annotations

import pytest

from hicache.observability.cache_gauges import _export_storage
from hicache.observability.metrics import InstanceMetrics, exposition_text
from hicache.observability.scrape import Scrape
from hicache_backends.memory import MemoryStorage


@pytest.mark.parametrize("counter", ["stale_hits", "corrupt_pages", "invalid_requests", "backend_errors"])
def test_counters_are_published_as_zero_counters_before_the_first_count(counter: str) -> None:
    store, metrics = MemoryStorage(None), InstanceMetrics()
    try:
        _export_storage(metrics, store)
        scrape = Scrape(exposition_text())
        assert scrape.value(f"hicache_backend_{counter}_total", cache=metrics.label) == 0
        store.stats.incr(counter, 2)
        _export_storage(metrics, store)
        assert Scrape(exposition_text()).value(f"hicache_backend_{counter}_total", cache=metrics.label) == 2
    finally:
        metrics.close()
