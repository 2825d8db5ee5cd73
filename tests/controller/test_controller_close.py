"""Closing the controller against a storage backend that hangs or blocks its I/O loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

import pytest
from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
import hicache.controller.controller as controller_module
from hicache.prefix_cache import fast_page_hashes, namespace_seed
from hicache.replay import StackConfig, build_stack, serve_request

PS = 4


class LoopBlockingStorage(FaultyStorage):
    """Writes block the storage I/O loop's thread (a synchronous call on a hung mount)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.unblock = threading.Event()

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        self.unblock.wait(10)
        return await super()._write(pages, buffers, parents)


def make(store: FaultyStorage):  # type: ignore[no-untyped-def]
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_io_timeout_s=2.0, storage_stall_s=0,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=0.3))
    return build_stack(cfg, storage=store)


async def test_drain_after_a_close_that_timed_out_returns() -> None:
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    store.hang_now()
    await serve_request(stack, list(range(8)), rid="a")
    await asyncio.sleep(0.02)  # the storage write is in flight, hung
    report = await stack.aclose()
    assert not report.drained and report.unwritten_pages == 2
    # the job the cancelled worker held was reported: nothing is left "unfinished"
    await asyncio.wait_for(stack.controller.drain(), 1.0)
    await asyncio.wait_for(stack.cache.drain(), 1.0)


async def test_close_returns_when_the_backend_blocks_its_io_loop() -> None:
    store = LoopBlockingStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    try:
        await serve_request(stack, list(range(8)), rid="a")
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        report = await asyncio.wait_for(stack.aclose(), 8.0)
        assert time.monotonic() - t0 < 5.0
        assert not report.drained
    finally:
        store.unblock.set()


class CloseBlockingStorage(FaultyStorage):
    """Closing blocks the storage I/O loop's thread (a flush on a hung mount)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.unblock = threading.Event()

    async def _close(self) -> None:
        self.unblock.wait(30)
        await super()._close()


async def test_close_returns_when_the_storage_close_blocks_its_io_loop() -> None:
    """A storage the controller owns (built from a config) is closed on its I/O loop; when
    that close blocks the loop, the close used to cancel it and then wait, for good, for the
    blocked loop to run the cancellation."""
    store = CloseBlockingStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    stack.controller.own_storage = True  # as build_stack makes it for a configured backend
    try:
        await serve_request(stack, list(range(8)), rid="a")
        t0 = time.monotonic()
        report = await asyncio.wait_for(stack.aclose(), 20.0)
        assert time.monotonic() - t0 < 5.0  # max(1 s, close_timeout_s) for the close, as much for the thread
        assert report.drained and report.unwritten_pages == 0
    finally:
        store.unblock.set()


async def test_device_eviction_does_not_wait_for_a_hung_storage_write() -> None:
    """Making device room needs the device->host copies, not the storage writes queued behind
    them: with storage hung, evict_async must return as soon as the backups are done."""
    from hicache.prefix_cache import EvictParams

    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, write_policy="write_back",
                                                  storage_io_timeout_s=30.0, cancelled_io_grace_s=0.0,
                                                  close_timeout_s=1.0))
    stack = build_stack(cfg, storage=store)
    try:
        await serve_request(stack, list(range(32)), rid="a")
        store.hang_now()
        await serve_request(stack, list(range(100, 132)), rid="b")
        t0 = time.monotonic()
        res = await asyncio.wait_for(stack.cache.evict_async(EvictParams(num_tokens=64)), 10.0)
        assert res.num_tokens_evicted == 64
        assert time.monotonic() - t0 < 2.0
    finally:
        store.release()
        await stack.aclose()


async def test_session_close_is_bounded_by_the_close_timeout_with_storage_hung() -> None:
    """Closing sessions waits for their host copies, not for storage writes: with storage hung
    the whole close still ends within the controller's close timeout (it reports the rest)."""
    from hicache.prefix_cache import Req, Session
    from hicache.session import SessionAwareCache

    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)  # close_timeout_s=0.3, storage_io_timeout_s=0.2
    stack.controller.config.storage_io_timeout_s = 5.0
    cache = SessionAwareCache(stack.cache)
    try:
        store.hang_now()
        await serve_request(stack, list(range(8)), rid="plain", verify=False)
        req = Req(rid="turn", origin_input_ids=list(range(100, 112)), session=Session("chat", streaming=True))
        cache.match_req(req)
        await cache.admit(req)
        assert await cache.alloc_extend(req, 12) is not None
        req.kv_committed_len = 12
        cache.release_req(req)
        assert cache.session_held_req_count() == 1
        t0 = time.monotonic()
        report = await asyncio.wait_for(cache.aclose(), 10.0)
        assert time.monotonic() - t0 < 3.0
        assert report is not None and not report.drained
    finally:
        store.release()


async def test_concurrent_closes_share_one_drain() -> None:
    """Two aclose() at once (a signal handler and the server's own shutdown): the second waits
    for the first close instead of being told "drained" at once, so the stack does not close
    its copy engine under the first close's drain; every queued backup lands."""
    cfg = StackConfig(page_size=PS, device_pages=256, host_pages=512, storage_backend="memory",
                      controller=ControllerConfig(prefetch_threshold=PS, backup_batch_pages=1))
    stack = build_stack(cfg)
    for i in range(40):
        await serve_request(stack, list(range(1000 * i, 1000 * i + 16)), rid=f"r{i}")
    first, second = await asyncio.gather(stack.aclose(), stack.aclose())
    assert first.drained and second.drained
    assert first.failed_device_backups == 0 and not first.unwritten
    counters = stack.controller.metrics.counters
    assert counters.get("backup_failures", 0) == 0
    assert stack.controller.metrics.pages.get("h2s", 0) == 40 * 4


async def test_a_backup_waiting_for_room_when_close_gives_up_is_refused_not_stranded() -> None:
    """backup() blocked on a full queue while close times out: it gets an answer (the job is
    reported failed, or the call raises CacheClosedError), never a wait that lasts forever,
    and no job is left in the closed controller's queue."""
    import torch

    from hicache.errors import CacheClosedError

    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(backup_queue_size=1, close_timeout_s=0.2))
    stack = build_stack(cfg)
    ctl = stack.controller
    real = stack.copy_engine.backup

    async def slow_backup(dev, host):  # a slow device->host copy (big batch, busy bus)
        await asyncio.sleep(1.0)
        await real(dev, host)

    stack.copy_engine.backup = slow_backup  # type: ignore[method-assign]
    dev = torch.arange(0, PS, dtype=torch.int64)
    host = torch.arange(0, PS, dtype=torch.int64)
    calls = [asyncio.create_task(ctl.backup(dev + PS * i, host + PS * i)) for i in range(3)]
    await asyncio.sleep(0.05)  # one copying, one queued, one waiting for room
    report = await ctl.aclose()
    assert not report.drained
    done, pending = await asyncio.wait(calls, timeout=2.0)
    assert not pending
    outcomes = [t.exception() if t.exception() is not None else t.result() for t in done]
    assert all(o is False or isinstance(o, CacheClosedError) for o in outcomes), outcomes
    assert report.failed_device_backups + sum(isinstance(o, CacheClosedError) for o in outcomes) == 3
    assert ctl._backup_q is not None and ctl._backup_q.empty()
    await stack.aclose()


async def test_work_offered_after_close_reported_its_leftovers_is_refused() -> None:
    """A request finishing while close waits for the storage backend to close: its backup is
    refused (the tree defers it, nothing locked or held), not queued where no worker runs."""
    from hicache.controller.controller import ControllerState

    cfg = StackConfig(page_size=PS, device_pages=32, host_pages=64, storage_backend="memory",
                      controller=ControllerConfig(prefetch_threshold=PS))
    stack = build_stack(cfg)
    ctl = stack.controller
    await serve_request(stack, list(range(8)), rid="warm")
    await stack.cache.drain()
    closing = asyncio.create_task(ctl.aclose())
    while not ctl._sealed:
        await asyncio.sleep(0)
    assert ctl.state is ControllerState.CLOSING
    dev = stack.allocator.alloc(PS)
    host = stack.host_pool.alloc(PS)
    assert not ctl.submit_backup(dev, host, lambda ok: None)
    await closing
    assert ctl._backup_q is not None and ctl._backup_q.empty()
    await stack.aclose()


async def test_the_close_report_counts_pages_storage_never_got() -> None:
    """Writes that failed for good were only in the log and the metrics: the close said
    "drained, nothing unwritten" although no page reached storage."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_max_retries=1,
                                                  storage_retry_base_s=0.001, close_timeout_s=2.0))
    stack = build_stack(cfg, storage=store)
    store.fail_writes = 1000
    await serve_request(stack, list(range(8)), rid="a")
    report = await stack.aclose()
    assert report.drained and not report.unwritten
    assert report.failed_storage_pages == 2


def _faulty_stack(probe_s: float) -> tuple[FaultyStorage, Any]:
    """A stack over a fresh ``FaultyStorage``, probing a store marked down every ``probe_s``
    (twice that at most)."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_probe_base_s=probe_s,
                                                  storage_probe_max_s=2 * probe_s))
    return store, build_stack(cfg, storage=store)


async def test_pages_a_reoffer_wrote_once_the_store_came_back_are_not_reported_as_never_written(
        caplog: pytest.LogCaptureFixture) -> None:
    """Pages whose write was skipped while the store was down, and that the re-offer wrote
    once it came back, are in storage at close. The report summed lifetime counters and said
    they were never written there (with a warning), a false alarm at every shutdown after an
    outage; the lifetime total is kept apart, named as one."""
    store, stack = _faulty_stack(probe_s=0.01)
    ctl = stack.controller
    await serve_request(stack, list(range(8)), rid="a")
    ctl.health.trip("test: the store went away")
    await stack.cache.drain()  # the 2 pages' write is skipped: the store is down
    for _ in range(200):  # the probe finds it back; the re-offer writes them
        if ctl.health.up and ctl.metrics.counters["storage_writes_reoffered"]:
            break
        await asyncio.sleep(0.01)
    await stack.cache.drain()
    assert ctl.metrics.counters["storage_write_skipped_unhealthy"] == 2
    keys = fast_page_hashes(list(range(8)), PS, namespace_seed(None))
    assert (await store.batch_exists_v2(keys)).kv_hit_pages == 2
    with caplog.at_level(logging.WARNING, logger="hicache"):
        report = await stack.aclose()
    assert report.drained and not report.unwritten
    assert report.failed_storage_pages == 0, report
    assert report.lifetime_failed_storage_pages == 2
    assert "failed_storage_pages" not in report.summary()
    assert not [r for r in caplog.records if "meant for storage" in r.getMessage()]


async def test_the_close_report_counts_pages_still_out_of_storage_including_those_waiting_for_their_prefix() -> None:
    """The store is down until the close: the prefix's page was skipped, and its child's 2
    pages never had a write (a page is written only after its prefix). All 3 are missing from
    storage at close; the lifetime counters count skips, not pages: the prefix's page once per
    offer the store was down for (its second request offered it again), the child's never."""
    store, stack = _faulty_stack(probe_s=60.0)
    ctl = stack.controller
    ctl.health.trip("test: the store went away")
    await serve_request(stack, list(range(PS)), rid="a")
    await stack.cache.drain()
    await serve_request(stack, list(range(3 * PS)), rid="ab", prefetch=False)
    await stack.cache.drain()
    report = await stack.aclose()
    assert report.drained and not report.unwritten
    assert report.failed_storage_pages == 3, report
    assert report.lifetime_failed_storage_pages == ctl.metrics.counters["storage_write_skipped_unhealthy"] == 2
    assert "failed_storage_pages=3" in report.summary()


async def test_pages_listed_unwritten_at_close_are_not_counted_again_as_failed() -> None:
    """The prefix's write hangs at close: its 2 pages are listed ``unwritten`` (stuck), and
    only the child's 2, which waited for that write, are counted in ``failed_storage_pages``."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    store.hang_now()
    try:
        await serve_request(stack, list(range(8)), rid="a")
        await serve_request(stack, list(range(16)), rid="ab", prefetch=False)
        await stack.controller.drain_backups()
        report = await stack.aclose()
    finally:
        store.release()
    assert not report.drained and report.unwritten_pages == 2, report
    assert report.failed_storage_pages == 2, report
    assert report.lifetime_failed_storage_pages == 0


async def test_a_stack_whose_cache_close_fails_still_stops_its_copy_threads() -> None:
    """The copy engine's threads go even when the cache's close raised (the facade did that
    in a ``finally``; the stack did not)."""
    import pytest

    stack = build_stack(StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None))

    async def broken_close(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("cache close failed")

    real_close = stack.cache.aclose
    stack.cache.aclose = broken_close  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="cache close failed"):
        await stack.aclose()
    assert stack.copy_engine._closed
    await real_close()


async def _writes_queued(stack, n: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until ``n`` storage writes are queued (a copy's completion, on the loop, queues its write)."""
    await stack.controller.drain_backups()
    for _ in range(200):
        if stack.controller.storage_writes_pending >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{stack.controller.storage_writes_pending} storage writes queued, not {n}")


async def test_device_eviction_waits_for_the_first_storage_write_that_frees_room_not_the_whole_queue() -> None:
    """KV kept on device (a handed-over history) waits for host room that storage writes free:
    evict_async returns once the first write has landed and made that room, not after the
    slow store has worked off its whole backlog."""
    from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey

    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=4, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_io_timeout_s=30.0,
                                                  storage_batch_pages=1, storage_hop_bytes=1, storage_stall_s=0,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=5.0))
    stack = build_stack(cfg, storage=store)
    try:
        store.delay = 0.5  # each write lands 0.5 s after the one before it
        for i in range(4):  # four one-page prompts: host full of copies whose writes wait
            await serve_request(stack, [1000 * (i + 1) + t for t in range(PS)], rid=f"p{i}", prefetch=False)
        await _writes_queued(stack, 4)
        cache = stack.cache
        tokens = [9000 + t for t in range(PS)]
        await serve_request(stack, tokens, rid="kept", prefetch=False)
        await stack.controller.drain_backups()
        node = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
        cache.write_backup(node)  # deferred for want of host room, kept on device meanwhile
        assert node.host_value is None and node in cache._deferred
        pending = stack.controller.storage_writes_pending
        assert pending >= 4
        t0 = time.monotonic()
        res = await asyncio.wait_for(cache.evict_async(EvictParams(num_tokens=5 * PS)), 10.0)
        took = time.monotonic() - t0
        assert res.num_tokens_evicted == 5 * PS
        assert stack.controller.storage_writes_pending > 0, "it waited for the whole queue"
        assert took < 0.5 * pending, took
    finally:
        await stack.aclose()


async def test_a_wait_for_storage_progress_ends_at_close() -> None:
    """Nothing queued: it returns at once; a write that never lands: the close wakes it."""
    store = FaultyStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    await asyncio.wait_for(stack.controller.wait_storage_progress(), 1.0)
    store.delay = 30.0
    await serve_request(stack, list(range(8)), rid="a", prefetch=False)
    await _writes_queued(stack, 1)
    waiting = asyncio.ensure_future(stack.controller.wait_storage_progress())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    report = await asyncio.wait_for(stack.aclose(), 10.0)
    await asyncio.wait_for(waiting, 1.0)
    assert not report.drained and stack.controller.storage_writes_pending == 0


class ExistsBlockingStorage(FaultyStorage):
    """Lookups block the storage I/O loop's thread (a stat on a hung mount)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.unblock = threading.Event()

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        self.unblock.wait(10)
        return await super()._exists(pages)


async def test_the_close_names_stuck_prefetches_quoted_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A prefetch task is named after its request's id, the caller's text: the close's warning
    of tasks still waiting for storage wrote every name raw, so an id with a newline, a NUL or
    an ANSI escape went into the log as it was, and many stuck prefetches of megabyte ids made
    one line of many megabytes. It names them quoted, a few of them."""
    from hicache.prefix_cache import Req

    evil = "x\nERROR forged\x00\x1b[31m\r" + "A" * 1_000_000
    store = ExistsBlockingStorage(store_id=f"faulty-{uuid.uuid4()}")
    stack = make(store)
    try:
        for i in range(20):
            req = Req(rid=f"{evil}{i}", origin_input_ids=list(range(100 * i, 100 * i + 8)))
            stack.cache.match_req(req)
            assert stack.cache.start_prefetch(req)
        await asyncio.sleep(0.05)  # the first lookup blocks the I/O loop
        with caplog.at_level(logging.WARNING, logger="hicache.controller"):
            await asyncio.wait_for(stack.aclose(), 8.0)
    finally:
        store.unblock.set()
    stuck = [r.getMessage() for r in caplog.records if "still wait for storage calls" in r.getMessage()]
    assert stuck, [r.getMessage()[:200] for r in caplog.records]
    for message in (r.getMessage() for r in caplog.records):
        assert len(message) < 2_000 and not any(ord(c) < 32 or ord(c) == 127 for c in message), message[:200]


class StuckStorage(FaultyStorage):
    """A hung medium: a write waits on a thread that does not return (its cancelled caller
    waits for the thread, as every backend's must), and the close flushes on that medium and
    outlives its cancellation."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.unblock = threading.Event()
        self.writing = threading.Event()

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        from hicache.storage.offload import run_to_completion

        self.writing.set()
        await run_to_completion(self.unblock.wait, 60)
        return await super()._write(pages, buffers, parents)

    async def _close(self) -> None:
        flush = asyncio.ensure_future(asyncio.to_thread(self.unblock.wait, 60))
        while not flush.done():
            try:
                await asyncio.shield(flush)
            except asyncio.CancelledError:
                pass  # a close that does not take its cancellation
        await super()._close()


async def test_a_close_with_a_deadline_ends_by_it_with_its_store_and_a_write_stuck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose write hangs on its medium and whose close outlives its cancellation: the
    controller's close waited 1 s more for that close and 1 s more for the worker stuck in the
    write, whatever the deadline, ending up to 2 s past it (a server's drain budget, with its
    SIGKILL behind). Those waits take what the deadline leaves; the report still names the
    pages of the stuck write. (The waits are made 6 s each here, so that a close that ignored
    the deadline would end 12 s past it: far outside a loaded machine's scheduling noise.)"""
    monkeypatch.setattr(controller_module, "_LAST_CLOSE_WAIT_S", 6.0)
    store = StuckStorage(store_id=f"faulty-{uuid.uuid4()}")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None, storage_thread=False,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_io_timeout_s=60.0, storage_stall_s=0,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=60.0))
    stack = build_stack(cfg, storage=store)
    stack.controller.own_storage = True  # as build_stack makes it for a configured backend
    try:
        await serve_request(stack, list(range(8)), rid="a")
        assert await asyncio.to_thread(store.writing.wait, 30)
        budget = 3.0
        t0 = time.monotonic()
        report = await asyncio.wait_for(stack.aclose(deadline=t0 + budget), 30.0)
        took = time.monotonic() - t0
        assert took < budget + 4.0, took  # (the two waits' own bound: 6 s each here)
        assert not report.drained and report.stuck_storage_calls == 1
        assert report.unwritten_pages == 2 and [u.reason for u in report.unwritten] == ["stuck"]
    finally:
        store.unblock.set()
        await asyncio.sleep(0.2)  # the store's close and the stuck write end
