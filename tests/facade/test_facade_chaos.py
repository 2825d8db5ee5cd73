"""A store that misbehaves at random (raises, hangs a while, answers lists of the wrong length
or of the wrong type, raises a stray ``CancelledError``) under concurrent requests, some of
them cancelled: every prefix a request is handed is exact, no background task dies, the close
drains, and the backend's errors are counted and visible in the scrape."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
import torch
from hicache_backends.memory import MemoryStorage

from hicache.errors import HiCacheError
from hicache.facade import HiCache
from hicache.observability.scrape import Scrape
from hicache.replay.synthetic import verify_kv, write_synthetic_kv
from hicache.storage.registry import register_backend

PS = 16


class ChaosStorage(MemoryStorage):
    """The memory backend; each call misbehaves with probability ``rate`` (seeded)."""

    backend_name = "chaos-memory"

    def __init__(self, storage_config=None, *, store_id: str | None = None, namespace=None,  # type: ignore[no-untyped-def]
                 seed: int = 0, rate: float = 0.15) -> None:
        super().__init__(storage_config, store_id=store_id, namespace=namespace)
        self.rng = random.Random(seed)
        self.rate = rate
        self.faults = 0

    async def _fault(self, n: int) -> object:
        if self.rng.random() >= self.rate:
            return None
        self.faults += 1
        kind = self.rng.choice(["raise", "hang", "length", "type", "cancel"])
        if kind == "raise":
            raise self.rng.choice([OSError("injected"), RuntimeError("injected"), KeyError("injected")])
        if kind == "hang":
            await asyncio.sleep(self.rng.choice([0.01, 0.1, 0.3]))
            return None
        if kind == "cancel":
            raise asyncio.CancelledError()  # a library's stray cancellation, not the caller's
        if kind == "length":
            return [True] * (n + self.rng.choice([-1, 1]))
        return self.rng.choice([None, 7, {"a": 1}, object()])

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        bad = await self._fault(len(pages))
        return bad if bad is not None else await super()._exists(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        bad = await self._fault(len(pages))
        return bad if bad is not None else await super()._read(pages, buffers)

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        bad = await self._fault(len(pages))
        return bad if bad is not None else await super()._write(pages, buffers, parents)


register_backend("chaos-memory", ChaosStorage)


def config(seed: int) -> dict:
    rng = random.Random(seed)
    return {
        "model": {"name": "test/chaos", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 16 * PS, "page_size": PS, "max_requests": 8, "max_context_len": 512},
        "host": {"ratio": 1.0},  # a small host: pages go to the store and come back from it
        "storage": {"backend": "chaos-memory", "options": {"store_id": uuid.uuid4().hex, "seed": seed}},
        "cache": {"prefetch": {"policy": rng.choice(["wait_complete", "best_effort", "timeout"]),
                               "threshold_tokens": 0, "timeout_base_s": 0.2},
                  "write_policy": rng.choice(["write_through", "write_back"])},
        "session": {"reap_interval_s": None},
    }


async def one(cache: HiCache, rng: random.Random, i: int, wrong: list[int]) -> str:
    tokens = [(i % 10) * 1000 + j for j in range(rng.randrange(1, 6) * PS + rng.randrange(PS))]
    try:
        h = await cache.begin(f"r{i}", tokens, session_id=f"s{i % 3}" if rng.random() < 0.3 else None)
    except HiCacheError:
        return "refused"
    try:
        for layer in range(cache.device_pool.layer_num):
            await h.wait_layer(layer)
        t = torch.tensor(h.token_ids)
        if verify_kv(cache.device_pool, h.kv_indices[: h.prefix_len], t[: h.prefix_len]) != 0:
            wrong.append(i)
        write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], t[h.prefix_len :])
        await cache.commit(h)
        return "ok"
    except HiCacheError:
        await cache.abort(h)
        return "aborted"


async def serve(cache: HiCache, rng: random.Random, wrong: list[int]) -> list[object]:
    """30 concurrent requests over 10 prompt families, some cancelled mid-flight."""
    tasks: list[asyncio.Task[str]] = []
    for i in range(30):
        tasks.append(asyncio.ensure_future(one(cache, rng, i, wrong)))
        if rng.random() < 0.25:
            await asyncio.sleep(rng.random() * 0.03)
            if rng.random() < 0.3:
                tasks[rng.randrange(len(tasks))].cancel()
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_store_that_misbehaves_at_random_never_serves_wrong_kv_nor_kills_a_task(seed: int) -> None:
    rng = random.Random(seed)
    cfg = config(seed)
    wrong: list[int] = []
    for run in range(2):  # a restart on the same store: the second run's prefixes come from it
        cache = HiCache.from_config(cfg)
        await cache.start()
        try:
            outcomes = await serve(cache, rng, wrong)
            assert all(o in ("ok", "refused", "aborted") or isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            assert outcomes.count("ok") > 0
            assert not wrong, f"requests {wrong} were handed a prefix whose KV differs from a recompute"
            controller = cache._stack.controller
            died = [t for t in controller._tasks if t.done() and not t.cancelled() and t.exception() is not None]
            assert not died
            await cache.drain()
            store = cache.storage
            errors = store.get_stats()["backend_errors"]
            if run == 1:
                assert store.faults > 0 and errors > 0  # raised, wrong lengths and types are each counted
                text = await asyncio.to_thread(cache.prometheus_text)
                scraped = Scrape(text).value("hicache_backend_backend_errors_total", cache=cache.metrics_label,
                                             backend="chaos-memory")
                assert scraped >= errors
        finally:
            report = await asyncio.wait_for(cache.aclose(), 60)
        assert report.drained
