"""Storage writes queued together reach the storage I/O thread in one hand-off (a *hop*).

Each hand-off costs the server's loop two thread wake-ups, so the storage worker sends every
queued job that fits in one hop's budget (their deletions and batches in order) in one call.
What must not change with it: each job's pages land in order and are acknowledged only as far
as they landed, a job whose batch fails is retried on its own without holding the others
back, a call that raises is held against the store's health, and a job too large for a hop is
still written batch by batch. And what a hop adds must not cost anything: each call inside it
gets the stall limit a call of its own would, is one latency sample and is judged for the
store's health in the order it ran; what landed before a hop was cut short (or the controller
closed) counts, and a finished job is acknowledged without waiting for another job's retries.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
from hicache.controller.jobs import StorageWriteJob
from hicache.stack import StackConfig, build_stack

PS = 4


def make(**controller: Any) -> tuple[Any, FaultyStorage]:
    store = FaultyStorage(store_id=f"hops-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(**{"storage_retry_base_s": 0.001, **controller}))
    return build_stack(cfg, storage=store), store


def count_hops(controller: Any) -> list[int]:
    """Count the controller's calls onto its storage I/O thread."""
    hops = [0]
    run = controller._io.run

    async def counting(coro: Any) -> Any:
        hops[0] += 1
        return await run(coro)

    controller._io.run = counting
    return hops


def submit(stack: Any, jobs: int, pages: int, tag: str, done: list[int], **extra: Any) -> list[list[str]]:
    keys = [[f"{tag}-{j}-{p}" for p in range(pages)] for j in range(jobs)]
    for ks in keys:
        host = stack.host_pool.alloc(pages * PS)
        assert host is not None
        job = StorageWriteJob(keys=ks, host_indices=host, prior_key=None, on_done=done.append, **extra)
        assert stack.controller.submit_storage_write(job)
    return keys


def stored(store: FaultyStorage) -> set[str]:
    return {key for _, key, _ in store.medium.pages}


async def write_all(stack: Any, store: FaultyStorage, jobs: int, pages: int, tag: str) -> None:
    """Queue ``jobs`` jobs at once, drain, and check every page landed and was acknowledged."""
    done: list[int] = []
    keys = submit(stack, jobs=jobs, pages=pages, tag=tag, done=done)
    await stack.controller.drain()
    assert done == [pages] * jobs
    assert stored(store) == {k for ks in keys for k in ks}


@pytest.fixture
async def opened() -> Any:
    made: list[Any] = []

    async def open_(**controller: Any) -> tuple[Any, FaultyStorage, list[int]]:
        stack, store = make(**controller)
        await stack.controller.open_storage()
        made.append(stack)
        return stack, store, count_hops(stack.controller)

    yield open_
    for stack in made:
        await stack.aclose()


async def test_jobs_queued_together_take_one_hop(opened: Any) -> None:
    stack, store, hops = await opened()
    await write_all(stack, store, jobs=10, pages=2, tag="a")
    assert hops[0] == 1 and store.write_calls == 10  # one call per job, one hand-off for all
    c = stack.controller.metrics.counters
    assert c["storage_write_retries"] == 0 and c["storage_write_failures"] == 0
    assert stack.controller.health.up


async def test_a_job_whose_write_fails_is_retried_alone(opened: Any) -> None:
    stack, store, hops = await opened()
    store.fail_writes = 1  # the first job's call stores nothing
    await write_all(stack, store, jobs=5, pages=2, tag="b")
    assert stack.controller.metrics.counters["storage_write_retries"] == 1
    assert hops[0] == 2  # the hop, then the first job's retry


async def test_a_raising_call_fails_only_its_job_and_counts_against_health(opened: Any) -> None:
    stack, store, hops = await opened()
    real = store.batch_set_v2
    raised: list[int] = []

    async def flaky(transfers: Any, info: Any = None) -> Any:
        if not raised:
            raised.append(1)
            raise RuntimeError("injected: the call itself raised")
        return await real(transfers, info)

    store.batch_set_v2 = flaky  # type: ignore[method-assign]
    await write_all(stack, store, jobs=4, pages=1, tag="c")
    assert stack.controller.metrics.counters["storage_write_retries"] == 1
    # the raise counted once against the store, then the next call's success cleared it
    assert stack.controller.health.up


async def test_a_failed_batch_stops_its_job_at_the_last_page_that_landed(opened: Any) -> None:
    stack, store, hops = await opened(storage_batch_pages=2, storage_max_retries=0)
    real_write = store._write
    calls: list[int] = []

    async def second_call_fails(pages: Any, buffers: Any, parents: Any) -> Any:
        calls.append(len(pages))
        if len(calls) == 2:  # the job's second batch stores nothing
            return [False] * len(pages)
        return await real_write(pages, buffers, parents)

    store._write = second_call_fails  # type: ignore[method-assign]
    done: list[int] = []
    keys = submit(stack, jobs=1, pages=6, tag="d", done=done)
    await stack.controller.drain()
    assert done == [2]  # pages after a missing one cannot be found: not acknowledged
    assert stored(store) == set(keys[0][:2])
    assert calls == [2, 2]  # the third batch was never sent
    assert stack.controller.metrics.counters["storage_write_failures"] == 4


async def test_a_job_larger_than_a_hop_is_written_batch_by_batch(opened: Any) -> None:
    stack, store, hops = await opened(storage_batch_pages=2, storage_hop_bytes=0)
    done: list[int] = []
    keys = submit(stack, jobs=1, pages=5, tag="e", done=done)
    await stack.controller.drain()
    assert done == [5]
    assert stored(store) == set(keys[0])
    assert hops[0] == 3 and store.write_calls == 3  # 2 + 2 + 1 pages, one hand-off each


async def test_deletions_ride_in_the_hop_ahead_of_their_write(opened: Any) -> None:
    stack, store, hops = await opened()
    done: list[int] = []
    old = submit(stack, jobs=1, pages=2, tag="old", done=done)[0]
    await stack.controller.drain()
    new = submit(stack, jobs=2, pages=1, tag="new", done=done, delete_first=old + ["never-written"])
    await stack.controller.drain()
    assert done == [2, 1, 1]
    assert stored(store) == {k for ks in new for k in ks}
    c = stack.controller.metrics.counters
    assert c["storage_deleted_pages"] == 2  # the second job found them gone already
    assert c["storage_delete_missed_pages"] == 4
    assert hops[0] == 2


async def test_a_store_marked_down_skips_every_queued_job_and_counts_it(opened: Any) -> None:
    stack, store, hops = await opened()
    stack.controller.health.trip("test: the store is down")
    done: list[int] = []
    submit(stack, jobs=3, pages=2, tag="f", done=done)
    await stack.controller.drain()
    assert done == [0, 0, 0]
    assert stack.controller.metrics.counters["storage_write_skipped_unhealthy"] == 6
    assert hops[0] == 0 and not stored(store)


async def test_a_hop_of_slow_calls_gets_the_stall_limit_per_call(opened: Any) -> None:
    # ten writes of 0.1 s each: the hop takes 1 s, every call well within a 0.5 s stall limit
    stack, store, hops = await opened(storage_stall_s=0.5, storage_io_timeout_s=5.0)
    store.delay = 0.1
    await write_all(stack, store, jobs=10, pages=1, tag="slow")
    assert hops[0] == 1
    assert stack.controller.health.up and stack.controller.metrics.counters["storage_stalls"] == 0


async def test_a_hop_cut_short_keeps_what_landed(opened: Any) -> None:
    stack, store, hops = await opened(storage_stall_s=0.3, storage_io_timeout_s=0.6)
    real_write = store._write
    calls: list[int] = []

    async def third_call_hangs(pages: Any, buffers: Any, parents: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            await asyncio.sleep(30)  # cancelled by the timeout
        return await real_write(pages, buffers, parents)

    store._write = third_call_hangs  # type: ignore[method-assign]
    done: list[int] = []
    keys = submit(stack, jobs=4, pages=1, tag="cut", done=done)
    await stack.controller.drain()
    c = stack.controller.metrics.counters
    assert c["storage_stalls"] == 1 and not stack.controller.health.up  # the hung call was cut
    assert done == [1, 1, 0, 0]  # the two writes that landed count; the rest skipped, counted
    assert stored(store) == set(keys[0] + keys[1])
    assert c["storage_write_skipped_unhealthy"] == 2


async def test_a_finished_job_is_acknowledged_while_another_retries(opened: Any) -> None:
    stack, store, hops = await opened(storage_retry_base_s=0.5, storage_max_retries=1)
    store.fail_writes = 1  # the first job's call fails; its retry waits 0.5 s
    loop = asyncio.get_running_loop()
    when: dict[str, float] = {}

    def done_at(tag: str) -> Any:
        return lambda n: when.setdefault(tag, loop.time())

    t0 = loop.time()
    for tag in ("bad", "good"):
        host = stack.host_pool.alloc(PS)
        assert stack.controller.submit_storage_write(
            StorageWriteJob(keys=[f"{tag}-0"], host_indices=host, prior_key=None, on_done=done_at(tag)))
    await stack.controller.drain()
    assert when["good"] - t0 < 0.4 <= when["bad"] - t0
    assert stored(store) == {"bad-0", "good-0"}


def one_page_job(stack: Any, key: str, on_done: Any, **extra: Any) -> StorageWriteJob:
    host = stack.host_pool.alloc(PS)
    assert host is not None
    return StorageWriteJob(keys=[key], host_indices=host, prior_key=None, on_done=on_done, **extra)


async def test_closing_mid_hop_acknowledges_what_landed_and_reports_only_the_rest() -> None:
    stack, store = make()
    await stack.controller.open_storage()
    store.delay = 0.2
    done: dict[str, int] = {}
    for j in range(4):
        assert stack.controller.submit_storage_write(
            one_page_job(stack, f"c-{j}", lambda n, j=j: done.__setitem__(f"c-{j}", n)))
    await asyncio.sleep(0.5)  # two of the four one-call jobs have landed, the third is writing
    landed = stored(store)
    report = await stack.controller.aclose(timeout=0.05)
    await stack.aclose()
    assert {"c-0", "c-1"} <= landed
    for key in sorted(landed):  # landed before close: acknowledged as written and counted
        assert done[key] == 1, done
    unwritten = {u.first_key for u in report.unwritten}
    assert unwritten == {f"c-{j}" for j in range(4)} - stored(store)
    assert all(done[k] == 0 for k in unwritten)
    assert stack.controller.metrics.pages["h2s"] == len(stored(store))
    assert stack.controller.metrics.counters["unwritten_on_close"] == len(unwritten)


async def test_each_call_inside_a_hop_is_one_latency_sample() -> None:
    stack, store = make()
    await stack.controller.open_storage()
    samples: list[str] = []
    real = stack.controller.metrics.observe

    def spy(op: str, tier: str, seconds: float) -> None:
        samples.append(op)
        real(op, tier, seconds)

    stack.controller.metrics.observe = spy  # type: ignore[method-assign]
    store.delay = 0.02
    done: list[int] = []
    hops = count_hops(stack.controller)
    for j in range(10):
        assert stack.controller.submit_storage_write(one_page_job(stack, f"h-{j}", done.append))
    await stack.controller.drain()
    await stack.aclose()
    assert done == [1] * 10 and hops[0] < 10  # they did share hops
    assert samples.count("set") == store.write_calls == 10


async def test_health_judges_a_hops_calls_in_the_order_they_ran() -> None:
    """Calls 1, 3, 5 raise and 2, 4, 6 land: one call at a time each success resets the
    error count, so a store that answers every other call is never marked down."""
    stack, store = make(storage_health_errors=3)
    await stack.controller.open_storage()
    real = store.batch_set_v2
    n = [0]

    async def flaky(transfers: Any, info: Any = None) -> Any:
        n[0] += 1
        if n[0] in (1, 3, 5):
            raise RuntimeError("injected")
        return await real(transfers, info)

    store.batch_set_v2 = flaky  # type: ignore[method-assign]
    done: list[int] = []
    for j in range(6):
        assert stack.controller.submit_storage_write(one_page_job(stack, f"r-{j}", done.append))
    await stack.controller.drain()
    counters = dict(stack.controller.metrics.counters)
    up = stack.controller.health.up
    await stack.aclose()
    assert up and counters["storage_trips"] == 0
    assert done == [1] * 6  # the three that raised were retried and landed


async def test_a_delete_that_raises_in_a_hop_is_logged_and_judged_not_counted_as_a_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack, store = make(storage_health_errors=5)
    await stack.controller.open_storage()

    async def boom(keys: Any, pool: Any = None) -> Any:
        raise RuntimeError("delete exploded")

    store.batch_delete = boom  # type: ignore[method-assign]
    judged: list[str] = []
    real_failed = stack.controller.health.failed

    def failed(why: str) -> None:
        judged.append(why)
        real_failed(why)

    stack.controller.health.failed = failed  # type: ignore[method-assign]
    done: list[int] = []
    with caplog.at_level("ERROR", logger="hicache.controller"):
        assert stack.controller.submit_storage_write(one_page_job(stack, "d0", done.append, delete_first=["x"]))
        await stack.controller.drain()
    counters = dict(stack.controller.metrics.counters)
    await stack.controller._delete_pages(["y"])  # the same failure on the one-call path
    one_call = dict(stack.controller.metrics.counters)
    await stack.aclose()
    assert done == [1]  # a failed delete never blocks the write
    assert counters["storage_delete_missed_pages"] == 1
    assert any("delete exploded" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert judged[:2] == ["delete raised RuntimeError"] * 2  # in the hop, then on its own
    assert counters["storage_read_failures"] == one_call["storage_read_failures"] == 0


async def test_close_while_a_call_outlives_its_cancel_ends_the_worker_cleanly() -> None:
    """close gives up on a stuck call and reports its job; when the call returns at last, the
    worker must not acknowledge that job again, and it must end (not go back to its queue)."""
    store = FaultyStorage(store_id=f"stuck-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(storage_stall_s=0, storage_io_timeout_s=30.0,
                                                  cancelled_io_grace_s=0.05))
    stack = build_stack(cfg, storage=store)
    ctl = stack.controller
    await ctl.open_storage()
    real_write = store._write
    calls: list[int] = []

    async def second_call_finishes_its_io_first(pages: Any, buffers: Any, parents: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(0.3)  # a backend that ends its I/O before it returns
        return await real_write(pages, buffers, parents)

    store._write = second_call_finishes_its_io_first  # type: ignore[method-assign]
    done: dict[str, list[int]] = {"s-0": [], "s-1": []}
    for j in range(2):
        assert ctl.submit_storage_write(one_page_job(stack, f"s-{j}", done[f"s-{j}"].append))
    await asyncio.sleep(0.2)  # s-0 landed, s-1's call hangs
    workers = [t for t in ctl._tasks if "storage" in t.get_name()]
    report = await ctl.aclose(timeout=0.05)
    await asyncio.sleep(1.0)  # the stuck call returns, the worker resumes
    await stack.aclose()
    assert ctl.metrics.counters["worker_errors"] == 0
    assert workers and all(t.done() for t in workers)
    # each acknowledged once, by close: the hop was still stuck then, so close could not know
    # that s-0 had landed (reporting a landed page unwritten is the safe side: never the reverse)
    assert done == {"s-0": [0], "s-1": [0]}
    assert sorted(u.first_key for u in report.unwritten) == ["s-0", "s-1"]
    assert ctl._storage_busy == {}  # nothing left behind after close


async def test_close_during_a_retry_acknowledges_what_every_job_of_the_hop_landed() -> None:
    stack, store = make(storage_batch_pages=1, storage_retry_base_s=5.0, storage_retry_max_s=5.0)
    ctl = stack.controller
    await ctl.open_storage()
    real_write = store._write

    async def second_pages_fail(pages: Any, buffers: Any, parents: Any) -> Any:
        if pages[0][0].endswith("-1"):
            return [False] * len(pages)
        return await real_write(pages, buffers, parents)

    store._write = second_pages_fail  # type: ignore[method-assign]
    done: dict[str, int] = {}
    for tag in ("A", "B"):
        host = stack.host_pool.alloc(2 * PS)
        assert host is not None
        assert ctl.submit_storage_write(StorageWriteJob(
            keys=[f"{tag}-0", f"{tag}-1"], host_indices=host, prior_key=None,
            on_done=lambda n, tag=tag: done.__setitem__(tag, n)))
    await asyncio.sleep(0.3)  # the hop ran; A waits 5 s to retry, B after it
    landed = stored(store)
    report = await ctl.aclose(timeout=0.05)
    await stack.aclose()
    assert landed == {"A-0", "B-0"}
    assert done == {"A": 1, "B": 1}
    assert sorted((u.first_key, u.pages) for u in report.unwritten) == [("A-1", 1), ("B-1", 1)]


async def test_a_job_the_hop_never_reached_gets_its_first_attempt() -> None:
    stack, store = make(storage_max_retries=0, storage_health_errors=3)
    ctl = stack.controller
    await ctl.open_storage()
    real_hop = ctl._hop

    async def hop_ends_after_its_first_job(hop: Any, out: Any, progress: Any) -> None:
        await real_hop(hop[:1], out, progress)
        raise RuntimeError("injected: the hop itself raised after its first job")

    ctl._hop = hop_ends_after_its_first_job  # type: ignore[method-assign]
    done: list[int] = []
    for j in range(2):
        assert ctl.submit_storage_write(one_page_job(stack, f"u-{j}", done.append))
    await ctl.drain()
    retries = ctl.metrics.counters["storage_write_retries"]
    await stack.aclose()
    assert done == [1, 1] and retries == 0  # the second job was sent once, as its first try
