"""A backend's batch call that answers without a pool it was asked about (a malformed answer)
reads or writes nothing: never a hit served from host pages nobody wrote."""

from __future__ import annotations

import uuid

from _hicache_faults import seed_memory_store
from hicache.controller import ControllerConfig
from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage.registry import register_backend
from hicache_backends.memory import MemoryStorage


class EmptyAnswerStorage(MemoryStorage):
    backend_name = "empty-answer-memory"

    async def batch_get_v2(self, transfers, extra_info=None):  # type: ignore[no-untyped-def]
        return {}  # reads nothing, names no pool


register_backend("empty-answer-memory", EmptyAnswerStorage)


async def test_a_prefetch_answered_with_no_pool_serves_no_hit() -> None:
    store = uuid.uuid4().hex
    tokens = list(range(16))
    await seed_memory_store(store, tokens, page_size=4)
    cfg = StackConfig(page_size=4, device_pages=16, host_pages=32, storage_backend="empty-answer-memory",
                      storage_options={"store_id": store},
                      controller=ControllerConfig(prefetch_threshold=4, prefetch_policy="wait_complete"))
    stack = build_stack(cfg)
    try:
        out = await serve_request(stack, tokens, rid="r")
        assert out.storage_hit == 0 and out.verify_failures == 0, out
    finally:
        await stack.aclose()
