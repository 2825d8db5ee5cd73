"""Backups under host pressure: a burst of write-throughs larger than the host pool still
reaches storage (deferred backups, redundant host copies shed), and the metrics say why."""

from __future__ import annotations

import asyncio
import uuid

from _hicache_faults import FaultyStorage
from hicache.controller import ControllerConfig
from hicache.prefix_cache import fast_page_hashes, namespace_seed
from hicache.replay import StackConfig, build_stack, serve_request

PS = 4


def prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 4 * PS))


async def test_a_burst_larger_than_the_host_pool_reaches_storage() -> None:
    store = FaultyStorage(store_id=f"burst-{uuid.uuid4()}")
    store.delay = 0.01  # storage is slower than the burst: host pages wait for their writes
    cfg = StackConfig(page_size=PS, device_pages=256, host_pages=16, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, cancelled_io_grace_s=0.0))
    stack = build_stack(cfg, storage=store)
    try:
        for i in range(20):  # 80 pages of committed KV against 16 host pages
            await serve_request(stack, prompt(i), rid=f"b{i}", prefetch=False)
        await stack.cache.drain()
        missing = []
        for i in range(20):
            keys = fast_page_hashes(prompt(i), PS, namespace_seed(None))
            if not all(await store.exists_pages(keys)):
                missing.append(i)
        assert missing == []
        counters = stack.controller.metrics.counters
        assert counters["backup_deferred"] > 0 and counters["host_copies_shed_tokens"] > 0
        assert counters["backup_rejected"] == 0  # the backup queue was never full
        stack.cache.sanity_check()
    finally:
        await stack.aclose()


async def host_full_of_a_filler(write_policy: str):  # type: ignore[no-untyped-def]
    """A stack whose 4-page host holds one served prompt's copy (the filler, also on device)."""
    from hicache.prefix_cache import MatchPrefixParams, RadixKey

    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=4, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, write_policy=write_policy))
    stack = build_stack(cfg)
    filler = list(range(5000, 5000 + 4 * PS))
    await serve_request(stack, filler, rid="filler", prefetch=False)
    await stack.cache.drain()
    stack.cache.write_backup(stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(filler))).last_device_node)
    await stack.cache.drain()
    assert stack.cache.host_pool.available_size() == 0
    return stack, filler


async def a_deferred_backup(stack, filler: list[int], tokens: list[int]):  # type: ignore[no-untyped-def]
    """Serve ``tokens`` and ask for their backup while the filler, locked on device, holds all
    of host: the backup waits for host room (deferred, kept on device). Returns its node and
    the filler's locked node."""
    from hicache.prefix_cache import MatchPrefixParams, RadixKey

    cache = stack.cache
    await serve_request(stack, tokens, rid="a", prefetch=False)
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
    lock = cache.match_prefix(MatchPrefixParams(key=RadixKey(filler))).last_device_node
    cache.inc_lock_ref(lock)  # the filler's host copy cannot make room
    assert not cache.write_backup(node) and cache._deferred.get(node) is True
    return node, lock


async def test_a_deferred_backup_covers_both_halves_of_a_split() -> None:
    """A backup waiting for host room (kept on device: KV that must be written) whose node is
    split by a later insert: the new upper half waits too and is written once room frees up
    (it was left out: device eviction could drop it, and its pages never reached host)."""
    from hicache.prefix_cache import EvictParams, InsertParams, RadixKey

    stack, filler = await host_full_of_a_filler("write_back")
    cache = stack.cache
    try:
        tokens = list(range(100, 100 + 4 * PS))
        node, lock = await a_deferred_backup(stack, filler, tokens)
        diverging = tokens[: 2 * PS] + [9] * (2 * PS)
        cache.insert(InsertParams(key=RadixKey(diverging), value=stack.allocator.alloc(4 * PS)))
        upper = node.parent
        assert upper is not cache.root_node and len(upper.key) == 2 * PS
        assert cache._deferred.get(upper) is True
        cache.evict(EvictParams(num_tokens=10**6))
        assert upper.value is not None and node.value is not None  # kept on device
        cache.dec_lock_ref(lock)
        cache.evict(EvictParams(num_tokens=10**6))  # the filler leaves the device (it has a host copy)
        cache.evict_host(4 * PS)  # ... and host: room, the deferred backups start
        await cache.drain()
        assert upper.host_value is not None and node.host_value is not None
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_a_backup_asked_to_keep_its_node_right_after_the_insert_keeps_it() -> None:
    """Write-through backups of an insert start once per loop step, together. A caller that
    needs a node written (a session's handed-over history: ``write_backup`` keeps it on device
    until its copy starts) right after the insert, before that batch started, must still get
    that promise when the batch finds no host room (the batch deferred it without it)."""
    from hicache.prefix_cache import EvictParams, InsertParams, MatchPrefixParams, RadixKey

    stack, filler = await host_full_of_a_filler("write_through")
    cache = stack.cache
    try:
        lock = cache.match_prefix(MatchPrefixParams(key=RadixKey(filler))).last_device_node
        cache.inc_lock_ref(lock)  # ... which cannot make room
        tokens = list(range(100, 100 + 4 * PS))
        cache.insert(InsertParams(key=RadixKey(tokens), value=stack.allocator.alloc(4 * PS)))
        node = cache.root_node.children[cache._child_key(None, tokens, 0)]
        assert not cache.write_backup(node) and cache._deferred.get(node) is True
        cache.evict(EvictParams(num_tokens=10**6))
        assert node.value is not None  # kept on device until its copy can start
        cache.dec_lock_ref(lock)
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(4 * PS)  # room: the deferred backup starts
        await cache.drain()
        assert node.host_value is not None
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_a_write_through_whose_start_raises_leaves_nothing_locked() -> None:
    """The write-throughs of a loop step start in a loop callback (``call_soon``), where an
    exception is only logged by asyncio. A start that raises (here the controller's queue) must
    not leave its node marked in flight and locked forever, nor its host slots taken, nor keep
    the backups queued after it waiting for an unrelated match or eviction."""
    from hicache.prefix_cache import EvictParams, InsertParams, MatchPrefixParams, RadixKey

    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=16, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, write_policy="write_through"))
    stack = build_stack(cfg)
    cache = stack.cache
    try:
        await serve_request(stack, prompt(9), rid="warm", prefetch=False)  # controller started
        await cache.drain()
        real = cache.controller.submit_backup
        calls = 0

        def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        cache.controller.submit_backup = flaky  # type: ignore[method-assign]
        a, b = prompt(1), prompt(2)
        for t in (a, b):  # one loop step: both wait in the batch
            cache.insert(InsertParams(key=RadixKey(t), value=stack.allocator.alloc(len(t))))
        await asyncio.sleep(0.05)  # the batch's callback ran (a's start raised)
        assert not cache._backup_batch  # b started too, without waiting for some later match
        cache.controller.submit_backup = real  # type: ignore[method-assign]
        await cache.drain()
        node_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(a))).last_device_node
        assert node_a.lock_ref == 0 and node_a.backup_op is None, node_a
        cache.evict(EvictParams(num_tokens=10**6))  # nothing stays pinned on device
        assert cache.protected_size() == 0
        assert cache.host_pool.available_size() + cache.host_size() == cache.host_pool.size
        cache.sanity_check()
    finally:
        await stack.aclose()


async def test_close_reports_backups_still_waiting_for_host_room() -> None:
    """A backup deferred for host room when the cache closes never reached host: the close
    report says how many pages (only the tree knows them), never silence."""
    stack, filler = await host_full_of_a_filler("write_back")
    try:
        await a_deferred_backup(stack, filler, list(range(100, 100 + 4 * PS)))
    finally:
        report = await stack.aclose()
    assert report.deferred_backup_pages == 4, report


async def stored_prompts(store: FaultyStorage, n: int) -> int:
    """How many of ``prompt(0..n-1)`` storage holds whole."""
    held = 0
    for i in range(n):
        keys = fast_page_hashes(prompt(i), PS, namespace_seed(None))
        held += all(await store.exists_pages(keys))
    return held


def burst_past_the_storage_queue(close_timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    """A stack whose storage queue (2 jobs) is far shorter than a burst of write-throughs to a
    slow store: most writes are refused by the full queue (backpressure)."""
    store = FaultyStorage(store_id=f"queue-{uuid.uuid4()}")
    store.delay = 0.01
    cfg = StackConfig(page_size=PS, device_pages=256, host_pages=256, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, storage_queue_size=2,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=close_timeout_s))
    return store, build_stack(cfg, storage=store)


async def test_a_storage_write_refused_by_a_full_queue_is_written_by_drain() -> None:
    """``drain()`` waits for every storage write: one the full queue refused is offered again
    once the queue has room. It stayed on host unwritten, drain() returned, and storage missed
    the prompt for good (it was offered again only on a later hit of the prompt)."""
    store, stack = burst_past_the_storage_queue()
    try:
        for i in range(20):
            await serve_request(stack, prompt(i), rid=f"q{i}", prefetch=False)
        await stack.cache.drain()
        assert stack.controller.metrics.counters["storage_rejected"] > 0  # the queue was full
        assert await stored_prompts(store, 20) == 20
    finally:
        await stack.aclose()


async def test_a_close_writes_or_reports_storage_writes_a_full_queue_refused() -> None:
    """A close that drains writes the pages the full queue refused too, and one that cannot
    drain reports them: the close said ``drained`` with nothing unwritten while most of the
    burst never reached storage."""
    for timeout in (30.0, 0.02):
        store, stack = burst_past_the_storage_queue(close_timeout_s=timeout)
        for i in range(20):
            await serve_request(stack, prompt(i), rid=f"q{i}", prefetch=False)
        report = await stack.aclose()
        held = await stored_prompts(store, 20)
        assert held * 4 + report.unwritten_pages + report.failed_storage_pages == 20 * 4, (timeout, held, report)
        if report.drained:
            assert held == 20, report
