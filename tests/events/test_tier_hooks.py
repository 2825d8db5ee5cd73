"""Every tier reports its stores and removals to the stack's hub: the tree (device, host) and
the storage (writes, evictions, corrupt pages, clears), each with the page keys it holds."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

import pytest

from hicache.controller import ControllerConfig
from hicache.events import BlockRemoved, BlockStored
from hicache.keys import page_hashes
from hicache.observability import ChangeKind, Tier, TierChange
from hicache.prefix_cache import EvictParams
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage import create_async_storage
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from hicache_backends.file.layout import page_id

PS = 4


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def record(hub) -> list[TierChange]:  # type: ignore[no-untyped-def]
    seen: list[TierChange] = []
    hub.subscribe(seen.append)
    return seen


def of(seen: list[TierChange], kind: ChangeKind, tier: Tier) -> list[TierChange]:
    return [c for c in seen if c.kind is kind and c.tier is tier]


async def served(stack, tokens: list[int]) -> tuple[list[TierChange], list[str]]:  # type: ignore[no-untyped-def]
    """Record the stack's changes, serve ``tokens`` once and let the copies land."""
    seen = record(stack.tier_changes)
    await serve_request(stack, tokens, rid="a")
    await stack.cache.drain()
    return seen, page_hashes(tokens, PS)


def stack_for(**kw: object):  # type: ignore[no-untyped-def]
    ctl = ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete")
    base: dict = dict(page_size=PS, device_pages=16, host_pages=32, storage_backend=None, controller=ctl)
    base.update(kw)
    return build_stack(StackConfig(**base))


async def test_device_and_host_stores_and_removals_carry_chained_keys() -> None:
    stack = stack_for()
    a = toks(0, 16)
    seen, keys = await served(stack, a)
    dev = of(seen, ChangeKind.STORED, Tier.DEVICE)
    assert [k for c in dev for k in c.keys] == keys
    assert dev[0].token_ids == tuple(a) and dev[0].parent_key is None and dev[0].page_size == PS
    host = of(seen, ChangeKind.STORED, Tier.HOST)
    assert [k for c in host for k in c.keys] == keys  # after the backup landed
    # a second prompt sharing 8 tokens: its new node's parent is the shared page's key
    b = a[:8] + toks(500, 8)
    await serve_request(stack, b, rid="b")
    new = of(seen, ChangeKind.STORED, Tier.DEVICE)[-1]
    assert new.keys == tuple(page_hashes(b, PS)[2:]) and new.parent_key == keys[1]
    await stack.cache.drain()
    # demotion: device removed, host kept
    seen.clear()
    stack.cache.evict(EvictParams(num_tokens=10**6))
    assert sorted(k for c in of(seen, ChangeKind.REMOVED, Tier.DEVICE) for k in c.keys) == sorted(
        set(keys) | set(page_hashes(b, PS)))
    assert not of(seen, ChangeKind.REMOVED, Tier.HOST)
    # host eviction: host removed, leaves first
    seen.clear()
    stack.cache.evict_host(10**6)
    assert sorted(k for c in of(seen, ChangeKind.REMOVED, Tier.HOST) for k in c.keys) == sorted(
        set(keys) | set(page_hashes(b, PS)))
    # a load back from host reports the device copy again; reset clears both tiers
    await serve_request(stack, a, rid="again")
    seen.clear()
    stack.cache.reset()
    assert [(c.kind, c.tier) for c in seen] == [(ChangeKind.CLEARED, Tier.DEVICE), (ChangeKind.CLEARED, Tier.HOST)]
    await stack.aclose()


async def test_load_back_reports_the_device_copy() -> None:
    stack = stack_for()
    a = toks(0, 16)
    await serve_request(stack, a, rid="a")
    await stack.cache.drain()
    stack.cache.evict(EvictParams(num_tokens=10**6))
    seen = record(stack.tier_changes)
    out = await serve_request(stack, a, rid="b")
    assert out.verify_failures == 0
    assert {k for c in of(seen, ChangeKind.STORED, Tier.DEVICE) for k in c.keys} >= set(page_hashes(a, PS))
    await stack.aclose()


async def test_take_events_returns_vllm_events_since_the_last_call() -> None:
    stack = stack_for()
    cache = stack.cache
    assert cache.take_events() == []  # starts the log
    a = toks(0, 8)
    await serve_request(stack, a, rid="a")
    await cache.drain()
    events = cache.take_events()
    assert [(type(e), e.medium) for e in events] == [(BlockStored, "GPU"), (BlockStored, "CPU")]
    assert events[0].block_hashes == [bytes.fromhex(k) for k in page_hashes(a, PS)]
    assert cache.take_events() == []
    cache.evict(EvictParams(num_tokens=10**6))
    assert [type(e) for e in cache.take_events()] == [BlockRemoved]
    await stack.aclose()


async def test_storage_writes_and_prefetched_pages_are_reported(tmp_path: Path) -> None:
    stack = stack_for(storage_backend="file", storage_options={"root": str(tmp_path), "max_bytes": None})
    a = toks(0, 16)
    seen, keys = await served(stack, a)
    written = of(seen, ChangeKind.STORED, Tier.STORAGE)
    assert [k for c in written for k in c.keys] == keys and written[0].backend == "file"
    assert written[0].parent_key is None and written[0].page_size == PS
    # drop device and host: a new request prefetches from storage into host, reported as host
    stack.cache.evict(EvictParams(num_tokens=10**6))
    stack.cache.evict_host(10**6)
    seen.clear()
    out = await serve_request(stack, a + [1, 2, 3, 4], rid="b")
    assert out.verify_failures == 0
    assert {k for c in of(seen, ChangeKind.STORED, Tier.HOST) for k in c.keys} == set(keys)
    await stack.aclose()


async def _pool_with(keys: list[str]) -> ArrayHostPool:
    pool = ArrayHostPool(len(keys), PAGE)
    pool.fill_random(1)
    return pool


async def test_file_evictions_and_corrupt_pages_are_reported(tmp_path: Path) -> None:
    keys = keys_for(12, salt=3)
    pool = await _pool_with(keys)
    store = create_async_storage("file", None, root=str(tmp_path / "a"), namespace=NS_A, max_bytes=None)
    store.register_mem_pool_host(pool)
    seen = record(store.tier_changes)
    async with store:
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        assert [k for c in of(seen, ChangeKind.STORED, Tier.STORAGE) for k in c.keys] == keys
        # a page that fails verification is deleted and reported removed
        with open(store.layout.path(page_id(keys[0], "kv")), "r+b") as f:
            f.seek(-40, os.SEEK_END)
            f.write(b"\xff" * 4)
        assert await store.batch_get_v1(keys[:1], pool.indices(0, 1)) == [False]
        gone = of(seen, ChangeKind.REMOVED, Tier.STORAGE)
        assert [(c.keys, c.reason) for c in gone] == [((keys[0],), "corrupt")]
        # clear() reports the storage tier cleared, naming the pages it dropped (once its
        # opening scan indexed the folder)
        await store.wait_background()
        seen.clear()
        assert await store.clear()
        assert [(c.kind, c.tier, c.origin, c.keys_complete, sorted(c.keys)) for c in seen] == [
            (ChangeKind.CLEARED, Tier.STORAGE, "local", True, sorted(keys[1:]))]
        # a page whose header cannot be read cannot be named: the clear says "any page"
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        with open(store.layout.path(page_id(keys[3], "kv")), "r+b") as f:
            f.write(b"\0" * 16)
        seen.clear()
        assert await store.clear()
        assert [(c.kind, c.keys, c.keys_complete) for c in seen] == [(ChangeKind.CLEARED, (), False)]
    # a bounded store evicts to make room: the victims are reported by key
    page = store.layout.file_size(keys[0], "kv", pool.page_nbytes)
    small = create_async_storage("file", None, root=str(tmp_path / "b"), namespace=NS_A, max_bytes=4 * page)
    small.register_mem_pool_host(pool)
    seen = record(small.tier_changes)
    async with small:
        for i in range(len(keys)):
            assert await small.batch_set_v1(keys[i : i + 1], pool.indices(i, 1)) == [True]
        gone = of(seen, ChangeKind.REMOVED, Tier.STORAGE)
        removed = [k for c in gone for k in c.keys]
        assert sorted(removed) == sorted(keys[:-4])  # least recently used first
        assert all(c.reason == "evicted" and c.origin == "local" for c in gone)
        assert await small.exists_pages(removed) == [False] * len(removed)


async def test_memory_evictions_are_reported() -> None:
    keys = keys_for(6, salt=4)
    pool = await _pool_with(keys)
    store = create_async_storage("memory", None, namespace=NS_A, max_bytes=3 * pool.page_nbytes)
    store.register_mem_pool_host(pool)
    seen = record(store.tier_changes)
    async with store:
        for i in range(len(keys)):
            await store.batch_set_v1(keys[i : i + 1], pool.indices(i, 1))
    removed = [k for c in of(seen, ChangeKind.REMOVED, Tier.STORAGE) for k in c.keys]
    assert removed == keys[:3]



async def test_a_page_another_big_batch_evicts_meanwhile_is_never_left_stored() -> None:
    """Batches of big pages (1 MiB and more: every real model's) are copied on threads. A batch
    evicting a page that a concurrent batch had just put reported the removal from its thread,
    before the other batch reported the page stored on the loop: a subscriber (a router) saw
    REMOVED then STORED and held the page in storage for good. Half of the runs did."""
    from hicache.storage.types import PageKey

    for run in range(20):
        a, b = keys_for(1, salt=100 + run), keys_for(2, salt=500 + run)
        pool = ArrayHostPool(3, PAGE, token_elems=1 << 17)  # 1 MiB pages: written on threads
        store = create_async_storage("memory", None, namespace=NS_A, max_bytes=2 * pool.page_nbytes)
        store.register_mem_pool_host(pool)
        view: set[str] = set()

        def apply(change: TierChange, view: set[str] = view) -> None:
            if change.kind is ChangeKind.STORED:
                view.update(change.keys)
            else:
                view.difference_update(change.keys)

        store.tier_changes.subscribe(apply)
        async with store:
            await asyncio.gather(store.batch_set_v1(a, pool.indices(0, 1)), store.batch_set_v1(b, pool.indices(1, 2)))
            held = {k for k in a + b if store.medium.has(store._entry(PageKey(k, "kv")))}
        assert view == held, f"run {run}: subscribers hold {len(view - held)} evicted page(s) as stored"

def test_a_subscriber_that_raises_never_breaks_a_tier() -> None:
    stack = stack_for()

    def bad(change: TierChange) -> None:
        raise RuntimeError("consumer bug")

    stack.tier_changes.subscribe(bad)

    async def go() -> None:
        out = await serve_request(stack, toks(0, 8), rid="a")
        assert out.verify_failures == 0
        await stack.cache.drain()
        await stack.aclose()

    asyncio.run(go())
    assert stack.tier_changes.subscriber_errors >= 2


async def test_events_take_events_drops_are_counted_in_the_caches_metrics(caplog) -> None:
    """An engine polling take_events too rarely lost the oldest events silently: only the log
    object counted them. They are the cache's ``take_events_dropped`` metric now, with one
    warning."""
    stack = stack_for()
    cache = stack.cache
    cache._event_log._maxlen = 1
    assert cache.take_events() == []  # starts the log
    await serve_request(stack, toks(0, 8), rid="a")
    await cache.drain()
    assert len(cache.take_events()) == 1
    assert stack.controller.metrics.counters["take_events_dropped"] == 1
    assert any("take_events" in r.getMessage() for r in caplog.records)
    await stack.aclose()


async def test_take_events_honours_the_config_files_hash_format_and_tiers(tmp_path: Path) -> None:
    """The ``[events]`` section's ``hash_format`` and ``tiers`` shaped what the publisher sent,
    while ``take_events()`` (what an engine that polls publishes itself) ignored both: it gave
    32-byte hashes to a router configured for 64-bit ints, and every tier's events to one
    configured for some. Both are honoured now, for a cache built from a config file."""
    from hicache.events.convert import block_hash
    from hicache.facade import HiCache

    path = tmp_path / "hicache.toml"
    path.write_text(
        '[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 8\nkv_dtype = "float32"\n'
        '[device]\ndevice = "cpu"\nsize_tokens = 64\npage_size = 4\nmax_context_len = 256\n'
        '[host]\nratio = 2.0\n'
        '[storage]\nbackend = ""\n'
        '[events]\nhash_format = "int"\ntiers = ["host"]\n'
    )
    async with HiCache.from_config(str(path)) as cache:
        assert cache.cache is not None
        assert cache.cache.take_events() == []  # starts the log
        tokens = toks(0, 8)
        h = await cache.begin("a", tokens)
        await cache.commit(h)
        await cache.drain()
        events = cache.cache.take_events()
    assert events, "no event for the host tier"
    assert {e.medium for e in events} == {"CPU"}
    assert [h for e in events for h in e.block_hashes] == [block_hash(k, "int") for k in page_hashes(tokens, PS)]


async def test_a_reset_during_a_backup_names_only_the_host_pages_announced() -> None:
    """A reset lists the pages host dropped; a page whose device->host copy was still running
    was never announced stored on host (that comes when the copy lands, and the reset discards
    it), so naming it made routers see a CPU removal of a block never stored there."""
    stack = stack_for()
    seen = record(stack.tier_changes)
    await serve_request(stack, toks(0, 16), rid="a")
    await asyncio.sleep(0)  # the write-through backup starts; it has not landed
    assert any(n.backup_op is not None for n in stack.cache._nodes())
    stack.cache.reset()
    announced = {k for c in of(seen, ChangeKind.STORED, Tier.HOST) for k in c.keys}
    (host,) = of(seen, ChangeKind.CLEARED, Tier.HOST)
    (device,) = of(seen, ChangeKind.CLEARED, Tier.DEVICE)
    assert host.keys_complete and set(host.keys) <= announced, (host.keys, announced)
    assert device.keys == tuple(page_hashes(toks(0, 16), PS))
    await stack.cache.drain()
    assert not of(seen, ChangeKind.STORED, Tier.HOST)  # the copy of the dropped tree is not announced
    await stack.aclose()



def count_like_a_router(hub) -> Counter[str]:  # type: ignore[no-untyped-def]
    """A router that reference-counts a replica's storage blocks, as vLLM's contract lets it
    (``BlockStored`` up, ``BlockRemoved`` down, ``AllBlocksCleared`` forgets them all)."""
    counts: Counter[str] = Counter()

    def apply(change: TierChange) -> None:
        if change.tier is not Tier.STORAGE:
            return
        if change.kind is ChangeKind.CLEARED:
            counts.clear()
            return
        counts.update({k: 1 if change.kind is ChangeKind.STORED else -1 for k in change.keys})

    hub.subscribe(apply)
    return counts


@pytest.mark.parametrize("backend, token_elems, chained", [
    ("memory", 8, True), ("memory", 8, False), ("memory", 1 << 17, True), ("memory", 1 << 17, False),
    ("file", 8, True), ("file", 8, False), ("file-rewrite", 8, True),
])
async def test_a_page_written_again_is_announced_stored_once(tmp_path: Path, backend: str, token_elems: int,
                                                              chained: bool) -> None:
    """Writing pages the store already holds (a cache reset, then the same prompt served
    again) announced each again: a router counting BlockStored against BlockRemoved then held
    a page stored after its one removal. A page held before the write is not announced again
    (1 MiB pages: the memory store writes them on a thread; ``file-rewrite``: no skip_existing)."""
    keys = keys_for(6, salt=31)
    pool = ArrayHostPool(len(keys), PAGE, token_elems=token_elems)
    pool.fill_random(5)
    opts: dict = {"max_bytes": None}
    if backend != "memory":
        opts.update(root=str(tmp_path), skip_existing=backend == "file")
    store = create_async_storage(backend.split("-")[0], None, namespace=NS_A, **opts)
    store.register_mem_pool_host(pool)
    counts = count_like_a_router(store.tier_changes)
    async with store:
        for _ in range(3):
            if chained:  # one chained batch
                assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
            else:  # a page a call, no parent
                for i in range(len(keys)):
                    assert await store.batch_set_v1(keys[i:i + 1], pool.indices(i, 1)) == [True]
        assert counts == Counter(dict.fromkeys(keys, 1))
        assert await store.batch_delete(keys[-2:]) == [True, True]
        assert +counts == Counter(dict.fromkeys(keys[:-2], 1))  # gone for the router too
        # written again once gone: announced again
        assert await store.batch_set_v1(keys[-2:], pool.indices(len(keys) - 2, 2)) == [True, True]
        assert counts == Counter(dict.fromkeys(keys, 1))


async def test_two_writes_racing_with_the_same_new_pages_announce_each_once() -> None:
    """Batches of big pages are copied on threads, so two callers writing the same new pages
    (two requests sharing a prefix) run at once: which one finds a page new is decided as each
    page is put, under the medium's lock, so exactly one announces it."""
    for run in range(10):
        keys = keys_for(3, salt=700 + run)
        pool = ArrayHostPool(3, PAGE, token_elems=1 << 17)  # 1 MiB pages: written on threads
        store = create_async_storage("memory", None, namespace=NS_A)
        store.register_mem_pool_host(pool)
        counts = count_like_a_router(store.tier_changes)
        async with store:
            await asyncio.gather(*(store.batch_set_v1(keys, pool.indices(0, 3)) for _ in range(3)))
        assert counts == Counter(dict.fromkeys(keys, 1)), f"run {run}"


@pytest.mark.parametrize("backend, token_elems", [("memory", 8), ("memory", 1 << 17), ("file", 8)])
async def test_a_new_page_named_twice_in_one_write_is_announced_once(tmp_path: Path, backend: str,
                                                                     token_elems: int) -> None:
    """A write naming a new page twice (the second put finds the batch's own copy) announced
    it not at all, so its one eviction took a router's count below zero."""
    keys = keys_for(2, salt=913)
    pool = ArrayHostPool(4, PAGE, token_elems=token_elems)
    pool.fill_random(5)
    opts: dict = {"max_bytes": None}
    if backend != "memory":
        opts.update(root=str(tmp_path), skip_existing=True)
    store = create_async_storage(backend, None, namespace=NS_A, **opts)
    store.register_mem_pool_host(pool)
    counts = count_like_a_router(store.tier_changes)
    async with store:
        batch = [keys[0], keys[1], keys[0]]
        assert await store.batch_set_v1(batch, pool.indices(0, 3)) == [True] * 3
        assert counts[keys[0]] == 1, counts
        assert await store.batch_delete([keys[0]]) == [True]
        assert counts[keys[0]] == 0, counts


async def test_a_clear_whose_page_headers_fail_to_read_still_clears_and_reports(tmp_path: Path, monkeypatch) -> None:
    """A file store's clear names the pages it dropped from their headers in the folder set
    aside. An I/O error there (EIO on a failing disk, a cancelled clear) came after the rename:
    the clear answered failed though the namespace was gone, reported no clear at all (a router
    kept believing every page held), and never removed the folder set aside (its bytes held on
    disk, off the count). It is a clear of any page instead, finished as any other."""
    from hicache_backends.file import io as file_io

    keys = keys_for(6, salt=41)
    pool = await _pool_with(keys)
    store = create_async_storage("file", None, root=str(tmp_path / "a"), namespace=NS_A, max_bytes=None)
    store.register_mem_pool_host(pool)
    seen = record(store.tier_changes)
    async with store:
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        await store.wait_background()

        def failing_disk(*args: object) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(file_io, "cleared_identities", failing_disk)
        seen.clear()
        assert await store.clear()
        assert [(c.kind, c.keys, c.keys_complete) for c in seen] == [(ChangeKind.CLEARED, (), False)]
        await store.wait_background()
        assert not [n for n in os.listdir(store.layout.root) if n.startswith(".trash-")]  # the folder set aside went
        assert await store.batch_exists(keys) == 0
