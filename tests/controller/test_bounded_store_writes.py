"""Write-through into a store smaller than what is written to it (a prompt longer than the
storage tier): the store keeps the leading pages that fit and refuses the rest for room, and
the controller takes that refusal as final.

Before: the memory store evicted everything for the batch - other prompts' pages and then
the batch's own first pages, for its tail - and answered the first pages as not stored; the
controller retried that as a transient failure (each retry evicting again), ended with the
pages counted as failed writes, the store holding tail pages no lookup reaches, and the
storage queue stalled by the backoff sleeps. A file store refused the tail the same way
every retry.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from hicache.controller import ControllerConfig
from hicache.controller.jobs import StorageWriteJob
from hicache.prefix_cache import EvictParams
from hicache.replay import serve_request
from hicache.stack import StackConfig, build_stack

PS = 4


def _stack(backend: str, tmp_path: Any, **controller: Any) -> Any:
    options = {"root": str(tmp_path / "store"), "min_free_bytes": 0} if backend == "file" else {}
    return build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=32, storage_backend=backend, storage_pages=3,
        storage_options=options, placement="lru",
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete", **controller)))


@pytest.mark.parametrize("backend", ["memory", "file"])
async def test_a_prompt_longer_than_the_store_keeps_its_leading_pages_and_is_not_retried(
        backend: str, tmp_path: Any) -> None:
    stack = _stack(backend, tmp_path)
    try:
        cache = stack.cache
        await serve_request(stack, list(range(8)), rid="a")
        await cache.drain()
        long = list(range(100, 124))  # 6 pages, the store holds 3
        await serve_request(stack, long, rid="b")
        await cache.drain()
        c = stack.controller.metrics.counters
        assert c["storage_write_retries"] == 0 and c["storage_write_failures"] == 0
        assert c["storage_write_no_space_pages"] == 3
        assert stack.storage.get_stats()["rejected_pages_no_space"] == 3
        # the first 3 pages of b are in storage and reachable: served again from there
        cache.evict(EvictParams(num_tokens=10**6))
        cache.evict_host(10**6)
        await cache.drain()
        again = await serve_request(stack, long, rid="b2")
        assert again.verify_failures == 0
        assert again.storage_hit == 3 * PS
        assert stack.storage.get_stats()["evicted_pages"] == 2  # a's pages only, once
    finally:
        await stack.aclose()


@pytest.mark.parametrize("hop_bytes", [64 << 20, 1])  # in one hop; batch by batch (_write_job)
async def test_a_continuation_never_evicts_its_own_leading_pages(tmp_path: Any, hop_bytes: int) -> None:
    """A job written in batches of 2 into a store of 3 pages: the second batch's room must not
    come from the first batch's pages, nor may a later write chained after them (a short
    write offered again) evict them for its tail."""
    stack = _stack("memory", tmp_path, storage_batch_pages=2, storage_retry_base_s=0.001, storage_hop_bytes=hop_bytes)
    try:
        ctl = stack.controller
        await ctl.open_storage()
        keys = [f"job-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
        done: list[int] = []
        host = stack.host_pool.alloc(6 * PS)
        assert ctl.submit_storage_write(StorageWriteJob(keys=keys, host_indices=host, prior_key=None,
                                                        on_done=done.append))
        await ctl.drain()
        assert done == [3]
        assert await stack.storage.exists_pages(keys) == [True] * 3 + [False] * 3
        tail = stack.host_pool.alloc(3 * PS)
        assert ctl.submit_storage_write(StorageWriteJob(keys=keys[3:], host_indices=tail, prior_key=keys[2],
                                                        on_done=done.append))
        await ctl.drain()
        assert done == [3, 0]
        assert await stack.storage.exists_pages(keys) == [True] * 3 + [False] * 3
        c = ctl.metrics.counters
        assert c["storage_write_retries"] == 0 and c["storage_write_failures"] == 0
        assert c["storage_write_no_space_pages"] == 6
        assert stack.storage.get_stats()["evicted_pages"] == 0
    finally:
        await stack.aclose()
