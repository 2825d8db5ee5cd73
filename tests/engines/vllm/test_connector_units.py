"""The connector's engine-free halves against a real file store and real torch tensors shaped
like vLLM's CPU KV cache (blocks x heads x block_size x (K|V content)): the scheduler's radix
tree over host slots, the worker's HostKVPool and controller, and the reports between them."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.errors import ConfigError
from hicache.integrations.vllm.host_tree import HostPageTree
from hicache.integrations.vllm.naming import KVGeometry, PageKeyChain, deployment_namespace
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.scheduler_side import SchedulerSide, StepPlan
from hicache.integrations.vllm.store_io import StoreIO, make_backend
from hicache.integrations.vllm.transfers import PageLoad, PageSave
from hicache.integrations.vllm.worker_side import WorkerSide
from hicache.storage.offload import run_to_completion

BS = 32
GEOM = KVGeometry(block_size=BS, num_layers=2, num_kv_heads=1, head_size=64, dtype="bfloat16", block_nbytes=BS * 128 * 2)
TOKENS = [(i * 37 + 11) % 500 for i in range(5 * BS + 3)]
OTHER = [(i * 53 + 5) % 500 for i in range(5 * BS + 3)]


def namespace(**kw: object):
    args = dict(model="m", revision=None, geometry=GEOM, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                block_format="cpu_attn-vec")
    args.update(kw)
    return deployment_namespace(**args)  # type: ignore[arg-type]


def kv_layers(seed: int | None, blocks: int = 16) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(blocks, 1, BS, 128, dtype=torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 1, BS, 128, generator=g).to(torch.bfloat16) for _ in range(2)]


def worker(root: Path, layers: list[torch.Tensor], host_pages: int = 64, load_timeout_s: float = 10.0,
           **controller: object) -> WorkerSide:
    opts = ConnectorOptions(controller=dict(controller))
    w = WorkerSide(GEOM, make_backend("file", {"root": str(root)}, namespace()), host_pages=host_pages,
                   load_timeout_s=load_timeout_s, controller=opts.controller_config())
    w.register([(f"layer.{i}", t) for i, t in enumerate(layers)])
    return w


def scheduler(backend: str, options: dict, host_pages: int = 64, **kw: float) -> SchedulerSide:
    return SchedulerSide(StoreIO(backend, options, [namespace()], name="t-sched"), HostPageTree(host_pages, BS),
                         lookup_wait_s=kw.get("wait", 5.0), lookup_timeout_s=kw.get("timeout", 5.0))


def saves(keys: Sequence[str], slots: Sequence[int], blocks: Sequence[int], job: int = 1) -> PageSave:
    return PageSave("r", tuple(keys), tuple(slots), tuple(blocks), job=job)


def stored(root: Path, seed: int, num_pages: int) -> tuple[list[torch.Tensor], list[str]]:
    """KV layers from ``seed`` whose blocks 0..num_pages-1 a worker saved under ``root``, and
    their keys (the worker is closed: every write reached the store)."""
    src = kv_layers(seed)
    keys = PageKeyChain(BS).extend(TOKENS, num_pages)
    w = worker(root, src)
    w.save([saves(keys, range(num_pages), range(num_pages))])
    assert w.close(timeout=30) == 0
    return src, keys


def load(w: WorkerSide, loads: list[PageLoad]) -> set[int]:
    w.start(loads)
    for i in range(GEOM.num_layers):
        w.wait_layer(f"layer.{i}")
    w.finish_step()
    return w.take_failed_blocks()


def begin(w: WorkerSide, plan: StepPlan) -> None:
    """What the worker's connector does with a step's metadata before its loads."""
    w.begin_step(plan.commit, plan.abort, plan.epoch, plan.step, plan.resolved)


def run_step(s: SchedulerSide, w: WorkerSide, scheduled: list, *, report: bool = True) -> tuple[StepPlan, set[int]]:
    """One vLLM step of both halves: plan, the worker's loads and saves, its report back."""
    plan = s.plan_step(scheduled)
    begin(w, plan)
    failed = load(w, plan.loads)
    w.save(plan.saves)
    if report:
        s.on_report(w.take_report())
    return plan, failed


def wait_report(s: SchedulerSide, w: WorkerSide, timeout: float = 20.0) -> None:
    """Hand the worker's reports to the scheduler until every storage write ended."""
    deadline = time.monotonic() + timeout
    while s._writes and time.monotonic() < deadline:
        s.on_report(w.take_report())
        time.sleep(0.02)
    assert not s._writes, "storage writes never reported done"


def request(s: SchedulerSide, rid: str, tokens: list[int], blocks: list[int], num_computed: int = 0) -> int:
    """A request's lookup and allocation as vLLM makes them; returns the tokens hicache serves."""
    hit = s.matched_tokens(rid, tokens, None, num_computed)
    assert hit is not None
    if hit:
        s.allocated(rid, blocks, hit)
    return hit


def page_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > GEOM.page_nbytes]


# ---------------------------------------------------------------- keys and namespace
def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    mine = PageKeyChain(BS, "tenant-a").extend(TOKENS, 5)
    code = (
        "from hicache.integrations.vllm.naming import PageKeyChain;"
        f"print(','.join(PageKeyChain({BS}, 'tenant-a').extend({TOKENS!r}, 5)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().split(",") == mine


def slow_writes(w: Any, seconds: float) -> None:
    """Make every storage write of worker ``w`` take ``seconds`` longer (a slow store)."""
    backend = w.controller.storage
    real_write = backend._write

    async def slow_write(pages, buffers, parents):  # type: ignore[no-untyped-def]
        await asyncio.sleep(seconds)
        return await real_write(pages, buffers, parents)

    backend._write = slow_write  # type: ignore[method-assign]


def test_salt_and_tokens_change_keys_and_chains_extend_consistently() -> None:
    plain = PageKeyChain(BS).extend(TOKENS, 5)
    assert PageKeyChain(BS, "").extend(TOKENS, 5) == plain
    salted = PageKeyChain(BS, "s").extend(TOKENS, 5)
    assert not set(plain) & set(salted)
    chain = PageKeyChain(BS)
    assert chain.extend(TOKENS, 2) == plain[:2]
    assert chain.extend(TOKENS, 99) == plain  # no more than the tokens fill
    other = list(TOKENS)
    other[BS] += 1  # second block differs: first key equal, the rest differ
    changed = PageKeyChain(BS).extend(other, 5)
    assert changed[0] == plain[0] and not set(changed[1:]) & set(plain)


def test_namespace_changes_with_what_makes_kv_incompatible() -> None:
    base = namespace().digest
    variants = [
        namespace(model="other"), namespace(revision="r2"), namespace(tp_rank=1, tp_size=2), namespace(pp_size=2),
        namespace(salt="deploy-b"), namespace(block_format="cpu_attn-amx"), namespace(block_format="kv-cells"),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "dtype": "float16"})),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "block_size": 64})),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "num_layers": 3})),
    ]
    digests = {v.digest for v in variants}
    assert base not in digests and len(digests) == len(variants)
    assert namespace().digest == base


def test_options_refuse_unknown_keys_and_bad_values() -> None:
    assert ConnectorOptions.from_extra_config(None) == ConnectorOptions()
    with pytest.raises(ConfigError, match="host_page"):
        ConnectorOptions.from_extra_config({"host_page": 3})
    for bad in ({"host_pages": 0}, {"host_pages": True}, {"load_timeout_s": -1}, {"lookup_wait_s": float("nan")},
                {"backend": ""}, {"backend_options": []}):
        with pytest.raises(ConfigError):
            ConnectorOptions.from_extra_config(bad)
    # finite, but past what a thread can wait: every wait on them raised OverflowError (each
    # storage read a miss, the forward's layer wait and shutdown's drain an exception)
    for name in ("lookup_wait_s", "lookup_timeout_s", "load_timeout_s", "close_timeout_s"):
        with pytest.raises(ConfigError, match=name):
            ConnectorOptions.from_extra_config({name: 1e12})
    assert ConnectorOptions.from_extra_config({"load_timeout_s": 86400.0}).load_timeout_s == 86400.0
    with pytest.raises(ConfigError, match="no option"):
        StoreIO("file", {"rooot": "/nonexistent"}, [namespace()], name="t")
    with pytest.raises(ConfigError, match="lru"):
        ConnectorOptions.from_extra_config({"eviction_policy": "newest"})
    with pytest.raises(ConfigError, match="storage_queue_size"):
        ConnectorOptions.from_extra_config({"controller": {"storage_queue_sise": 8}})
    with pytest.raises(ConfigError, match="set by the connector"):
        ConnectorOptions.from_extra_config({"controller": {"prefetch_threshold": 64}})
    for bad in ({"recompute_tokens_per_s": 0}, {"recompute_tokens_per_s": float("inf")},
                {"recompute_tokens_per_s": True}, {"recompute_bound": "yes"}):
        with pytest.raises(ConfigError, match="recompute"):
            ConnectorOptions.from_extra_config(bad)
    opts = ConnectorOptions.from_extra_config({"controller": {"storage_max_retries": 1}, "eviction_policy": "slru"})
    cfg = opts.controller_config()
    assert cfg.storage_max_retries == 1 and cfg.prefetch_threshold == 0 and cfg.prefetch_policy == "wait_complete"


# ---------------------------------------------------------------- worker: save, load
def test_a_load_timeout_of_zero_is_refused_at_start(tmp_path: Path) -> None:
    """``load_timeout_s: 0`` gave every storage read no time at all: each page the scheduler
    had claimed (its lookup found it) failed its load, and under vLLM's default
    ``kv_load_failure_policy: fail`` every request with a storage hit failed. The option is
    refused at start; the other timeouts keep 0 (no wait, no lookups, no drain)."""
    src, keys = stored(tmp_path, seed=3, num_pages=2)
    w = worker(tmp_path, kv_layers(None), load_timeout_s=0.0)
    try:
        assert load(w, [PageLoad("r", tuple(keys), (0, 1), (0, 1))]) == {0, 1}  # what 0 did
    finally:
        w.close(timeout=10)
    with pytest.raises(ConfigError, match="load_timeout_s"):
        ConnectorOptions.from_extra_config({"load_timeout_s": 0})
    for name in ("lookup_wait_s", "lookup_timeout_s", "close_timeout_s"):
        assert getattr(ConnectorOptions.from_extra_config({name: 0}), name) == 0


def test_saved_pages_load_back_bit_exact_in_a_new_worker(tmp_path: Path) -> None:
    src = kv_layers(seed=1)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    w1 = worker(tmp_path, src)
    w1.save([saves(keys[:3], (0, 1, 2), (4, 9, 2), job=1), PageSave("q", tuple(keys[3:5]), (3, 4), (11, 0), job=2)])
    assert w1.close(timeout=30) == 0
    assert w1.stats["pages_saved"] == 5

    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        failed = load(w2, [PageLoad("r", tuple(keys[:5]), (7, 8, 9, 10, 11), (1, 2, 3, 4, 5))])
        assert failed == set()
        for layer_src, layer_dst in zip(src, dst):
            for s, d in zip((4, 9, 2, 11, 0), (1, 2, 3, 4, 5)):
                assert torch.equal(layer_src[s], layer_dst[d])
        assert w2.stats["pages_loaded"] == 5
        # the second time the pages come from the host pool, not from storage
        assert load(w2, [PageLoad("r", tuple(keys[:2]), (7, 8), (6, 7), from_host=2)]) == set()
        assert w2.stats["pages_from_host"] == 2 and w2.stats["pages_loaded"] == 5
        assert torch.equal(dst[1][6], src[1][4])
    finally:
        w2.close(timeout=10)


def test_a_damaged_page_fails_with_the_pages_after_it_and_writes_nothing(tmp_path: Path) -> None:
    src, keys = stored(tmp_path, seed=2, num_pages=4)
    pages = sorted(page_files(tmp_path))
    assert len(pages) == 4
    # damage the page of keys[1]: find its file by the payload it holds, flip one payload byte
    payload = torch.cat([t[1].reshape(-1).view(torch.uint8) for t in src]).numpy().tobytes()
    target = next(p for p in pages if payload in p.read_bytes())
    data = bytearray(target.read_bytes())
    data[data.find(payload) + 100] ^= 0x55
    target.write_bytes(bytes(data))

    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        failed = load(w2, [PageLoad("r", tuple(keys), (0, 1, 2, 3), (8, 9, 10, 11)),
                           PageLoad("x", ("missing-key",), (4,), (12,))])
        assert failed == {9, 10, 11, 12}
        assert torch.equal(dst[0][8], src[0][0])
        for b in (9, 10, 11, 12):
            assert not dst[0][b].any() and not dst[1][b].any()  # nothing written into failed blocks
        # the slots the scheduler put those pages in are reported: they hold nothing
        assert w2.take_report().bad_slots == {1, 2, 3, 4}
        assert w2.holds(0) == keys[0] and w2.holds(1) is None
    finally:
        w2.close(timeout=10)


def test_a_failed_load_says_in_the_log_which_request_and_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A load the scheduler promised that fails (pages the store lost since its lookup, a host
    page the worker no longer holds, no host slot to read into) fails its blocks, and under
    vLLM's default ``kv_load_failure_policy`` its request; the worker said nothing then (its
    ``pages_failed`` count came only at close), so an operator saw vLLM's "KV load failure"
    with no word of which pages failed or why. Each request's failure is logged, with the
    reason of its first failed page (the pages after it fail with it)."""
    _, keys = stored(tmp_path, seed=3, num_pages=3)
    for page in page_files(tmp_path):
        page.unlink()  # the store lost them after the scheduler's lookup
    w = worker(tmp_path, kv_layers(seed=None), host_pages=8)
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.integrations.vllm"):
            failed = load(w, [PageLoad("lost", tuple(keys), (0, 1, 2), (3, 4, 5)),
                              PageLoad("gone", tuple(keys[:1]), (6,), (6,), from_host=1),
                              PageLoad("full", tuple(keys[:2]), (-1, -1), (7, 8))])
    finally:
        w.close(timeout=10)
    assert failed == {3, 4, 5, 6, 7, 8}
    said = {r.getMessage() for r in caplog.records}
    for rid, n, why in (("lost", 3, "storage did not return it"), ("gone", 1, "its host slot no longer holds it"),
                        ("full", 2, "no free host slot to read it into")):
        assert any(f"{n} of {n} page(s) of '{rid}'" in m and why in m for m in said), (rid, said)


def test_a_read_slower_than_the_load_timeout_fails_its_blocks_and_writes_nothing(tmp_path: Path) -> None:
    _, keys = stored(tmp_path, seed=5, num_pages=2)
    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst, host_pages=8, load_timeout_s=0.5)
    backend = w2.controller.storage
    real_read = backend._read
    disk = threading.Event()  # a read stuck in the kernel (an I/O thread cannot be abandoned)

    async def slow_read(pages, buffers):  # type: ignore[no-untyped-def]
        await run_to_completion(disk.wait, 30)
        return await real_read(pages, buffers)

    backend._read = slow_read  # type: ignore[method-assign]
    try:
        t = time.monotonic()
        assert load(w2, [PageLoad("r", tuple(keys), (3, 4), (3, 4))]) == {3, 4}
        assert time.monotonic() - t < 2.5
        assert not dst[0][3:5].any() and not dst[1][3:5].any()
        # the slots a cancelled read may still touch are refused until the read has returned
        w2.save([saves(keys, (3, 4), (3, 4))])
        assert w2.stats["saves_dropped"] == 2 and w2.take_report().bad_slots == {3, 4}
        disk.set()
        deadline = time.monotonic() + 10
        while w2._reading and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not w2._reading
    finally:
        disk.set()
        w2.close(timeout=10)



def test_an_old_lookup_is_asked_again_before_its_pages_are_promised(tmp_path: Path, monkeypatch) -> None:
    """A request vLLM could not admit yet (or a preempted one, back later) reused its first
    storage answer for good: pages the store dropped meanwhile were still promised, their load
    failed, and under kv_load_failure_policy="fail" the request errored out."""
    from hicache.integrations.vllm import scheduler_side

    stored(tmp_path, seed=4, num_pages=3)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(seed=None))
    try:
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS  # not admitted this step
        s.plan_step([])
        s.store.call(s.store.backends[0].batch_delete(PageKeyChain(BS).extend(TOKENS, 3)), timeout=10)
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS  # a moment later: the answer stands
        monkeypatch.setattr(scheduler_side, "LOOKUP_TTL_S", 0.0)  # later: it is old
        hit = None
        for _ in range(100):  # "ask again" while the new lookup runs
            hit = s.matched_tokens("a", TOKENS, None, 0)
            if hit is not None:
                break
            time.sleep(0.01)
        assert hit == 0
        plan, failed = run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
        assert not failed
    finally:
        w.close(timeout=10)
        s.close(timeout=10)

def test_a_closed_worker_ignores_further_steps(tmp_path: Path) -> None:
    src, keys = stored(tmp_path, seed=6, num_pages=1)
    w = worker(tmp_path, src)
    assert w.close(timeout=10) == 0
    assert w.close(timeout=10) == 0  # twice is fine
    w.start([PageLoad("r", tuple(keys), (3,), (3,))])
    w.wait_layer("layer.0")
    w.save([saves(keys, (3,), (3,), job=7)])
    w.finish_step()
    assert w.take_failed_blocks() == set()
    assert w.take_report().jobs_done[7] == 1  # the scheduler still learns the job ended


def test_block_ids_outside_vllms_cache_fail_cleanly(tmp_path: Path) -> None:
    src = kv_layers(seed=15)
    keys = PageKeyChain(BS).extend(TOKENS, 3)
    w = worker(tmp_path, src)
    try:
        w.save([saves(keys, (0, 1, 2), (3, 99, 4), job=5)])  # block 99 does not exist
        assert w.holds(0) == keys[0] and w.holds(1) is None
        assert load(w, [PageLoad("r", tuple(keys[:1]), (0,), (-1,), from_host=1)]) == {-1}
    finally:
        assert w.close(timeout=10) == 0
    report = w.take_report()
    assert report.jobs_done[5] == 1 and report.bad_slots == {1, 2} and w.stats["pages_saved"] == 1


def test_close_drains_the_storage_queue_or_reports_what_it_left(tmp_path: Path) -> None:
    """Writes still queued at shutdown reach the store (close waits for the controller's
    queue), or, past the close timeout, are counted as lost, never half written."""
    src = kv_layers(seed=8)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    for root, timeout in ((tmp_path / "drained", 30.0), (tmp_path / "cut", 0.2)):
        w = worker(root, src, storage_batch_pages=1)
        slow_writes(w, 0.3)
        w.save([saves(keys, range(5), range(5))])
        lost = w.close(timeout=timeout)
        if timeout > 1:
            assert lost == 0 and w.stats["pages_saved"] == 5
            dst = kv_layers(seed=None)
            w2 = worker(root, dst)
            try:
                assert load(w2, [PageLoad("r", tuple(keys), tuple(range(5)), (10, 11, 12, 13, 14))]) == set()
                assert all(torch.equal(src[i][b], dst[i][10 + b]) for i in range(2) for b in range(5))
            finally:
                w2.close(timeout=10)
        else:
            assert lost > 0 and w.stats["pages_saved"] + lost == 5
            assert len(page_files(root)) == w.stats["pages_saved"]


def test_scheduler_store_close_with_a_lookup_stuck_in_a_thread_keeps_its_timeout() -> None:
    """A store whose open hangs in a thread call (a folder made on a hard NFS mount whose server
    is down) with a lookup waiting for it: the scheduler's close waited for the lookup and the
    store's close up to its timeout each, then joined the loop thread for a fixed 10 s more
    (vLLM's shutdown, and a failed start-up's ``close(0)``, held that long). Its loop's stop now
    keeps the close's timeout; the lookup still gets its answer once the thread call returns."""
    from hicache_backends.memory.backend import MemoryStorage

    mount_back = threading.Event()

    class HungOpen(MemoryStorage):
        async def _open(self) -> None:
            await run_to_completion(mount_back.wait, 30)  # really blocks a thread
            await super()._open()

    store = StoreIO("memory", {}, [namespace()], name="t-stuck")
    store.backends[0] = HungOpen(namespace=namespace())
    lookup = store.submit(store.primary.exists_pages(["x"]))
    try:
        began = time.monotonic()
        store.close(0.3)
        assert time.monotonic() - began < 3.0  # was 0.3 + 0.3 + 10 s
    finally:
        mount_back.set()
    with pytest.raises(BaseException):
        lookup.result(10)
    store._loop._thread.join(10)
    assert store._loop.loop.is_closed()


def test_a_slot_still_being_written_is_never_overwritten(tmp_path: Path) -> None:
    src = kv_layers(seed=9)
    keys = PageKeyChain(BS).extend(TOKENS, 2)
    other = PageKeyChain(BS).extend(OTHER, 1)
    w = worker(tmp_path, src)
    slow_writes(w, 0.5)
    w.save([saves(keys, (0, 1), (0, 1), job=1)])
    w.save([saves(other, (1,), (7,), job=2)])  # a (buggy) plan reusing slot 1 at once
    report = w.take_report()
    assert report.bad_slots == {1} and report.jobs_done[2] == 1 and w.stats["saves_dropped"] == 1
    assert w.holds(1) == keys[1]
    assert w.close(timeout=30) == 0
    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        assert load(w2, [PageLoad("r", tuple(keys), (0, 1), (3, 4))]) == set()
        assert torch.equal(dst[0][4], src[0][1])  # the page written is the first one, whole
    finally:
        w2.close(timeout=10)


# ---------------------------------------------------------------- scheduler
def test_scheduler_hits_stored_pages_and_plans_loads_and_saves(tmp_path: Path) -> None:
    stored(tmp_path, seed=4, num_pages=3)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    s = scheduler("file", {"root": str(tmp_path)})
    try:
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS  # asked again: same answer
        assert s.matched_tokens("b", TOKENS, "other-tenant", 0) == 0  # salted: other keys
        assert s.matched_tokens("c", TOKENS[: 3 * BS], None, 0) == 2 * BS  # one token is computed
        assert s.matched_tokens("d", TOKENS, None, BS) == 2 * BS  # vLLM holds block 0 already
        blocks = list(range(100, 106))
        s.allocated("d", blocks, 2 * BS)
        plan = s.plan_step([("d", 3 * BS, len(TOKENS), TOKENS, blocks)])
        # the tree holds no prefix of them (vLLM holds block 0): read into staging slots
        (ld,) = plan.loads
        assert (ld.keys, ld.block_ids, ld.from_host) == (tuple(keys[1:3]), (101, 102), 0)
        # every page from the tree's end on goes to host slots; 3 and 4 are new: written
        (sv,) = plan.saves
        assert sv.keys == tuple(keys) and sv.block_ids == tuple(blocks[:5]) and sv.write_from == 3
        assert sv.prior_key == keys[2] and s.tree.held_pages() == 5
        assert s.plan_step([("d", len(TOKENS), len(TOKENS) + 1, TOKENS, blocks)]).saves == []
        # another request with the same prompt is served from the host tier at once
        assert s.matched_tokens("e", TOKENS, None, 0) == 5 * BS
        s.finished("d")
        assert s.plan_step([("d", 0, len(TOKENS), TOKENS, blocks)]).saves == []
    finally:
        s.close(timeout=10)


def test_scheduler_with_a_store_that_is_down_answers_miss_without_raising() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scheduler("s3", {"url": "s3://nobody/kv", "storage_options": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                                          "key": "k", "secret": "s"},
                          "request_timeout": 1.0, "call_timeout": 2.0, "retries": 0}, wait=0.001, timeout=10.0)
    try:
        answers = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            a = s.matched_tokens("a", TOKENS, None, 0)
            answers.append(a)
            if a is not None:
                break
            time.sleep(0.05)
        assert answers[-1] == 0
        assert all(a is None for a in answers[:-1])
    finally:
        s.close(timeout=10)


def test_scheduler_lookup_past_its_timeout_is_a_miss(tmp_path: Path) -> None:
    s = scheduler("file", {"root": str(tmp_path)}, wait=0.0, timeout=0.0)
    try:
        # the lookup is submitted; with no time to wait and no time allowed it is a miss or an
        # immediate answer, never "ask again" forever
        first = s.matched_tokens("a", TOKENS, None, 0)
        assert first in (0, None)
        assert s.matched_tokens("a", TOKENS, None, 0) == 0
    finally:
        s.close(timeout=10)


# ---------------------------------------------------------------- both halves together
def test_a_prompt_is_served_from_the_host_tier_without_storage(tmp_path: Path) -> None:
    """Computed once, its blocks freed by vLLM, asked again: the tree says the host pool holds
    it, the worker copies it from there (the store is emptied first: it cannot come from it)."""
    src = kv_layers(seed=10)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, src)
    try:
        assert request(s, "a", TOKENS, list(range(6))) == 0
        run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
        s.finished("a")
        wait_report(s, w)
        for p in page_files(tmp_path):
            p.unlink()
        blocks = list(range(8, 14))
        assert request(s, "b", TOKENS, blocks) == 5 * BS
        plan, failed = run_step(s, w, [("b", 5 * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set() and plan.loads[0].from_host == 5 and plan.saves == []
        assert w.stats["pages_from_host"] == 5 and w.stats["pages_loaded"] == 0
        assert all(torch.equal(src[i][b], src[i][8 + b]) for i in range(2) for b in range(5))
        assert s.stats["host_hit_tokens"] == 5 * BS
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_evicted_host_pages_come_back_from_storage(tmp_path: Path) -> None:
    """A host tier of 6 pages: a second prompt evicts the first one's pages by LRU; the first
    prompt then hits storage and loads bit-exact into new slots, which join the tree again."""
    src = kv_layers(seed=11)
    orig = [t.clone() for t in src]
    s = scheduler("file", {"root": str(tmp_path)}, host_pages=6)
    w = worker(tmp_path, src, host_pages=6)
    try:
        request(s, "a", TOKENS, list(range(6)))
        run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
        assert s.tree.held_pages() == 5
        wait_report(s, w)  # a's writes ended: its pages may be evicted now
        request(s, "b", OTHER, list(range(6, 12)))
        run_step(s, w, [("b", 0, len(OTHER), OTHER, list(range(6, 12)))])
        wait_report(s, w)
        # the tree evicts whole nodes: a's pages (one node) went at once
        assert s.tree.held_pages() == 5 and s.tree.stats["evicted_pages"] == 5
        held = s.tree.match(TOKENS, None, 5, count_hit=False).pages
        assert held == 0
        s.finished("a")
        blocks = [12, 13, 14, 15, 0, 1]
        assert request(s, "a2", TOKENS, blocks) == 5 * BS  # host part, then storage
        plan, failed = run_step(s, w, [("a2", 5 * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set()
        (ld,) = plan.loads
        assert ld.from_host == held
        assert w.stats["pages_loaded"] == 5 - held
        assert all(torch.equal(orig[i][b], src[i][blocks[b]]) for i in range(2) for b in range(5))
        assert s.tree.match(TOKENS, None, 5, count_hit=False).pages == 5  # in the host tier again
        s.tree.tree.sanity_check()
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_a_worker_that_lost_its_host_pages_reports_them_and_nothing_wrong_is_served(tmp_path: Path) -> None:
    """The scheduler's tree says the host pool holds a prompt, but the worker restarted (an
    empty pool): the load fails for those blocks (vLLM recomputes them), the worker reports the
    slots, the scheduler forgets them, and the next lookup goes to storage and loads right."""
    src = kv_layers(seed=12)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, src)
    request(s, "a", TOKENS, list(range(6)))
    run_step(s, w, [("a", 0, len(TOKENS), TOKENS, list(range(6)))])
    wait_report(s, w)
    assert w.close(timeout=30) == 0
    s.finished("a")
    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        blocks = list(range(8, 14))
        assert request(s, "b", TOKENS, blocks) == 5 * BS
        plan, failed = run_step(s, w2, [("b", 5 * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set(blocks[:5])
        assert not dst[0][8:13].any()  # nothing copied from slots that hold nothing
        assert s.tree.held_pages() == 0  # the report dropped every node
        s.finished("b")
        assert request(s, "c", TOKENS, blocks) == 5 * BS  # from storage now
        plan, failed = run_step(s, w2, [("c", 5 * BS, len(TOKENS), TOKENS, blocks)])
        assert failed == set() and plan.loads[0].from_host == 0
        assert all(torch.equal(src[i][b], dst[i][8 + b]) for i in range(2) for b in range(5))
    finally:
        w2.close(timeout=10)
        s.close(timeout=10)


def test_a_storage_hit_is_never_larger_than_the_host_room(tmp_path: Path) -> None:
    """Every host slot is locked by writes still running: a storage hit has no slot to read
    into. It used to be reported anyway and its load failed, which under vLLM's default
    ``kv_load_failure_policy="fail"`` fails the request; now the hit is cut to the room (none
    here: the request computes). A save bigger than the room saves its first pages and tries
    the rest next step. With room for two pages, two are promised, and the next request in
    the same step is not promised the same two."""
    stored(tmp_path, seed=13, num_pages=4)
    src = kv_layers(seed=14)
    s = scheduler("file", {"root": str(tmp_path)}, host_pages=3)
    w = worker(tmp_path, src, host_pages=3)
    try:
        request(s, "a", OTHER, list(range(6)))
        (sv,), _ = run_step(s, w, [("a", 0, len(OTHER), OTHER, list(range(6)))], report=False)[0].saves, None
        assert len(sv.keys) == 3 and s.tree.held_pages() == 3  # five pages, three slots: the first three
        assert s.tree.tree.protected_size() == 3 * BS  # locked while being written
        # the rest finds no room while the writes run: nothing saved, nothing waits
        assert s.plan_step([("a", len(OTHER), len(OTHER) + 1, OTHER, list(range(6)))]).saves == []
        blocks = list(range(10, 15))
        assert request(s, "c", TOKENS, blocks) == 0  # four pages stored, no slot to read them into
        assert s.stats["hits_capped_for_room"] == 4 and s.stats["loads_without_room"] == 0
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_hits_in_one_step_share_the_host_room(tmp_path: Path) -> None:
    stored(tmp_path, seed=13, num_pages=4)
    s = scheduler("file", {"root": str(tmp_path)}, host_pages=2)
    try:
        assert s.matched_tokens("a", TOKENS, None, 0) == 2 * BS  # room for two of the four
        assert s.matched_tokens("b", TOKENS, None, 0) == 0  # those two are promised to "a"
        assert s.matched_tokens("a", TOKENS, None, 0) == 2 * BS  # asked again: its own promise
        s.allocated("a", list(range(5)), 2 * BS)
        # capped once per request: "a" asked again adds nothing
        assert s.stats["loads_without_room"] == 0 and s.stats["hits_capped_for_room"] == 2 + 4
        s.plan_step([("a", 2 * BS, 2 * BS + 1, TOKENS, list(range(5)))])
        s.finished("b")
    finally:
        s.close(timeout=10)


def test_writes_unlock_only_when_every_worker_reported(tmp_path: Path) -> None:
    from hicache.integrations.vllm.transfers import WorkerReport

    s = SchedulerSide(StoreIO("file", {"root": str(tmp_path)}, [namespace()], name="t"), HostPageTree(8, BS),
                      lookup_wait_s=5.0, lookup_timeout_s=5.0, num_workers=2)
    try:
        request(s, "a", TOKENS, list(range(6)))
        (sv,) = s.plan_step([("a", 0, len(TOKENS), TOKENS, list(range(6)))]).saves
        s.on_report(WorkerReport(jobs_done=__import__("collections").Counter({sv.job: 1})))
        assert sv.job in s._writes
        merged = WorkerReport().merge(WorkerReport(jobs_done=__import__("collections").Counter({sv.job: 1})))
        s.on_report(merged)
        assert not s._writes and s.tree.tree.protected_size() == 0
    finally:
        s.close(timeout=10)


def test_the_worker_report_crosses_vllm_as_mergeable_worker_metadata() -> None:
    from collections import Counter

    from hicache.integrations.vllm.connector import HiCacheWorkerMetadata
    from hicache.integrations.vllm.transfers import WorkerReport

    a = HiCacheWorkerMetadata(WorkerReport(Counter({1: 1}), {3}, reads=[(2, 0.5), (4, 0.1)], load_wait_s=0.25))
    b = HiCacheWorkerMetadata(WorkerReport(Counter({1: 1, 2: 1}), {4}, reads=[(1, 0.75)], load_wait_s=0.5))
    merged = a.aggregate(b)
    assert merged.report.jobs_done == Counter({1: 2, 2: 1}) and merged.report.bad_slots == {3, 4}
    # the ranks' reads of a step as the slowest one's (the forward waits for the last shard),
    # not averaged; and the forward waited as long as its slowest rank
    assert merged.report.reads == [(1, 0.75), (4, 0.1)] and merged.report.load_wait_s == 0.5
    assert WorkerReport(reads=[(1, 0.0)]) and WorkerReport(load_wait_s=0.1) and not WorkerReport()
    import pickle

    assert pickle.loads(pickle.dumps(merged)).report == merged.report


def test_kv_first_layers_round_trip_block_by_block(tmp_path: Path) -> None:
    """FlashAttention's per-layer tensors are [2, blocks, block_size, heads, dim]: a block is
    then two pieces, K and V, and still moves as one page."""
    g = torch.Generator().manual_seed(7)
    src = [torch.randn(2, 16, BS, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    keys = PageKeyChain(BS).extend(TOKENS, 3)
    w1 = worker(tmp_path, src)
    w1.save([saves(keys, (0, 1, 2), (5, 0, 9))])
    assert w1.close(timeout=30) == 0
    dst = [torch.zeros(2, 16, BS, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    w2 = worker(tmp_path, dst)
    try:
        assert load(w2, [PageLoad("r", tuple(keys), (0, 1, 2), (1, 2, 3))]) == set()
        for a, b in zip(src, dst):
            for s, d in zip((5, 0, 9), (1, 2, 3)):
                assert torch.equal(a[:, s], b[:, d])
        assert torch.count_nonzero(dst[0][:, 4]) == 0
    finally:
        w2.close(timeout=10)
    with pytest.raises(ValueError, match="holds no block"):
        worker(tmp_path, [torch.zeros(3, 16, BS, 64, dtype=torch.bfloat16) for _ in range(2)])


def test_lora_and_multimodal_inputs_root_their_own_key_chains() -> None:
    """Same tokens under another LoRA adapter or with another image are other KV."""
    from types import SimpleNamespace as NS

    from hicache.integrations.vllm.connector import request_salt

    def req(salt=None, lora=None, images=()):
        feats = [NS(identifier=i, mm_position=NS(offset=4, length=8)) for i in images]
        return NS(cache_salt=salt, lora_request=lora, mm_features=feats)

    assert request_salt(req()) is None and request_salt(req("s")) == "s"  # keys kept as they were
    a, b = NS(lora_name="a", lora_path="/a"), NS(lora_name="b", lora_path="/b")
    salts = [request_salt(r) for r in (req(), req("s"), req(lora=a), req(lora=b), req(images=["x"]),
                                       req(images=["y"]), req("s", lora=a, images=["x"]))]
    assert len(set(salts)) == len(salts)
    chains = {tuple(PageKeyChain(BS, s).extend(TOKENS, 2)) for s in salts}
    assert len(chains) == len(salts)


def test_a_request_whose_salt_changes_moves_to_its_new_root(tmp_path: Path) -> None:
    """A vLLM streaming-input session given a new image mid-life changes its salt (each image's
    identifier is part of the root): its pages after the change are other KV than the same
    tokens without that image. They were saved under the old root, where another session with
    the first image and another second one (same placeholder tokens) would have loaded them.
    The request moves to the new root: its saves go there (every page saved again), and so
    does a lookup after a preemption."""
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(seed=3))
    try:
        blocks = list(range(8))
        old = PageKeyChain(BS, "img=x").extend(TOKENS, 5)
        new = PageKeyChain(BS, "img=x,y").extend(TOKENS, 5)
        first = TOKENS[: 2 * BS + 1]
        assert s.matched_tokens("a", first, "img=x", 0) == 0
        plan, _ = run_step(s, w, [("a", 0, len(first), first, blocks)])
        assert [sv.keys for sv in plan.saves] == [tuple(old[:2])]
        s.reroot("a", "img=x,y")  # the session's next input brought image y
        plan, _ = run_step(s, w, [("a", len(first), len(TOKENS), TOKENS, blocks)])
        (sv,) = plan.saves
        assert sv.keys == tuple(new) and sv.write_from == 0 and sv.prior_key is None
        wait_report(s, w)
        assert s.stats["requests_rerooted"] == 1
        s.reroot("gone", "img=z")  # no state, nothing to move
        # the old root holds the two pages computed before the image, the new one all five
        assert s.matched_tokens("b", TOKENS, "img=x", 0) == 2 * BS
        assert s.matched_tokens("c", TOKENS, "img=x,y", 0) == 5 * BS
        for rid in ("a", "b", "c"):
            s.finished(rid)
        s.tree.clear()  # storage alone answers from here: the keys it holds are what was written
        assert s.matched_tokens("b", TOKENS, "img=x", 0) == 2 * BS
        assert s.matched_tokens("c", TOKENS, "img=x,y", 0) == 5 * BS
        # a lookup under a changed salt (a preempted session asks again) moves the state too
        assert s.matched_tokens("b", TOKENS, "img=x,y", 0) == 5 * BS
        assert s._reqs["b"].chain.extend(TOKENS, 5) == new and s.stats["requests_rerooted"] == 2
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_pages_read_from_storage_count_as_stored(tmp_path: Path) -> None:
    """Pages a load read from storage into the tree are in storage (the lookup found them): a
    later request through them writes only its own new pages, and its lookup asks storage
    only about the pages after the host tier's hit. A bad-slot report forgets that again."""
    stored(tmp_path, seed=4, num_pages=3)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(seed=None))
    try:
        blocks = list(range(8))
        assert request(s, "a", TOKENS, blocks) == 3 * BS
        run_step(s, w, [("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
        wait_report(s, w)
        s.finished("a")
        slots = s.tree.match(TOKENS, None, 5, count_hit=False).slots
        assert len(slots) == 5 and set(slots) <= s.tree.stored
        # b: vLLM holds the first five pages; its decoded tokens complete page 5
        toks = TOKENS + list(range(BS))
        assert s.matched_tokens("b", toks[: len(TOKENS)], None, 5 * BS) == 0
        plan, _ = run_step(s, w, [("b", 5 * BS, 6 * BS, toks, blocks)])
        assert [(sv.write_from, sv.copy_from, len(sv.keys)) for sv in plan.saves] == [(0, 0, 1)]
        assert s.stats["pages_rewritten"] == 0
        wait_report(s, w)
        s.finished("b")
        asked: list[int] = []
        be = s.store.backends[0]
        real = be.exists_pages

        async def spy(keys):
            asked.append(len(keys))
            return await real(keys)

        be.exists_pages = spy
        long = TOKENS[: 5 * BS] + [7] * (3 * BS + 1)
        assert s.matched_tokens("c", long, None, 0) == 5 * BS
        assert asked == [3]  # pages 5..7 only: the host tier's five are known stored
        from hicache.integrations.vllm.transfers import WorkerReport

        s.on_report(WorkerReport(bad_slots={slots[1]}))
        assert not set(slots[1:]) & s.tree.stored and slots[0] in s.tree.stored
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_freed_host_slots_leave_the_stored_set() -> None:
    """Evicted slots hold nothing: they are no longer counted as stored (one entry per page,
    whatever the page size); with nothing stored, evictions skip that bookkeeping."""
    for bs in (1, 4):
        t = HostPageTree(8, bs)
        toks = list(range(8 * bs))
        slots = t.reserve(8)
        m = t.match(toks, None, 8, count_hit=False)
        t.insert(toks, None, m, slots)
        t.stored.update(slots[:6])
        t.stored.add(1000)  # a slot outside the evicted ones stays
        got = t.reserve(8)  # evicts every page
        assert got is not None and t.stored == {1000}
        t.stored.clear()
        calls: list[list[int]] = []
        hook = t.tree.on_free
        t.tree.on_free = lambda slots: (calls.append(list(slots)), hook(slots))
        t.insert(toks, None, t.match(toks, None, 8, count_hit=False), got)
        assert t.reserve(8) is not None and t.stored == set() and t.held_pages() == 0
        assert calls == []  # nothing stored: evictions skip the per-page bookkeeping


# ---------------------------------------------------------------- storage hits against recomputing
def test_workers_report_their_reads_and_load_waits_and_the_scheduler_learns_both(tmp_path: Path) -> None:
    """A step that reads from storage reports its pages and seconds (the store's pace) and how
    long the forward waited for them; the scheduler times the step from its plan to the
    report, less that wait, against the tokens it computed (the engine's prefill pace)."""
    stored(tmp_path, seed=21, num_pages=3)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(None))
    backend = w.controller.storage
    real_read = backend._read

    async def slow_read(pages, buffers):  # type: ignore[no-untyped-def]
        # a read far longer than the engine thread takes to reach its first layer's wait, on a
        # loaded machine too (a read of a few ms was often done before the forward waited)
        await asyncio.sleep(0.5)
        return await real_read(pages, buffers)

    backend._read = slow_read  # type: ignore[method-assign]
    try:
        assert s.bound.read_pace.seconds_per_page is None and s.bound.prefill.observations == 0
        blocks = list(range(6))
        assert request(s, "a", TOKENS, blocks) == 3 * BS
        plan = s.plan_step([("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
        begin(w, plan)
        assert load(w, plan.loads) == set()
        w.save(plan.saves)
        report = w.take_report()
        ((pages, seconds),) = report.reads
        # the forward's first layer waited for the whole read
        assert pages == 3 and seconds > 0 and report.load_wait_s >= 0.5 * seconds
        s.on_report(report)
        assert s.bound.read_pace.seconds_per_page == pytest.approx(seconds / 3)
        assert s.bound.prefill.observations == 1  # 2 pages + 3 tokens computed: one prefill seen
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def _clock_only(name: str) -> SchedulerSide:
    return SchedulerSide(StoreIO("memory", {}, [namespace()], name=name), HostPageTree(8, BS),
                         lookup_wait_s=0.1, lookup_timeout_s=1.0)


def test_a_step_is_timed_without_its_load_wait_and_decode_teaches_nothing() -> None:
    """Steps of requests the connector does not know are timed only. The same steps, once
    with most of their time spent waiting for loads: that part is not compute. Decode-only
    steps (one token a request, here 64 of them) and a step all of whose time was a load wait
    teach nothing."""
    from hicache.integrations.vllm.transfers import WorkerReport

    learned = []
    for waiting in (0.0, 0.6):  # the share of each step spent waiting for its loads
        s = _clock_only(f"t-clock-{waiting}")
        try:
            for n in (64, 128, 256, 512):
                plan = s.plan_step([("x", 0, n, [], [])])
                took = time.perf_counter()
                time.sleep(n * 1e-4)  # a step's time grows with its tokens: a clear slope
                took = time.perf_counter() - took
                s.on_report(WorkerReport(step=plan.step, load_wait_s=waiting * took))
            plan = s.plan_step([(f"d{i}", 100, 101, [], []) for i in range(64)])
            time.sleep(0.02)
            s.on_report(WorkerReport(step=plan.step))
            plan = s.plan_step([("y", 0, 1024, [], [])])
            s.on_report(WorkerReport(step=plan.step, load_wait_s=3600.0))
            assert s.bound.prefill.observations == 4
            s.on_report(WorkerReport(step=999))  # a report of a step never planned (or timed already)
            assert s.bound.prefill.observations == 4 and not s.bound.step_clock
            learned.append(s.bound.prefill.seconds_per_token)
        finally:
            s.close(timeout=10)
    full, less_waits = learned
    assert full is not None and less_waits is not None and less_waits < 0.7 * full


def test_async_scheduling_times_a_step_from_the_report_before_it() -> None:
    """vLLM's async scheduling plans step k+1 while step k runs: timed from its own plan, each
    step also counted the one before it (and that one's load wait), so a slow store's stalls
    made recomputing look dear and kept the store claimed. A step now starts at the previous
    step's report when that is later than its plan."""
    from hicache.integrations.vllm.transfers import WorkerReport

    s = _clock_only("t-async")
    step_s, tokens = 0.03, 256
    try:
        plans = [s.plan_step([("x", 0, tokens, [], [])])]
        for _ in range(6):
            plans.append(s.plan_step([("x", 0, tokens, [], [])]))  # the next one, planned at once
            time.sleep(step_s)  # the oldest one runs
            s.on_report(WorkerReport(step=plans.pop(0).step))
        spt = s.bound.prefill.seconds_per_token
        assert spt is not None and spt < 1.5 * step_s / tokens  # timed from its own plan: 2x
    finally:
        s.close(timeout=10)


def test_storage_hits_are_not_claimed_while_a_read_is_slower_than_recomputing(tmp_path: Path) -> None:
    """The field notes' bug: a storage hit slower than recomputing. Once both paces are known
    and a page read costs more than computing the page, the scheduler claims no storage hit
    (pages in the host tier still are: they cost a memory copy); every ``repace_s`` one load
    goes through to measure the store again. Nothing is cut before a read was seen, with a
    fast store, or with the bound off."""
    from hicache.integrations.vllm.transfers import WorkerReport

    stored(tmp_path, seed=22, num_pages=3)

    def sched(**kw: object) -> SchedulerSide:
        return SchedulerSide(StoreIO("file", {"root": str(tmp_path)}, [namespace()], name="t-bound"),
                             HostPageTree(64, BS), lookup_wait_s=5.0, lookup_timeout_s=5.0, **kw)  # type: ignore[arg-type]

    # recomputing a page (32 tokens) at 1e6 tokens/s: 32 us; the store: 0.1 s a page
    s = sched(recompute_tokens_per_s=1e6, repace_s=0.2)
    try:
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS  # no read seen yet: claimed
        s.on_report(WorkerReport(reads=[(2, 0.2)]))
        assert s.matched_tokens("b", TOKENS, None, 0) == 0
        assert s.matched_tokens("b", TOKENS, None, 0) == 0  # asked again: counted once
        assert s.matched_tokens("b2", TOKENS, None, BS) == 0  # vLLM holds one block: the rest is storage's
        assert s.stats["hit_pages_cut_recompute"] == 3 + 2
        time.sleep(0.25)
        assert s.matched_tokens("c", TOKENS, None, 0) == 3 * BS  # one load measures the store again
        assert s.matched_tokens("d", TOKENS, None, 0) == 0  # the others wait for its word
        assert s.matched_tokens("c", TOKENS, None, 0) == 3 * BS  # the pacer keeps its claim till its read
        assert s.stats["repace_loads"] == 1
        s.finished("c")  # the pacer ended before its read: the next one after repace_s measures
        time.sleep(0.25)
        assert s.matched_tokens("e", TOKENS, None, 0) == 3 * BS
        s.on_report(WorkerReport(reads=[(3, 0.2)]))  # still slow: the store stays unclaimed
        assert s.matched_tokens("f", TOKENS, None, 0) == 0
        assert s.stats["hit_pages_cut_recompute"] == 3 + 2 + 3 + 3
        time.sleep(0.25)
        assert s.matched_tokens("g", TOKENS, None, 0) == 3 * BS  # measured again
        s.on_report(WorkerReport(reads=[(3, 0.00003)]))  # the store recovered: that read alone counts
        assert s.matched_tokens("h", TOKENS, None, 0) == 3 * BS
        assert s.stats["repace_loads"] == 3
    finally:
        s.close(timeout=10)
    for kw in ({"recompute_tokens_per_s": 10.0}, {"recompute_tokens_per_s": 1e6, "recompute_bound": False}):
        s = sched(**kw)
        try:
            s.on_report(WorkerReport(reads=[(2, 0.2)]))
            assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS, kw
            assert s.stats["hit_pages_cut_recompute"] == 0
        finally:
            s.close(timeout=10)


def test_host_tier_hits_are_claimed_whatever_the_stores_pace(tmp_path: Path) -> None:
    stored(tmp_path, seed=23, num_pages=3)
    from hicache.integrations.vllm.transfers import WorkerReport

    s = SchedulerSide(StoreIO("file", {"root": str(tmp_path)}, [namespace()], name="t-host"),
                      HostPageTree(64, BS), lookup_wait_s=5.0, lookup_timeout_s=5.0,
                      recompute_tokens_per_s=1e6, repace_s=3600.0)
    w = worker(tmp_path, kv_layers(None))
    try:
        blocks = list(range(6))
        assert request(s, "a", TOKENS, blocks) == 3 * BS  # no pace yet: read from storage
        run_step(s, w, [("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
        wait_report(s, w)
        s.on_report(WorkerReport(reads=[(1, 10.0)]))  # then the store turns very slow
        # the prompt's five pages sit in the host tier now: a hit without the store
        assert s.matched_tokens("b", TOKENS, None, 0) == 5 * BS
        assert s.stats["hit_pages_cut_recompute"] == 0
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_a_read_that_lands_nothing_does_not_set_the_pace(tmp_path: Path) -> None:
    """Pages gone from the store by the time they are read fail at once: that says nothing of
    how long a good read takes, so it is not reported as one (it made a slow store look fast)."""
    stored(tmp_path, seed=24, num_pages=3)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(None))
    try:
        blocks = list(range(6))
        assert request(s, "a", TOKENS, blocks) == 3 * BS
        for f in page_files(tmp_path):
            f.unlink()
        plan = s.plan_step([("a", 3 * BS, len(TOKENS), TOKENS, blocks)])
        begin(w, plan)
        assert load(w, plan.loads) == {0, 1, 2}
        assert w.take_report().reads == []
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


# ---------------------------------------------------------------- review findings (stop 39)
def test_a_failed_load_is_reported_before_the_step_is_finished(tmp_path: Path) -> None:
    """vLLM with speculative decoding asks for the step's failed blocks right after the
    forward's last layer, before wait_for_save: a page found missing must be reported then,
    in the step its block was read, never a step late."""
    stored(tmp_path, seed=1, num_pages=3)  # pages 0..2 stored, page 3 is not
    w = worker(tmp_path, kv_layers(None))
    keys = PageKeyChain(BS).extend(TOKENS, 4)
    try:
        for step in range(40):
            w.begin_step(step=step + 1)
            w.start([PageLoad(f"r{step}", tuple(keys), (0, 1, 2, 3), (4, 5, 6, 7), from_host=0)])
            for i in range(GEOM.num_layers):
                w.wait_layer(f"layer.{i}")
            assert w.take_failed_blocks() == {7}, f"step {step}: the failure came late"
            w.finish_step()
            assert w.take_failed_blocks() == set()
            with w._lock:
                w._resident = [None] * w.num_pages  # fresh slots each step
    finally:
        w.close(5)


def test_the_connector_finishes_the_load_before_vllm_reads_its_failures() -> None:
    """get_block_ids_with_load_errors and build_connector_worker_meta end the step's load
    first (vLLM may call them before wait_for_save); finishing again later is a no-op."""
    from hicache.integrations.vllm.connector import HiCacheConnector

    calls: list[str] = []

    class Worker:
        def finish_step(self) -> None:
            calls.append("finish")

        def take_failed_blocks(self) -> set[int]:
            calls.append("failed")
            return {3}

        def take_report(self) -> None:
            calls.append("report")

    conn = object.__new__(HiCacheConnector)
    conn._worker = Worker()  # type: ignore[attr-defined]
    assert conn.get_block_ids_with_load_errors() == {3}
    assert conn.build_connector_worker_meta() is None
    assert calls == ["finish", "failed", "finish", "report"]


def test_loads_the_scheduler_promised_are_read_while_the_store_is_marked_down(tmp_path: Path) -> None:
    """A slow storage write marks the worker's store down; the scheduler (which claims hits
    through its own lookups) still counts stored pages as hits. Not reading them would fail
    their blocks (vLLM's default policy fails the request): the promised read is made."""
    stored(tmp_path, seed=1, num_pages=4)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(None), storage_stall_s=0.3, storage_probe_base_s=5.0)
    try:
        slow_writes(w, 1.0)
        w.save([PageSave("x", tuple(PageKeyChain(BS).extend(OTHER, 2)), (40, 41), (5, 6), job=9)])
        deadline = time.monotonic() + 10
        while w.controller.health.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not w.controller.health.up
        toks = TOKENS[: 4 * BS + 3]
        hit = request(s, "A", toks, [0, 1, 2, 3, 4])
        assert hit == 4 * BS
        _, failed = run_step(s, w, [("A", hit, 4 * BS, toks, [0, 1, 2, 3, 4])])
        assert failed == set()
        assert w.controller.metrics.counters.get("prefetch_promised_while_down", 0) >= 1
    finally:
        w.close(5)
        s.close(5)


def test_loads_the_scheduler_promised_ignore_the_prefetch_budget(tmp_path: Path) -> None:
    """An in-flight budget smaller than a promised load does not turn it into failed blocks."""
    stored(tmp_path, seed=1, num_pages=4)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(None), max_inflight_prefetch_tokens=3 * BS)
    try:
        toks = TOKENS[: 4 * BS + 3]
        hit = request(s, "A", toks, [0, 1, 2, 3, 4])
        assert hit == 4 * BS
        _, failed = run_step(s, w, [("A", hit, 4 * BS, toks, [0, 1, 2, 3, 4])])
        assert failed == set()
    finally:
        w.close(5)
        s.close(5)


def test_a_host_page_another_request_of_the_step_reads_loads_whatever_the_order(tmp_path: Path) -> None:
    """Request A reads pages from storage into new host slots (they join the tree when A is
    allocated); B, allocated after it in the same step, matches them as host pages. vLLM lists
    new requests before resumed ones, so B's load can come first in the step: it must not fail."""
    src, _ = stored(tmp_path, seed=1, num_pages=4)
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(None))
    try:
        old = TOKENS[: 2 * BS + 1]  # an earlier request leaves pages 0..1 on host
        hit = request(s, "old", old, list(range(8, 11)))
        run_step(s, w, [("old", hit, 2 * BS + 1, old, list(range(8, 11)))])
        s.finished("old")
        toks = TOKENS[: 4 * BS + 3]
        a_blocks, b_blocks = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
        hit_a = request(s, "A", toks, a_blocks)
        hit_b = request(s, "B", toks, b_blocks)
        assert hit_a == hit_b == 4 * BS and s._loads["B"].from_host == 4
        _, failed = run_step(s, w, [("B", hit_b, 4 * BS, toks, b_blocks), ("A", hit_a, 4 * BS, toks, a_blocks)])
        assert failed == set()
        assert s.stats["bad_slot_pages_dropped"] == 0
        for layer_src, layer in zip(src, w.layers):
            for a, b in zip(a_blocks[:4] + b_blocks[:4], list(range(4)) * 2):
                assert torch.equal(layer[a], layer_src[b]), "a block holds other KV than the page stored"
    finally:
        w.close(5)
        s.close(5)


def test_a_page_copied_and_written_by_two_requests_in_one_step_is_kept_and_stored(tmp_path: Path) -> None:
    """A and B share page 0 (vLLM's block 2), which the host tree lacks. In one step A, which
    knows page 0 is stored, copies it into a new slot; B, which does not, then matches that
    slot in the tree and writes page 0 from it with its own new page 1. The worker saw the slot
    empty (A's copy lands in the step's gather) and reported it bad: the scheduler dropped A's
    pages and B's, and B's page 1 was never written. Every copy of the step lands before any
    write starts, so the slot is kept: nothing is dropped and B's pages are stored bit-exact."""
    root = tmp_path / "store"
    s = scheduler("file", {"root": str(root)})
    layers = kv_layers(seed=2)
    w = worker(root, layers)
    try:
        b_tokens = TOKENS[:BS] + OTHER[:BS]
        assert s.matched_tokens("b", b_tokens[: BS + 5], None, BS) == 0  # vLLM holds page 0; store lacks it
        src, _ = stored(root, seed=1, num_pages=1)  # page 0 reaches the store meanwhile
        for layer, layer_src in zip(layers, src):
            layer[2] = layer_src[0]  # vLLM's block 2 holds that same page 0
        a_tokens = TOKENS[: 2 * BS + 29]
        assert s.matched_tokens("a", a_tokens, None, BS) == 0  # vLLM holds page 0; it is stored
        plan, _ = run_step(s, w, [("a", BS, 2 * BS + 29, a_tokens, [2, 9, 6]),
                                  ("b", 2 * BS - 1, 2 * BS, b_tokens, [2, 13])])
        sa, sb = plan.saves
        assert (sa.copy_from, sa.write_from, sb.copy_from, sb.write_from) == (0, 1, 1, 0)
        assert sb.slots[0] == sa.slots[0]  # B writes page 0 from the slot A copies it into
        assert s.stats["bad_slot_pages_dropped"] == 0
        assert s.tree.match(a_tokens, None, 2, count_hit=False).pages == 2
        assert s.tree.match(b_tokens, None, 2, count_hit=False).pages == 2
        wait_report(s, w)
        assert w.close(timeout=30) == 0
        dst = kv_layers(seed=None)
        w2 = worker(root, dst)
        try:
            keys = PageKeyChain(BS).extend(b_tokens, 2)
            assert load(w2, [PageLoad("r", tuple(keys), (0, 1), (3, 4))]) == set()
            for layer_dst, layer in zip(dst, layers):
                assert torch.equal(layer_dst[3], layer[2]) and torch.equal(layer_dst[4], layer[13])
        finally:
            w2.close(timeout=10)
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_a_page_copied_in_a_step_is_not_evicted_for_a_later_request_of_that_step(tmp_path: Path) -> None:
    """A, which knows its pages are stored, only copies them into the host tier's two slots
    (no write locks them). B, later in the same step, needs a slot for its own new page:
    eviction took A's fresh pages and gave B one of their slots, the worker refused the second
    copy into it and reported it bad, and B's page was neither kept nor written. A's pages now
    stay put for the step; B's page waits for room and is saved the next step."""
    root = tmp_path / "store"
    s = scheduler("file", {"root": str(root)}, host_pages=2)
    w = worker(root, kv_layers(seed=2))
    try:
        stored(root, seed=1, num_pages=2)
        a_tokens, b_tokens = TOKENS[: 2 * BS + 5], OTHER[: BS + 5]
        # vLLM holds page 0 and computes page 1 itself (it loads none of the hit)
        assert s.matched_tokens("a", a_tokens, None, BS) == BS
        s.allocated("a", [2, 3, 4], 0)
        assert s.matched_tokens("b", b_tokens, None, 0) == 0
        plan, _ = run_step(s, w, [("a", BS, 2 * BS + 5, a_tokens, [2, 3, 4]), ("b", 0, BS + 5, b_tokens, [5, 6])])
        assert s.stats["bad_slot_pages_dropped"] == 0 and w.stats["saves_dropped"] == 0
        assert [(sv.req_id, sv.slots, sv.job) for sv in plan.saves] == [("a", (0, 1), 0)]  # B: no room
        assert s.tree.match(a_tokens, None, 2, count_hit=False).pages == 2
        plan, _ = run_step(s, w, [("b", BS + 5, BS + 6, b_tokens, [5, 6])])
        (sv,) = plan.saves  # A's pages are evictable now
        assert sv.req_id == "b" and sv.job
        wait_report(s, w)
        assert s.stats["bad_slot_pages_dropped"] == 0 and s.stats["pages_unwritten"] == 0
        assert s.matched_tokens("c", b_tokens, None, 0) == BS  # B's page is stored
    finally:
        w.close(timeout=10)
        s.close(timeout=10)


def test_a_capped_storage_hit_is_counted_once_per_request(tmp_path: Path) -> None:
    """vLLM asks about a waiting request at every step: pages the host tier has no room for
    are counted once (``hits_capped_for_room``), not once per ask."""
    stored(tmp_path, seed=4, num_pages=5)
    s = scheduler("file", {"root": str(tmp_path)}, host_pages=2)
    try:
        for _ in range(3):
            assert s.matched_tokens("a", TOKENS, None, 0) == 2 * BS
            s.plan_step([])
        assert s.stats["hits_capped_for_room"] == 3
    finally:
        s.close(timeout=10)
