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


def test_max_bytes_rejects_bool() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match="max_bytes"):
        create_async_storage("memory", None, max_bytes=True)


async def test_big_batches_round_trip_through_the_worker_thread() -> None:
    """A batch of at least OFFLOAD_MIN_BYTES is copied on a thread (it used to be copied on the
    event loop, hundreds of MiB for a batch of real pages)."""
    import torch

    from hicache.storage.offload import OFFLOAD_MIN_BYTES
    from hicache.testing import ArrayHostPool

    store = create_async_storage("memory", None)
    elems = OFFLOAD_MIN_BYTES // (4 * 2)
    src = ArrayHostPool(3, 4, token_elems=elems)
    src.fill_random(9)
    store.register_mem_pool_host(src)
    keys = ["a", "b", "c"]
    assert await store.batch_set_v1(keys, src.indices(0, 3)) == [True] * 3
    dst = ArrayHostPool(3, 4, token_elems=elems)
    store.register_mem_pool_host(dst)
    assert await store.batch_get_v1(keys, dst.indices(0, 3)) == [True] * 3
    assert torch.equal(dst.buffer, src.buffer)
    await store.aclose()
