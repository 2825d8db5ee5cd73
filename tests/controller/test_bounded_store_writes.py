"""Write-through into a store smaller than what is written to it (a prompt longer than the
storage tier): the memory store keeps the leading pages that fit and refuses the rest as
beyond its capacity, and the controller takes that refusal as final. A refusal for room that
may clear up (the file store's: a peer's pages not indexed yet) is retried as before.

Before: the memory store evicted everything for the batch - other prompts' pages and then
the batch's own first pages, for its tail - and answered the first pages as not stored; the
controller retried that as a transient failure (each retry evicting again), ended with the
pages counted as failed writes, the store holding tail pages no lookup reaches, and the
storage queue stalled by the backoff sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from hicache.controller import ControllerConfig
from hicache.controller.jobs import StorageWriteJob
from hicache.prefix_cache import EvictParams
from hicache.replay import serve_request
from hicache.stack import StackConfig, build_stack

PS = 4


def _stack(backend: str, tmp_path: Any, head_dim: int = 1, **controller: Any) -> Any:
    options = {"root": str(tmp_path / "store"), "min_free_bytes": 0} if backend == "file" else {}
    return build_stack(StackConfig(
        page_size=PS, device_pages=16, host_pages=32, storage_backend=backend, storage_pages=3,
        storage_options=options, placement="lru", head_dim=head_dim,
        controller=ControllerConfig(prefetch_threshold=PS, prefetch_policy="wait_complete", **controller)))


# 256 KiB pages: a batch of them is stored on a thread (run_to_completion), whose counts did
# not reach the call (the refusal went unseen and was retried as a failure)
# the file store too: it keeps a chain's prefix as the memory store does (leaves go first, a
# page a write continues never), but counted its refusal only as one that may clear up, so
# the controller retried it with backoff and counted the pages as failed writes
@pytest.mark.parametrize("backend", ["memory", "file"])
@pytest.mark.parametrize("head_dim", [1, 8192])
async def test_a_prompt_longer_than_the_store_keeps_its_leading_pages_and_is_not_retried(
        head_dim: int, backend: str, tmp_path: Any) -> None:
    stack = _stack(backend, tmp_path, head_dim=head_dim)
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
        stats = stack.storage.get_stats()
        assert stats["rejected_pages_no_space"] == stats["rejected_pages_beyond_capacity"] == 3
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


async def test_a_file_store_refusal_that_clears_up_is_retried(tmp_path: Any) -> None:
    """Two stacks share one file namespace bounded to 3 pages; A fills it, then B writes 3
    pages. B has not indexed A's pages, so its first write is refused for room (nothing of its
    own to evict), which starts its rescan; the retry, with A's pages indexed, evicts them and
    lands. Taking every refusal for room as final left B's pages out of storage."""
    root = tmp_path / "shared"
    # retries spread over seconds: the rescan the refusal starts must end before they run out,
    # which a loaded machine may take longer than three quick retries for
    b = _stack("file", root, storage_retry_base_s=0.05, storage_max_retries=8)
    a = _stack("file", root)
    try:
        await b.controller.open_storage()
        await asyncio.wait_for(b.controller._on_io(b.storage.wait_background()), 30)  # B's opening scan ends
        await serve_request(a, list(range(12)), rid="x")
        await a.cache.drain()
        await serve_request(b, list(range(100, 112)), rid="y")
        await b.cache.drain()
        c = b.controller.metrics.counters
        assert c["storage_write_failures"] == 0 and c.get("storage_write_no_space_pages", 0) == 0
        stats = b.storage.get_stats()
        assert stats["write_ok"] == 3 and stats.get("rejected_pages_beyond_capacity", 0) == 0
    finally:
        await a.aclose()
        await b.aclose()
