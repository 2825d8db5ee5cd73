"""The controller's hot-path updates (a transfer: seven series; a latency sample) look their
children up once, and a closed owner's late update still writes nothing: the remembered
children are not used once it is closed, so a series the close removed does not come back."""

from __future__ import annotations

from hicache.controller.metrics import ControllerMetrics
from hicache.observability.metrics import exposition_text
from hicache.observability.scrape import Scrape


def test_repeated_transfers_and_samples_add_up_on_the_same_series() -> None:
    metrics = ControllerMetrics()
    try:
        for _ in range(3):
            metrics.transfer("h2s", 4, 4096, 0.5)
            metrics.observe("set", "storage", 0.25)
        scrape = Scrape(exposition_text())
        label = metrics.label
        assert scrape.value("hicache_transfer_pages_total", cache=label, direction="h2s") == 12
        assert scrape.value("hicache_transfer_bytes_total", cache=label, direction="h2s") == 12288
        assert scrape.value("hicache_tier_pages_total", cache=label, tier="host", io="read") == 12
        assert scrape.value("hicache_tier_bytes_total", cache=label, tier="storage", io="written") == 12288
        assert scrape.value("hicache_operation_seconds_count", cache=label, op="set", tier="storage") == 3
        assert metrics.pages["h2s"] == 12 and metrics.ops["h2s"] == 3
    finally:
        metrics.close()


def test_a_late_update_after_close_does_not_bring_a_series_back() -> None:
    metrics = ControllerMetrics()
    metrics.transfer("d2h", 2, 512, 0.1)  # children looked up and remembered while open
    metrics.observe("backup", "host", 0.1)
    label = metrics.label
    metrics.close()
    assert Scrape(exposition_text()).value("hicache_transfer_pages_total", cache=label, direction="d2h") is None
    metrics.transfer("d2h", 2, 512, 0.1)  # a task finishing after the close
    metrics.observe("backup", "host", 0.1)
    scrape = Scrape(exposition_text())
    assert scrape.value("hicache_transfer_pages_total", cache=label, direction="d2h") is None
    assert scrape.value("hicache_operation_seconds_count", cache=label, op="backup", tier="host") is None
    assert metrics.pages["d2h"] == 4  # the instance's own figures still count
