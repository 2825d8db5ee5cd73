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


@pytest.mark.parametrize("seed", range(6))
async def test_batch_write_from_page_views_matches_the_page_protocol(fill_bytes, seed):
    """A ``page_first`` pool's batch is written from views asked for once (``page_views``); a
    ``layer_first`` pool's goes page by page through the page protocol. Random batches with
    malformed pages (scattered, negative) and a page past the pool's end (``page_views`` then
    refuses the batch, and it is asked page by page) end alike: same flags, counters, stored
    payloads and reported stores."""
    import random

    from hicache.observability.tier_events import ChangeKind, Tier

    ps, pages = 4, 8
    dev = MHATokenToKVPool(pages * ps, ps, torch.bfloat16, 2, 8, 3, "cpu")
    fill_bytes(dev.kv_data, seed)
    results = []
    for layout in ("page_first", "layer_first"):
        host = MHATokenToKVPoolHost(dev, page_size=ps, layout=layout, host_to_device_ratio=1.0)
        assert host.num_pages == pages
        async with CopyEngine(dev, host) as eng:
            await eng.backup(token_idx(list(range(pages)), ps), token_idx(list(range(pages)), ps))
        store = storage.create_async_storage("memory", None)
        store.register_mem_pool_host(host)
        stored: list[str] = []
        store.tier_changes.subscribe(lambda c: stored.extend(c.keys), wants={(ChangeKind.STORED, Tier.STORAGE)})
        batch_rng = random.Random(seed)  # the same batches for both pools
        flags = []
        async with store:
            for b in range(6):
                n = batch_rng.randint(1, 6)
                chosen = [batch_rng.randrange(pages + (b % 3 == 2)) for _ in range(n)]  # pages: past the end
                idx = token_idx(chosen, ps)
                if b % 2:
                    idx[batch_rng.randrange(idx.numel())] = batch_rng.choice([-1, 3, 17])
                keys = [f"b{b}p{i}" for i in range(n)]
                flags.append((await store.batch_set_v2([storage.PoolTransfer(name="kv", host_indices=idx, keys=keys)]))["kv"])
            payloads = {p.key: bytes(store.medium.get((store.namespace.digest, p.key, p.pool)))
                        for p, _ in await store.list_pages()}
            # (not the timings, nor the name of the store's medium: each run has its own)
            counters = {k: v for k, v in store.get_stats().items() if not k.endswith("seconds") and k != "store"}
        results.append((flags, counters, payloads, sorted(stored)))
    assert results[0] == results[1]
    assert any(not all(f) for f in results[0][0]) and any(all(f) for f in results[0][0])
