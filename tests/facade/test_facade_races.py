"""Facade regressions: concurrency, failures and lifecycle edges of the request path.

Each test pins one defect found in review: KV read from slots still being loaded, a lock leaked
by two requests sharing an id, freed slots handed to the tree after a failed load, storage
opened on the wrong loop, begin() succeeding on a closed cache, close races and failed starts.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import hicache.facade as facade_mod
from hicache.errors import CacheClosedError, HiCacheError, PrefixLoadError
from hicache.facade import HiCache
from hicache.replay.synthetic import verify_kv, write_synthetic_kv
from hicache.testing import inject_load_faults

sys.path.insert(0, str(Path(__file__).parent))
from test_facade import PS, config, prompt, run  # noqa: E402


async def demote_shared(cache: HiCache, shared: list[int]) -> None:
    """Put ``shared`` in the tree, then flood the device so that it lives on host only."""
    await run(cache, "seed", shared + prompt(3, 20))
    for i in range(12):
        await run(cache, f"flood{i}", prompt(100 + i, 10 * PS))
    await cache.drain()


def slow_loads(cache: HiCache, delay: float = 0.05, fail: bool = False) -> Callable[[], None]:
    return inject_load_faults(cache._stack.copy_engine, delay=delay, fail=fail)


def assert_no_leak(cache: HiCache) -> None:
    stack = cache._stack
    inner = cache.cache.inner
    inner.sanity_check()
    assert inner.protected_size() == 0, "a lock outlived every request"
    tree = inner.all_device_indices()
    if tree.numel():
        assert stack.allocator.is_allocated(tree), "the tree holds free slots"
    assert stack.allocator.available_size() + tree.numel() == stack.allocator.size
    assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size


async def test_second_request_waits_for_a_load_in_flight() -> None:
    """B matches A's prefix while A's host->device load is still copying: B must not read
    those slots before the copy ends (it got no load handle of its own)."""
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        await demote_shared(cache, shared)
        slow_loads(cache)
        a = await cache.begin("a", shared + prompt(5, 7))
        assert a.hits["host"] == 5 * PS and a.load is not None
        b = await cache.begin("b", shared + prompt(6, 7))
        assert b.prefix_len == 5 * PS
        tb = torch.tensor(b.token_ids)
        for layer in range(cache.device_pool.layer_num):
            await b.wait_layer(layer)
        assert verify_kv(cache.device_pool, b.kv_indices[: b.prefix_len], tb[: b.prefix_len]) == 0
        await cache.abort(a)
        await cache.abort(b)
        await cache.drain()
        assert_no_leak(cache)


async def test_a_layer_out_of_range_is_an_argument_error_with_or_without_a_load() -> None:
    """``wait_layer`` with a layer outside ``0..num_layers-1`` (or not an integer) is the
    caller's error, the same with or without a host load: it returned silently without one, and
    with one it came out as a PrefixLoadError ("abort it") although the load was fine."""
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        await demote_shared(cache, shared)
        slow_loads(cache)
        fresh = await cache.begin("fresh", prompt(7, 9))
        loaded = await cache.begin("loaded", shared + prompt(5, 7))
        assert fresh.load is None and loaded.load is not None
        n = cache.device_pool.layer_num
        for h in (loaded, fresh):
            for bad in (n, -1, 99):
                with pytest.raises(IndexError, match="out of range"):
                    await h.wait_layer(bad)
                with pytest.raises(IndexError, match="out of range"):
                    await asyncio.to_thread(h.wait_layer_sync, bad)
            for bad in (True, 0.0, "0", None):
                with pytest.raises(TypeError, match="layer"):
                    await h.wait_layer(bad)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match="layer"):
                    h.wait_layer_sync(bad)  # type: ignore[arg-type]
            for layer in range(n):
                await h.wait_layer(torch.tensor(layer))  # an integer scalar is an index
            assert h.num_layers == n
        # the load itself was fine: the request goes on and its prefix KV is exact
        tl = torch.tensor(loaded.token_ids)
        assert verify_kv(cache.device_pool, loaded.kv_indices[: loaded.prefix_len], tl[: loaded.prefix_len]) == 0
        for h in (fresh, loaded):
            t = torch.tensor(h.token_ids)
            write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], t[h.prefix_len :])
            await cache.commit(h)
        await cache.drain()
        assert_no_leak(cache)


async def test_requests_sharing_an_id_do_not_leak_locks() -> None:
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        await run(cache, "a", shared + prompt(3, 20))
        h1 = await cache.begin("dup", shared + prompt(4, 3))
        h2 = await cache.begin("dup", shared + prompt(5, 3))
        assert h1.rid == h2.rid == "dup"
        write_synthetic_kv(cache.device_pool, h1.kv_indices, torch.tensor(h1.token_ids))
        await cache.commit(h1)
        await cache.abort(h2)  # must release h2's own lock, not think h1's finish did
        await cache.drain()
        assert_no_leak(cache)


async def test_commit_after_a_failed_load_aborts_instead_of_inserting_freed_slots() -> None:
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        await demote_shared(cache, shared)
        restore = slow_loads(cache, delay=0.001, fail=True)
        h = await cache.begin("f", shared + prompt(5, 7))
        assert h.load is not None and h.prefix_len == 5 * PS
        with pytest.raises(PrefixLoadError, match="abort it"):  # the copy's own error, typed
            await h.wait_loaded()
        with pytest.raises(PrefixLoadError):
            await h.wait_layer(0)
        with pytest.raises(PrefixLoadError):
            await asyncio.to_thread(h.wait_layer_sync, 0)
        write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], torch.tensor(h.token_ids[h.prefix_len :]))
        with pytest.raises(HiCacheError, match="load"):
            await cache.commit(h)
        assert h.done
        await cache.drain()
        assert_no_leak(cache)
        # the prefix is still on host and loads fine once copies work again
        restore()
        h = await run(cache, "g", shared + prompt(6, 7))
        assert h.prefix_len == 5 * PS


async def test_file_storage_is_opened_and_closed_on_the_controller_loop(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR)
    async with HiCache.from_config(config(tmp_path)) as cache:
        await run(cache, "w", prompt(7, 3 * PS))
        scan = cache.storage._scanner.task
        assert scan is None or scan.get_loop() is not asyncio.get_running_loop()
    assert not [r for r in caplog.records if "closing" in r.getMessage()], caplog.text
    async with HiCache.from_config(config(tmp_path)) as again:
        h = await run(again, "r", prompt(7, 3 * PS) + [1])
        assert h.hits["storage"] == 3 * PS


async def test_begin_that_finishes_after_close_raises_and_releases() -> None:
    cache = await HiCache.from_config(config()).start()
    stack = cache._stack
    inner_alloc = cache.cache.alloc_extend
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def alloc_then_wait(req, n):  # type: ignore[no-untyped-def]
        slots = await inner_alloc(req, n)
        entered.set()
        await gate.wait()  # aclose() runs while this begin is still inside
        return slots

    cache.cache.alloc_extend = alloc_then_wait  # type: ignore[method-assign]
    task = asyncio.ensure_future(cache.begin("late", prompt(1, 40)))
    await entered.wait()
    close = asyncio.ensure_future(cache.aclose())
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(CacheClosedError):
        await task
    await close
    assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size
    assert not cache._live


async def test_concurrent_aclose_waits_for_the_one_close() -> None:
    cache = await HiCache.from_config(config()).start()
    await run(cache, "a", prompt(1, 40))
    engine = cache._stack.copy_engine
    first = asyncio.ensure_future(cache.aclose())
    await asyncio.sleep(0)
    await cache.aclose()  # returns only once the close is complete
    assert engine._closed
    await first
    with pytest.raises(CacheClosedError):
        await cache.begin("x", [1])


async def test_cancelled_aclose_still_closes_everything() -> None:
    cache = await HiCache.from_config(config()).start()
    await run(cache, "a", prompt(1, 40))
    engine = cache._stack.copy_engine
    t = asyncio.ensure_future(cache.aclose())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await cache.aclose()
    assert engine._closed
    assert cache._stack.controller.state.value == "closed"


async def test_failed_start_leaves_no_thread_behind(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("x")
    built = []
    orig = facade_mod.build_stack

    def record(cfg, **kw):  # type: ignore[no-untyped-def]
        stack = orig(cfg, **kw)
        built.append(stack)
        return stack

    monkeypatch.setattr(facade_mod, "build_stack", record)
    cfg = config()
    cfg["storage"] = {"backend": "file", "options": {"root": str(root)}}
    cache = HiCache.from_config(cfg)
    before = set(threading.enumerate())
    with pytest.raises(Exception):
        await cache.start()
    assert built and built[0].copy_engine._closed
    assert built[0].controller._io is None or not built[0].controller._io.running
    await asyncio.sleep(0.05)
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("hicache")]
    assert not left, left
    with pytest.raises(CacheClosedError):
        await cache.begin("x", [1])


def record_stacks(monkeypatch, gate: asyncio.Event | None = None) -> list:
    """Record every stack ``start()`` builds; with ``gate``, its storage opens only once the
    gate is set (a slow open: a window for a second start() or an aclose())."""
    built: list = []
    orig = facade_mod.build_stack

    def record(cfg, **kw):  # type: ignore[no-untyped-def]
        stack = orig(cfg, **kw)
        built.append(stack)
        if gate is not None:
            open_storage = stack.controller.open_storage

            async def slow_open() -> None:
                await gate.wait()
                await open_storage()

            stack.controller.open_storage = slow_open
        return stack

    monkeypatch.setattr(facade_mod, "build_stack", record)
    return built


async def test_concurrent_starts_build_one_stack(tmp_path: Path, monkeypatch) -> None:
    """Two start() at once (a server starting the cache lazily from two handlers): the second
    waits for the first instead of building a second stack, whose threads and open storage were
    orphaned by the first's (never closed: hicache-storage-io and the file backend's threads
    outlived aclose())."""
    gate = asyncio.Event()
    built = record_stacks(monkeypatch, gate)
    cache = HiCache.from_config(config(tmp_path))
    before = set(threading.enumerate())
    starts = [asyncio.ensure_future(cache.start()) for _ in range(2)]
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.gather(*starts) == [cache, cache]
    assert len(built) == 1
    await run(cache, "a", prompt(1, 40))
    await cache.aclose()
    await asyncio.sleep(0.05)
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("hicache")]
    assert not left, left


async def test_close_during_start_takes_the_start_down(tmp_path: Path, monkeypatch) -> None:
    """aclose() while start() opens the storage (a shutdown during startup), here an open that
    never answers (a store behind a dead network): the close cancels the open and returns
    once what the start built is closed, the start raises CacheClosedError, and the cache stays
    closed. It used to return at once and the start then opened the cache: begin() succeeded
    after the close and nothing closed the stack; then it waited for the open, for ever here."""
    gate = asyncio.Event()  # never set
    built = record_stacks(monkeypatch, gate)
    cache = HiCache.from_config(config(tmp_path))
    before = set(threading.enumerate())
    start = asyncio.ensure_future(cache.start())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cache.aclose(), 10)
    with pytest.raises(CacheClosedError):
        await start
    assert len(built) == 1 and built[0].copy_engine._closed
    with pytest.raises(CacheClosedError):
        await cache.begin("x", [1])
    with pytest.raises(CacheClosedError):
        await cache.start()
    await asyncio.sleep(0.05)
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("hicache")]
    assert not left, left


async def test_cancelled_start_is_a_cancellation_not_a_close(tmp_path: Path, monkeypatch) -> None:
    """The caller of start() cancelled while the storage opens: the cancellation reaches it
    (not a CacheClosedError), nothing half-built is left, and a later start() opens the cache."""
    gate = asyncio.Event()
    built = record_stacks(monkeypatch, gate)
    cache = HiCache.from_config(config(tmp_path))
    start = asyncio.ensure_future(cache.start())
    await asyncio.sleep(0.01)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert len(built) == 1 and built[0].copy_engine._closed
    gate.set()
    async with cache:
        await run(cache, "a", prompt(1, 40))
    assert len(built) == 2


async def test_chunk_commit_waits_for_a_load_of_the_slots_it_now_points_at() -> None:
    """C computed a prefix itself; meanwhile the same prefix was cached, demoted to host, and
    another request started loading it. C's chunk commit finds those nodes "on device" (their
    slots are being loaded), drops its own copies and points at the tree's: the next chunk
    reads them, so commit returns only once they hold the KV."""
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        c = await cache.begin("c", shared + prompt(9, 3))
        assert c.prefix_len == 0
        await demote_shared(cache, shared)
        slow_loads(cache, delay=0.05)
        a = await cache.begin("a", shared + prompt(5, 7))
        assert a.load is not None
        tc = torch.tensor(c.token_ids)
        write_synthetic_kv(cache.device_pool, c.kv_indices, tc)
        await cache.commit(c, finished=False)
        prefix = c.req.prefix_indices
        assert prefix.numel() >= 5 * PS
        assert verify_kv(cache.device_pool, prefix, tc[: prefix.numel()]) == 0
        await cache.commit(c)
        await cache.abort(a)
        await cache.drain()
        assert_no_leak(cache)


async def test_chunk_commit_refreshes_kv_indices() -> None:
    """After a chunk commit the request's duplicates of cached pages are freed; its handle
    must name the slots that now hold its KV, not the freed ones."""
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        c = await cache.begin("c", shared + prompt(9, 3))
        await run(cache, "other", shared + prompt(3, 20))  # caches the same prefix meanwhile
        t = torch.tensor(c.token_ids)
        write_synthetic_kv(cache.device_pool, c.kv_indices, t)
        await cache.commit(c, finished=False)
        assert cache._stack.allocator.is_allocated(c.kv_indices[: 5 * PS])
        assert verify_kv(cache.device_pool, c.kv_indices, t) == 0
        await cache.commit(c)
        await cache.drain()
        assert_no_leak(cache)


@pytest.mark.parametrize("device_room", [False, True])
async def test_close_while_a_session_turn_waits_for_device_room(device_room: bool) -> None:
    """A session's first turn is in ``alloc_extend``, awaiting room on a full device, when the
    cache closes: the close aborts the attached turn (its row and pages freed, ``req_pool_idx``
    None). The begin must then raise CacheClosedError (was: the failed allocation freed the row
    again, ``ReqToTokenPool.free(None)`` -> TypeError), and give back what it took meanwhile."""
    cache = await HiCache.from_config(config()).start()
    stack = cache._stack
    alloc = stack.allocator
    hog = alloc.alloc(alloc.available_size())  # device memory held by someone else
    assert hog is not None
    inner = cache.cache.inner
    waiting, go = asyncio.Event(), asyncio.Event()
    evict_async = inner.evict_async

    async def slow_evict_async(params):  # type: ignore[no-untyped-def]
        waiting.set()
        await go.wait()  # the close runs while the turn waits for room
        return await evict_async(params)

    inner.evict_async = slow_evict_async  # the await inside SessionAwareCache.ensure_free
    task = asyncio.ensure_future(cache.begin("turn", prompt(1, 40), session_id="s"))
    await asyncio.wait_for(waiting.wait(), 5)
    close = asyncio.ensure_future(cache.aclose())
    for _ in range(100):  # until the close has aborted the attached turn
        await asyncio.sleep(0)
        slot = cache.cache.slots.get("s")
        if slot is None or slot.attached_req is None:
            break
    assert cache.cache.slots.get("s") is None or cache.cache.slots["s"].attached_req is None
    if device_room:
        alloc.free(hog)  # the room comes after all: nothing it allocates may outlive the close
    go.set()
    with pytest.raises(CacheClosedError):
        await task
    await asyncio.wait_for(close, 10)
    if not device_room:
        alloc.free(hog)
    assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size
    assert alloc.available_size() + cache.cache.inner.all_device_indices().numel() == alloc.size
    assert not cache._live


async def test_room_another_request_takes_while_a_begin_waits_for_write_backs_is_made_again() -> None:
    """write_back: the tree's pages go only once their host copies land, so a begin that needs
    room waits for those copies. When another request admitted meanwhile took exactly the room
    they freed, the begin saw as many free slots as before it waited, read that as "nothing can
    be freed" and failed with OutOfKVSlotsError while the device was full of evictable pages
    (about one request in 700 under three concurrent clients). It evicts again instead."""
    async with HiCache.from_config(config(cache={"write_policy": "write_back"})) as cache:
        stack = cache._stack
        for i in range(6):
            await run(cache, f"fill{i}", prompt(40 + i, 10 * PS))  # 60 of 64 pages, no host copy yet
        alloc, tree = stack.allocator, stack.cache
        real_evict_async = tree.evict_async
        taken: list[torch.Tensor] = []

        async def another_request_takes_what_it_frees(params):  # type: ignore[no-untyped-def]
            before = alloc.available_size()
            result = await real_evict_async(params)
            if not taken and alloc.available_size() > before:  # once, while the begin waited
                taken.append(alloc.alloc(alloc.available_size() - before))
            return result

        tree.evict_async = another_request_takes_what_it_frees  # type: ignore[method-assign]
        h = await cache.begin("x", prompt(9, 8 * PS))
        assert taken and taken[0] is not None  # the room was taken meanwhile
        write_synthetic_kv(cache.device_pool, h.kv_indices, torch.tensor(h.token_ids))
        await cache.commit(h)
        del tree.evict_async
        alloc.free(taken[0])
        await cache.drain()
        assert_no_leak(cache)
