"""Storage health: a store that hangs or fails is noticed once, skipped, probed and taken back.

The store is the memory backend with a switch the test flips from its own thread (storage calls
run on the controller's I/O loop thread, so the switch is a plain attribute, polled)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from hicache_backends.memory import MemoryStorage

from hicache.controller import ControllerConfig
from hicache.controller.health import HealthState, StorageHealth
from hicache.prefix_cache import fast_page_hashes, namespace_seed
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage import PageKey
from hicache.testing import eventually

PS = 4


class SwitchStorage(MemoryStorage):
    """``mode``: ``"ok"``, ``"hang"`` (every call waits while it stays so) or ``"raise"``."""

    backend_name = "switch-memory"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.mode = "ok"
        self.calls = 0

    async def _gate(self) -> None:
        self.calls += 1
        while self.mode == "hang":
            await asyncio.sleep(0.005)
        if self.mode == "raise":
            raise OSError("injected: the store is gone")

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        await self._gate()
        return await super()._exists(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        await self._gate()
        return await super()._read(pages, buffers)

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        await self._gate()
        return await super()._write(pages, buffers, parents)


def make(store: MemoryStorage, **controller: object):  # type: ignore[no-untyped-def]
    base: dict[str, object] = dict(
        prefetch_threshold=PS, prefetch_policy="timeout", prefetch_timeout_base_s=0.3,
        prefetch_timeout_per_ki_token_s=0.0, storage_io_timeout_s=5.0, storage_stall_s=0.15,
        storage_probe_base_s=0.05, storage_probe_max_s=0.2, storage_retry_base_s=0.001,
        cancelled_io_grace_s=0.0, close_timeout_s=2.0,
    )
    base.update(controller)
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend=None,
                      controller=ControllerConfig(**base))  # type: ignore[arg-type]
    return build_stack(cfg, storage=store)


@contextlib.asynccontextmanager
async def switched(store_id: str | None = None, **controller: object) -> AsyncIterator[tuple[SwitchStorage, object]]:
    """A stack over a :class:`SwitchStorage`; on exit the store answers again and the stack closes."""
    store = SwitchStorage(store_id=store_id or f"switch-{uuid.uuid4()}")
    stack = make(store, **controller)
    try:
        yield store, stack
    finally:
        store.mode = "ok"
        await stack.aclose()


async def seed(store_id: str, prompts: list[list[int]]) -> None:
    """Write the prompts' pages to the shared medium through a well-behaved stack."""
    w = make(MemoryStorage(store_id=store_id))
    for i, p in enumerate(prompts):
        await serve_request(w, p, rid=f"seed-{i}")
    await w.cache.drain()
    await w.aclose()


def prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 16 * PS))


async def timed(stack, tokens: list[int], rid: str) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    out = await serve_request(stack, tokens, rid=rid)
    return time.monotonic() - t0, out


async def test_a_hanging_store_costs_one_stall_then_requests_skip_it_until_a_probe_passes() -> None:
    store_id = f"hang-{uuid.uuid4()}"
    await seed(store_id, [prompt(i) for i in range(8)])
    async with switched(store_id) as (store, stack):
        m = stack.controller.metrics
        store.mode = "hang"
        first, _ = await timed(stack, prompt(0), "r0")
        # the first request pays about the stall (0.15 s) or its prefetch timeout (0.3 s), far
        # less than the I/O timeout (5 s) it would wait without stall detection
        assert first < 2.5
        await asyncio.sleep(0.05)
        assert stack.controller.health.state is HealthState.DOWN
        started = m.counters.get("prefetch_started", 0)
        for i in range(1, 5):
            await serve_request(stack, prompt(i), rid=f"r{i}")
        # skipped: no prefetch starts (and waits) on a store that hangs (behaviour, not time:
        # a request that waited would take the prefetch timeout, a loaded machine as long)
        assert m.counters.get("prefetch_started", 0) == started
        assert m.counters["prefetch_skipped_unhealthy"] >= 4
        assert m.counters["storage_trips"] == 1
        assert m.snapshot()["gauges"]["storage_up"] == 0.0
        probes = m.counters["storage_probes"]
        await asyncio.sleep(0.4)
        assert m.counters["storage_probes"] > probes  # probing with backoff, in the background

        store.mode = "ok"  # the store comes back: a probe finds it, prefetches start again
        await eventually(lambda: stack.controller.health.up)
        assert m.counters["storage_recoveries"] == 1
        _, out = await timed(stack, prompt(6), "r6")
        assert out.storage_hit == 16 * PS and out.verify_failures == 0  # type: ignore[attr-defined]


async def test_a_failing_store_is_skipped_after_a_few_errors_and_writes_end_at_once() -> None:
    async with switched(storage_health_errors=3, storage_max_retries=3) as (store, stack):
        m = stack.controller.metrics
        store.mode = "raise"
        for i in range(6):
            await serve_request(stack, prompt(i), rid=f"w{i}", prefetch=False)
        t0 = time.monotonic()
        await asyncio.wait_for(stack.cache.drain(), 2.0)
        assert time.monotonic() - t0 < 1.0
        assert stack.controller.health.state is HealthState.DOWN
        assert m.counters["storage_write_skipped_unhealthy"] > 0
        calls = store.calls
        await serve_request(stack, prompt(7), rid="w7", prefetch=False)
        await stack.cache.drain()
        # while down, only the probes reach the store
        assert store.calls - calls <= m.counters["storage_probes"] + 1
        store.mode = "ok"
        await eventually(lambda: stack.controller.health.up)
        # a later hit offers the pages that were not written again
        await serve_request(stack, prompt(7), rid="w7b", prefetch=False)
        await stack.cache.drain()
        keys = fast_page_hashes(prompt(7), PS, namespace_seed(None))
        assert all(await store.exists_pages(keys))


async def test_drain_returns_in_bounded_time_while_the_store_hangs() -> None:
    store = SwitchStorage(store_id=f"drain-{uuid.uuid4()}")
    stack = make(store, storage_io_timeout_s=30.0, storage_stall_s=0.2)
    try:  # not switched(): the close is what is measured here
        store.mode = "hang"
        for i in range(8):
            await serve_request(stack, prompt(i), rid=f"d{i}", prefetch=False)
        t0 = time.monotonic()
        await asyncio.wait_for(stack.cache.drain(), 5.0)
        assert time.monotonic() - t0 < 1.5  # one stall, not 8 jobs x retries x 30 s
        t0 = time.monotonic()
        report = await stack.aclose()
        assert time.monotonic() - t0 < 1.5 and report.drained
    finally:
        store.mode = "ok"


def test_health_state_machine_backoff() -> None:
    now = [0.0]
    seen: list[HealthState] = []
    h = StorageHealth(errors_to_trip=2, probe_base_s=0.5, probe_max_s=2.0, on_change=seen.append,
                      clock=lambda: now[0])
    h.failed("x")
    h.succeeded()
    h.failed("x")
    assert h.up  # not consecutive
    h.failed("x")
    assert not h.up and seen == [HealthState.DOWN] and h.next_probe_in() == 0.5
    h.probe_failed()
    h.probe_failed()
    h.probe_failed()
    assert h.next_probe_in() == 2.0
    now[0] = 3.0
    h.probe_passed()
    assert h.up and seen == [HealthState.DOWN, HealthState.UP] and h.consecutive_errors == 0
    h.trip("hang")
    assert h.next_probe_in() == 0.5  # the backoff starts over


def test_a_zero_probe_base_still_backs_off_after_a_failed_probe() -> None:
    """``storage_probe_base_s=0`` (probe as soon as the store is marked down) is a valid setting,
    and the backoff is "doubled after each failed probe up to the maximum": doubling 0 kept it
    0, and a store that stayed down was probed back to back, thousands of times a second."""
    h = StorageHealth(errors_to_trip=1, probe_base_s=0.0, probe_max_s=2.0)
    h.trip("gone")
    assert h.next_probe_in() == 0.0  # the first probe at once, as configured
    h.probe_failed()
    assert h.next_probe_in() > 0.0
    first = h.next_probe_in()
    h.probe_failed()
    assert h.next_probe_in() == min(2.0, 2 * first)  # and doubled from there
    for _ in range(20):
        h.probe_failed()
    assert h.next_probe_in() == 2.0


async def test_a_store_that_stays_down_is_not_probed_back_to_back_with_a_zero_probe_base() -> None:
    async with switched(storage_probe_base_s=0.0, storage_probe_max_s=1.0, storage_health_errors=1) as (store, stack):
        store.mode = "raise"
        await serve_request(stack, prompt(1), rid="a")
        await eventually(lambda: not stack.controller.health.up)
        await asyncio.sleep(0.5)
        assert stack.controller.metrics.counters.get("storage_probes", 0) <= 10


class OneBadRead(MemoryStorage):
    """Reads take a while; the next ``bad`` of them raise."""

    backend_name = "one-bad-read"
    bad = 0

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)
        if self.bad:
            self.bad -= 1
            raise OSError("one transient read error")
        return await super()._read(pages, buffers)


async def test_one_failing_call_among_concurrent_ones_counts_once() -> None:
    """Each call was judged by the backend's shared error counter moving while it ran: three
    concurrent prefetch reads with one raising counted three failures and tripped a breaker
    set to three errors; the two good reads were held against the store too."""
    store = OneBadRead(store_id=f"bad-read-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete",
                                                  storage_health_errors=3, storage_probe_base_s=5.0))
    stack = build_stack(cfg, storage=store)
    try:
        prompts = [[1000 * i + j for j in range(8)] for i in range(3)]
        for i, p in enumerate(prompts):
            await serve_request(stack, p, rid=f"w{i}")
        await stack.cache.drain()
        stack.cache.evict(10**6)
        stack.cache.evict_host(10**6)
        await stack.cache.drain()
        store.bad = 1
        outs = await asyncio.gather(*(serve_request(stack, p, rid=f"r{i}") for i, p in enumerate(prompts)))
        assert sorted(o.storage_hit for o in outs) == [0, 8, 8]
        assert stack.controller.health.up and stack.controller.metrics.counters.get("storage_trips", 0) == 0
    finally:
        await stack.aclose()


async def test_a_blocked_server_loop_is_not_taken_for_a_stalled_store() -> None:
    """The stall and timeout limits were counted on the server's loop: a loop blocked longer
    than ``storage_stall_s`` (a slow synchronous forward pass) marked a healthy store down and
    dropped the call's answer, both when the block came before the call reached the I/O loop
    and when the call ended there while the loop was blocked (its answer waiting to be taken)."""
    async with switched(storage_stall_s=0.1, storage_io_timeout_s=0.3) as (store, stack):
        await serve_request(stack, prompt(0), rid="warm")
        await stack.cache.drain()
        controller = stack.controller  # type: ignore[attr-defined]
        samples: list[float] = []
        observe = controller.metrics.observe
        controller.metrics.observe = lambda op, tier, s: (samples.append(s), observe(op, tier, s))
        before = asyncio.ensure_future(controller._storage_call(store.batch_exists_v2(["k"]), "exists"))
        asyncio.get_running_loop().call_soon(time.sleep, 0.4)  # before the call has left the loop
        assert await before is not None
        during = asyncio.ensure_future(controller._storage_call(store.batch_exists_v2(["k"]), "exists"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        time.sleep(0.4)  # the call ends on the I/O loop meanwhile
        assert await during is not None
        counters = controller.metrics.counters
        assert controller.health.up
        assert counters.get("storage_stalls", 0) == counters.get("storage_timeouts", 0) == 0
        assert samples and max(samples) < 0.1  # the loop's block is not the store's latency


class BlockingRead(MemoryStorage):
    """Each read blocks the server's loop (``loop``) for ``block`` seconds as it begins, and
    itself answers at once: the answer waits for the loop."""

    backend_name = "blocking-read"
    loop: asyncio.AbstractEventLoop | None = None
    block = 0.0

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        if self.loop is not None and self.block:
            self.loop.call_soon_threadsafe(time.sleep, self.block)
        return await super()._read(pages, buffers)


async def test_a_timeout_prefetch_keeps_pages_that_landed_while_the_loop_was_blocked() -> None:
    """The ``timeout`` policy cut a prefetch whose read had ended in time, its answer only held
    up by the blocked server loop: the pages, already in host memory, were dropped and computed."""
    store_id = f"blocking-read-{uuid.uuid4()}"
    await seed(store_id, [prompt(1)])
    store = BlockingRead(store_id=store_id)
    stack = make(store, prefetch_batch_pages=64, storage_stall_s=0.0)
    try:
        store.loop, store.block = asyncio.get_running_loop(), 0.45  # past the 0.3 s deadline
        out = await serve_request(stack, prompt(1), rid="r")
        assert out.storage_hit == len(prompt(1))  # type: ignore[attr-defined]
        assert stack.controller.health.up  # type: ignore[attr-defined]
    finally:
        store.block = 0.0
        await stack.aclose()


async def test_a_promised_read_is_made_while_the_store_is_down_and_outlives_a_trip() -> None:
    """Pages an engine already counted as hits (``promised``) are read even while the store is
    marked down, and a trip while the read runs does not interrupt it; an optional prefetch is
    skipped as before."""
    store_id = f"promised-{uuid.uuid4()}"
    await seed(store_id, [prompt(1)])
    async with switched(store_id) as (store, stack):
        ctl = stack.controller  # type: ignore[attr-defined]
        keys = fast_page_hashes(prompt(1), PS, namespace_seed(None))[:8]
        pool = stack.host_pool  # type: ignore[attr-defined]

        def alloc(tokens: int):  # type: ignore[no-untyped-def]
            return pool.alloc(tokens)

        ctl.health.trip("test: marked down")
        assert not ctl.health.up
        assert ctl.start_prefetch("optional", keys, alloc_host=alloc) is None
        store.mode = "hang"  # the promised read waits in the store...
        op = ctl.start_prefetch("promised", keys, alloc_host=alloc, promised=True)
        assert op is not None
        await asyncio.sleep(0.1)
        ctl.health.trip("test: down again while it reads")  # ...and is not interrupted by this
        store.mode = "ok"
        result = await ctl.wait_prefetch("promised", "wait_complete")
        assert result is not None and result.pages == len(keys)
        assert ctl.metrics.counters.get("prefetch_promised_while_down", 0) == 1
        pool.free(result.host_indices)


async def test_writes_skipped_while_the_store_was_down_are_made_when_it_is_back() -> None:
    """A prompt's write stalls and the store is marked down; a longer prompt through it comes
    meanwhile (its pages wait for their parent's). Once a probe finds the store back, both are
    written, without waiting for a hit to pass by."""
    async with switched(storage_stall_s=0.1) as (store, stack):
        ctl = stack.controller  # type: ignore[attr-defined]
        a = list(range(1, 1 + 2 * PS))
        ab = a + list(range(100, 100 + 6 * PS))
        store.mode = "hang"
        await serve_request(stack, a, rid="a", prefetch=False)
        await eventually(lambda: not ctl.health.up, timeout=10)
        await serve_request(stack, ab, rid="ab", prefetch=False)
        store.mode = "ok"
        await eventually(lambda: ctl.health.up, timeout=10)
        await stack.cache.drain()  # type: ignore[attr-defined]

        def missing() -> int:
            return sum(len(n.hash_value) - n.storage_pages for n in stack.cache._nodes())  # type: ignore[attr-defined]

        await eventually(lambda: missing() == 0, timeout=10)
        assert len(store.medium.pages) == len(ab) // PS
        assert stack.cache.metrics.counters.get("storage_writes_reoffered", 0) >= 1  # type: ignore[attr-defined]


async def test_a_wait_takes_only_the_prefetch_it_waited_for() -> None:
    """A prefetch aborted while a caller waits for it, then started again under the same rid:
    the first wait ends with nothing, and the new prefetch is left to its own waiter."""
    store_id = f"rid-{uuid.uuid4()}"
    await seed(store_id, [prompt(1)])
    async with switched(store_id) as (store, stack):
        ctl = stack.controller  # type: ignore[attr-defined]
        pool = stack.host_pool  # type: ignore[attr-defined]
        keys = fast_page_hashes(prompt(1), PS, namespace_seed(None))[:8]
        store.mode = "hang"
        assert ctl.start_prefetch("r", keys, alloc_host=pool.alloc) is not None
        first = asyncio.ensure_future(ctl.wait_prefetch("r", "wait_complete"))
        await asyncio.sleep(0.05)
        ctl.abort_prefetch("r")
        second = ctl.start_prefetch("r", keys, alloc_host=pool.alloc)
        assert second is not None
        store.mode = "ok"
        assert await first is None
        result = await ctl.wait_prefetch("r", "wait_complete")
        assert result is not None and result.pages == len(keys)
        pool.free(result.host_indices)
