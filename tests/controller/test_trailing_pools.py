"""An extra pool with hit policy ``TRAILING_PAGES`` (a hybrid model's Mamba state: one key, the
last KV page's) through the controller's storage writes and prefetches, batch by batch. Its
key goes with the batch that holds its page; its flags answer for that page alone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from hicache.controller import ControllerConfig, StorageWriteJob
from hicache.controller.transfers import all_pools_ok, slice_transfer
from hicache.keys import page_hashes
from hicache.replay import StackConfig, build_stack
from hicache.storage import PoolHitPolicy, PoolTransfer
from hicache.testing import eventually
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


class _HeldLaterReads(MemoryStorage):
    """Reads after the first wait until ``go`` is set (a prefetch cut between its batches)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.go = asyncio.Event()
        self.reads = 0

    async def batch_get_v2(self, transfers, extra_info=None):  # type: ignore[no-untyped-def]
        self.reads += 1
        if self.reads > 1:
            await self.go.wait()
        return await super().batch_get_v2(transfers, extra_info)


async def _states_then_prefetch(store: MemoryStorage, states_at: list[int], *, room_pages: int = 64,
                                cut_after_first_batch: bool = False, **controller: int) -> tuple[object, object, object]:
    """Store a 5-page chain's KV, with a state snapshot (slot 1 + i) at each page of ``states_at``
    (what earlier, shorter requests left), then prefetch all 5 pages with the state into slot 7,
    with host room for ``room_pages``: (the prefetch's result, the state each stored length
    restores to, slot 7's bytes)."""
    mamba = ArrayHostPool(num_pages=8, page_size=1, token_elems=8, dtype=torch.float32)
    mamba.fill_random(5)
    store.register_mem_host_pool_v2(mamba, "mamba")
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=PS, **controller))  # type: ignore[arg-type]
    stack = build_stack(cfg, storage=store)
    ctl = stack.controller
    free_before = stack.host_pool.available_size()
    try:
        keys = page_hashes(list(range(5 * PS)), PS)
        for i, page in enumerate(states_at):
            host = stack.host_pool.alloc((page + 1) * PS)
            written: list[int] = []
            job = StorageWriteJob(keys=keys[: page + 1], host_indices=host, prior_key=None, on_done=written.append,
                                  extra=[PoolTransfer("mamba", mamba.indices(1 + i, 1), keys=keys[page : page + 1],
                                                      hit_policy=TRAILING)])
            assert ctl.submit_storage_write(job)
            await ctl.drain()
            assert written == [page + 1]
            stack.host_pool.free(host)
        before = mamba.page_bytes(7)
        op = ctl.start_prefetch("r", keys, alloc_host=lambda n: stack.host_pool.alloc(min(n, room_pages * PS)),
                                extra=[PoolTransfer("mamba", mamba.indices(7, 1), keys=keys[-1:], hit_policy=TRAILING)])
        assert op is not None
        if cut_after_first_batch:
            assert isinstance(store, _HeldLaterReads)
            await eventually(lambda: op.completed_pages > 0)
            res = ctl.take_prefetch("r")  # the stop policy's cut, before the batch with the state
            store.go.set()
            await ctl.wait_prefetches()
        else:
            res = await ctl.wait_prefetch("r", "wait_complete")
        assert res is not None
        stack.host_pool.free(res.host_indices)
        await eventually(lambda: stack.host_pool.available_size() == free_before)
        states = {page + 1: mamba.page_bytes(1 + i) for i, page in enumerate(states_at)}
        return res, states, (before, mamba.page_bytes(7))
    finally:
        await stack.aclose()


@pytest.mark.parametrize("batch_pages", [1, 2, 8])
async def test_a_partial_hybrid_hit_reads_the_state_at_its_own_end(batch_pages: int) -> None:
    """Storage held 3 of the 5 pages asked for, with the state an earlier 3-page request
    stored at page 2: the usable hit is 3 pages, but the prefetch read its state under the
    5-page chain's key (page 4), i.e. not at all, and handed over 3 pages as complete with a
    state slot nobody wrote. It reads the state at page 2 now."""
    res, states, (_, slot) = await _states_then_prefetch(
        MemoryStorage(store_id=f"trail-{uuid.uuid4()}"), [2], prefetch_batch_pages=batch_pages)
    assert res.pages == 3 and slot == states[3]  # type: ignore[attr-defined]


async def test_a_hybrid_prefetch_cut_by_host_room_ends_at_a_stored_state() -> None:
    """Host room for 3 of 5 found pages: the pages handed over end where a state was stored
    (page 2 of snapshots at pages 1 and 4) and come with it; with no state at or before the
    room's end, nothing is handed over."""
    res, states, (_, slot) = await _states_then_prefetch(
        MemoryStorage(store_id=f"trail-{uuid.uuid4()}"), [1, 4], room_pages=3, prefetch_batch_pages=1)
    assert res.pages == 2 and slot == states[2]  # type: ignore[attr-defined]
    res, _, (before, slot) = await _states_then_prefetch(
        MemoryStorage(store_id=f"trail-{uuid.uuid4()}"), [4], room_pages=3)
    assert res.pages == 0 and slot == before  # type: ignore[attr-defined]


async def test_a_hybrid_prefetch_cut_before_its_state_landed_hands_over_nothing() -> None:
    """A stop policy's cut after the first of several batches handed over that batch's pages,
    though the state is read with the last one: pages with a state slot nobody wrote."""
    res, _, (before, slot) = await _states_then_prefetch(
        _HeldLaterReads(store_id=f"trail-{uuid.uuid4()}"), [4], cut_after_first_batch=True, prefetch_batch_pages=2)
    assert res.pages == 0 and slot == before  # type: ignore[attr-defined]
