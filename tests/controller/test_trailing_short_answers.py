"""A ``TRAILING_PAGES`` pool answered with fewer flags than the keys it was given (here none)
landed nothing for the pages those keys belong to: counted landed, a prefetch served 3 pages
as a storage hit with a Mamba state nobody read."""
import uuid

import torch

from hicache.controller import ControllerConfig, StorageWriteJob
from hicache.controller.transfers import all_pools_ok
from hicache.keys import page_hashes
from hicache.replay import StackConfig, build_stack
from hicache.storage import PoolHitPolicy, PoolTransfer
from hicache.testing.pools import ArrayHostPool
from hicache_backends.memory import MemoryStorage

PS = 4
TRAILING = PoolHitPolicy.TRAILING_PAGES


def test_unit_a_trailing_pool_with_no_flag_for_its_key_did_not_land() -> None:
    kv = PoolTransfer("kv", torch.arange(8), keys=["a", "b"])
    state = PoolTransfer("mamba", torch.arange(1), keys=["b"], hit_policy=TRAILING)
    # an ALL_PAGES pool's short answer is padded with False; a trailing pool's is taken as True
    assert all_pools_ok({"kv": [True, True], "mamba": []}, 2, [kv, state]) == [True, False]


class ShortStateAnswer(MemoryStorage):
    async def batch_get_v2(self, transfers, extra_info=None):  # type: ignore[no-untyped-def]
        out = {}
        for t in transfers:  # reads the KV, answers the state pool without reading it
            if t.name == "mamba":
                out["mamba"] = []
            else:
                out.update(await super().batch_get_v2([t], extra_info))
        return out


async def test_a_prefetch_whose_state_was_not_read_serves_no_state() -> None:
    store = ShortStateAnswer(store_id=f"trail-{uuid.uuid4()}")
    mamba = ArrayHostPool(num_pages=8, page_size=1, token_elems=8, dtype=torch.float32)
    mamba.fill_random(3)
    store.register_mem_host_pool_v2(mamba, "mamba")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS))
    stack = build_stack(cfg, storage=store)
    ctl = stack.controller
    try:
        keys = page_hashes(list(range(3 * PS)), PS)
        host = stack.host_pool.alloc(3 * PS)
        written: list[int] = []
        job = StorageWriteJob(keys=keys, host_indices=host, prior_key=None, on_done=written.append,
                              extra=[PoolTransfer("mamba", mamba.indices(5, 1), keys=keys[-1:], hit_policy=TRAILING)])
        assert ctl.submit_storage_write(job)
        await ctl.drain()
        assert written == [3]
        ctl.start_prefetch("r", keys, alloc_host=stack.host_pool.alloc,
                           extra=[PoolTransfer("mamba", mamba.indices(6, 1), keys=keys[-1:], hit_policy=TRAILING)])
        res = await ctl.wait_prefetch("r", "wait_complete")
        assert res.pages < 3 or mamba.page_bytes(6) == mamba.page_bytes(5), \
            "3 pages served with the state of host slot 6 never read"
    finally:
        await stack.aclose()
