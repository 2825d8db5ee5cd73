"""Our host pools behind a real storage backend (the in-memory one), through the v2 multi-pool
path: KV written from a ``page_first`` pool (zero-copy) is read into a ``layer_first`` pool
(staged), and the Mamba state pool rides along as the second pool."""

from __future__ import annotations

import uuid

import pytest
import torch

from hicache.memory import (
    CopyEngine,
    MambaHostPool,
    MambaStatePool,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
)

storage = pytest.importorskip("hicache.storage")
memory_backend = pytest.importorskip("hicache_backends.memory")


def token_idx(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)


def kv_bytes(pool: MHATokenToKVPool, pages: list[int]) -> bytes:
    ps = pool.page_size
    return b"".join(
        pool.kv_data[:, :, p * ps : (p + 1) * ps].contiguous().view(torch.uint8).numpy().tobytes() for p in pages
    )


async def test_v2_round_trip_across_layouts_with_mamba(fill_bytes):
    ps = 4
    store_id = f"mem-tiers-{uuid.uuid4().hex}"
    src_kv = MHATokenToKVPool(8 * ps, ps, torch.bfloat16, 2, 8, 3, "cpu")
    src_state = MambaStatePool(4, {"conv": (3, 2), "ssm": (4,)}, torch.float32, "cpu")
    fill_bytes(src_kv.kv_data, 1)
    for t in src_state.states.values():
        fill_bytes(t, 2)
    host_w = MHATokenToKVPoolHost(src_kv, page_size=ps, layout="page_first")
    state_w = MambaHostPool(src_state, host_size=4)
    keys = ["p0", "p1", "p2"]

    # device -> host -> storage
    async with CopyEngine(src_kv, host_w) as kv_eng, CopyEngine(src_state, state_w) as st_eng:
        await kv_eng.backup(token_idx([5, 6, 1], ps), token_idx([0, 1, 2], ps))
        await st_eng.backup(torch.tensor([3]), torch.tensor([0]))
    writer = storage.create_async_storage("memory", None, store_id=store_id)
    writer.register_mem_pool_host(host_w)
    writer.register_mem_host_pool_v2(state_w, "mamba")
    async with writer:
        res = await writer.batch_set_v2([
            storage.PoolTransfer(name="kv", host_indices=token_idx([0, 1, 2], ps), keys=keys),
            storage.PoolTransfer(name="mamba", host_indices=torch.tensor([0]), keys=keys[-1:],
                                 hit_policy=storage.PoolHitPolicy.TRAILING_PAGES),
        ])
        assert res == {"kv": [True] * 3, "mamba": [True]}

    # storage -> host (another layout) -> device
    dst_kv = MHATokenToKVPool(8 * ps, ps, torch.bfloat16, 2, 8, 3, "cpu")
    dst_state = MambaStatePool(4, {"conv": (3, 2), "ssm": (4,)}, torch.float32, "cpu")
    host_r = MHATokenToKVPoolHost(dst_kv, page_size=ps, layout="layer_first")
    state_r = MambaHostPool(dst_state, host_size=4)
    reader = storage.create_async_storage("memory", None, store_id=store_id)
    reader.register_mem_pool_host(host_r)
    reader.register_mem_host_pool_v2(state_r, "mamba")
    assert reader.namespace == writer.namespace  # the layout is not part of what pages mean
    try:
        async with reader:
            mamba_probe = storage.PoolTransfer(name="mamba", keys=keys[-1:],
                                               hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)
            hit = await reader.batch_exists_v2(keys, [mamba_probe])
            assert hit.kv_hit_pages == 3
            got = await reader.batch_get_v2([
                storage.PoolTransfer(name="kv", host_indices=token_idx([7, 3, 4], ps), keys=keys),
                storage.PoolTransfer(name="mamba", host_indices=torch.tensor([2]), keys=keys[-1:]),
            ])
            assert got == {"kv": [True] * 3, "mamba": [True]}
    finally:
        memory_backend.MemoryMedium.drop_shared(store_id)
    async with CopyEngine(dst_kv, host_r) as kv_eng, CopyEngine(dst_state, state_r) as st_eng:
        await kv_eng.load(token_idx([7, 3, 4], ps), token_idx([0, 1, 2], ps)).wait()
        await st_eng.load(torch.tensor([2]), torch.tensor([1])).wait()
    assert kv_bytes(dst_kv, [0, 1, 2]) == kv_bytes(src_kv, [5, 6, 1])
    for name in ("conv", "ssm"):
        assert torch.equal(dst_state.states[name][1].view(torch.uint8), src_state.states[name][3].view(torch.uint8))
