"""OpenTelemetry spans: the SDK's in-memory exporter sees a request's cache work, nested under
its ``hicache.begin``; with tracing off nothing of OpenTelemetry is even imported."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from hicache.facade import HiCache
from hicache.observability import tracing

PS = 16
CODE_OFF = """
import asyncio, sys
from hicache.facade import HiCache
async def main():
    cfg = {"storage": {"backend": "memory"}, "device": {"device": "cpu", "size_tokens": 1024, "page_size": 16}}
    async with HiCache.from_config(cfg) as cache:
        h = await cache.begin("r", list(range(40)))
        await cache.commit(h)
asyncio.run(main())
assert "opentelemetry" not in sys.modules, "tracing is off: OpenTelemetry must not be imported"
"""
CODE_MISSING = """
import asyncio, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from hicache.errors import ConfigError
from hicache.facade import HiCache
async def main():
    try:
        await HiCache.from_config({"storage": {"backend": "memory"}, "tracing": {"enabled": True}}).start()
    except ConfigError as exc:
        assert "hicache[otel]" in str(exc), exc
        return
    raise AssertionError("started without OpenTelemetry")
asyncio.run(main())
"""


def config(store_id: str) -> dict:
    return {
        "model": {"name": "test/tracing", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 64 * PS, "page_size": PS, "max_requests": 8, "max_context_len": 2048},
        "storage": {"backend": "memory", "options": {"store_id": store_id}},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "session": {"reap_interval_s": None},
        "tracing": {"enabled": True},
    }


@pytest.fixture
def exporter() -> Iterator[object]:
    pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK is not installed (hicache[otel])")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.enable(provider)  # the config's enable() keeps this provider
    try:
        yield memory
    finally:
        tracing.disable()
        provider.shutdown()


async def _serve(cache: HiCache, rid: str, tokens: list[int]) -> None:
    h = await cache.begin(rid, tokens)
    for layer in range(cache.device_pool.layer_num):
        await h.wait_layer(layer)
    await cache.commit(h, finished=True)


async def test_spans_cover_match_prefetch_load_back_and_backup(exporter) -> None:
    store = uuid.uuid4().hex
    tokens = [7_000 + i for i in range(6 * PS + 5)]
    async with HiCache.from_config(config(store)) as first:
        await _serve(first, "w", tokens)
        await first.drain()
    written = {s.name for s in exporter.get_finished_spans()}
    assert {"hicache.backup", "hicache.backup.storage"} <= written, written  # the workers' own roots
    exporter.clear()
    async with HiCache.from_config(config(store)) as second:  # a fresh cache: the prefix is only in storage
        await _serve(second, "r", tokens)
        await second.drain()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    for name in ("hicache.begin", "hicache.match", "hicache.admit", "hicache.prefetch", "hicache.load_back"):
        assert name in by_name, (name, sorted(by_name))
    (begin,) = by_name["hicache.begin"]
    assert begin.attributes["hicache.tokens"] == len(tokens)
    assert begin.attributes["hicache.prefix_tokens"] == 6 * PS
    (admit,) = by_name["hicache.admit"]
    parents = {"hicache.match": begin, "hicache.admit": begin, "hicache.prefetch": begin, "hicache.load_back": admit}
    for name, parent in parents.items():
        (child,) = by_name[name]
        assert child.parent is not None and child.parent.span_id == parent.context.span_id, name
        assert child.context.trace_id == begin.context.trace_id
    assert by_name["hicache.prefetch"][0].attributes["hicache.pages"] == 6
    assert by_name["hicache.load_back"][0].attributes["hicache.pages"] == 6


def test_off_by_default_and_nothing_imported() -> None:
    assert tracing.span("x") is tracing.span("y")  # one shared no-op
    subprocess.run([sys.executable, "-c", CODE_OFF], check=True, timeout=120)


def test_enabled_without_the_extra_is_a_config_error() -> None:
    subprocess.run([sys.executable, "-c", CODE_MISSING], check=True, timeout=120)


async def test_backup_spans_are_roots_not_in_the_first_requests_trace(exporter) -> None:
    """The workers' ``hicache.backup`` / ``hicache.backup.storage`` spans are roots, as the
    README and this module's docstring say. Why: the workers were started lazily inside the
    first request's ``begin`` and inherited its span context, so every backup of every later
    request landed in that first request's trace, under its long-ended ``hicache.begin``."""
    store = uuid.uuid4().hex
    async with HiCache.from_config(config(store)) as cache:
        for i in range(3):
            await _serve(cache, f"r{i}", [10_000 * (i + 1) + t for t in range(4 * PS)])
            await cache.drain()
    spans = exporter.get_finished_spans()
    backups = [s for s in spans if s.name in ("hicache.backup", "hicache.backup.storage")]
    assert len(backups) >= 6, sorted(s.name for s in spans)  # each request: a host and a storage backup
    begins = {s.context.trace_id for s in spans if s.name == "hicache.begin"}
    for s in backups:
        assert s.parent is None, (s.name, "parented to another span")
        assert s.context.trace_id not in begins, (s.name, "in a request's trace")


async def test_a_prefetch_that_failed_has_a_span_that_says_so(exporter) -> None:
    """The ``hicache.prefetch`` span is the one entered and left by hand: a prefetch that
    raised (its error logged, ``worker_errors`` counted) ended its span as if it had succeeded,
    so a trace showed a failed fetch as a clean one. It now carries the error status and the
    exception, and the reason the fetch stopped."""
    from opentelemetry.trace import StatusCode

    store = uuid.uuid4().hex
    tokens = [30_000 + i for i in range(6 * PS + 5)]
    async with HiCache.from_config(config(store)) as first:
        await _serve(first, "w", tokens)
        await first.drain()
    exporter.clear()
    async with HiCache.from_config(config(store)) as second:  # the prefix is only in storage
        storage = second._stack.storage

        class Garbled:  # a backend answering a lookup with something that is not a hit count
            kv_hit_pages = None

        async def garbled_exists(keys, extra=None):
            return Garbled()

        storage.batch_exists_v2 = garbled_exists  # type: ignore[method-assign]
        await _serve(second, "r", tokens)  # computed, not fetched: the request itself is served
        await second.drain()
        assert second._stack.controller.metrics.counters["worker_errors"] == 1
    (prefetch,) = [s for s in exporter.get_finished_spans() if s.name == "hicache.prefetch"]
    assert prefetch.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in prefetch.events)
    assert prefetch.attributes["hicache.stop"] == "error"
