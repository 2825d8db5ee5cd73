"""The recompute bound on prefetch waits: under the ``timeout`` policy a request stops waiting
for storage once the pages it still lacks would be recomputed sooner than fetched, and never
waits longer than recomputing them (a storage hit is never slower than a recompute)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from pathlib import Path

import pytest
from hicache_backends.memory import MemoryStorage

from _hicache_faults import FaultyStorage, seed_memory_store
from hicache.config import HiCacheConfig
from hicache.controller import ControllerConfig
from hicache.controller.recompute import PrefillCost, ReadPace, give_up_at
from hicache.errors import ConfigError
from hicache.prefix_cache import Req
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage.offload import run_to_completion
from hicache.testing import eventually

PS = 4


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


# ---------------------------------------------------------------------- the rates


def test_a_configured_rate_is_used_as_it_is_and_reports_change_nothing() -> None:
    cost = PrefillCost(1000.0)
    cost.observe(10, 99.0)
    assert cost.seconds_per_token == pytest.approx(1e-3) and cost.seconds(500) == pytest.approx(0.5)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            PrefillCost(bad)


def test_a_learned_rate_is_the_slope_not_the_fixed_cost_of_a_forward() -> None:
    cost = PrefillCost(min_observations=3)
    assert cost.seconds_per_token is None and cost.seconds(100) is None
    for n in (100, 400, 1600, 800, 200):
        cost.observe(n, 0.02 + 5e-5 * n)  # 20 ms a forward whatever its length, 50 us a token
    assert cost.seconds_per_token == pytest.approx(5e-5, rel=1e-6)
    assert cost.tokens_per_s == pytest.approx(20_000, rel=1e-6)


def test_one_prompt_length_gives_the_average_and_odd_reports_are_ignored() -> None:
    cost = PrefillCost(min_observations=2, decay=1.0)
    for bad in ((0, 1.0), (100, 0.0), (100, -1.0), (100, math.nan), (math.inf, 1.0), ("x", 1.0), (None, 1.0),
                (31, 1.0)):  # the last: too short, its fixed cost would pass for a per-token one
        cost.observe(*bad)  # type: ignore[arg-type]
    assert cost.observations == 0
    cost.observe(100, 0.1)
    cost.observe(100, 0.3)
    assert cost.seconds_per_token == pytest.approx(0.002)


def test_no_report_raises_or_makes_recomputing_free() -> None:
    """``note_prefill`` is promised never to raise on odd values, and a rate is used to cut
    waits: an int too large for a float raised ``OverflowError``; reports whose sums overflow
    (or whose seconds underflow) gave 0 s a token, so ``tokens_per_s`` (the metrics gauge)
    raised ``ZeroDivisionError`` and every wait's cap was 0 (each storage hit dropped)."""
    cost = PrefillCost()
    cost.observe(10**400, 1.0)
    assert cost.observations == 0
    for reports in ([(1e308, 1.0)] * 4, [(1e200, 1.0)] * 4, [(100, 5e-324)] * 4,
                    [(n, n * 1e-312) for n in (100, 200, 400, 800)]):
        cost = PrefillCost()
        for n, t in reports:
            cost.observe(n, t)  # type: ignore[arg-type]
        spt = cost.seconds_per_token
        assert spt is None or (math.isfinite(spt) and spt > 0)
        rate = cost.tokens_per_s
        assert rate is None or (math.isfinite(rate) and rate > 0)
    cost = PrefillCost(min_observations=3)
    cost.observe(1e200, 1.0)  # refused: it would have swamped the sums for thousands of reports
    for n in (100, 400, 1600, 800, 200):
        cost.observe(n, 0.02 + 5e-5 * n)
    assert cost.seconds_per_token == pytest.approx(5e-5, rel=1e-6)


def test_a_slope_lost_in_the_noise_is_not_taken_for_the_rate() -> None:
    """A GPU's short prefills cost about the same whatever their length (a forward is launch
    bound up to ~1k tokens): the fit's slope is then noise, and a tiny positive one read as
    millions of tokens/s made every cap a few microseconds (each storage hit dropped). A slope
    the reports cannot tell from zero gives way to the average (an upper bound on the cost
    of a token); a clear one, through the same jitter, is still the rate."""
    lengths = [200, 900, 500, 300, 800, 600, 400, 700, 250, 850, 450, 650]
    jitter = [+0.03, -0.01, +0.02, -0.03, +0.01, -0.02, +0.03, 0.0, -0.01, +0.02, -0.03, +0.01]
    flat = PrefillCost()
    for n, j in zip(lengths, jitter):
        flat.observe(n, 0.02 * (1 + j))  # 20 ms a forward, 3% jitter
    average = sum(n * 0.9 ** (11 - i) for i, n in enumerate(lengths)) / sum(
        0.02 * (1 + j) * 0.9 ** (11 - i) for i, j in enumerate(jitter))
    assert flat.tokens_per_s == pytest.approx(average, rel=1e-6)  # ~28k, not the 2.3M the slope says
    steep = PrefillCost()
    for n, j in zip(lengths, jitter):
        steep.observe(n * 8, (0.02 + 5e-5 * n * 8) * (1 + j))  # compute bound: 20k tokens/s
    assert steep.tokens_per_s == pytest.approx(20_000, rel=0.2)


def test_read_pace_follows_a_store_that_slows_down() -> None:
    pace = ReadPace(alpha=0.5)
    assert pace.seconds_per_page is None
    pace.observe(10, 0.1)
    assert pace.seconds_per_page == pytest.approx(0.01)
    pace.observe(10, 1.0)
    assert pace.seconds_per_page == pytest.approx(0.055)
    pace.observe(0, 5.0)
    pace.observe(3, math.nan)
    assert pace.seconds_per_page == pytest.approx(0.055)


def test_give_up_weighs_the_rest_of_the_fetch_against_its_recompute() -> None:
    # 64 tokens a page at 100 us a token: 6.4 ms a page recomputed; "now" is t = 100 s
    common = dict(now=100.0, page_tokens=64, seconds_per_token=1e-4, wait_start=100.0, cap_s=10.0)
    # a store at 1 ms a page: worth waiting for, until the cap (recomputing what was missing)
    assert give_up_at(missing_pages=10, inflight_pages=0, call_since=None, seconds_per_page=0.001, **common) == 110.0
    # at 10 ms a page: give up at once
    assert give_up_at(missing_pages=10, inflight_pages=0, call_since=None, seconds_per_page=0.01, **common) == 100.0
    # a 4-page read under way 30 ms of its expected 40: the rest (10 ms) beats 25.6 ms recomputed;
    # it is given up on once it is late by the slack (25.6 ms), at 100 - 0.03 + 0.04 + 0.0256
    t = give_up_at(missing_pages=4, inflight_pages=4, call_since=99.97, seconds_per_page=0.01, **common)
    assert t == pytest.approx(100.0356)
    # an exists call (no pages) that hangs: the slack is what the recompute leaves after the reads
    t = give_up_at(missing_pages=10, inflight_pages=0, call_since=99.99, seconds_per_page=0.001, **common)
    assert t == pytest.approx(99.99 + 0.064 - 0.010)
    # a call just begun whose own expected time already loses: at once
    assert give_up_at(missing_pages=10, inflight_pages=10, call_since=100.0, seconds_per_page=0.01, **common) == 100.0
    # no pace yet: only the cap; nothing missing: the op is ending
    assert give_up_at(missing_pages=10, inflight_pages=0, call_since=None, seconds_per_page=None, **common) == 110.0
    assert give_up_at(missing_pages=0, inflight_pages=0, call_since=None, seconds_per_page=1.0, **common) == math.inf
    # the cap holds whatever the pace says: a read late by more than the cap allows
    short = dict(common, cap_s=0.02)
    assert give_up_at(missing_pages=4, inflight_pages=4, call_since=99.97, seconds_per_page=0.01, **short) == 100.02


def test_the_rate_is_validated_in_both_configs() -> None:
    for bad in (0, -5.0, math.inf, "fast", True):
        with pytest.raises(ConfigError, match="prefetch_recompute_tokens_per_s"):
            ControllerConfig(prefetch_recompute_tokens_per_s=bad)  # type: ignore[arg-type]
    base = {"model": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}}
    with pytest.raises(Exception, match="recompute_tokens_per_s"):
        HiCacheConfig.model_validate({**base, "cache": {"prefetch": {"recompute_tokens_per_s": 0}}})
    cfg = HiCacheConfig.model_validate({**base, "cache": {"prefetch": {"recompute_tokens_per_s": 5e4}}})
    from hicache.stack import controller_options

    assert controller_options(cfg)["prefetch_recompute_tokens_per_s"] == 5e4


# ---------------------------------------------------------------------- on the real controller


async def _seeded(*prompts: list[int]) -> str:
    store_id = f"rc-{uuid.uuid4()}"
    await seed_memory_store(store_id, *prompts, page_size=PS)
    return store_id


def _stack(store_id: str, store: object = None, device_pages: int = 32, **controller: object):  # type: ignore[no-untyped-def]
    """A stack under the ``timeout`` policy reading ``store`` (default: a FaultyStorage of
    ``store_id``), host twice the device; ``controller`` overrides the policy's settings."""
    base: dict[str, object] = dict(prefetch_threshold=PS, prefetch_batch_pages=2, prefetch_policy="timeout",
                                   prefetch_timeout_base_s=60.0, prefetch_timeout_per_ki_token_s=0.0)
    base.update(controller)
    store = store if store is not None else FaultyStorage(store_id=store_id)
    cfg = StackConfig(page_size=PS, device_pages=device_pages, host_pages=2 * device_pages, storage_backend=None,
                      controller=ControllerConfig(**base))  # type: ignore[arg-type]
    return build_stack(cfg, storage=store), store


async def test_a_store_slower_than_recomputing_is_not_waited_for() -> None:
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_recompute_tokens_per_s=1e7)
    store.delay = 0.05  # each 2-page read: far slower than recomputing 8 tokens at 10M tokens/s
    t0 = time.monotonic()
    out = await serve_request(stack, data, rid="slow")
    waited = time.monotonic() - t0
    assert out.storage_hit < 64 and out.computed + out.storage_hit == 64 and out.verify_failures == 0
    assert waited < 30  # the fixed timeout (60 s) did not decide it
    counters = stack.controller.metrics.counters
    assert counters["prefetch_cut_recompute"] == 1
    assert stack.controller.metrics.snapshot()["gauges"]["recompute_tokens_per_s"] == pytest.approx(1e7)
    await stack.controller.wait_prefetches()
    assert stack.host_pool.available_size() + sum(  # every fetched page not taken was freed
        n.host_value.numel() for n in stack.cache._nodes() if n.host_value is not None) == 64 * PS
    await stack.aclose()


async def test_a_store_faster_than_recomputing_is_waited_for_to_the_end() -> None:
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_recompute_tokens_per_s=0.5)  # 8 s a page
    store.delay = 0.002
    out = await serve_request(stack, data, rid="fast")
    assert out.storage_hit == 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 0
    assert stack.controller._prefetcher.pace.seconds_per_page is not None  # learned from its reads
    await stack.aclose()


async def test_a_store_that_hangs_is_waited_for_no_longer_than_a_recompute() -> None:
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_recompute_tokens_per_s=2000.0,
                          storage_io_timeout_s=120.0, cancelled_io_grace_s=0.0)
    store.hang_now()  # no pace is known: only the cap (64 tokens at 2,000/s: 32 ms) ends the wait
    t0 = time.monotonic()
    out = await serve_request(stack, data, rid="hung")
    assert time.monotonic() - t0 < 30 and out.computed == 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1
    store.release()
    await stack.aclose()


async def test_the_pace_decides_before_the_cap_and_polling_sees_it_too() -> None:
    """SGLang's scheduler polls (``prefetch_ready``): the same rule answers there, at once when
    the store's known pace already loses against the recompute, with a cap (6.4 s) far away."""
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_recompute_tokens_per_s=10.0)  # 0.4 s a page
    store.hang_now()
    cache = stack.cache
    req = Req(rid="poll", origin_input_ids=data)
    cache.match_req(req)
    assert cache.start_prefetch(req)
    assert not stack.controller.prefetch_ready("poll")  # no pace known: the cap is far
    stack.controller._prefetcher.pace.observe(1, 10.0)  # 10 s a page: slower than 0.4 s
    assert stack.controller.prefetch_ready("poll") and stack.controller.prefetch_ready("poll")
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1  # counted once
    cache.abort_req(req)
    store.release()
    await stack.aclose()


async def test_without_a_rate_the_timeout_policy_is_unchanged() -> None:
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_timeout_base_s=0.2)
    store.delay = 0.03
    out = await serve_request(stack, data, rid="plain")
    assert 0 < out.storage_hit < 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 0
    assert stack.controller.metrics.snapshot()["gauges"]["recompute_tokens_per_s"] == 0
    await stack.aclose()


async def test_reported_prefills_set_the_rate() -> None:
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data))
    assert stack.controller._prefetcher.prefill.seconds_per_token is None
    for n in (64, 128, 256, 512):
        stack.controller.note_prefill(n, 0.001 + n * 1e-6)
    stack.controller.note_prefill(-3, float("nan"))  # ignored, never raised
    assert stack.controller.metrics.snapshot()["gauges"]["recompute_tokens_per_s"] == pytest.approx(1e6, rel=1e-3)
    await stack.aclose()


async def test_a_request_queued_behind_busy_prefetches_stops_waiting_for_its_turn() -> None:
    """One prefetch at a time, the store hung: the second request's prefetch never starts. Its
    wait for a turn counts against the store as a late call does, so the request gives up once
    the slack its recompute leaves has passed, not at the fixed timeout (60 s)."""
    a, b = toks(0, 32), toks(1000, 32)
    store_id = await _seeded(a, b)
    stack, store = _stack(store_id, prefetch_recompute_tokens_per_s=100.0, max_concurrent_prefetches=1,
                          storage_io_timeout_s=120.0, cancelled_io_grace_s=0.0)
    stack.controller._prefetcher.pace.observe(1, 0.001)  # a store known to be fast, 1 ms a page
    store.hang_now()
    first = Req(rid="first", origin_input_ids=a)
    stack.cache.match_req(first)
    assert stack.cache.start_prefetch(first)  # takes the one turn, then hangs
    t0 = time.monotonic()
    out = await serve_request(stack, b, rid="second")  # 8 pages: 0.32 s recomputed, 8 ms fetched
    assert time.monotonic() - t0 < 30 and out.computed == 32 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1
    stack.cache.abort_req(first)
    store.release()
    await stack.aclose()


class _ReadsHang(FaultyStorage):
    """Answers ``exists`` at once; every read waits until released."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.reads_go = asyncio.Event()

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        await self.reads_go.wait()
        return await super()._read(pages, buffers)


async def test_a_read_still_running_shows_the_pace_before_any_read_finished() -> None:
    """Right after a start no read has finished, so the store's pace is unknown and only the
    cap (6.4 s here) would end a wait; a read already running for a second on two pages shows
    the store is slower than the recompute (0.4 s a page), and the next request gives up at once."""
    a, b = toks(0, 64), toks(1000, 64)
    store_id = await _seeded(a, b)
    store = _ReadsHang(store_id=store_id)
    stack, _ = _stack(store_id, store, device_pages=64, prefetch_recompute_tokens_per_s=10.0,
                      storage_io_timeout_s=120.0, cancelled_io_grace_s=0.0)
    prefetcher = stack.controller._prefetcher
    first = Req(rid="first", origin_input_ids=a)
    stack.cache.match_req(first)
    assert stack.cache.start_prefetch(first)
    for _ in range(5000):
        if prefetcher._reading:
            break
        await asyncio.sleep(0.001)
    assert prefetcher._reading and prefetcher.pace.seconds_per_page is None
    await asyncio.sleep(1.0)  # 1 s into a 2-page read: at least 0.5 s a page
    t0 = time.monotonic()
    out = await serve_request(stack, b, rid="second")
    assert time.monotonic() - t0 < 3.0  # not the 6.4 s cap
    assert out.computed == 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1
    stack.cache.abort_req(first)
    store.reads_go.set()
    await stack.aclose()


async def test_a_slow_round_trip_shows_the_store_is_slow_before_any_page_was_read() -> None:
    """A read call takes at least one ``exists`` round trip: 1 s round trips for batches of 2
    pages are 0.5 s a page, slower than recomputing one (0.4 s), so once a lookup has shown
    them a request gives up at once instead of waiting out the cap (6.4 s)."""
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), prefetch_recompute_tokens_per_s=10.0, storage_io_timeout_s=120.0)
    store.delay = 1.0
    await serve_request(stack, toks(5000, 64), rid="absent")  # storage holds none of it: one lookup
    assert stack.controller._prefetcher.round_trip.seconds_per_page is not None
    assert stack.controller._prefetcher.pace.seconds_per_page is None  # no page read yet
    t0 = time.monotonic()
    out = await serve_request(stack, data, rid="held")
    assert time.monotonic() - t0 < 3.0 and out.computed == 64 and out.verify_failures == 0
    # the lookup of the absent prompt was waited for (nothing known yet, under the cap)
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1
    await stack.controller.wait_prefetches()
    await stack.aclose()


class _BlockingRead(FaultyStorage):
    """Each read blocks the server's loop (``loop``) for ``block`` seconds as it begins, and
    itself answers at once: its answer waits for the loop (a synchronous forward pass)."""

    loop: asyncio.AbstractEventLoop | None = None
    block = 0.0

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        if self.loop is not None and self.block:
            self.loop.call_soon_threadsafe(time.sleep, self.block)
            self.block = 0.0
        return await super()._read(pages, buffers)


async def _blocked_loop_stack(data: list[int], *, batch_pages: int, rate: float):  # type: ignore[no-untyped-def]
    """A stack over a seeded store whose first read blocks the server's loop for 0.45 s
    (see :class:`_BlockingRead`), under the recompute bound at ``rate`` tokens/s."""
    store = _BlockingRead(store_id=await _seeded(data))
    cfg = StackConfig(page_size=PS, device_pages=32, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_batch_pages=batch_pages,
                                                  prefetch_policy="timeout", prefetch_timeout_base_s=60.0,
                                                  prefetch_timeout_per_ki_token_s=0.0,
                                                  prefetch_recompute_tokens_per_s=rate, storage_stall_s=0.0))
    stack = build_stack(cfg, storage=store)
    store.loop, store.block = asyncio.get_running_loop(), 0.45
    return stack


async def test_polling_keeps_pages_that_landed_while_the_loop_was_blocked() -> None:
    """``wait`` keeps a read that ended in time while the server's loop was blocked; a poll
    (SGLang's scheduler: ``check_prefetch_progress`` between synchronous forward passes, the
    very case of a blocked loop) cut it: the read looked 0.45 s late against a 0.32 s cap, and
    the 16 pages already in host memory were dropped and recomputed."""
    data = toks(0, 64)
    stack = await _blocked_loop_stack(data, batch_pages=64, rate=200.0)
    req = Req(rid="poll", origin_input_ids=data)
    stack.cache.match_req(req)
    assert stack.cache.start_prefetch(req)
    t0 = time.monotonic()
    while not stack.cache.check_prefetch_progress("poll"):
        assert time.monotonic() - t0 < 30
        await asyncio.sleep(0.01)
    assert stack.controller.metrics.counters["prefetch_pages_used"] == 16
    stack.cache.abort_req(req)
    await stack.aclose()


class _SlowLookup(FaultyStorage):
    """``exists`` takes ``lookup_s`` (a lookup of many keys, a round trip per wave of HEADs);
    reads answer at once."""

    lookup_s = 0.0

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.lookup_s)
        return await super()._exists(pages)


async def test_a_slow_lookup_does_not_hide_reads_known_to_be_fast() -> None:
    """The ``exists`` round trip is a floor on the pace only while no read has shown it: a
    store whose lookups are slow (0.5 s for 16 keys: 0.25 s a 2-page batch, slower than the
    0.2 s a page recomputes) but whose reads were measured at about a millisecond a page is
    worth waiting for. The floor applied over the measured pace cut every such wait at once."""
    data, first = toks(0, 64), toks(1000, 64)
    store_id = await _seeded(data, first)
    store = _SlowLookup(store_id=store_id)
    store.lookup_s = 0.5
    stack, _ = _stack(store_id, store, device_pages=64, storage_io_timeout_s=120.0)
    out = await serve_request(stack, first, rid="learn")  # no rate yet: waited for, the pace learned
    assert out.storage_hit == 64
    prefetcher = stack.controller._prefetcher
    assert prefetcher.pace.seconds_per_page is not None and prefetcher.round_trip.seconds_per_page is not None
    for n in (64, 128, 256, 512):
        stack.controller.note_prefill(n, n / 20.0)  # 20 tokens/s: 0.2 s a 4-token page
    t0 = time.monotonic()
    out = await serve_request(stack, data, rid="held")
    assert time.monotonic() - t0 < 30
    assert out.storage_hit == 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 0
    await stack.aclose()


async def test_a_blocked_loop_is_not_taken_for_a_slow_store() -> None:
    """A read's time was measured on the server's loop: one that ended in a millisecond while
    the loop was blocked for 0.45 s (a synchronous forward pass) taught the pace 0.22 s a page,
    5x the recompute (40 ms), and the same request was cut after its first batch, with the
    pace slow to forget it. A read is timed to its end on the I/O loop, as the controller's
    latency samples are."""
    data = toks(0, 64)
    stack = await _blocked_loop_stack(data, batch_pages=2, rate=100.0)
    out = await serve_request(stack, data, rid="blocked")
    assert out.storage_hit == 64 and out.verify_failures == 0
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 0
    pace = stack.controller._prefetcher.pace.seconds_per_page
    assert pace is not None and pace < 0.04
    await stack.aclose()


async def test_a_rate_learned_while_a_request_waits_applies_to_that_wait() -> None:
    """No rate at first: the request waits under the fixed timeout (60 s). Prefills the engine
    reports meanwhile make the rate known, and the same wait is then weighed against the
    recompute: the hung store is given up on long before the timeout."""
    data = toks(0, 64)
    stack, store = _stack(await _seeded(data), storage_io_timeout_s=120.0, storage_stall_s=120.0,
                          cancelled_io_grace_s=0.0)  # no stall trip either: only the bound can end it
    store.hang_now()
    task = asyncio.ensure_future(serve_request(stack, data, rid="early"))
    await asyncio.sleep(0.2)
    assert not task.done()
    t0 = time.monotonic()
    for n in (64, 128, 256, 512):  # 10k tokens/s: 64 tokens recompute in 6.4 ms
        stack.controller.note_prefill(n, n * 1e-4)
    out = await asyncio.wait_for(task, 30)
    assert time.monotonic() - t0 < 10 and out.computed == 64 and out.verify_failures == 0  # not 60 s
    assert stack.controller.metrics.counters["prefetch_cut_recompute"] == 1
    store.release()
    await stack.aclose()


class _SomeReadsStuck(MemoryStorage):
    """Reads of the pages under ``stuck`` wait on a worker thread until ``free()`` (a hung
    mount, as the file backend's I/O threads hang: a cancelled call returns only when the
    thread does); every other call answers at once. ``held`` is set once such a read has
    reached the store: a call cancelled before that (on a loaded machine the I/O loop may
    not have begun it yet) never hangs at all."""

    backend_name = "some-reads-stuck-memory"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.stuck: set[str] = set()
        self.gate = threading.Event()
        self.held = threading.Event()

    def free(self) -> None:
        self.gate.set()

    def _gated(self, pages, buffers):  # type: ignore[no-untyped-def]
        if any(p.key in self.stuck for p in pages):
            self.held.set()
            self.gate.wait(60)
        return self._read_into(pages, buffers)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        return await run_to_completion(self._gated, pages, buffers)


@pytest.mark.parametrize("how", ["timed_out", "aborted"])
async def test_a_read_given_up_on_does_not_set_the_pace_after_the_store_is_back(how: str) -> None:
    """A read that timed out is given up on (the store marked down, its request let go) but may
    never return (a hung mount); so may a read whose request was aborted. It still counted as a
    read in flight, its pace growing with every second it was stuck: once the store answered
    again (a probe took it back) and reads were fast, every request under the ``timeout``
    policy was cut at once (recomputed), for as long as that one read stayed stuck. A call
    nobody waits for any more says nothing of the store's pace now."""
    a, b = toks(0, 32), toks(1000, 32)
    store_id = await _seeded(a, b)
    store = _SomeReadsStuck(store_id=store_id)
    stack, _ = _stack(store_id, store, device_pages=64, prefetch_recompute_tokens_per_s=100.0,  # 40 ms a page
                      storage_io_timeout_s=1.0 if how == "timed_out" else 30.0, storage_stall_s=0.0,
                      storage_probe_base_s=0.05, storage_probe_max_s=0.1, cancelled_io_grace_s=0.0)
    ctl = stack.controller
    try:
        first = Req(rid="first", origin_input_ids=a)
        stack.cache.match_req(first)
        assert stack.cache.start_prefetch(first)
        op = ctl.prefetch_op("first")
        assert op is not None
        store.stuck = set(op.keys)
        await eventually(store.held.is_set, timeout=30.0)  # its first read hangs in the store
        if how == "timed_out":
            assert await stack.cache.wait_prefetch("first") == 0  # its read hangs: nothing fetched
            stack.cache.abort_req(first)
            await eventually(lambda: ctl.metrics.counters.get("storage_timeouts", 0) == 1)  # given up on
            await eventually(lambda: ctl.health.up, timeout=5.0)  # a probe took the store back
        else:
            stack.cache.abort_req(first)
        await asyncio.sleep(0.5)  # the read given up on, still stuck: 0.25 s a page and growing
        cuts = ctl.metrics.counters.get("prefetch_cut_recompute", 0)  # the first request's wait
        out = await serve_request(stack, b, rid="second")  # 2 ms reads against 40 ms a page
        assert out.storage_hit == 32 and out.verify_failures == 0
        assert ctl.metrics.counters.get("prefetch_cut_recompute", 0) == cuts
        assert not op.finished  # (the stuck read still runs)
    finally:
        store.free()
        await stack.aclose()
