"""``hicache stats`` against a real server and a real store, and the Grafana dashboard against
a real scrape: every metric the dashboard queries exists."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import aiohttp
import pytest

from hicache.cli import main
from hicache.config import HiCacheConfig
from hicache.facade import HiCache
from hicache.observability.scrape import Scrape, histogram_quantile
from hicache.observability.stats_view import render_scrape, run_stats
from hicache.server import running_server

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-hicache.json"
PS = 16
TOKENS = [(7 * i + 3) % 97 for i in range(8 * PS + 3)]  # inside the tiny model's vocabulary


def small_config(root: Path) -> HiCacheConfig:
    return HiCacheConfig.model_validate({
        "model": {"name": "tests/stats-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
        "device": {"device": "cpu", "size_tokens": 4096, "page_size": PS, "max_context_len": 2048},
        "host": {"ratio": 2.0},
        "storage": {"backend": "file", "options": {"root": str(root), "max_bytes": 1 << 30, "min_free_bytes": 0}},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "server": {"host": "127.0.0.1", "port": 0, "max_batch": 4, "max_new_tokens": 4},
    })


async def _scrape_after_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Scrape, str, str]:
    """The server's scrape, the ``stats`` screen of it, and the server's cache label (the scrape
    is the process's: a cache another test left open shows in it too)."""
    cfg = small_config(tmp_path / "store")
    async with HiCache.from_config(cfg) as writer:  # another cache put the prefix in the store
        h = await writer.begin("w", TOKENS)
        await writer.commit(h)
        await writer.drain()
    async with running_server(cfg, port=0) as srv, aiohttp.ClientSession() as http:
        for _ in range(2):  # storage hit (prefetch + load-back), then a device hit
            async with http.post(f"{srv.url}/v1/generate", json={"tokens": TOKENS, "max_new_tokens": 2}) as resp:
                assert resp.status == 200
        await srv.cache.drain()
        async with http.get(f"{srv.url}/metrics") as resp:
            scrape = Scrape(await resp.text())
        capsys.readouterr()
        # the CLI blocks on its HTTP call: run it off this loop, which serves the request
        assert await asyncio.to_thread(main, ["stats", srv.url, "--once"]) == 0
        screen = capsys.readouterr().out
        label = srv.cache.metrics_label
    assert label is not None
    return scrape, screen, label


async def test_stats_screen_and_dashboard_metrics_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scrape, screen, label = await _scrape_after_traffic(tmp_path, capsys)
    assert scrape.value("hicache_hit_tokens_total", tier="storage") >= 8 * PS
    # the screen: tiers with their hits, the operations with percentiles, queues and the store
    rows = {line.split()[0]: line.split() for line in screen.splitlines() if line.split()}
    assert int(rows["storage"][1].replace(",", "")) >= 8 * PS
    assert "TTFT p50" in screen and "storage: up" in screen
    assert re.search(r"^get\s+storage\s+\d+\s+[\d.]+", screen, re.M), screen
    assert re.search(r"^load_back\s+host\s+\d+", screen, re.M), screen
    # the screen sums the process's caches: this server's own queue is empty after its drain
    assert re.search(r"^queues: backup \d+", screen, re.M), screen
    assert scrape.value("hicache_backup_queue_depth", cache=label) == 0
    # the dashboard: valid JSON, and every hicache metric it queries is in the scrape
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    queried = {m for e in exprs for m in re.findall(r"\bhicache_[a-z0-9_]+", e)}
    assert len(queried) >= 20
    missing = sorted(queried - scrape.names)
    assert not missing, f"the dashboard queries metrics no scrape has: {missing}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("hit ratio", "latency", "heatmap", "bytes/s", "queue", "breaker", "ttft"):
        assert topic in titles, topic


async def test_stats_of_a_store_root(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store")
    async with HiCache.from_config(cfg) as cache:
        h = await cache.begin("w", TOKENS)
        await cache.commit(h)
        await cache.drain()
    out = io.StringIO()
    assert await asyncio.to_thread(run_stats, str(tmp_path / "store"), once=True, out=out) == 0
    screen = out.getvalue()
    assert "backend file   namespaces 1   pages 8" in screen, screen
    assert "writes refused for free space 0" in screen and "floor (min_free_bytes)" in screen


def test_stats_rates_between_refreshes_and_an_unreachable_url() -> None:
    text = ('# TYPE hicache_tier_bytes counter\n'
            'hicache_tier_bytes_total{cache="0",tier="host",io="read"} %d\n'
            '# TYPE hicache_prompt_tokens counter\nhicache_prompt_tokens_total{cache="0"} 10\n')
    before, after = Scrape(text % 0), Scrape(text % (4 << 20))
    screen = render_scrape(after, "x", previous=(10.0, before), now=12.0)
    host = next(line for line in screen.splitlines() if line.startswith("host"))
    assert "2.0 MiB/s" in host, host
    out = io.StringIO()
    assert run_stats("http://127.0.0.1:9/metrics", once=True, out=out) == 1
    assert "cannot scrape" in out.getvalue()
    assert run_stats("localhost:8471", once=True, out=io.StringIO()) == 2  # neither a folder nor a URL


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 50.0), (0.2, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == pytest.approx(0.1)


async def test_kv_event_publisher_counts_are_in_the_scrape(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store").model_copy(deep=True)
    cfg = HiCacheConfig.model_validate({**cfg.model_dump(), "events": {"enabled": True, "endpoint": None,
                                                                        "replay_endpoint": None}})
    async with HiCache.from_config(cfg) as cache:
        h = await cache.begin("w", TOKENS)
        await cache.commit(h)
        await cache.drain()
        published = 0.0
        for _ in range(200):  # the publisher thread takes the changes off the hub's queue
            scrape = Scrape(cache.prometheus_text())
            published = scrape.value("hicache_events_published_events_total", cache=cache.metrics_label) or 0.0
            if published:
                break
            await asyncio.sleep(0.02)
        assert published > 0
        assert scrape.value("hicache_events_dropped_events_total", cache=cache.metrics_label) == 0
        assert scrape.value("hicache_events_queued", cache=cache.metrics_label) is not None
        assert scrape.value("hicache_events_replays_open", cache=cache.metrics_label) == 0
        assert scrape.value("hicache_events_replays_refused_total", cache=cache.metrics_label) == 0


async def test_stats_counts_a_store_shared_by_two_caches_once(tmp_path: Path) -> None:
    """Two caches over one file store folder each report the whole store's size: the screen
    showed twice its pages and bytes."""
    cfg = small_config(tmp_path / "store")
    async with HiCache.from_config(cfg) as first:
        h = await first.begin("w", TOKENS)
        await first.commit(h)
        await first.drain()
        async with HiCache.from_config(cfg) as second:  # its scan finds the first one's pages
            labels = {first.metrics_label, second.metrics_label}
            scrape = Scrape(first.prometheus_text())
            for _ in range(200):
                stored = {s.labels["cache"]: s.value for s in scrape.select("hicache_backend_stored_pages")
                          if s.labels["cache"] in labels}
                if len(stored) == 2 and set(stored.values()) == {8.0}:
                    break
                await asyncio.sleep(0.02)
                scrape = Scrape(first.prometheus_text())
            assert set(stored.values()) == {8.0}, stored  # each cache reports the one store
            screen = render_scrape(scrape, "x")
            assert re.search(r"stored 8 pages \(", screen), screen
