"""The controller: metrics, queues and backpressure, retries, faults, prefetch policies,
abort, close, and an event loop that stays responsive."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
import math
import uuid

import pytest
import torch

from _hicache_faults import FaultyStorage, seed_memory_store
from hicache.controller import ControllerConfig, ControllerMetrics, ControllerState
from hicache.errors import ConfigError
from hicache.observability.scrape import Scrape
from hicache.prefix_cache import MatchPrefixParams, RadixKey, Req
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.stack import storage_namespace

PS = 4


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def make(storage: bool = True, **controller: object):  # type: ignore[no-untyped-def]
    base: dict[str, object] = dict(prefetch_threshold=PS, prefetch_policy="wait_complete",
                                   storage_retry_base_s=0.001, cancelled_io_grace_s=0.0)
    base.update(controller)
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(**base))  # type: ignore[arg-type]
    store = None
    if storage:
        store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = build_stack(cfg, storage=store)
    return stack, store


async def seed_storage(store_id: str, tokens: list[int]) -> None:
    """Write ``tokens``' pages to a shared medium through a separate, well-behaved cache."""
    await seed_memory_store(store_id, tokens, page_size=PS)


def test_config_validation_and_timeout_formula() -> None:
    with pytest.raises(ConfigError, match="allowed"):
        ControllerConfig(write_policy="sometimes")
    with pytest.raises(ConfigError, match="allowed"):
        ControllerConfig.from_dict({"bogus": 1})
    c = ControllerConfig()
    assert c.write_through_threshold == 1
    assert ControllerConfig(write_policy="write_through_selective").write_through_threshold == 2
    assert c.prefetch_threshold == 256
    assert c.prefetch_timeout(0) == pytest.approx(2.0)
    assert c.prefetch_timeout(10 * 1024) == pytest.approx(3.0)
    assert c.prefetch_timeout(10**9) == pytest.approx(30.0)


def test_a_zero_io_timeout_is_refused_at_start_on_every_path() -> None:
    """``storage_io_timeout_s=0`` passed the old check (not negative) and froze the server's
    event loop at its first storage call: the wait loop of ``_storage_call`` took 0 for a
    reached stall limit on every pass and never awaited. It is a ConfigError naming the option
    now, from the controller's config and from the options of the paths that build one."""
    from hicache.integrations.vllm.options import ConnectorOptions

    for bad in (0, 0.0, -1.0, math.nan, True, "30"):
        with pytest.raises(ConfigError, match="storage_io_timeout_s"):
            ControllerConfig(storage_io_timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="storage_io_timeout_s"):
        ControllerConfig.from_dict({"storage_io_timeout_s": 0})
    with pytest.raises(ConfigError, match="storage_io_timeout_s"):
        ConnectorOptions.from_extra_config({"controller": {"storage_io_timeout_s": 0}})
    assert ControllerConfig(storage_io_timeout_s=0.001, storage_stall_s=0).storage_io_timeout_s == 0.001


@pytest.mark.parametrize(("name", "bad"), [
    ("storage_batch_pages", 1.5), ("backup_queue_size", "64"), ("storage_health_errors", math.inf),
    ("max_concurrent_prefetches", math.nan), ("prefetch_batch_pages", None), ("backup_batch_pages", True),
    ("storage_max_retries", 2.5), ("prefetch_threshold", "256"), ("storage_retry_base_s", "x"),
    ("storage_stall_s", math.nan), ("close_timeout_s", False),
])
def test_controller_options_of_the_wrong_type_are_config_errors(name: str, bad: object) -> None:
    """A replay config's ``[controller]`` table and a vLLM connector's ``controller`` options reach
    these fields as written: a string was an ``int()``-checked pass, then a ``TypeError`` mid-run
    (``"x"`` one at once), inf and nan an ``OverflowError`` or ``ValueError`` traceback, a
    fractional page count or a nan stall limit a controller that ran on them silently."""
    with pytest.raises(ConfigError, match=name):
        ControllerConfig.from_dict({name: bad})


def test_metrics_snapshot_and_prometheus_text() -> None:
    m = ControllerMetrics()
    m.hit("host", 128)
    m.transfer("d2h", 2, 4096, 0.5)
    m.incr("backup_failures")
    m.gauge("backup_queue_depth", lambda: 3)
    m.gauge("broken_gauge", lambda: 1 / 0)
    m.observe("get", "storage", 0.003)
    snap = m.snapshot()
    assert snap["hit_tokens"]["host"] == 128 and snap["bytes"]["d2h"] == 4096
    assert snap["gauges"]["backup_queue_depth"] == 3
    text = m.prometheus_text()
    assert "# TYPE hicache_hit_tokens_total counter" in text
    assert "# TYPE hicache_backup_queue_depth gauge" in text
    scrape = Scrape(text)
    mine = {"cache": m.label}
    assert scrape.value("hicache_hit_tokens_total", tier="host", **mine) == 128
    assert scrape.value("hicache_transfer_bytes_total", direction="d2h", **mine) == 4096
    assert scrape.value("hicache_tier_bytes_total", tier="host", io="written", **mine) == 4096
    assert scrape.value("hicache_tier_pages_total", tier="device", io="read", **mine) == 2
    assert scrape.value("hicache_backup_failures_total", **mine) == 1
    assert scrape.value("hicache_backup_queue_depth", **mine) == 3
    assert math.isnan(scrape.value("hicache_broken_gauge", **mine))
    assert scrape.value("hicache_operation_seconds_count", op="get", tier="storage", **mine) == 1
    # a second instance in the same process neither collides nor mixes its numbers in
    other = ControllerMetrics()
    other.hit("host", 5)
    scrape = Scrape(other.prometheus_text())
    assert scrape.value("hicache_hit_tokens_total", tier="host", **mine) == 128
    assert scrape.value("hicache_hit_tokens_total", tier="host", cache=other.label) == 5
    # closing removes the instance's series from the scrape
    m.close()
    scrape = Scrape(other.prometheus_text())
    assert scrape.select("hicache_hit_tokens_total", **mine) == []
    assert scrape.value("hicache_hit_tokens_total", tier="host", cache=other.label) == 5
    other.close()


def test_metrics_owners_sharing_a_label_keep_each_others_series() -> None:
    """Two owners under one ``cache`` label (two caches given one name, a cache replaced by a
    new one of the same name before the old closed, an app built twice on one cache) write the
    same series. The first to close removed them: the one still running vanished from the
    scrape though it went on counting. A series now leaves with the last owner writing it;
    until then the label is one row (counters add up, never reset)."""
    from hicache.observability.metrics import exposition_text
    from hicache.server.metrics import ServerMetrics

    label = f"prod-{uuid.uuid4().hex[:8]}"
    old, new = ControllerMetrics(label), ControllerMetrics(label)
    old.hit("host", 3)
    new.hit("host", 4)
    new.gauge("backup_queue_depth", lambda: 7)
    old.close()
    scrape = Scrape(new.prometheus_text())
    assert scrape.value("hicache_hit_tokens_total", tier="host", cache=label) == 7
    assert scrape.value("hicache_backup_failures_total", cache=label) == 0
    assert scrape.value("hicache_backup_queue_depth", cache=label) == 7
    new.hit("host", 1)
    assert Scrape(new.prometheus_text()).value("hicache_hit_tokens_total", tier="host", cache=label) == 8
    # an owner collected without close releases its share the same way
    third = ControllerMetrics(label)
    del third
    gc.collect()
    assert Scrape(exposition_text()).value("hicache_hit_tokens_total", tier="host", cache=label) == 8
    # the server's families under its cache's label: two apps on one cache, the first shut down
    first, second = ServerMetrics(label), ServerMetrics(label)
    second.requests["ok"] += 2
    first.close()
    scrape = Scrape(exposition_text())
    assert scrape.value("hicache_server_requests_total", outcome="ok", cache=label) == 2
    assert scrape.value("hicache_hit_tokens_total", tier="host", cache=label) == 8
    second.close()
    new.close()
    scrape = Scrape(exposition_text())
    assert scrape.select("hicache_hit_tokens_total", cache=label) == []
    assert scrape.select("hicache_server_requests_total", cache=label) == []


async def test_backup_queue_backpressure() -> None:
    stack, _ = make(storage=False, backup_queue_size=1)
    cache = stack.cache
    for i in range(4):  # each insert queues one backup; the queue holds one
        await serve_request(stack, toks(100 * i, 8), rid=str(i), verify=False)
    assert stack.controller.metrics.counters["backup_rejected"] >= 1
    await cache.drain()
    cache.sanity_check()
    # rejected backups leave no host page behind
    held = cache.host_size()
    assert stack.host_pool.available_size() + held == 64 * PS
    await stack.aclose()


async def test_storage_write_failures_are_retried_counted_never_acked() -> None:
    stack, store = make(storage_max_retries=2)
    store.fail_writes = 10**6
    await serve_request(stack, toks(0, 8), rid="a")
    await stack.cache.drain()
    c = stack.controller.metrics.counters
    assert c["storage_write_retries"] == 2 and c["storage_write_failures"] == 2
    node = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(toks(0, 8)))).last_host_node
    assert node.storage_pages == 0 and not node.on_storage
    assert store.write_calls == 3
    await stack.aclose()


async def test_backend_exception_does_not_kill_the_worker() -> None:
    stack, store = make(storage_max_retries=1)
    store.raise_writes = 1  # the first attempt raises, the retry succeeds
    await serve_request(stack, toks(0, 8), rid="a")
    await stack.cache.drain()
    await serve_request(stack, toks(500, 8), rid="b")
    await stack.cache.drain()
    for t in (toks(0, 8), toks(500, 8)):
        assert stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(t))).last_host_node.on_storage
    assert store.stats.get("backend_errors") == 1
    assert stack.controller.metrics.counters["worker_errors"] == 0
    await stack.aclose()


class _FailingCall(FaultyStorage):
    """Its ``batch_exists_v2`` or ``batch_get_v2`` itself raises, or hangs until cancelled."""

    def __init__(self, call: str, how: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.call, self.how, self.failed_calls = call, how, 0

    async def _fail(self) -> None:
        self.failed_calls += 1
        if self.how == "raises":
            raise OSError("injected: the store's call raised")
        await asyncio.Event().wait()  # the controller's I/O timeout cancels it

    async def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):  # type: ignore[no-untyped-def]
        if self.call == "exists":
            await self._fail()
        return await super().batch_exists_v2(keys, pool_transfers, extra_info)

    async def batch_get_v2(self, transfers, extra_info=None):  # type: ignore[no-untyped-def]
        if self.call == "read":
            await self._fail()
        return await super().batch_get_v2(transfers, extra_info)


@pytest.mark.parametrize("call", ["exists", "read"])
@pytest.mark.parametrize("how", ["raises", "times_out"])
async def test_a_failed_read_or_exists_call_counts_once(call: str, how: str) -> None:
    """``storage_read_failures`` ("storage read or exists calls that failed") counted a read
    that raised twice (the storage call, then the prefetch seeing ``None``), one that timed
    out once, and an exists that timed out not at all: one failed call is one count now."""
    sid = f"failing-{uuid.uuid4()}"
    await seed_storage(sid, toks(0, 32))
    store = _FailingCall(call, how, store_id=sid)
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete",
                                                  storage_io_timeout_s=0.1, storage_stall_s=0.0,
                                                  cancelled_io_grace_s=0.0))
    stack = build_stack(cfg, storage=store)
    try:
        out = await asyncio.wait_for(serve_request(stack, toks(0, 32), rid="r"), 10.0)
        await asyncio.wait_for(stack.controller.wait_prefetches(), 10.0)  # a timed-out call has ended
        assert out.computed == 32 and store.failed_calls == 1
        assert stack.controller.metrics.counters["storage_read_failures"] == 1
    finally:
        await stack.aclose()


async def test_hanging_backend_requests_fall_back_to_compute() -> None:
    stack, store = make(prefetch_policy="timeout", prefetch_timeout_base_s=0.05,
                        prefetch_timeout_per_ki_token_s=0.0, storage_io_timeout_s=60.0)
    store.hang_now()
    t0 = time.monotonic()
    out = await serve_request(stack, toks(0, 16), rid="h")
    assert time.monotonic() - t0 < 1.0  # the request did not wait past its policy
    assert out.computed == 16 and out.verify_failures == 0
    out = await serve_request(stack, toks(0, 16), rid="h2")  # the device tier still works
    assert out.device_hit == 16
    report = await stack.controller.aclose(timeout=0.2)
    assert not report.drained and report.unwritten_pages >= 4  # the hung backup is reported
    assert all(u.reason == "closed" for u in report.unwritten)
    assert not stack.controller._tasks
    store.release()


async def test_abort_mid_prefetch_leaks_nothing() -> None:
    store_id = f"abort-{uuid.uuid4()}"
    data = toks(0, 64)
    await seed_storage(store_id, data)
    stack, _ = make(storage=False)
    await stack.aclose()
    store = FaultyStorage(store_id=store_id)
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_batch_pages=2,
                                                  cancelled_io_grace_s=0.05))
    stack = build_stack(cfg, storage=store)
    store.delay = 0.02
    cache = stack.cache
    req = Req(rid="x", origin_input_ids=data)
    cache.match_req(req)
    assert cache.start_prefetch(req)
    op = stack.controller.prefetch_op("x")
    for _ in range(5000):  # until some batches landed, one is in flight (not a fixed sleep: load)
        if op is None or op.completed_pages or op.finished:
            break
        await asyncio.sleep(0.001)
    assert op is not None and 0 < op.completed_pages < 16
    cache.abort_req(req)
    await stack.controller.wait_prefetches()
    assert stack.host_pool.available_size() == 64 * PS
    assert all(n.host_ref == 0 and n.lock_ref == 0 for n in cache._nodes())
    assert stack.controller.metrics.counters["prefetch_aborted"] == 1
    assert stack.controller.metrics.snapshot()["gauges"]["prefetch_inflight_tokens"] == 0
    await stack.aclose()


async def _prefetch_with(policy: str, delay: float, scrape: list[Scrape] | None = None,  # type: ignore[no-untyped-def]
                         **extra: object):
    """One 64-token request fetched from a seeded store in 2-page batches, each call delayed;
    ``scrape`` gets the controller's metrics before the stack closes."""
    store_id = f"pol-{uuid.uuid4()}"
    data = toks(0, 64)
    await seed_storage(store_id, data)
    store = FaultyStorage(store_id=store_id)
    cfg = StackConfig(page_size=PS, device_pages=32, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_batch_pages=2,
                                                  prefetch_policy=policy, **extra))  # type: ignore[arg-type]
    stack = build_stack(cfg, storage=store)
    store.delay = delay
    t0 = time.monotonic()
    out = await serve_request(stack, data, rid="p")
    waited = time.monotonic() - t0
    await stack.controller.wait_prefetches()
    if scrape is not None:
        scrape.append(Scrape(stack.controller.metrics.prometheus_text()))
        scrape.append(stack.controller.metrics.label)  # type: ignore[arg-type]
    await stack.aclose()
    return out, waited


async def test_prefetch_policy_wait_complete_takes_everything() -> None:
    out, _ = await _prefetch_with("wait_complete", 0.001)
    assert out.storage_hit == 64 and out.verify_failures == 0


async def test_the_prefetch_latency_is_the_whole_fetch_not_its_last_batch() -> None:
    """``hicache_operation_seconds{op="prefetch"}`` is one request's storage fetch: 8 batches
    of 2 pages at 0.05 s a call take 0.4 s or more (it measured the last batch alone)."""
    got: list = []
    out, _ = await _prefetch_with("wait_complete", 0.05, scrape=got)
    assert out.storage_hit == 64
    scrape, label = got
    mine = {"cache": label, "op": "prefetch", "tier": "storage"}
    assert scrape.value("hicache_operation_seconds_count", **mine) == 1
    assert scrape.value("hicache_operation_seconds_sum", **mine) >= 0.4


async def test_prefetch_policy_best_effort_takes_what_arrived() -> None:
    out, waited = await _prefetch_with("best_effort", 0.05)
    assert out.storage_hit < 64 and out.verify_failures == 0
    assert waited < 0.5


async def test_prefetch_policy_timeout_stops_at_the_deadline() -> None:
    out, waited = await _prefetch_with("timeout", 0.03, prefetch_timeout_base_s=0.25,
                                       prefetch_timeout_per_ki_token_s=0.0)
    assert 0 < out.storage_hit < 64 and out.verify_failures == 0
    assert waited < 0.6


@pytest.mark.parametrize("short", ["stored", "host_room"])
async def test_a_storage_hit_below_the_threshold_is_not_read(tmp_path, short: str) -> None:  # type: ignore[no-untyped-def]
    """``prefetch_threshold``: fewer storage tokens than this are not worth a prefetch (SGLang
    revokes such a hit after its lookup, and takes no host room below it). The threshold was
    checked against the tokens asked for only: a 64-token request with 2 pages in storage, or
    host room for 2 pages, read them under a threshold of 4 pages, and the request waited for
    the read. Now nothing is read (counted in ``prefetch_skipped_threshold``) and the request
    computes those tokens."""
    def stack_for(host_pages: int):  # type: ignore[no-untyped-def]
        ctrl = ControllerConfig(prefetch_threshold=4 * PS, prefetch_policy="wait_complete")
        return build_stack(StackConfig(page_size=PS, device_pages=32, host_pages=host_pages,
                                       storage_backend="file", storage_options={"root": str(tmp_path)},
                                       controller=ctrl))

    writer = stack_for(64)
    stored = toks(0, 8) if short == "stored" else toks(0, 64)
    await serve_request(writer, stored, rid="w")
    await writer.cache.drain()
    await writer.aclose()
    reader = stack_for(64 if short == "stored" else 2)
    out = await serve_request(reader, toks(0, 64), rid="r")
    await reader.controller.wait_prefetches()
    counters = reader.controller.metrics.counters
    assert out.storage_hit == 0 and out.computed == 64 and out.verify_failures == 0
    assert counters["prefetch_pages_done"] == 0 and reader.controller.metrics.pages["s2h"] == 0
    assert counters["prefetch_skipped_threshold"] == 1
    assert out.attribution is not None and out.attribution.misses.get("prefetch_skipped") == len(stored)
    await reader.cache.drain()
    assert reader.host_pool.available_size() + reader.cache.host_size() == reader.host_pool.size
    await reader.aclose()


async def test_prefetch_rate_limit() -> None:
    store_id = f"rate-{uuid.uuid4()}"
    await seed_storage(store_id, toks(0, 32))
    store = FaultyStorage(store_id=store_id)
    cfg = StackConfig(page_size=PS, device_pages=32, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, max_inflight_prefetch_tokens=40))
    stack = build_stack(cfg, storage=store)
    store.hang_now()
    a, b = Req(rid="a", origin_input_ids=toks(0, 32)), Req(rid="b", origin_input_ids=toks(0, 32))
    for r in (a, b):
        stack.cache.match_req(r)
    assert stack.cache.start_prefetch(a)
    assert not stack.cache.start_prefetch(b)
    assert stack.controller.metrics.counters["prefetch_rate_limited"] == 1
    stack.cache.abort_req(a)
    store.release()
    await stack.controller.wait_prefetches()
    await stack.aclose()
    assert stack.host_pool.available_size() == 64 * PS


async def test_a_prefetch_aborted_before_it_ran_gives_its_budget_back() -> None:
    """The scheduler rejects a request in the same step it started its prefetch: the task is
    cancelled before its first step, so its body (and its finally) never runs. Its tokens must
    still leave the in-flight budget, or every later prefetch is rate limited for good."""
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend="memory",
                      controller=ControllerConfig(prefetch_threshold=PS, max_inflight_prefetch_tokens=64))
    stack = build_stack(cfg)
    for i in range(4):
        req = Req(rid=f"r{i}", origin_input_ids=toks(1000 * i, 32))
        stack.cache.match_req(req)
        assert stack.cache.start_prefetch(req)
        stack.cache.abort_req(req)  # same tick: the task has not started
        await stack.controller.wait_prefetches()
    assert stack.controller.metrics.counters.get("prefetch_rate_limited", 0) == 0
    assert stack.controller.metrics.counters["prefetch_aborted"] == 4
    await stack.aclose()
    assert stack.host_pool.available_size() == 128 * PS


async def test_close_drains_queued_backups() -> None:
    stack, store = make()
    store.delay = 0.01
    for i in range(5):
        await serve_request(stack, toks(100 * i, 8), rid=str(i), verify=False)
    report = await stack.controller.aclose()
    assert report.drained and report.unwritten == []
    assert stack.controller.state is ControllerState.CLOSED
    assert not stack.controller._tasks
    for node in stack.cache._nodes():
        assert node.on_storage
        assert all(await store.exists_pages(node.hash_value))
    assert not stack.controller.submit_backup(torch.arange(4), torch.arange(4), lambda ok: None)


class _StepTimer:
    """Measures the loop-thread CPU time of every callback the loop runs (each task step).

    Time the garbage collector spends inside a step is taken out and reported apart
    (``gc_worst``): a collection runs wherever an allocation happens to trigger it, it is the
    interpreter's pause, not the step's work, and a server that cares freezes its start-up heap
    (``gc.freeze()``)."""

    def __init__(self, skip: asyncio.Task | None) -> None:  # type: ignore[type-arg]
        self.skip = skip
        self.worst = 0.0
        self.worst_name = ""
        self.count = 0
        self.gc_time = 0.0
        self.gc_worst = 0.0
        self._gc_t0: float | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = asyncio.events.Handle._run
        timer = self
        loop_thread = threading.get_ident()

        def on_gc(phase: str, info: dict) -> None:
            if threading.get_ident() != loop_thread:
                return
            if phase == "start":
                timer._gc_t0 = time.thread_time()
            elif timer._gc_t0 is not None:
                took = time.thread_time() - timer._gc_t0
                timer.gc_time += took
                timer.gc_worst = max(timer.gc_worst, took)
                timer._gc_t0 = None

        gc.callbacks.append(on_gc)
        self._on_gc = on_gc

        def _run(handle: asyncio.Handle) -> None:
            if threading.get_ident() != loop_thread:  # the storage I/O loop: not ours to time
                original(handle)
                return
            owner = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
            g0 = timer.gc_time
            t0 = time.thread_time()
            original(handle)
            took = time.thread_time() - t0 - (timer.gc_time - g0)
            if owner is timer.skip:
                return
            timer.count += 1
            if took > timer.worst:
                timer.worst = took
                timer.worst_name = (
                    f"{owner.get_name()} {owner.get_coro()!r:.60}" if isinstance(owner, asyncio.Task) else repr(handle)[:80]
                )

        monkeypatch.setattr(asyncio.events.Handle, "_run", _run)

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


@pytest.fixture
def strict_latency() -> Iterator[bool]:
    """``HICACHE_STRICT_LATENCY=1``: hold the ticker to idle + 5 ms, with the GIL switch
    interval at 1 ms for this test (restored after).

    The switch interval is process-wide and the application's to set, never the library's: a
    thread running Python (a worker between copies, a garbage collection on it) keeps the GIL
    for up to that long once the loop thread asks for it, 5 ms by default, which alone is the
    whole budget. Measured on a 2-core runner it is worth about 3 ms of p99 here. A server that
    wants a loop this tight sets it itself (see :mod:`hicache.controller.io_thread`).
    """
    strict = bool(os.environ.get("HICACHE_STRICT_LATENCY"))
    old = sys.getswitchinterval()
    if strict:
        sys.setswitchinterval(0.001)
    try:
        yield strict
    finally:
        sys.setswitchinterval(old)


async def test_event_loop_stays_responsive_while_pages_stream(
    monkeypatch: pytest.MonkeyPatch, record_property: Any, strict_latency: bool
) -> None:
    """A ticker on the loop is never late by more than a few milliseconds while ~0.5 GiB move
    device->host->storage and back (copies on the copy thread, storage in bounded batches).

    The "server" here does no model work on the loop: KV is written once before the clock
    starts, so what the ticker measures is the cache and the controller.
    """
    cfg = StackConfig(page_size=64, head_num=8, head_dim=64, layer_num=2, dtype="float16",
                      device_pages=512, host_pages=1024, storage_backend=None,
                      controller=ControllerConfig(storage_batch_pages=16, prefetch_batch_pages=16,
                                                  backup_batch_pages=64, prefetch_threshold=64,
                                                  prefetch_policy="wait_complete",
                                                  # storage copies yield the cores to the loop
                                                  # thread (see hicache.controller.io_thread)
                                                  io_thread_nice=19))
    from hicache_backends.memory import MemoryStorage

    probe = build_stack(cfg)
    ns = storage_namespace(probe.host_pool)
    await probe.aclose()
    stack = build_stack(cfg, storage=MemoryStorage(max_bytes=1 << 31, namespace=ns))
    cache = stack.cache
    stack.device_pool.kv_data.view(torch.int16).random_()
    prompts = [toks(10**6 * (i + 1), 64 * 64) for i in range(8)]
    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        period = 0.002
        nxt = time.perf_counter() + period
        while not stop.is_set():
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            now = time.perf_counter()
            lateness.append(now - nxt)
            nxt = now + period

    idle = await _ticker_baseline()
    steps = _StepTimer(skip=asyncio.current_task())  # the test body plays the server
    steps.install(monkeypatch)
    tick = asyncio.create_task(ticker(), name="ticker")
    for i, prompt in enumerate(prompts):  # insert 64 pages each: write-through to host, storage
        req = Req(rid=f"w{i}", origin_input_ids=prompt)
        req.req_pool_idx = stack.req_to_token_pool.alloc(1)[0]
        stack.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)] = stack.allocator.alloc(len(prompt))
        req.kv_committed_len = req.kv_allocated_len = len(prompt)
        cache.release_req(req)
        await asyncio.sleep(0)
    # a server yields between scheduler steps; each cache call below is one step
    await cache.drain()
    cache.evict(10**9)
    await asyncio.sleep(0)
    cache.evict_host(10**9)
    for i, prompt in enumerate(prompts):  # read back: storage -> host -> device
        req = Req(rid=f"r{i}", origin_input_ids=prompt)
        cache.match_req(req)
        assert cache.start_prefetch(req)
        res = await cache.admit(req)
        assert res.storage_hit == len(prompt)
        cache.dec_lock_ref(req.last_node)
        await asyncio.sleep(0)
        cache.evict(10**9)
        await asyncio.sleep(0)
        cache.evict_host(10**9)
        await asyncio.sleep(0)
    stop.set()
    await tick
    monkeypatch.undo()
    steps.remove()
    m = stack.controller.metrics.snapshot()
    await stack.aclose()
    moved = sum(m["bytes"].values()) / 2**20
    assert moved >= 512, moved
    # No step of the controller's tasks holds the loop for more than a few milliseconds of
    # CPU (thread time: what the loop itself did, not time the OS gave other threads).
    assert steps.count > 100
    # (about 1 ms measured alone; up to ~4-8 ms seen late in a full suite run with a large heap)
    assert steps.worst < 0.010, f"a controller step held the loop for {steps.worst * 1e3:.1f} ms ({steps.worst_name})"
    # Wall-clock lateness also includes the OS and the GIL handing the CPU to the copy and I/O
    # threads and, on a shared 2-core runner, to other processes: report it, compare it with an
    # idle ticker measured in the same run: within 50 ms of it by default (at least 100 ms), within 5 ms
    # (HICACHE_STRICT_LATENCY=1) where asked.
    p99 = sorted(lateness)[int(0.99 * len(lateness))]
    record_property("ticker_p99_ms", round(p99 * 1e3, 2))
    record_property("idle_ticker_p99_ms", round(idle * 1e3, 2))
    record_property("worst_step_cpu_ms", round(steps.worst * 1e3, 2))
    print(f"ticker p99 {p99 * 1e3:.1f} ms (idle {idle * 1e3:.1f} ms); worst loop step {steps.worst * 1e3:.2f} ms CPU; worst gc pause on the loop {steps.gc_worst * 1e3:.2f} ms")
    # measured alone on a 2-core runner: p99 4.5-7 ms (idle 0.3-1 ms); the default bound leaves
    # room for a noisy shared runner (50.6 ms seen with the suite's two workers and other work on
    # two cores, the worst step 1 ms of CPU: the OS, not the loop), strict mode holds it to "a
    # few ms"; the CPU bound above is what holds the loop's own steps
    limit = 0.005 + idle if strict_latency else max(0.1, idle + 0.05)
    assert p99 < limit, f"p99 lateness {p99 * 1e3:.1f} ms (idle p99 {idle * 1e3:.1f} ms)"


async def _ticker_baseline(seconds: float = 0.3) -> float:
    """p99 lateness of a 2 ms ticker on an otherwise idle loop (machine noise)."""
    late: list[float] = []
    period = 0.002
    end = time.perf_counter() + seconds
    nxt = time.perf_counter() + period
    while time.perf_counter() < end:
        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        now = time.perf_counter()
        late.append(now - nxt)
        nxt = now + period
    return sorted(late)[int(0.99 * len(late))]


async def test_storage_round_trip_with_an_extra_pool() -> None:
    """Backups and prefetches carry extra pools (indexer/mamba pages) through the v2 calls."""
    from hicache_backends.memory import MemoryStorage

    from hicache.controller import StorageWriteJob
    from hicache.keys import page_hashes
    from hicache.storage import PoolHitPolicy, PoolTransfer
    from hicache.testing.pools import ArrayHostPool

    store = MemoryStorage(store_id=f"extra-{uuid.uuid4()}")
    extra = ArrayHostPool(num_pages=8, page_size=PS, token_elems=4, dtype=torch.float32)
    extra.fill_random(7)
    store.register_mem_host_pool_v2(extra, "indexer")
    stack, _ = make(storage=False)
    await stack.aclose()
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS))
    stack = build_stack(cfg, storage=store)
    ctl = stack.controller
    keys = page_hashes(toks(0, 8), PS)
    host = stack.host_pool.alloc(2 * PS)
    written: list[int] = []
    job = StorageWriteJob(keys=keys, host_indices=host, prior_key=None, on_done=written.append,
                          extra=[PoolTransfer("indexer", extra.indices(0, 2), keys=keys)])
    assert ctl.submit_storage_write(job)
    await ctl.drain()
    assert written == [2]
    assert all(await store.exists_pages(keys, "indexer"))
    op = ctl.start_prefetch("x", keys, alloc_host=stack.host_pool.alloc,
                            extra=[PoolTransfer("indexer", extra.indices(4, 2), keys=keys,
                                                hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert op is not None
    res = await ctl.wait_prefetch("x", "wait_complete")
    assert res is not None and res.pages == 2
    for p in range(2):
        assert extra.page_bytes((4 + p) * PS) == extra.page_bytes(p * PS)
    stack.host_pool.free(res.host_indices)
    stack.host_pool.free(host)
    await stack.aclose()


def test_controller_outside_a_loop_is_a_clear_error() -> None:
    from hicache.errors import LoopMisuseError

    stack, _ = make(storage=False)
    with pytest.raises(LoopMisuseError, match="event loop"):
        stack.controller.submit_backup(torch.arange(4), torch.arange(4), lambda ok: None)
    stack.copy_engine.close()


async def test_polling_prefetch_progress_like_sglang_scheduler() -> None:
    store_id = f"poll-{uuid.uuid4()}"
    data = toks(0, 32)
    await seed_storage(store_id, data)
    store = FaultyStorage(store_id=store_id)
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete"))
    stack = build_stack(cfg, storage=store)
    cache = stack.cache
    req = Req(rid="p", origin_input_ids=data)
    cache.match_req(req)
    assert cache.start_prefetch(req)
    while not cache.check_prefetch_progress("p"):
        await asyncio.sleep(0.001)
    m = cache.match_req(req)
    assert m.host_hit_length == 32 and m.device_hit_length == 0
    assert all(n.host_ref == 0 for n in cache._nodes())
    await stack.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
async def test_io_thread_nice_lowers_its_own_threads_only() -> None:
    """``io_thread_nice`` lowers the I/O thread and the threads it starts (the backend's copy
    threads), and leaves the loop thread alone."""
    from hicache.controller.io_thread import IoThread

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = nice()

    async def probe() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        return nice(), await loop.run_in_executor(None, nice)

    io = IoThread(nice=5)
    here, worker = await io.run(probe())
    assert await io.stop(timeout=5)
    assert here == worker == min(19, base + 5)
    assert nice() == base
    with pytest.raises(ConfigError, match="io_thread_nice"):
        ControllerConfig(io_thread_nice=-1)
