"""The connector when things go wrong, on the same real parts as ``test_connector_units.py``
(a real file store, real tensors shaped like vLLM's CPU KV cache, both halves and the reports
between them) and, where the connector itself is the subject, vLLM's own config objects and
factory: loads that fail under a step that still runs, slots reported bad while a write reads
them, writes refused, a cache reset, pipeline stages of uneven depth, a slow store with many
waiting requests, and shutdown under vLLM's worker grace period."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _block_formats import backend_cache
from test_connector_units import (
    BS,
    begin,
    GEOM,
    OTHER,
    TOKENS,
    kv_layers,
    load,
    namespace,
    page_files,
    request,
    run_step,
    saves,
    scheduler,
    slow_writes,
    stored,
    wait_report,
    worker,
)

from hicache.errors import ConfigError
from hicache.integrations.vllm.host_tree import HostPageTree
from hicache.integrations.vllm.naming import PageKeyChain
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.scheduler_side import SchedulerSide
from hicache.integrations.vllm.store_io import StoreIO, make_backend
from hicache.integrations.vllm.transfers import PageLoad, PageSave
from hicache.integrations.vllm.worker_side import WorkerSide
from hicache.storage import StorageState
from hicache.storage.offload import run_to_completion


def in_store(s: SchedulerSide, keys: list[str], rank: int = 0) -> list[bool]:
    """Which of ``keys`` the store of parallel rank ``rank`` holds."""
    return [bool(e) for e in s.store.call(s.store.backends[rank].exists_pages(keys), timeout=10)]


def answer(s: SchedulerSide, rid: str, tokens: list[int]) -> int:
    """The lookup's answer as vLLM gets it: asked again each step until it is not "not yet"."""
    deadline = time.monotonic() + 20
    while (hit := s.matched_tokens(rid, tokens, None, 0)) is None and time.monotonic() < deadline:
        s.plan_step([])
        time.sleep(0.01)
    assert hit is not None
    return hit


def damage(root: Path, src: list[torch.Tensor], block: int) -> None:
    """Flip one payload byte of the stored page whose payload is block ``block`` of ``src``."""
    payload = torch.cat([t[block].reshape(-1).view(torch.uint8) for t in src]).numpy().tobytes()
    target = next(p for p in page_files(root) if payload in p.read_bytes())
    data = bytearray(target.read_bytes())
    data[data.find(payload) + 100] ^= 0x55
    target.write_bytes(bytes(data))


def forward(gpu: list[torch.Tensor], good: list[torch.Tensor], blocks: list[int], pages: range, *, garbage: bool) -> None:
    """What the model writes into the blocks of ``pages``: the right KV, or KV computed over
    blocks that failed to load (anything else)."""
    for p in pages:
        for i in range(GEOM.num_layers):
            gpu[i][blocks[p]] = -good[i][p] if garbage else good[i][p]


def block_writes(w: WorkerSide) -> threading.Event:
    """Hold every storage write of ``w`` until the returned event is set."""
    backend = w.controller.storage
    real_write = backend._write
    gate = threading.Event()

    async def held_write(pages, buffers, parents):  # type: ignore[no-untyped-def]
        await run_to_completion(gate.wait, 30)
        return await real_write(pages, buffers, parents)

    backend._write = held_write  # type: ignore[method-assign]
    return gate


# ---------------------------------------------------------------- KV computed over a failed load
@pytest.mark.parametrize("failure", ["damaged", "slow"])
def test_kv_computed_over_a_failed_load_is_never_stored(tmp_path: Path, failure: str) -> None:
    """vLLM runs the step in which a load fails (and rolls the request back after it): the
    pages that step computes attended to garbage. They must reach neither the host tier nor
    storage; once vLLM recomputed them, a fresh engine reads every page back right."""
    good = kv_layers(seed=2)  # the right KV: block p holds page p
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    stored(tmp_path, seed=2, num_pages=3)
    if failure == "damaged":
        damage(tmp_path, good, 1)
    s = scheduler("file", {"root": str(tmp_path)})
    gpu = kv_layers(seed=None)
    w = worker(tmp_path, gpu, load_timeout_s=0.5 if failure == "slow" else 10.0)
    disk = threading.Event()
    if failure == "slow":
        backend = w.controller.storage
        real_read = backend._read

        async def slow_read(pages, buffers):  # type: ignore[no-untyped-def]
            await run_to_completion(disk.wait, 30)
            return await real_read(pages, buffers)

        backend._read = slow_read  # type: ignore[method-assign]
    blocks = [8, 9, 10, 11, 12, 13]
    try:
        assert request(s, "a", TOKENS, blocks) == 3 * BS
        plan = s.plan_step([("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
        begin(w, plan)
        failed = load(w, plan.loads)
        assert failed == ({9, 10} if failure == "damaged" else {8, 9, 10})
        forward(gpu, good, blocks, range(3, 5), garbage=True)
        w.save(plan.saves)
        s.on_report(w.take_report())
        disk.set()
        wait_report(s, w)
        assert in_store(s, keys[3:5]) == [False, False]
        (sv,) = plan.saves
        assert sv.depends_on == (8, 9, 10)
        assert w.stats["saves_tainted"] == 2 and s.stats["saves_tainted"] == 1
        first_bad = min(blocks.index(b) for b in failed)
        assert s.tree.match(TOKENS, None, 5, count_hit=False).pages == first_bad  # the pages before stay
        deadline = time.monotonic() + 10
        while w._reading and time.monotonic() < deadline:  # the abandoned read returns
            time.sleep(0.02)
        # vLLM rolled the request back to its first failed block and computes from there
        forward(gpu, good, blocks, range(first_bad, 5), garbage=False)
        _, failed = run_step(s, w, [("a", first_bad * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set()
        s.finished("a")
        wait_report(s, w)
    finally:
        disk.set()
        w.close(timeout=30)
        s.close(timeout=10)
    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        assert load(w2, [PageLoad("c", tuple(keys), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4))]) == set()
        for p in range(5):
            assert all(torch.equal(dst[i][p], good[i][p]) for i in range(GEOM.num_layers)), f"page {p}"
    finally:
        w2.close(timeout=10)


def test_a_request_sharing_a_block_whose_load_failed_stores_nothing_either(tmp_path: Path) -> None:
    """vLLM shares blocks between requests: one that found the first pages in vLLM's own
    prefix cache, in blocks another request loads in the same step, computes over them too,
    and vLLM rolls it back as well. Its pages must not be stored either."""
    src, _ = stored(tmp_path, seed=2, num_pages=3)
    damage(tmp_path, src, 1)
    other = TOKENS[: 3 * BS] + OTHER[3 * BS :]  # the same first three pages, its own after
    other_keys = PageKeyChain(BS).extend(other, 5)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    s = scheduler("file", {"root": str(tmp_path)})
    gpu = kv_layers(seed=3)
    w = worker(tmp_path, gpu)
    a_blocks, b_blocks = [8, 9, 10, 11, 12, 13], [8, 9, 10, 3, 4, 5]
    try:
        assert request(s, "a", TOKENS, a_blocks) == 3 * BS
        assert s.matched_tokens("b", other, None, 3 * BS) == 0  # vLLM holds b's first three pages
        plan = s.plan_step([("a", 3 * BS, len(TOKENS), TOKENS, a_blocks), ("b", 3 * BS, len(other), other, b_blocks)])
        begin(w, plan)
        assert load(w, plan.loads) == {9, 10}
        w.save(plan.saves)
        s.on_report(w.take_report())
        wait_report(s, w)
        assert in_store(s, other_keys[3:5]) == [False, False] and in_store(s, keys[3:5]) == [False, False]
        assert s.tree.match(other, None, 5, count_hit=False).pages == 1
        by_req = {sv.req_id: sv for sv in plan.saves}
        assert by_req["b"].depends_on == (8, 9, 10) and s.stats["saves_tainted"] == 2
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_a_step_planned_before_a_failed_loads_outcome_stores_nothing_computed_over_it(tmp_path: Path) -> None:
    """Async scheduling plans step N+1 before vLLM saw step N's output: a long prompt whose
    load failed in step N computes its next chunk in step N+1 over the same garbage. That
    chunk's pages must not be stored either; once the scheduler saw step N, it stops
    suspecting step N's blocks."""
    good = kv_layers(seed=2)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    stored(tmp_path, seed=2, num_pages=3)
    damage(tmp_path, good, 1)
    s = scheduler("file", {"root": str(tmp_path)})
    gpu = kv_layers(seed=None)
    w = worker(tmp_path, gpu)
    blocks = [8, 9, 10, 11, 12, 13]
    try:
        assert request(s, "a", TOKENS, blocks) == 3 * BS
        step_n = s.plan_step([("a", 3 * BS, 4 * BS, TOKENS, blocks)])  # chunked prefill: page 3 now
        step_n1 = s.plan_step([("a", 4 * BS, len(TOKENS), TOKENS, blocks)])  # page 4, planned before N ran
        begin(w, step_n)
        assert load(w, step_n.loads) == {9, 10}
        forward(gpu, good, blocks, range(3, 4), garbage=True)
        w.save(step_n.saves)
        report_n = w.take_report()
        begin(w, step_n1)
        assert load(w, step_n1.loads) == set()
        forward(gpu, good, blocks, range(4, 5), garbage=True)
        w.save(step_n1.saves)
        s.on_report(report_n)
        s.on_report(w.take_report())
        wait_report(s, w)
        assert in_store(s, keys[3:5]) == [False, False]
        (sv,) = step_n1.saves
        assert sv.depends_on == (8, 9, 10) and w.stats["saves_tainted"] == 2
        # vLLM rolled the request back to block 1; the scheduler has seen step N: nothing is suspect
        forward(gpu, good, blocks, range(1, 5), garbage=False)
        plan, failed = run_step(s, w, [("a", BS, len(TOKENS), TOKENS, blocks)])
        (sv,) = plan.saves
        assert failed == set() and sv.depends_on == ()
        s.finished("a")
        wait_report(s, w)
        assert in_store(s, keys) == [True] * 5
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def rank_worker(root: Path, layers: list[torch.Tensor], rank: int) -> WorkerSide:
    """The worker of tensor-parallel rank ``rank`` of two (its own namespace: its shard)."""
    w = WorkerSide(GEOM, make_backend("file", {"root": str(root)}, namespace(tp_rank=rank, tp_size=2)),
                   host_pages=64, load_timeout_s=10.0, controller=ConnectorOptions().controller_config())
    w.register([(f"layer.{i}", t) for i, t in enumerate(layers)])
    return w


def stored_on_two_ranks(root: Path) -> tuple[list[str], list[list[torch.Tensor]]]:
    """The first 3 pages of ``TOKENS`` stored by both tensor-parallel ranks (each its shard);
    returns the page keys and the shards."""
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    shards = [kv_layers(seed=20 + r) for r in range(2)]
    for r in range(2):
        w = rank_worker(root, shards[r], r)
        w.save([saves(keys[:3], range(3), range(3))])
        assert w.close(timeout=30) == 0
    return keys, shards


def two_rank_pair(root: Path) -> tuple[SchedulerSide, list[WorkerSide]]:
    """A scheduler over both ranks' namespaces and a fresh worker per rank."""
    s = SchedulerSide(StoreIO("file", {"root": str(root)}, [namespace(tp_rank=r, tp_size=2) for r in range(2)],
                              name="t-tp"), HostPageTree(64, BS), lookup_wait_s=5.0, lookup_timeout_s=5.0, num_workers=2)
    return s, [rank_worker(root, kv_layers(seed=30 + r), r) for r in range(2)]


def plan_held_save(s: SchedulerSide, ws: list[WorkerSide]) -> tuple[Any, Any, list[int]]:
    """Request "a" (``TOKENS``, 3 pages a storage hit) planned for one step on both workers:
    its save of the pages computed after the hit is held (``hold``) until both report."""
    blocks = [8, 9, 10, 11, 12, 13]
    assert request(s, "a", TOKENS, blocks) == 3 * BS
    plan = s.plan_step([("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
    (sv,) = plan.saves
    assert sv.hold
    for w in ws:
        begin(w, plan)
    return plan, sv, blocks


@pytest.mark.parametrize("damaged", [True, False])
def test_with_two_workers_a_dependent_write_waits_until_both_reported_it_clean(tmp_path: Path, damaged: bool) -> None:
    """Tensor parallel: rank 0's load fails, rank 1's does not, but the garbage reaches rank
    1's KV too (through the collectives), and rank 1 cannot see rank 0's failure. So a write
    of pages computed over a load is held until every worker reported: one failure aborts it
    (nothing of it stored on any rank), all clean commits it (stored on every rank)."""
    keys, shards = stored_on_two_ranks(tmp_path)
    if damaged:
        damage(tmp_path, shards[0], 1)
    s, ws = two_rank_pair(tmp_path)
    try:
        plan, sv, blocks = plan_held_save(s, ws)
        assert sv.depends_on == (8, 9, 10)
        assert [load(w, plan.loads) for w in ws] == [{9, 10} if damaged else set(), set()]
        for w in ws:
            w.save(plan.saves)
        r0, r1 = (w.take_report() for w in ws)
        assert r1.held[sv.job] == 1 and (r0.tainted[sv.job] if damaged else r0.held[sv.job]) == 1
        assert in_store(s, keys[3:5], rank=1) == [False, False]  # held, not written
        s.on_report(r0.merge(r1))
        word = s.plan_step([])  # the next step's metadata carries the scheduler's word
        assert (word.abort, word.commit) == (([sv.job], []) if damaged else ([], [sv.job]))
        for w in ws:
            begin(w, word)
        deadline = time.monotonic() + 20
        while s._writes and time.monotonic() < deadline:
            s.on_report(ws[0].take_report().merge(ws[1].take_report()))
            time.sleep(0.02)
        assert not s._writes
        for rank in range(2):
            assert in_store(s, keys[3:5], rank=rank) == ([False, False] if damaged else [True, True])
        assert s.stats["saves_aborted"] == int(damaged)
    finally:
        for w in ws:
            w.close(timeout=10)
        s.close(timeout=10)


@pytest.mark.parametrize("why", ["busy_slot", "closed", "no_verdict"])
def test_a_held_write_one_worker_cannot_copy_is_aborted_on_every_worker(tmp_path: Path, why: str) -> None:
    """Tensor parallel, a ``hold`` save: worker 1 has nothing of it to write (its first slot is
    still filled by an abandoned storage read, or it is closed). It still gives its verdict
    (``skipped``), the scheduler aborts the write, worker 0 drops its held write, and the
    scheduler's write ends (its node unlocked). ``no_verdict``: a worker that ends the write
    without any verdict at all counts as one against it too."""
    keys, _ = stored_on_two_ranks(tmp_path)
    s, ws = two_rank_pair(tmp_path)
    try:
        plan, sv, blocks = plan_held_save(s, ws)
        assert [load(w, plan.loads) for w in ws] == [set(), set()]
        if why == "closed":
            ws[1].close(timeout=5)
        else:
            ws[1]._reading[sv.slots[0]] += 1  # an abandoned storage read still fills it
        for w in ws:
            w.save(plan.saves)
        r0, r1 = (w.take_report() for w in ws)
        assert r0.held[sv.job] == 1 and r1.jobs_done[sv.job] == 1 and r1.skipped[sv.job] == 1
        if why == "no_verdict":
            r1.skipped.clear()
        s.on_report(r0.merge(r1))
        word = s.plan_step([])
        assert (word.abort, word.commit) == ([sv.job], [])
        for w in ws:
            begin(w, word)
        s.on_report(ws[0].take_report().merge(ws[1].take_report()))
        assert not s._writes and not ws[0]._held and not ws[0]._writing
        assert s.stats["saves_aborted"] == 1
        assert s.tree.tree.protected_size() == 0  # the save's node is unlocked again
        assert in_store(s, keys[3:5], rank=0) == [False, False]
    finally:
        for w in ws:
            w.close(timeout=10)
        s.close(timeout=10)


# ---------------------------------------------------------------- bad slots under a running write
def test_bad_slots_of_a_node_whose_write_still_runs_are_forgotten_at_once(tmp_path: Path) -> None:
    """A worker reports slots bad while the write of their node still runs (the node is
    locked): the tree forgets them at once (no lookup is served from them again), and the
    slots stay out of the allocator until the write has read them."""
    src = kv_layers(seed=12)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, src)
    gate = block_writes(w)
    w2 = None
    try:
        request(s, "a", TOKENS, list(range(6)))
        run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
        s.finished("a")
        assert s._writes  # the write still runs: its node is locked
        w2 = worker(tmp_path, kv_layers(seed=None))  # a worker that lost its pool
        blocks = list(range(8, 14))
        assert request(s, "b", TOKENS, blocks) == 5 * BS  # the tree says the host tier holds it
        _, failed = run_step(s, w2, [("b", 5 * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set(blocks[:5])
        assert s.tree.held_pages() == 0 and s.tree.match(TOKENS, None, 5, count_hit=False).pages == 0
        s.tree.tree.sanity_check()
        assert s.tree.allocator.available_size() // BS == 64 - 5  # the write still reads them
        gate.set()
        wait_report(s, w)
        assert s.tree.allocator.available_size() // BS == 64
        s.tree.tree.sanity_check()
    finally:
        gate.set()
        w.close(timeout=10)
        if w2 is not None:
            w2.close(timeout=10)
        s.close(timeout=10)


# ---------------------------------------------------------------- refused writes
def test_a_refused_storage_write_is_made_again_by_the_next_save_through_its_pages(tmp_path: Path) -> None:
    """A write refused once (full queue, store briefly down) leaves pages only in the host
    tier. A later request that finds them there and computes more writes them again, before
    its own pages: after a restart storage serves the whole prompt, not a prefix with a hole."""
    long = [(i * 41 + 7) % 500 for i in range(10 * BS + 3)]
    keys = PageKeyChain(BS).extend(long, 10)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(seed=3, blocks=32))
    real = w.controller.submit_storage_write
    refused = []

    def refuse_once(job):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(job)
            return False  # what a full storage queue or a closing controller answers
        return real(job)

    w.controller.submit_storage_write = refuse_once  # type: ignore[method-assign]
    head = long[: 5 * BS + 3]
    try:
        request(s, "a", head, list(range(6)))
        run_step(s, w, [("a", 0, len(head), head, list(range(6)))])
        s.finished("a")
        wait_report(s, w)
        assert refused
        blocks = list(range(10, 21))
        assert request(s, "b", long, blocks) == 5 * BS  # from the host tier
        plan, _ = run_step(s, w, [("b", 5 * BS, len(long), long, blocks)])
        s.finished("b")
        wait_report(s, w)
    finally:
        w.close(timeout=30)
        s.close(timeout=10)
    s2 = scheduler("file", {"root": str(tmp_path)})
    try:
        assert in_store(s2, keys) == [True] * 10
        assert s2.matched_tokens("c", long, None, 0) == 10 * BS
    finally:
        s2.close(timeout=10)
    (sv,) = plan.saves  # pages 0..4 written from their host slots, then 5..9 copied and written
    assert sv.keys == tuple(keys) and (sv.copy_from, sv.write_from, sv.prior_key) == (5, 0, None)
    assert s.stats["pages_unwritten"] == 5 and s.stats["pages_rewritten"] == 5


# ---------------------------------------------------------------- reset
def test_reset_forgets_host_and_stored_pages_and_the_workers_follow(tmp_path: Path) -> None:
    """After a reset nothing from before is served: not the host tier, not storage (new key
    chains), and the worker drops its host pages when the next step's metadata shows the new
    epoch. A write still running at the reset keeps its slots until it ends."""
    src = kv_layers(seed=30)
    old_keys = PageKeyChain(BS).extend(TOKENS, 5)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, src)
    try:
        request(s, "a", TOKENS, list(range(6)))
        run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
        s.finished("a")
        wait_report(s, w)
        assert s.matched_tokens("b", TOKENS, None, 0) == 5 * BS and in_store(s, old_keys) == [True] * 5
        s.finished("b")
        gate = block_writes(w)
        request(s, "o", OTHER, list(range(6, 12)))
        run_step(s, w, [("o", 0, len(OTHER), OTHER, list(range(6, 12)))])
        assert s._writes  # still running at the reset

        assert s.reset() is True
        assert s.tree.held_pages() == 0
        assert s.matched_tokens("c", TOKENS, None, 0) == 0  # neither host tier nor storage
        plan = s.plan_step([])
        assert plan.epoch == 1
        begin(w, plan)
        assert all(w.holds(slot) is None for slot in range(w.num_pages))
        gate.set()
        wait_report(s, w)
        assert s.tree.allocator.available_size() // BS == 64  # the running write's slots came back
        # pages are saved and served again, under the new epoch's keys
        plan, _ = run_step(s, w, [("c", 0, len(TOKENS), TOKENS, list(range(6)))])
        (sv,) = plan.saves
        assert len(sv.keys) == 5 and not set(sv.keys) & set(old_keys)
        s.finished("c")
        wait_report(s, w)
        assert s.matched_tokens("d", TOKENS, None, 0) == 5 * BS
        s.tree.tree.sanity_check()
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


@pytest.fixture
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama's config with 5 layers (no weights: nothing here loads them)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-5")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512).save_pretrained(path)
    return str(path)


def vllm_connector(model: str, root: Path, role: Any, num_layers: int, pp_size: int = 1, spec: Any = None,
                   quantization: str | None = None, policy: str = "fail", async_scheduling: bool = False,
                   **parallel: Any) -> Any:
    """Our connector as vLLM's factory builds it, from a real ``VllmConfig``; its
    ``KVCacheConfig`` has ``num_layers`` layers (vLLM gives each pipeline stage its own) of
    ``spec`` (full attention by default), of the model's weights quantized by ``quantization``,
    under ``kv_load_failure_policy`` ``policy``, with async scheduling (as a GPU platform keeps
    it: vLLM's CPU platform turns it off) if ``async_scheduling``."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    kv = KVTransferConfig(kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
                          kv_role="kv_both", kv_connector_extra_config={"backend": "file",
                                                                        "backend_options": {"root": str(root)}},
                          kv_load_failure_policy=policy)
    config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                                 quantization=quantization),
        cache_config=CacheConfig(block_size=BS),
        parallel_config=ParallelConfig(pipeline_parallel_size=pp_size, **parallel,
                                       distributed_executor_backend="mp" if pp_size > 1 or parallel else None),
        kv_transfer_config=kv,
    )
    if async_scheduling:
        config.scheduler_config.async_scheduling = True
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    cpu_attention_layers(config, names, spec)
    with set_current_vllm_config(config):
        return KVConnectorFactory.create_connector(config, role, kv_cache_config)


def cpu_attention_layers(config: Any, names: list[str], spec: Any, backend: Any = None) -> None:
    """What vLLM's model runner has in the forward context when the connector's KV caches are
    registered: attention layers run by the CPU backend (``backend``: another one), of the
    ISA that backend picks for ``spec``."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    # as vLLM's CPUAttentionMetadataBuilder picks it: from the model's dtype, not the spec's
    isa = _get_attn_isa(config.model_config.dtype, spec.block_size, spec.head_size, str(config.cache_config.cache_dtype))
    for name in names:
        config.compilation_config.static_forward_context[name] = SimpleNamespace(
            get_attn_backend=lambda: backend or CPUAttentionBackend, impl=SimpleNamespace(isa=isa))


def store_five_pages(conn: Any, root: Path) -> None:
    """Five pages of ``TOKENS`` written to the connector's store by a worker of its own
    geometry (closed: every write reached the store)."""
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    backend = conn._scheduler.store.primary
    w = WorkerSide(conn.geometry, make_backend("file", {"root": str(root)}, backend.namespace), host_pages=8,
                   load_timeout_s=10.0, controller=ConnectorOptions().controller_config())
    w.register([(f"l{i}", torch.zeros(16, 2, BS, 2, 16, dtype=torch.bfloat16)) for i in range(5)])
    w.save([PageSave("r", tuple(keys), tuple(range(5)), tuple(range(5)), job=1)])
    assert w.close(timeout=30) == 0


def test_vllms_connector_reset_reaches_hicache(model_dir: str, tmp_path: Path) -> None:
    """vLLM's scheduler resets the connector through ``reset_cache`` (and reports the reset
    failed on ``False``): ours says it is done, and the pages stored before are no hit after."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler

    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    try:
        store_five_pages(conn, tmp_path)
        assert answer(conn._scheduler, "a", TOKENS) == 5 * BS
        assert Scheduler.reset_connector_cache(SimpleNamespace(connector=conn, log_stats=False)) is True
        assert answer(conn._scheduler, "b", TOKENS) == 0
    finally:
        conn.shutdown()


def test_an_engine_with_quantized_weights_never_reads_the_pages_of_one_without(model_dir: str, tmp_path: Path) -> None:
    """``--quantization fp8`` runs the same model name, revision and KV dtype with other weights,
    so the KV of the same tokens is other values: two engines sharing a store, one quantized
    and one not, served each other's KV. The weights' quantization is part of the namespace."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    plain = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    fp8 = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5, quantization="fp8")
    try:
        store_five_pages(plain, tmp_path)
        assert answer(plain._scheduler, "a", TOKENS) == 5 * BS
        assert answer(fp8._scheduler, "a", TOKENS) == 0
    finally:
        plain.shutdown()
        fp8.shutdown()


def test_a_sliding_window_kv_cache_is_refused(model_dir: str, tmp_path: Path) -> None:
    """vLLM puts its null block in place of blocks that left a sliding window: their pages,
    saved, held that block's bytes under real keys and a later prompt loaded them as its KV
    (wrong answers). A full-attention model, or --disable-hybrid-kv-cache-manager, is fine."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=64)
    with pytest.raises(ValueError, match="full-attention KV.*SlidingWindowSpec"):
        vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5, spec=window)


def test_kv_caches_whose_pages_are_not_their_prefixs_are_refused(model_dir: str, tmp_path: Path) -> None:
    """Two full-attention specs that pass the class check and still must not be stored:
    R-SWA swaps the decode blocks between a prompt and its window for vLLM's null block (saved
    late, a page held zeros under its real key: the next turn loaded them as its KV), and a
    prefix LM's prefill attends both ways (a page's KV depends on the whole prompt, so one
    found by its prefix is another prompt's KV; vLLM turns its own prefix caching off for it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, RSWASpec

    rswa = RSWASpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, rswa_window=32)
    with pytest.raises(ValueError, match="full-attention KV.*RSWASpec"):
        vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5, spec=rswa)
    prefix_lm = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, non_causal=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="non-causally"):
            vllm_connector(model_dir, tmp_path, role, num_layers=5, spec=prefix_lm)


def test_context_parallelism_is_refused(model_dir: str, tmp_path: Path) -> None:
    """Under context parallelism a worker's block holds its share of the tokens, and prefill
    ranks of one tensor-parallel rank would share a namespace: one would load another's share
    as its KV. The connector says so at start (the offloading route maps the shares). This
    vLLM builds decode context parallelism on CPU; its V1 runner refuses prefill context
    parallelism in ``VllmConfig``, so that one is checked on vLLM's ``ParallelConfig`` alone."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from hicache.integrations.vllm.connector import _refuse_context_parallel

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="context parallelism.*offloading tier"):
            vllm_connector(model_dir, tmp_path, role, num_layers=5, tensor_parallel_size=4, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match=r"context parallelism \(prefill 2, decode 1\)"):
        _refuse_context_parallel(ParallelConfig(prefill_context_parallel_size=2, distributed_executor_backend="mp"))
    _refuse_context_parallel(ParallelConfig(tensor_parallel_size=4, distributed_executor_backend="mp"))


def test_recompute_with_steps_in_flight_is_refused_at_start(model_dir: str, tmp_path: Path) -> None:
    """Where vLLM plans a step before the output of the one before (async scheduling, its
    default on a GPU; pipeline parallelism), ``kv_load_failure_policy: recompute`` drops the
    token the failed step sampled while the next step already computed over it, and a request
    that shared the failed block in that next step keeps what it computed: wrong KV no report
    of the connector undoes. The connector refuses it at start, naming the setting; ``fail``
    starts, and so does ``recompute`` with one step at a time."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"kv_load_failure_policy='recompute' with 2 steps in flight"):
            vllm_connector(model_dir, tmp_path, role, num_layers=5, policy="recompute", async_scheduling=True)
    with pytest.raises(ValueError, match="kv_load_failure_policy='recompute'.*--no-async-scheduling"):
        vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5, pp_size=2, policy="recompute")
    for policy, in_flight in (("fail", True), ("recompute", False)):
        conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5, policy=policy,
                              async_scheduling=in_flight)
        conn.shutdown()


def test_a_store_that_cannot_be_used_fails_start_up_with_its_error(model_dir: str, tmp_path: Path) -> None:
    """A ``root`` that cannot be a folder (under a file, say) is the backend's error at engine
    start, on both sides, as with hicache's other integrations. The store used to open on first
    use: the engine started, every lookup logged the error, and the cache never hit."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    (tmp_path / "a-file").write_text("")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="cannot use root"):
            vllm_connector(model_dir, tmp_path / "a-file" / "kv", role, num_layers=5)


def test_a_store_whose_open_hangs_does_not_hold_up_start_up(model_dir: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A file store whose folder set-up hangs in the kernel (a hard NFS mount whose server is
    down): the backend's thread call cannot be cut, and a cancelled open waits for it. Start-up
    used to cancel the open at its wait's end and then wait for that thread too, so vLLM did
    not start until the mount answered. Now each side starts after the wait, the open goes on
    meanwhile, and the store is used once it is open."""
    from hicache_backends.file import io as page_io
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from hicache.integrations.vllm import connector as connector_module

    mount_back = threading.Event()
    prepare = page_io.prepare_namespace

    def hung_mount(*args: Any) -> bool:
        mount_back.wait(30)
        return prepare(*args)

    monkeypatch.setattr(page_io, "prepare_namespace", hung_mount)
    monkeypatch.setattr(connector_module, "STORE_OPEN_WAIT_S", 0.3)
    conns = []
    try:
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            began = time.monotonic()
            conns.append(vllm_connector(model_dir, tmp_path, role, num_layers=5))
            assert time.monotonic() - began < 10
        stores = [conns[0]._scheduler.store.primary, conns[1]._worker.controller.storage]
        assert [store.state for store in stores] == [StorageState.UNOPENED] * 2  # still in the mount
        mount_back.set()
        deadline = time.monotonic() + 10
        while any(store.state is not StorageState.OPEN for store in stores) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [store.state for store in stores] == [StorageState.OPEN] * 2
    finally:
        mount_back.set()
        for conn in conns:
            conn.shutdown()


def split_kv_caches(model: str, root: Path, layout: str, kernel_block_size: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A worker's connector and the KV caches vLLM registers with it, both built by vLLM:
    5 layers of 64-token blocks, allocated (``allocate_kv_cache``) in the kernel blocks that
    ``prepare_kernel_block_sizes`` picks for a CPU attention backend that takes only
    ``kernel_block_size``-token blocks (what FlashInfer's 16/32/64 do to ``--block-size 128``)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

    class FixedKernelBlocks(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [kernel_block_size]

    kv = KVTransferConfig(kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
                          kv_role="kv_both", kv_connector_extra_config={"backend": "file",
                                                                        "backend_options": {"root": str(root)}})
    config = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
                        cache_config=CacheConfig(block_size=64), kv_transfer_config=kv)
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    cpu_attention_layers(config, names, spec)
    with set_current_vllm_config(config):
        kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)], 8 * 5 * spec.page_size_bytes)
        kernel = prepare_kernel_block_sizes(kv_cache_config, [[AttentionGroup(FixedKernelBlocks, names, spec, 0)]])
        assert kernel == [kernel_block_size]
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout(), kernel)
        conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert kv_cache_config.num_blocks == 8
    return conn, caches


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kv_caches_split_into_kernel_blocks_are_refused_at_start(model_dir: str, tmp_path: Path, layout: str) -> None:
    """vLLM splits every 64-token block into 32-token kernel blocks when the attention
    backend takes only those, and registers KV caches indexed by kernel block while the
    scheduler's block ids count 64-token blocks. The connector stopped with "holds no block of
    the 8192 bytes the namespace says". A split block's bytes are not an unsplit engine's
    page of the same tokens (the CPU backend keeps a block's K of all its tokens before their
    V), and the scheduler cannot know the split to keep such pages apart: the connector says
    so, and which block size works. The same KV caches unsplit register as before."""
    split, split_caches = split_kv_caches(model_dir, tmp_path, layout, kernel_block_size=32)
    whole, whole_caches = split_kv_caches(model_dir, tmp_path, layout, kernel_block_size=64)
    try:
        assert tuple(split_caches[split._layer_names[0]].shape) == (16, 2, 32, 32)  # 8 blocks of 2 kernel blocks
        assert tuple(whole_caches[whole._layer_names[0]].shape) == (8, 2, 64, 32)
        with pytest.raises(ValueError, match=r"does not support vLLM's kernel blocks: the attention backend takes "
                                             r"32-token blocks, so vLLM split every 64-token block into 2 .*"
                                             r"--block-size 32"):
            split.register_kv_caches(split_caches)
        whole.register_kv_caches(whole_caches)
        assert whole._worker is not None and whole._worker._num_blocks == 8
    finally:
        split.shutdown()
        whole.shutdown()


def test_a_streaming_session_given_an_image_saves_under_its_new_root(model_dir: str, tmp_path: Path) -> None:
    """vLLM's streaming-input update appends the new input's images to the running request's
    ``mm_features``: the connector's next step plan sees it and saves the session's pages
    under the root that includes the new image (under the old one, a session with another
    image at that place would have loaded them)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from hicache.integrations.vllm.connector import request_salt

    def image(name: str, offset: int) -> Any:
        return SimpleNamespace(identifier=name, mm_position=SimpleNamespace(offset=offset, length=4))

    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    blocks = list(range(8))
    conn.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (blocks,), block_pool=None))

    def step(req: Any, before: int, after: int) -> Any:
        req.all_token_ids = TOKENS[:after]
        out = SimpleNamespace(num_scheduled_tokens={"s": after - before}, scheduled_new_reqs=[],
                              scheduled_cached_reqs=SimpleNamespace(req_ids=["s"], num_computed_tokens=[before]))
        return conn.build_connector_meta(out)

    try:
        req = SimpleNamespace(request_id="s", prompt_token_ids=TOKENS[: 2 * BS + 1], prompt_embeds=None,
                              cache_salt=None, lora_request=None, mm_features=[image("x", 0)])
        hit = None
        for _ in range(100):  # None: the lookup still runs, vLLM asks again next step
            hit, _ = conn.get_num_new_matched_tokens(req, 0)
            if hit is not None:
                break
            time.sleep(0.05)
        assert hit == 0
        old_root = request_salt(req)
        assert [sv.keys for sv in step(req, 0, 2 * BS + 1).saves] == [tuple(PageKeyChain(BS, old_root).extend(TOKENS, 2))]
        req.mm_features.append(image("y", 2 * BS + 1))  # what _update_request_as_session does
        new_root = request_salt(req)
        (sv,) = step(req, 2 * BS + 1, len(TOKENS)).saves
        assert sv.keys == tuple(PageKeyChain(BS, new_root).extend(TOKENS, 5))
        assert conn._scheduler.stats["requests_rerooted"] == 1
        conn.request_finished(req, blocks)
    finally:
        conn.shutdown()


def test_hit_sources_split_host_memory_from_disk(model_dir: str, tmp_path: Path) -> None:
    """vLLM's per-source prefix-cache metrics were told DISK for every token, host-tier hits
    included."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    try:
        store_five_pages(conn, tmp_path)
        s = conn._scheduler
        req = SimpleNamespace(request_id="a")
        assert answer(s, "a", TOKENS) == 5 * BS
        s.allocated("a", list(range(5)), 5 * BS)
        assert conn.get_external_cache_hit_sources(req, 5 * BS) == {CacheHitSource.DISK: 5 * BS}
        s.plan_step([("a", 0, 5 * BS + 1, TOKENS, list(range(5)))])  # the pages join the host tier
        s.finished("a")
        req = SimpleNamespace(request_id="b")
        assert answer(s, "b", TOKENS) == 5 * BS
        s.allocated("b", list(range(5, 10)), 5 * BS)
        assert conn.get_external_cache_hit_sources(req, 5 * BS) == {CacheHitSource.HOST: 5 * BS}
    finally:
        conn.shutdown()


# ---------------------------------------------------------------- pipeline parallel
def test_pipeline_stages_of_uneven_depth_are_looked_up_under_their_own_layer_count(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 layers over 2 stages is 3 + 2. The scheduler's KV cache config is stage 0's (3
    layers), each stage's worker stores under its own layer count: the scheduler must look
    each stage up under that stage's count, or the prompt never hits."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    import hicache.integrations.vllm.connector as connector_module

    keys = PageKeyChain(BS).extend(TOKENS, 5)
    for pp, layers in ((0, 3), (1, 2)):
        monkeypatch.setattr(connector_module, "_worker_ranks", lambda pp=pp: (0, pp))
        conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.WORKER, num_layers=layers, pp_size=2)
        g = torch.Generator().manual_seed(pp)
        conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.randn(16, 2, BS, 2, 16, generator=g)
                                 .to(torch.bfloat16) for i in range(layers)})
        conn._worker.save([PageSave("r", tuple(keys), tuple(range(5)), tuple(range(5)), job=1)])
        conn.shutdown()
    sched = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=3, pp_size=2)
    try:
        assert [b.namespace.num_layers for b in sched._scheduler.store.backends] == [3, 2]
        assert answer(sched._scheduler, "a", TOKENS) == 5 * BS
    finally:
        sched.shutdown()


# ---------------------------------------------------------------- a slow store, many requests
def test_the_lookups_of_one_step_share_one_wait_budget(tmp_path: Path) -> None:
    """vLLM asks about every waiting request each step. With a store slower than the wait,
    the first lookup of a step spends the step's budget and the others only look, so a step
    is never blocked longer than one wait however long the queue; the next step has a new
    budget, and answers come once the store does."""
    s = scheduler("file", {"root": str(tmp_path)}, wait=0.2, timeout=60.0)
    backend = s.store.primary
    real = backend.exists_pages
    gate = threading.Event()

    async def slow_exists(keys, *args, **kwargs):  # type: ignore[no-untyped-def]
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return await real(keys, *args, **kwargs)

    backend.exists_pages = slow_exists  # type: ignore[method-assign]
    prompts = [[(i * 7 + j) % 500 for j in range(4 * BS + 1)] for i in range(20)]
    try:
        assert [s.matched_tokens(f"r{i}", p, None, 0) for i, p in enumerate(prompts)] == [None] * 20
        assert s.stats["lookup_waits"] == 1
        s.plan_step([])  # the step ends
        assert s.matched_tokens("r0", prompts[0], None, 0) is None
        assert s.stats["lookup_waits"] == 2
        gate.set()
        deadline = time.monotonic() + 20
        answers: list[int | None] = [None]
        while None in answers and time.monotonic() < deadline:
            s.plan_step([])
            answers = [s.matched_tokens(f"r{i}", p, None, 0) for i, p in enumerate(prompts)]
        assert answers == [0] * 20 and s.stats["lookups"] == 20
    finally:
        gate.set()
        s.close(timeout=10)


# ---------------------------------------------------------------- shutdown
def test_worker_shutdown_drains_within_vllms_grace_and_logs_what_it_gave_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's multiprocess executor gives a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS to
    exit, then SIGTERM, then SIGKILL: a drain past that loses the queued pages without a word.
    The worker's drain stops well before, and says how many pages were queued and given up."""
    from hicache.integrations.vllm.options import close_timeout_in_grace

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    limit = close_timeout_in_grace(30.0)
    assert 0 < limit < 1
    assert close_timeout_in_grace(0.2) == 0.2
    src = kv_layers(seed=8)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    w = worker(tmp_path, src, storage_batch_pages=1)
    slow_writes(w, 0.4)
    w.save([saves(keys, range(5), range(5))])
    with caplog.at_level(logging.INFO, logger="hicache.integrations.vllm"):
        lost = w.close(timeout=limit)
    assert 0 < lost <= 5 and w.stats["pages_saved"] + lost == 5
    assert "closing with 5 page(s) queued for storage" in caplog.text
    assert f"gave up {lost} of 5 page(s)" in caplog.text


def test_worker_shutdown_ends_inside_vllms_grace_when_the_store_hangs_in_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain had half the grace, and the store's close and the I/O thread as long again
    each on top: with a store hanging in its close (a flush to a dead mount) the worker was
    still closing after vLLM's default 5 s, and was killed."""
    from hicache.integrations.vllm.options import close_timeout_in_grace

    monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    limit = close_timeout_in_grace(30.0)
    src = kv_layers(seed=9)
    w = worker(tmp_path, src, storage_batch_pages=1)
    slow_writes(w, 0.5)  # the drain takes all the time it is given
    w.save([saves(PageKeyChain(BS).extend(TOKENS, 5), range(5), range(5))])
    backend = w.controller.storage
    release = threading.Event()

    async def hung_close() -> None:
        release.wait(30)  # blocks the store's I/O loop

    monkeypatch.setattr(backend, "_close", hung_close)
    try:
        t0 = time.monotonic()
        w.close(timeout=limit)
        assert time.monotonic() - t0 < 5.0
    finally:
        release.set()



def test_scheduler_shutdown_ends_inside_vllms_grace_when_the_store_hangs(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's connector runs in vLLM's engine core, which vLLM kills
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS after SIGTERM. With a store that hangs (a lookup in
    flight, then its close), its close waited close_timeout_s (30 s) for the lookup, as long
    again for each rank's store, and for its loop: the engine core was killed mid-close."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "4")
    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=3, pp_size=2)
    store = conn._scheduler.store

    async def hang(*args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(3600)

    for backend in store.backends:
        monkeypatch.setattr(backend, "exists_pages", hang)
        monkeypatch.setattr(backend, "aclose", hang)
    assert conn._scheduler.matched_tokens("r", TOKENS, None, 0) is None  # its lookup hangs
    t0 = time.monotonic()
    conn.shutdown()
    assert time.monotonic() - t0 < 4.0

# ---------------------------------------------------------------- batched save copies
@pytest.mark.parametrize("kv_first", [False, True])
def test_a_save_gathered_layer_by_layer_in_chunks_puts_every_block_in_its_slot(tmp_path: Path, kv_first: bool) -> None:
    """The end-of-step save copies each layer's blocks at once and whole pages per run of
    consecutive slots, a few pages at a time: blocks in any order, slots in runs and out of
    order, across chunk boundaries, both KV layouts; each slot must hold exactly its block."""
    g = torch.Generator().manual_seed(40)
    shape = (2, 16, BS, 1, 64) if kv_first else (16, 1, BS, 128)
    src = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros(*shape, dtype=torch.bfloat16) for _ in range(2)]
    keys = PageKeyChain(BS).extend(OTHER + TOKENS, 7)
    slots, blocks = (5, 6, 7, 1, 2, 9, 0), (12, 3, 0, 15, 7, 8, 1)
    w = worker(tmp_path, src)
    w.stage_bytes = 3 * GEOM.page_nbytes
    try:
        w.save([PageSave("r", tuple(keys), slots, blocks, write_from=7)])
        assert [w.holds(s) for s in slots] == keys
        w.register([(f"layer.{i}", t) for i, t in enumerate(dst)])
        assert load(w, [PageLoad("r", tuple(keys), slots, tuple(range(7)), from_host=7)]) == set()
        for i in range(2):
            for d, b in enumerate(blocks):
                assert torch.equal(dst[i][:, d] if kv_first else dst[i][d], src[i][:, b] if kv_first else src[i][b])
    finally:
        w.close(timeout=10)


def test_a_prompt_given_as_embeddings_is_neither_looked_up_nor_saved(model_dir: str, tmp_path: Path) -> None:
    """A prompt with embeddings (vLLM's prompt_embeds) holds the same placeholder token at every
    embedding position: keyed by its tokens, it was served the KV of another prompt with the
    same text and other embeddings (wrong answers). It is left to vLLM."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.request import Request

    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    try:
        store_five_pages(conn, tmp_path)
        plain = Request("plain", list(TOKENS), SamplingParams(max_tokens=1), None)
        # the pages are there (asked again until the lookup is not "not yet", as vLLM does: on
        # a loaded machine the lookup can outlast the connector's wait)
        deadline = time.monotonic() + 20
        while (hit := conn.get_num_new_matched_tokens(plain, 0)[0]) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hit == 5 * BS
        embeds = torch.zeros(len(TOKENS), 16)
        mixed = Request("embeds", list(TOKENS), SamplingParams(max_tokens=1), None, prompt_embeds=embeds)
        assert conn.get_num_new_matched_tokens(mixed, 0) == (0, False)
        assert "embeds" not in conn._requests  # no saves are planned for it
    finally:
        conn.shutdown()


_EXIT_WITHOUT_SHUTDOWN = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_connector_failures import BS, TOKENS, vllm_connector
from hicache.integrations.vllm.naming import PageKeyChain
from hicache.integrations.vllm.transfers import PageSave
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

conn = vllm_connector(sys.argv[1], sys.argv[2], KVConnectorRole.WORKER, num_layers=5)
conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.ones(16, 2, BS, 2, 16, dtype=torch.bfloat16)
                         for i in range(5)})
conn._worker.save([PageSave("r", tuple(PageKeyChain(BS).extend(TOKENS, 5)), tuple(range(5)), tuple(range(5)), job=1)])
print("saved", flush=True)
# no shutdown: the interpreter exits (an in-process engine left to it)
"""


def test_pages_queued_when_the_interpreter_exits_without_shutdown_are_written(model_dir: str, tmp_path: Path) -> None:
    """An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) left to the interpreter's exit:
    vLLM's shutdown came after Python refused new thread-pool work, and the pages queued for
    storage were lost. The worker now drains at exit, before the thread pools stop."""
    import subprocess
    import sys

    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    here = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_SHUTDOWN, model_dir, str(tmp_path), here],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "saved" in out.stdout, out.stderr[-3000:]
    assert "closing the controller failed" not in out.stderr
    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
    try:
        assert answer(conn._scheduler, "a", TOKENS) == 5 * BS
    finally:
        conn.shutdown()


def test_a_resumed_request_writes_again_the_pages_the_store_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request saves 12 pages, the store's bound drops pages 5-11, and the request is
    preempted (vLLM frees its blocks; no request_finished). It resumes with a 5-page storage
    hit: the pages it computes again are written again, from page 5, not only from page 12
    (which would land behind a hole no prefix lookup crosses)."""
    import hicache.integrations.vllm.scheduler_side as scheduler_side

    monkeypatch.setattr(scheduler_side, "LOOKUP_TTL_S", 0.0)  # every ask is a fresh lookup
    prompt = [(i * 41 + 7) % 500 for i in range(12 * BS + 3)]
    other = [(i * 53 + 5) % 500 for i in range(12 * BS + 3)]
    keys = PageKeyChain(BS).extend(prompt + [1] * BS, 13)
    s = scheduler("file", {"root": str(tmp_path)}, host_pages=13)
    w = worker(tmp_path, kv_layers(seed=3, blocks=64))
    try:
        blocks = list(range(13))
        assert request(s, "a", prompt, blocks) == 0
        run_step(s, w, [("a", 0, len(prompt), prompt, blocks)])
        wait_report(s, w)
        assert in_store(s, keys[:12]) == [True] * 12
        s.store.call(s.store.backends[0].batch_delete(keys[5:12]), timeout=10)  # the store's bound
        # "a" is preempted; another prompt takes the host tier
        ob = list(range(20, 33))
        request(s, "b", other, ob)
        run_step(s, w, [("b", 0, len(other), other, ob)])
        s.finished("b")
        wait_report(s, w)
        tokens = prompt + [1] * (BS - 2)  # 13 whole pages once resumed
        blocks2 = list(range(40, 54))
        hit = request(s, "a", prompt, blocks2)
        assert hit == 5 * BS
        run_step(s, w, [("a", hit, len(tokens), tokens, blocks2)])
        wait_report(s, w)
        assert in_store(s, keys[:13]) == [True] * 13
    finally:
        w.close(timeout=30)
        s.close(timeout=10)


# ---------------------------------------------------------------- a block's byte format
def test_a_blocks_bytes_follow_the_attention_backend_and_key_the_namespace(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 registers every layer as the logical [blocks, H, N, C] view whatever the
    physical layout, and the worker copies a block in that logical order; but what the bytes
    of a block hold is the attention backend's own format: FlashAttention's cell (h, n) is
    token n's K then V, vLLM's CPU backend keeps per head its K of the block's tokens (packed
    by its ISA: transposed for "vec", tiled for "amx") and then their V. The same tokens' KV
    were pages of different bytes under one namespace, so an engine of another backend (or a
    CPU engine of another ISA) sharing the store loaded them as its KV. The namespace now
    names the block format each side derives from vLLM's platform (and the CPU backend's
    ISA)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import cpu_attn

    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(BS, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    pages = {isa: backend_cache(isa, key, value)[1].contiguous().view(torch.uint8).flatten()
             for isa in (None, "vec", "amx")}
    assert len({bytes(p.numpy()) for p in pages.values()}) == 3  # the same KV, three byte formats

    def namespace(isa: str, cuda: bool = False) -> Any:
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: isa)
        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: not cuda)
        monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: cuda)
        conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.SCHEDULER, num_layers=5)
        try:
            return conn._scheduler.store.backends[0].namespace
        finally:
            conn.shutdown()

    vec, amx, cuda = namespace("vec"), namespace("amx"), namespace("vec", cuda=True)
    assert len({vec.digest, amx.digest, cuda.digest}) == 3
    assert dict(vec.extra)["block_format"] == "cpu_attn-vec" and dict(cuda.extra)["block_format"] == "kv-cells"


def test_a_worker_whose_backend_writes_another_block_format_is_refused_at_start(model_dir: str, tmp_path: Path) -> None:
    """The scheduler names the block format from vLLM's platform; a worker whose attention
    layers write another (FlashAttention's cells on a CPU engine, the CPU backend of another
    ISA, a layer vLLM did not put in the forward context) would store its pages under a
    namespace that says otherwise: the connector stops at start and says why."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from hicache.errors import ConfigError

    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(16, 2, BS, 32, dtype=torch.bfloat16) for i in range(5)}
    conn = vllm_connector(model_dir, tmp_path, KVConnectorRole.WORKER, num_layers=5)
    context = conn._vllm_config.compilation_config.static_forward_context
    try:
        assert conn._block_format.startswith("cpu_attn-")
        layer = context["model.layers.3.self_attn.attn"]
        context["model.layers.3.self_attn.attn"] = SimpleNamespace(get_attn_backend=lambda: FlashAttentionBackend,
                                                                   impl=SimpleNamespace())
        with pytest.raises(ConfigError, match=r"layer model.layers.3.self_attn.attn \(FlashAttentionBackend\) writes "
                                              r"KV blocks in format kv-cells, the namespace says cpu_attn-"):
            conn.register_kv_caches(caches)
        context["model.layers.3.self_attn.attn"] = SimpleNamespace(get_attn_backend=layer.get_attn_backend,
                                                                   impl=SimpleNamespace(isa="amx-other"))
        with pytest.raises(ConfigError, match=r"format cpu_attn-amx-other, the namespace says cpu_attn-"):
            conn.register_kv_caches(caches)
        del context["model.layers.3.self_attn.attn"]
        with pytest.raises(ConfigError, match=r"\(no attention layer\) writes KV blocks in format unknown"):
            conn.register_kv_caches(caches)
        context["model.layers.3.self_attn.attn"] = layer
        conn.register_kv_caches(caches)
        assert conn._worker is not None and conn._worker._num_blocks == 16
    finally:
        conn.shutdown()


def test_the_cpu_block_format_follows_the_models_dtype_as_vllms_attention_builder_does(monkeypatch: Any) -> None:
    """The CPU ISA (part of the block format) was picked from the KV cache spec's dtype, where
    vLLM's CPU attention builder, which sets the ISA its layers write, picks it from the model's
    dtype: under an fp8 cache (spec dtype uint8) a bf16 model on an AMX machine was named ``vec``
    while its layers wrote ``amx``, and the engine was refused at start."""
    import torch
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from hicache.integrations.vllm import block_format as formats

    monkeypatch.setattr(formats, "_platform", lambda: SimpleNamespace(
        is_cuda=lambda: False, is_cpu=lambda: True, is_rocm=lambda: False, is_xpu=lambda: False))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8)  # an fp8 cache
    builder_isa = cpu_attn._get_attn_isa(torch.bfloat16, 32, 64, "fp8")  # what the layers are given
    assert builder_isa == "amx"
    assert formats.block_format(spec, "fp8", torch.bfloat16) == f"cpu_attn-{builder_isa}"
