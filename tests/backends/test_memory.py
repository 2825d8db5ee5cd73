"""The conformance suite on the ``memory`` backend, found through its entry point."""

from __future__ import annotations

import uuid

import pytest

from hicache.storage import AsyncHiCacheStorage, create_async_storage
from hicache.testing import StoreTests
from hicache_backends.memory import MemoryMedium


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        store_id = f"conformance-{uuid.uuid4().hex}"

        def make(namespace=None) -> AsyncHiCacheStorage:
            return create_async_storage("memory", None, store_id=store_id, namespace=namespace)

        yield make
        MemoryMedium.drop_shared(store_id)

    async def raw_payload(self, store, key, pool="kv"):
        return store.medium.pages.get((store.namespace.digest, key, pool))


async def test_lru_bound_holds() -> None:
    store = create_async_storage("memory", None, max_bytes=10_000)
    import torch

    async with store:
        for i in range(50):
            assert await store.set(f"k{i}", torch.zeros(1000, dtype=torch.uint8))
        stats = store.get_stats()
        assert stats["stored_bytes"] <= 10_000
        assert stats["evicted_pages"] == 40
        assert await store.batch_exists([f"k{i}" for i in range(40, 50)]) == 10
        assert not await store.exists("k0")
        assert not await store.set("huge", torch.zeros(20_000, dtype=torch.uint8))
