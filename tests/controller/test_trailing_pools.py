"""An extra pool with hit policy ``TRAILING_PAGES`` (a hybrid model's Mamba state: one key, the
last KV page's) through the controller's storage writes and prefetches, batch by batch. Its
key goes with the batch that holds its page; its flags answer for that page alone."""

from __future__ import annotations

import uuid

import pytest
import torch

from hicache.controller import ControllerConfig, StorageWriteJob
from hicache.controller.transfers import all_pools_ok, slice_transfer
from hicache.keys import page_hashes
from hicache.replay import StackConfig, build_stack
from hicache.storage import PoolHitPolicy, PoolTransfer
from hicache.testing.pools import ArrayHostPool
from hicache_backends.memory import MemoryStorage

PS = 4
TRAILING = PoolHitPolicy.TRAILING_PAGES


def test_a_trailing_key_goes_with_the_batch_that_holds_its_page() -> None:
    state = PoolTransfer("mamba", torch.arange(4), keys=["s3", "s4"], hit_policy=TRAILING)  # pages 3, 4 of 5
    cuts = [slice_transfer(state, first, 2, 5) for first in (0, 2, 4)]
    assert [c.keys for c in cuts] == [None, ["s3"], ["s4"]]
    assert [c.host_indices.tolist() for c in cuts] == [[], [0, 1], [2, 3]]
    every = PoolTransfer("idx", torch.arange(5), keys=list("abcde"))
    assert slice_transfer(every, 2, 2, 5).keys == ["c", "d"]
    # flags of a trailing pool answer for the batch's last pages only
    assert all_pools_ok({"kv": [True] * 3, "mamba": [False]}, 3, [cuts[1]]) == [True, True, False]
    assert all_pools_ok({"kv": [True] * 2, "mamba": []}, 2, [cuts[0]]) == [True, True]


async def _write_then_prefetch(store: MemoryStorage, **controller: int | float) -> tuple[ArrayHostPool, list[int], object, object]:
    """Write 3 KV pages with the state of the last in host slot 5, then prefetch them back with
    the state into slot 6: (state pool, pages acknowledged written, the prefetch, counters)."""
    mamba = ArrayHostPool(num_pages=8, page_size=1, token_elems=8, dtype=torch.float32)
    mamba.fill_random(3)
    store.register_mem_host_pool_v2(mamba, "mamba")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, **controller))  # type: ignore[arg-type]
    stack = build_stack(cfg, storage=store)
    ctl = stack.controller
    try:
        keys = page_hashes(list(range(3 * PS)), PS)
        written: list[int] = []
        job = StorageWriteJob(keys=keys, host_indices=stack.host_pool.alloc(3 * PS), prior_key=None,
                              on_done=written.append,
                              extra=[PoolTransfer("mamba", mamba.indices(5, 1), keys=keys[-1:], hit_policy=TRAILING)])
        assert ctl.submit_storage_write(job)
        await ctl.drain()
        ctl.start_prefetch("r", keys, alloc_host=stack.host_pool.alloc,
                           extra=[PoolTransfer("mamba", mamba.indices(6, 1), keys=keys[-1:], hit_policy=TRAILING)])
        res = await ctl.wait_prefetch("r", "wait_complete")
        return mamba, written, res, ctl.metrics.snapshot()["counters"]
    finally:
        await stack.aclose()


@pytest.mark.parametrize("batch_pages", [1, 2, 8])
async def test_a_state_is_written_and_read_with_the_last_page(batch_pages: int) -> None:
    store = MemoryStorage(store_id=f"trail-{uuid.uuid4()}")
    mamba, written, res, counters = await _write_then_prefetch(
        store, storage_batch_pages=batch_pages, prefetch_batch_pages=batch_pages, storage_retry_base_s=0.001,
        storage_max_retries=1)
    assert written == [3] and not counters.get("storage_write_failures") and not counters.get("storage_write_retries")
    assert res is not None and res.pages == 3  # type: ignore[attr-defined]
    assert mamba.page_bytes(6) == mamba.page_bytes(5)


class _ShortStateAnswer(MemoryStorage):
    async def batch_get_v2(self, transfers, extra_info=None):  # type: ignore[no-untyped-def]
        out = {}
        for t in transfers:  # reads the KV, answers the state pool without reading it
            if t.name == "mamba":
                out["mamba"] = []
            else:
                out.update(await super().batch_get_v2([t], extra_info))
        return out


async def test_a_state_answered_without_its_flag_was_not_read() -> None:
    """A trailing pool answered with fewer flags than its keys counted as landed: the prefetch
    served 3 pages as a storage hit with a state nobody read."""
    kv = PoolTransfer("kv", torch.arange(8), keys=["a", "b"])
    state = PoolTransfer("mamba", torch.arange(1), keys=["b"], hit_policy=TRAILING)
    assert all_pools_ok({"kv": [True, True], "mamba": []}, 2, [kv, state]) == [True, False]
    mamba, written, res, _ = await _write_then_prefetch(_ShortStateAnswer(store_id=f"trail-{uuid.uuid4()}"))
    assert written == [3]
    assert res.pages < 3 or mamba.page_bytes(6) == mamba.page_bytes(5)  # type: ignore[attr-defined]


def test_an_answer_that_leaves_out_a_pool_landed_nothing() -> None:
    """A backend answering ``{}`` had the whole batch counted as landed: a prefetch handed the
    request host pages nobody wrote, served as a storage hit."""
    kv = PoolTransfer("kv", torch.arange(8), keys=["a", "b"])
    assert all_pools_ok({}, 2, [kv]) == [False, False]
    assert all_pools_ok({"kv": [True, True]}, 2, [kv]) == [True, True]
    state = PoolTransfer("mamba", torch.arange(1), keys=["b"], hit_policy=TRAILING)
    assert all_pools_ok({"kv": [True, True]}, 2, [kv, state]) == [False, False]
