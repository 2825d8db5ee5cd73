"""Per-request attribution: every miss reason produced by a scenario that really causes it.

Real parts throughout: the file backend in a tmp dir (pages corrupted and deleted on disk),
real tensors, the real tree, controller and prefetcher; faults come from a file store whose
calls can be switched to raise or hang. Every attribution's tokens add up to the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from hicache_backends.file import FileStorage

from hicache.controller import ControllerConfig
from hicache.keys import Namespace
from hicache.observability.attribution import MissReason, RequestAttribution
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage import PageKey

PS = 4
N = 10 * PS + 2  # ten full pages and a partial one


def prompt(i: int, n: int = N) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


class SwitchFileStorage(FileStorage):
    """The file backend with a switch: ``mode`` ``"ok"``, ``"raise"`` (reads and exists raise,
    as a broken mount would) or ``"hang"`` (they wait while it stays so)."""

    backend_name = "switch-file"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.mode = "ok"

    async def _gate(self) -> None:
        while self.mode == "hang":
            await asyncio.sleep(0.005)
        if self.mode == "raise":
            raise OSError("injected: the mount is gone")

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        await self._gate()
        return await super()._exists(pages)

    async def _exists_prefix(self, pages: Sequence[PageKey]) -> int:
        await self._gate()
        return await super()._exists_prefix(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        await self._gate()
        return await super()._read(pages, buffers)


def controller(**over: object) -> ControllerConfig:
    base: dict[str, object] = dict(
        prefetch_threshold=PS, prefetch_policy="wait_complete", storage_io_timeout_s=5.0,
        storage_stall_s=5.0, storage_probe_base_s=30.0, storage_probe_max_s=30.0,
        storage_retry_base_s=0.001, cancelled_io_grace_s=0.0, close_timeout_s=2.0,
    )
    base.update(over)
    return ControllerConfig(**base)  # type: ignore[arg-type]


def namespace(model: str = "test/attr") -> Namespace:
    return Namespace(model=model, kv_dtype="float32", layout="flat", page_size=PS, num_layers=1,
                     num_kv_heads=1, head_dim=2)


@contextlib.asynccontextmanager
async def stack_on(root: Path | None, *, model: str = "test/attr", store_cls: type = FileStorage,
                   explain: bool = False, **ctl: object) -> AsyncIterator[tuple[object, object]]:
    """A stack over a file store at ``root`` (``None``: no storage); closes both."""
    store = store_cls(None, root=str(root), namespace=namespace(model)) if root is not None else None
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend=None,
                      controller=controller(**ctl), explain_misses=explain)
    stack = build_stack(cfg, storage=store)
    if store is not None:
        await stack.controller.open_storage()
    try:
        yield stack, store
    finally:
        if store is not None:
            store.mode = "ok" if hasattr(store, "mode") else None
        await stack.aclose()
        if store is not None:
            await store.aclose()


def check(a: RequestAttribution | None, tokens: int) -> RequestAttribution:
    assert a is not None
    assert a.prompt_tokens == tokens
    assert a.hit_tokens + a.miss_tokens == tokens, a
    assert all(v > 0 for v in a.misses.values()), a
    assert set(a.misses) <= {r.value for r in MissReason}, a
    return a


async def serve(stack, tokens: list[int], rid: str) -> RequestAttribution:  # type: ignore[no-untyped-def]
    out = await serve_request(stack, tokens, rid=rid)
    return check(out.attribution, len(tokens))


def drop_device_and_host(stack) -> None:  # type: ignore[no-untyped-def]
    """Evict everything unlocked from device, then from host (the tree's own evictions)."""
    stack.cache.evict(stack.allocator.size)
    stack.cache.evict_host(stack.host_pool.size)


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.page"))


async def test_first_request_never_stored_then_device_hit() -> None:
    async with stack_on(None) as (stack, _):
        a = await serve(stack, prompt(1), "a")
        assert a.hits == {"device": 0, "host": 0, "storage": 0}
        assert a.misses == {"never_stored": 10 * PS, "partial_page": 2}
        b = await serve(stack, prompt(1), "b")
        assert b.hits["device"] == 10 * PS
        assert b.misses == {"partial_page": 2}


async def test_evicted_from_host_without_storage() -> None:
    async with stack_on(None) as (stack, _):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        a = await serve(stack, prompt(1), "b")
        assert a.misses == {"evicted_host": 10 * PS, "partial_page": 2}


async def test_evicted_from_device_when_no_host_copy_was_made() -> None:
    # selective write-through: a page is copied to host only after its second hit
    async with stack_on(None, write_policy="write_through_selective", write_through_threshold=3) as (stack, _):
        await serve(stack, prompt(1), "a")
        stack.cache.evict(stack.allocator.size)
        a = await serve(stack, prompt(1), "b")
        assert a.misses == {"evicted_device": 10 * PS, "partial_page": 2}


async def test_storage_hit_then_evicted_from_storage_by_another_process(tmp_path: Path) -> None:
    async with stack_on(tmp_path) as (stack, _):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        a = await serve(stack, prompt(1), "b")
        assert a.hits["storage"] == 10 * PS, a
        await stack.cache.drain()
        drop_device_and_host(stack)
        for f in page_files(tmp_path)[:]:
            f.unlink()  # another process evicted every page
        b = await serve(stack, prompt(1), "c")
        assert b.misses == {"evicted_storage": 10 * PS, "partial_page": 2}, b


async def test_corrupt_page_on_disk_is_a_verification_failure(tmp_path: Path) -> None:
    async with stack_on(tmp_path) as (stack, store):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        files = page_files(tmp_path)
        assert len(files) == 10
        for f in files:  # damage every page's payload in place
            data = bytearray(f.read_bytes())
            data[-40] ^= 0xFF
            f.write_bytes(bytes(data))
        a = await serve(stack, prompt(1), "b")
        assert a.misses.get("verification_failed", 0) >= PS, a
        assert set(a.misses) <= {"verification_failed", "partial_page"}, a
        assert store.stats.get("corrupt_pages") >= 1


async def test_other_model_on_the_same_store_is_a_namespace_mismatch(tmp_path: Path) -> None:
    async with stack_on(tmp_path, model="model/a") as (stack, _):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
    async with stack_on(tmp_path, model="model/b", explain=True) as (other, store):
        out = await serve_request(other, prompt(1), rid="b")
        a = check(out.attribution, N)
        assert a.probe_key is not None  # a flow caller that is not the facade explains it
        a = await other.attributor.explain(a, store)
        assert a.misses == {"namespace_mismatch": 10 * PS, "partial_page": 2}, a
        # without explain mode, the same miss is "never stored" here (no storage call made)
    async with stack_on(tmp_path, model="model/c") as (third, _):
        c = await serve(third, prompt(1), "c")
        assert c.misses == {"never_stored": 10 * PS, "partial_page": 2}, c


async def test_backend_error_then_storage_down(tmp_path: Path) -> None:
    async with stack_on(tmp_path, store_cls=SwitchFileStorage, storage_health_errors=2) as (stack, store):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        store.mode = "raise"
        a = await serve(stack, prompt(1), "b")
        assert a.misses == {"backend_error": 10 * PS, "partial_page": 2}, a
        await serve(stack, prompt(2), "c")  # a second failing call marks the store down
        await stack.cache.drain()
        drop_device_and_host(stack)
        assert not stack.controller.health.up
        b = await serve(stack, prompt(1), "d")
        assert b.misses == {"storage_down": 10 * PS, "partial_page": 2}, b


async def test_prefetch_cut_by_its_timeout(tmp_path: Path) -> None:
    async with stack_on(tmp_path, store_cls=SwitchFileStorage, prefetch_policy="timeout",
                        prefetch_timeout_base_s=0.05, prefetch_timeout_per_ki_token_s=0.0,
                        storage_stall_s=5.0, storage_io_timeout_s=10.0) as (stack, store):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        store.mode = "hang"
        a = await serve(stack, prompt(1), "b")
        store.mode = "ok"
        assert a.misses == {"prefetch_timeout": 10 * PS, "partial_page": 2}, a


async def test_host_hit_not_loaded_is_load_skipped(tmp_path: Path) -> None:
    async with stack_on(None) as (stack, _):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        stack.cache.evict(stack.allocator.size)  # demoted: the pages stay on host
        out = await serve_request(stack, prompt(1), rid="b", mem_quota=PS)
        a = check(out.attribution, N)
        assert a.misses == {"load_skipped": 10 * PS, "partial_page": 2}, a


async def test_partly_evicted_prefix_mixes_tiers_and_reasons(tmp_path: Path) -> None:
    async with stack_on(None) as (stack, _):
        await serve(stack, prompt(1, 4 * PS), "a")  # the first four pages
        await serve(stack, prompt(1), "b")  # the rest hangs below them
        await stack.cache.drain()
        drop_device_and_host(stack)
        await serve(stack, prompt(1, 4 * PS), "c")  # the first four come back on device
        a = await serve(stack, prompt(1) + [7] * PS, "d")
        assert a.hits["device"] == 4 * PS
        assert a.misses == {"evicted_host": 6 * PS, "never_stored": PS, "partial_page": 2}, a


async def test_counters_and_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    async with stack_on(None) as (stack, _):
        label = stack.controller.metrics.label  # the cache's own series: no other cache's counts
        with caplog.at_level(logging.DEBUG, logger="hicache.attribution"):
            await serve(stack, prompt(3), "a")
            await serve(stack, prompt(3), "b")
        assert value("hicache_request_miss_tokens_total", cache=label, reason="never_stored") == 10 * PS
        assert value("hicache_request_hit_tokens_total", cache=label, tier="device") == 10 * PS
    # closed: its series left the scrape
    assert value("hicache_request_hit_tokens_total", cache=label, tier="device") == 0.0
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache.attribution"]
    assert any("request 'a': 42 tokens: hit device=0 host=0 storage=0; missed never_stored=40 partial_page=2" in m
               for m in lines), lines


async def test_every_tier_and_reason_is_a_zero_counter_before_the_first_request() -> None:
    """Series were created at their first count, already at that count: Prometheus'
    ``rate``/``increase`` take a series' first sample as its start, so the first (or a lone)
    ``backend_error`` or ``verification_failed`` miss never showed on a dashboard or an
    alert. Each tier and reason is published as zero from the start."""
    from prometheus_client import REGISTRY

    async with stack_on(None) as (stack, _):
        label = stack.controller.metrics.label
        for tier in ("device", "host", "storage"):
            assert REGISTRY.get_sample_value("hicache_request_hit_tokens_total", {"cache": label, "tier": tier}) == 0
        for reason in MissReason:
            assert REGISTRY.get_sample_value("hicache_request_miss_tokens_total",
                                             {"cache": label, "reason": reason.value}) == 0, reason


# ---------------------------------------------------------------------- through the facade


def facade_config(root: Path, model: str, **cache: object) -> dict:
    return {
        "model": {"name": model, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 64 * 16, "page_size": 16, "max_requests": 8,
                   "max_context_len": 2048},
        "host": {"ratio": 4.0},
        "storage": {"backend": "file", "options": {"root": str(root)}},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}, **cache},
        "session": {"reap_interval_s": None},
    }


async def facade_run(cache, rid: str, tokens: list[int], session_id: str | None = None):  # type: ignore[no-untyped-def]
    import torch

    from hicache.replay.synthetic import write_synthetic_kv

    h = await cache.begin(rid, tokens, session_id=session_id)
    for layer in range(cache.device_pool.layer_num):
        await h.wait_layer(layer)
    write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], torch.tensor(tokens)[h.prefix_len :])
    await cache.commit(h, finished=True)
    check(h.attribution, len(tokens))
    return h


async def test_facade_handle_carries_it_and_explains_a_namespace_mismatch(tmp_path: Path) -> None:
    from hicache.facade import HiCache

    tokens = prompt(5, 100)
    async with HiCache.from_config(facade_config(tmp_path, "model/a")) as a:
        h = await facade_run(a, "r1", tokens)
        assert h.attribution.misses == {"never_stored": 96, "partial_page": 4}
        h = await facade_run(a, "r2", tokens)
        assert h.attribution.hits == {"device": 96, "host": 0, "storage": 0} == h.hits
        await a.drain()
    async with HiCache.from_config(facade_config(tmp_path, "model/b", explain_misses=True)) as b:
        h = await facade_run(b, "r3", tokens)
        assert h.attribution.misses == {"namespace_mismatch": 96, "partial_page": 4}, h.attribution
        assert h.attribution.probe_key is None
    async with HiCache.from_config(facade_config(tmp_path, "model/a")) as again:  # same model, restarted
        h = await facade_run(again, "r4", tokens)
        assert h.attribution.hits["storage"] == 96, h.attribution


async def test_session_turn_restored_from_its_slot(tmp_path: Path) -> None:
    from hicache.facade import HiCache

    async with HiCache.from_config(facade_config(tmp_path, "model/s")) as cache:
        first = prompt(6, 40)
        await facade_run(cache, "t1", first, session_id="chat")
        h = await facade_run(cache, "t2", first + [1, 2, 3] * 8, session_id="chat")
        a = h.attribution
        assert a.hits["device"] == h.prefix_len > 0, a
        assert a.misses == {"never_stored": 64 - h.prefix_len}, a


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_evictions_always_add_up(tmp_path: Path, seed: int) -> None:
    """Shared prefixes, random evictions on every tier and damaged pages: every request's hits
    and misses add up to its prompt, and a page this process saw is never "unknown"."""
    import random

    rnd = random.Random(seed)
    base = prompt(9, 6 * PS)
    prompts = [base + prompt(20 + i, rnd.randrange(1, 6) * PS + rnd.randrange(PS)) for i in range(4)]
    async with stack_on(tmp_path) as (stack, _):
        for step in range(20):
            tokens = rnd.choice(prompts)
            a = await serve(stack, tokens, f"r{step}")
            assert "unknown" not in a.misses, a
            await stack.cache.drain()
            action = rnd.randrange(5)
            if action == 0:
                stack.cache.evict(stack.allocator.size)
            elif action == 1:
                drop_device_and_host(stack)
            elif action == 2:
                files = page_files(tmp_path)
                for f in rnd.sample(files, min(len(files), 3)):
                    f.unlink()
            elif action == 3:
                files = page_files(tmp_path)
                if files:
                    f = rnd.choice(files)
                    data = bytearray(f.read_bytes())
                    data[-40] ^= 0x55
                    f.write_bytes(bytes(data))


async def test_stored_but_below_the_prefetch_threshold_is_prefetch_skipped(tmp_path: Path) -> None:
    async with stack_on(tmp_path, prefetch_threshold=1000 * PS) as (stack, _):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        a = await serve(stack, prompt(1), "b")
        assert a.misses == {"prefetch_skipped": 10 * PS, "partial_page": 2}, a


async def test_a_record_the_ledger_forgot_is_unknown() -> None:
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend=None,
                      controller=controller(), attribution_ledger_pages=3)
    stack = build_stack(cfg)
    try:
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)  # ten pages leave host: the ledger keeps the last three
        a = await serve(stack, prompt(1), "b")
        assert a.misses.get("unknown", 0) >= 7 * PS - 2 * PS, a  # bitmap collisions aside
        assert a.misses.get("evicted_host", 0) + a.misses.get("unknown", 0) == 10 * PS, a
        fresh = await serve(stack, prompt(2), "c")
        assert fresh.misses == {"never_stored": 10 * PS, "partial_page": 2}, fresh
    finally:
        await stack.aclose()


async def test_after_a_reset_the_pages_it_dropped_read_evicted_and_new_ones_never_stored() -> None:
    """reset() (SGLang's flush_cache) drops device and host at once. Its CLEARED changes named
    no pages: first the ledger ignored them (a prompt served just before read never_stored
    afterwards), then it made every page with no record unknown, for good: after one flush no
    miss had a reason. The reset now lists the pages each tier held: those read evicted, a
    prompt never served reads never_stored, and recorded losses keep theirs."""
    async with stack_on(None) as (stack, _):
        await serve(stack, prompt(2), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)  # prompt 2: evicted from host, recorded
        await serve(stack, prompt(1), "b")
        assert (await serve(stack, prompt(1), "c")).hits["device"] == 10 * PS
        await stack.cache.drain()
        stack.cache.reset()
        stack.allocator.clear()
        a = await serve(stack, prompt(1), "d")
        assert a.misses == {"evicted_host": 10 * PS, "partial_page": 2}, a  # device and host held it
        b = await serve(stack, prompt(2), "e")
        assert b.misses == {"evicted_host": 10 * PS, "partial_page": 2}, b
        fresh = await serve(stack, prompt(3), "f")
        assert fresh.misses == {"never_stored": 10 * PS, "partial_page": 2}, fresh
        assert not stack.attributor.ledger.tiers_cleared


async def test_the_ledger_size_is_a_config_key() -> None:
    """``cache.attribution_ledger_pages`` reaches the ledger; unset, it follows the tiers."""
    from hicache.config import load_config
    from hicache.stack import stack_config_from

    base = {"device": {"page_size": PS, "size_tokens": 64 * PS}, "storage": {"backend": "memory"}}
    for given in (5000, None):
        data = {**base, "cache": {"attribution_ledger_pages": given}} if given is not None else base
        cfg = stack_config_from(load_config(data, environ={}, check=False))
        assert cfg.attribution_ledger_pages == given
        stack = build_stack(cfg)
        try:
            tiers = cfg.device_pages + cfg.host_pages + (cfg.storage_pages or 0)
            assert stack.attributor is not None
            assert stack.attributor.ledger.capacity == (given or min(1 << 18, max(1 << 14, 2 * tiers)))
        finally:
            await stack.aclose()


async def test_attribution_off() -> None:
    cfg = StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend=None,
                      controller=controller(), attribution=False)
    stack = build_stack(cfg)
    try:
        out = await serve_request(stack, prompt(1), rid="a")
        assert out.attribution is None and stack.attributor is None
    finally:
        await stack.aclose()


async def test_storage_cleared_is_evicted_storage(tmp_path: Path) -> None:
    async with stack_on(tmp_path) as (stack, store):
        await serve(stack, prompt(1), "a")
        await stack.cache.drain()
        drop_device_and_host(stack)
        assert await stack.controller._on_io(store.clear())  # on the loop the store runs on
        a = await serve(stack, prompt(1), "b")
        assert a.misses == {"evicted_storage": 10 * PS, "partial_page": 2}, a
