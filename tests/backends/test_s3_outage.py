"""The ``s3`` backend when the service goes away: a moto server in a subprocess is frozen
(SIGSTOP: connections hang), killed, and restarted on the same port. Every call must come back
within ``call_timeout`` with misses/False, nothing may raise out of the backend, the breaker must
stop the hammering, and the store must recover on its own when the service is back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest
import torch

from hicache.storage import create_async_storage
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from s3_server import MotoProcess, create_bucket, eventually, s3_options

T = TypeVar("T")

FAULT_OPTIONS: dict[str, Any] = dict(
    request_timeout=0.5,
    call_timeout=2.0,
    retries=1,
    retry_backoff=0.02,
    retry_backoff_max=0.1,
    breaker_threshold=3,
    breaker_cooldown=0.5,
)
LIMIT = FAULT_OPTIONS["call_timeout"] + 0.75  # scheduling slack on a loaded 2-core machine
BUCKET = "hicache-outage"


async def within_limit(coro: Awaitable[T]) -> T:
    t0 = time.monotonic()
    result = await coro
    took = time.monotonic() - t0
    assert took < LIMIT, f"call took {took:.2f} s"
    return result


@pytest.fixture
def moto_process():
    pytest.importorskip("s3fs")
    server = MotoProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(120)
async def test_outage_returns_misses_in_time_and_recovers(moto_process: MotoProcess) -> None:
    await asyncio.to_thread(create_bucket, moto_process.endpoint, BUCKET)
    store = create_async_storage(
        "s3", None, url=f"s3://{BUCKET}/outage", storage_options=s3_options(moto_process.endpoint),
        namespace=NS_A, **FAULT_OPTIONS,
    )
    keys = keys_for(8, salt=90)
    src = ArrayHostPool(8, PAGE)
    src.fill_random(90)
    dst = ArrayHostPool(8, PAGE)
    async with store:
        store.register_mem_pool_host(src)
        assert await store.batch_set_v1(keys[:4], src.indices(0, 4)) == [True] * 4

        async def read(n: int = 4) -> list[bool]:
            store.register_mem_pool_host(dst)
            return await store.batch_get_v1(keys[:n], dst.indices(0, n))

        async def write(lo: int, hi: int) -> list[bool]:
            store.register_mem_pool_host(src)
            return await store.batch_set_v1(keys[lo:hi], src.indices(lo, hi - lo))

        # -- 1. the service hangs: requests time out, the breaker opens
        await asyncio.to_thread(moto_process.pause)
        for _ in range(3):
            assert await within_limit(read()) == [False] * 4
            assert await within_limit(write(4, 6)) == [False] * 2
            assert await within_limit(store.exists_pages(keys[4:])) == [False] * 4
            assert await within_limit(store.get(keys[0])) is None
            assert await within_limit(store.set("v0", torch.ones(4))) is False
        stats = store.get_stats()
        assert stats["timeouts"] >= 3 and stats["breaker_open"] >= 1 and stats["breaker_rejected"] > 0
        assert stats["breaker_state"] != "closed"
        # -- it comes back: the background probe closes the breaker with no user call
        await asyncio.to_thread(moto_process.resume)

        async def closed() -> bool:
            return store.get_stats()["breaker_state"] == "closed"

        await eventually(closed)
        assert await read() == [True] * 4  # moto kept its data across the freeze
        assert dst.page_bytes(0) == src.page_bytes(0)

        # -- 2. the service dies: connection refused, misses at once once the breaker is open
        await asyncio.to_thread(moto_process.stop)
        opened_before = store.get_stats()["breaker_open"]
        t0 = time.monotonic()
        for _ in range(5):
            assert await within_limit(read()) == [False] * 4
            assert await within_limit(write(4, 8)) == [False] * 4
            assert await within_limit(store.batch_exists(keys[4:])) == 0
        assert time.monotonic() - t0 < 5 * LIMIT
        stats = store.get_stats()
        assert stats["breaker_open"] > opened_before
        assert stats["transient_errors"] > 0
        # -- 3. it restarts empty on the same port; re-create the bucket and carry on
        await asyncio.to_thread(moto_process.start)
        await asyncio.to_thread(create_bucket, moto_process.endpoint, BUCKET)
        await eventually(closed)

        async def writes_work() -> bool:
            return await write(0, 8) == [True] * 8

        await eventually(writes_work)
        dst.buffer.zero_()
        store.register_mem_pool_host(dst)
        assert await store.batch_get_v1(keys, dst.indices(0, 8)) == [True] * 8
        assert torch.equal(dst.buffer, src.buffer)
        assert store.get_stats().get("backend_errors", 0) == 0  # nothing ever raised out of a primitive


async def test_unreachable_at_open_still_opens_and_misses() -> None:
    """A store whose service is down when it opens must open, answer misses, not raise."""
    store = create_async_storage(
        "s3", None, url="s3://nowhere/x", storage_options=s3_options("http://127.0.0.1:9"),
        namespace=NS_A, **FAULT_OPTIONS,
    )
    async with store:
        assert await within_limit(store.exists_pages(["a", "b"])) == [False, False]
        assert await within_limit(store.set("a", torch.ones(4))) is False
        assert await within_limit(store.get("a")) is None
        assert await store.clear() is False
        assert store.get_stats()["manifest_errors"] >= 1


@pytest.mark.timeout(120)
async def test_the_controller_marks_an_unreachable_s3_store_down_and_up_again(moto_process: MotoProcess) -> None:
    """The s3 backend answers misses while its service is gone (its breaker), and counted no
    backend error: the controller's health held the store up, ``storage_up`` 1, writes sent
    into the breaker, for as long as the service was dead. Its give-ups now count as the call's
    ``unavailable``: the store is marked down, then up again once the service answers."""
    from hicache.controller.config import ControllerConfig
    from hicache.replay.driver import serve_request
    from hicache.stack import StackConfig, build_stack
    from s3_server import eventually

    bucket = "hicache-health"
    await asyncio.to_thread(create_bucket, moto_process.endpoint, bucket)
    options = {"url": f"s3://{bucket}/x", "storage_options": s3_options(moto_process.endpoint), **FAULT_OPTIONS}
    cfg = StackConfig(page_size=4, layer_num=1, head_num=1, head_dim=4, dtype="float32", device_pages=64,
                      host_pages=64, storage_backend="s3", storage_options=options,
                      controller=ControllerConfig(write_policy="write_through", storage_probe_base_s=0.2,
                                                  storage_probe_max_s=0.5))
    stack = build_stack(cfg)
    try:
        await serve_request(stack, list(range(16)), rid="a")
        await stack.cache.drain()
        assert stack.controller.health.up
        await asyncio.to_thread(moto_process.stop)
        for i in range(6):
            await serve_request(stack, list(range(1000 * (i + 1), 1000 * (i + 1) + 16)), rid=f"b{i}")
            await stack.cache.drain()
        assert not stack.controller.health.up
        await asyncio.to_thread(moto_process.start)
        await asyncio.to_thread(create_bucket, moto_process.endpoint, bucket)

        async def up() -> bool:
            return stack.controller.health.up

        await eventually(up, 15)
    finally:
        await stack.aclose()
