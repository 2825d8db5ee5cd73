"""Backups under host pressure: a burst of write-throughs larger than the host pool still
reaches storage (deferred backups, redundant host copies shed), and the metrics say why."""

from __future__ import annotations

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
