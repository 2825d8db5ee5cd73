"""Seeded random interleavings of the whole request path on tiny pools.

Four concurrent clients begin, extend, commit (whole or as a chunk), abort and release sessions,
sometimes cancel a begin mid-await, reuse request ids, and share prefixes, while host->device
copies are slowed down and sometimes fail, and the storage backend is slow, times out, raises
and loses pages. Every prefix a request is handed is checked against a full recompute; after
the run every pool is back to its initial free size (what the tree holds aside), no lock is
left, and every device page the tree holds has the right KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import traceback
import uuid

import pytest
import torch
from hicache_backends.memory import MemoryStorage

import hicache.facade as facade_mod
import hicache.stack as stack_mod
from hicache.testing import inject_load_faults
from hicache.errors import CacheClosedError, HiCacheError, OutOfKVSlotsError
from hicache.facade import HiCache
from hicache.replay.synthetic import verify_kv, write_synthetic_kv

PS = 4


class ChaosStorage(MemoryStorage):
    """The memory backend, slow, sometimes past the I/O timeout, raising or missing pages."""

    backend_name = "chaos-memory"

    def __init__(self, *args, rnd: random.Random, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.rnd = rnd

    async def _chaos(self) -> None:
        r = self.rnd.random()
        if r < 0.03:
            await asyncio.sleep(0.15)  # past the I/O timeout below
        elif r < 0.3:
            await asyncio.sleep(0.001)
        if r > 0.97:
            raise OSError("chaos")

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        await self._chaos()
        return await super()._exists(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        await self._chaos()
        ok = await super()._read(pages, buffers)
        return [x and self.rnd.random() > 0.1 for x in ok]

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        await self._chaos()
        if self.rnd.random() < 0.1:
            return [False] * len(pages)
        return await super()._write(pages, buffers, parents)


def config(seed: int) -> dict:
    rnd = random.Random(seed)
    return {
        "model": {"name": "interleave", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
        "device": {"device": "cpu", "size_tokens": 24 * PS, "page_size": PS, "max_requests": 6,
                   "max_context_len": 256},
        "host": {"ratio": 2.0},
        "storage": {"backend": "memory", "options": {"store_id": f"interleave-{uuid.uuid4().hex}"}},
        "cache": {
            "prefetch": {"policy": rnd.choice(["best_effort", "wait_complete", "timeout"]),
                         "threshold_tokens": 0, "timeout_base_s": 0.05},
            "write_policy": rnd.choice(["write_through", "write_back", "write_through_selective"]),
        },
        "session": {"reap_interval_s": None},
    }


async def scenario(seed: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    rnd = random.Random(seed)
    chaos_rnd = random.Random(seed + 1)
    build = stack_mod.build_stack

    def build_chaotic(cfg, storage=None):  # type: ignore[no-untyped-def]
        probe = build(dataclasses.replace(cfg, storage_backend=None))
        store = ChaosStorage(namespace=stack_mod.storage_namespace(probe.host_pool),
                             store_id=uuid.uuid4().hex, rnd=chaos_rnd)
        return build(cfg, storage=store)

    monkeypatch.setattr(facade_mod, "build_stack", build_chaotic)
    cache = HiCache.from_config(config(seed))
    ctrl = cache._stack_config.controller
    ctrl.storage_io_timeout_s, ctrl.cancelled_io_grace_s, ctrl.storage_retry_base_s = 0.1, 0.02, 0.001
    await cache.start()
    stack = cache._stack
    fail_rnd = random.Random(seed * 7)
    inject_load_faults(stack.copy_engine, delay=0.002, fail=lambda: fail_rnd.random() < 0.1)
    problems: list[str] = []
    bases = [[1000 * b + i for i in range(40)] for b in range(4)]
    history: dict[str, list[int]] = {}

    async def client(w: int) -> None:
        for step in range(10):
            sid = rnd.choice([None, None, f"s{w}", f"s{(w + 1) % 4}"])
            if sid is not None and sid in history and rnd.random() < 0.8:
                tokens = history[sid] + [rnd.randrange(50_000, 60_000) for _ in range(rnd.randrange(1, 9))]
            else:
                tokens = rnd.choice(bases)[: rnd.randrange(4, 40)] + [
                    rnd.randrange(60_000, 70_000) for _ in range(rnd.randrange(1, 12))]
            rid = rnd.choice([f"r{w}-{step}", "same"])
            task = asyncio.ensure_future(cache.begin(rid, tokens, session_id=sid))
            if rnd.random() < 0.15:
                await asyncio.sleep(rnd.choice([0, 0.001, 0.003]))
                task.cancel()
            try:
                h = await task
            except (OutOfKVSlotsError, asyncio.CancelledError):
                continue
            failed = False
            for layer in range(2):
                try:
                    await h.wait_layer(layer)
                except Exception:  # noqa: BLE001 - an injected load failure
                    failed = True
            if failed:
                await cache.abort(h)
                continue
            t = torch.tensor(h.token_ids)
            if verify_kv(cache.device_pool, h.kv_indices[: h.prefix_len], t[: h.prefix_len]):
                problems.append(f"{rid}: prefix KV differs from a recompute ({h.hits})")
            write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], t[h.prefix_len :])
            await asyncio.sleep(0)
            try:
                r = rnd.random()
                if r < 0.15:
                    await cache.abort(h)
                    continue
                if r < 0.3:
                    await cache.commit(h, finished=False)
                    p = h.req.prefix_indices
                    if verify_kv(cache.device_pool, p, t[: p.numel()]):
                        problems.append(f"{rid}: prefix after a chunk differs from a recompute")
                for _ in range(rnd.randrange(0, 4)):
                    tok = rnd.randrange(70_000, 80_000)
                    try:
                        new = await cache.extend(h, [tok])
                    except OutOfKVSlotsError:
                        break
                    write_synthetic_kv(cache.device_pool, new, torch.tensor([tok]))
                await cache.commit(h, finished=True)
            except CacheClosedError:
                raise
            except HiCacheError:
                continue  # a shared prefix load failed: the request was aborted
            if sid is not None:
                history[sid] = list(h.token_ids)
                if rnd.random() < 0.2:
                    await cache.release_session(sid)
                    history.pop(sid, None)

    await asyncio.gather(*(client(w) for w in range(4)))
    for sid in list(cache.cache.slots):
        await cache.release_session(sid)
    await cache.drain()
    await stack.controller.wait_prefetches()
    inner = cache.cache.inner
    inner.sanity_check()
    if inner.protected_size():
        problems.append(f"{inner.protected_size()} tokens still locked")
    tree = inner.all_device_indices()
    if tree.numel() and not stack.allocator.is_allocated(tree):
        problems.append("the tree holds device slots the allocator thinks are free")
    if stack.allocator.available_size() + tree.numel() != stack.allocator.size:
        problems.append("device slots leaked")
    if stack.host_pool.available_size() + inner.host_size() != stack.host_pool.size:
        problems.append("host slots leaked")
    if stack.req_to_token_pool.available_size() != stack.req_to_token_pool.size:
        problems.append("request slots leaked")
    if cache._live or cache._rids:
        problems.append("handles outlived their requests")

    def check(node) -> None:  # type: ignore[no-untyped-def]
        for child in node.children.values():
            if child.value is not None and verify_kv(cache.device_pool, child.value, torch.tensor(child.key)):
                problems.append("the tree serves wrong KV")
            check(child)

    check(inner.root_node)
    await asyncio.wait_for(cache.aclose(), 10)
    return problems


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_random_interleavings_leak_nothing_and_serve_exact_kv(seed: int, monkeypatch) -> None:
    assert await asyncio.wait_for(scenario(seed, monkeypatch), 60) == []


@pytest.mark.parametrize("seed", [0, 1])
async def test_close_in_the_middle_of_random_traffic(seed: int) -> None:
    cache = await HiCache.from_config(config(seed)).start()
    rnd = random.Random(seed)

    async def client(w: int) -> None:
        for step in range(20):
            tokens = [w * 1000 + i for i in range(rnd.randrange(4, 40))]
            try:
                h = await cache.begin(f"c{w}-{step}", tokens, session_id=rnd.choice([None, f"s{w}"]))
                write_synthetic_kv(cache.device_pool, h.kv_indices, torch.tensor(h.token_ids))
                await asyncio.sleep(0)
                await cache.commit(h)
            except OutOfKVSlotsError:
                continue
            except CacheClosedError:
                return

    clients = [asyncio.ensure_future(client(w)) for w in range(4)]
    await asyncio.sleep(0.01 + rnd.random() * 0.03)
    await asyncio.wait_for(cache.aclose(), 10)
    results = await asyncio.gather(*clients, return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    assert not bad, "".join(traceback.format_exception(bad[0]))
    assert not cache._live
    assert cache._stack.controller.state.value == "closed"
    with pytest.raises(CacheClosedError):
        await cache.begin("late", [1, 2, 3])
