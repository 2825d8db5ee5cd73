"""The tier's parts one by one: the zero-copy chunk pool, keys and namespaces, the job runner's
bad inputs, and configuration errors as vLLM's factory meets them."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiering import BLOCK, Engine, block_keys, offloading_config, tier_config
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.errors import BackendNotFoundError, ConfigError, StorageStateError
from hicache.integrations.vllm.tier_keys import offload_key_group, page_key
from hicache.integrations.vllm.tier_keys import tier_namespace as _tier_namespace
from hicache.integrations.vllm.tier_pool import ChunkPool
from hicache.integrations.vllm.tier_runner import TierRunner, parent_runs
from hicache.storage import create_async_storage


def tier_namespace(config: object, chunk_bytes: int, *, block_format: str = "kv-cells|mla-concat", **kw: object) -> object:
    """The tier's namespace of ``config`` on an NVIDIA GPU (the block format tier.py derives there)."""
    return _tier_namespace(config, chunk_bytes, block_format=block_format, **kw)  # type: ignore[arg-type]


def _view(chunks: int = 8, stride: int = 256) -> tuple[np.ndarray, memoryview]:
    backing = np.zeros((chunks, stride), dtype=np.int8)  # vLLM's view is int8 rows
    return backing, memoryview(backing)


# ---------------------------------------------------------------------------- chunk pool

def test_chunk_pool_pages_are_live_rows_of_the_view() -> None:
    backing, view = _view()
    pool = ChunkPool(view)
    assert (pool.num_chunks, pool.page_nbytes, pool.page_size) == (8, 256, 1)
    page = pool.page_view(3)
    assert page.data_ptr() == backing[3].ctypes.data  # no copy
    page.fill_(7)
    assert (backing[3] == 7).all() and not backing[2].any()
    pool.set_from_flat_data_page(5, torch.full((256,), 9, dtype=torch.uint8))
    assert (backing[5] == 9).all()
    for bad in (-1, 8, True, "1"):
        with pytest.raises(IndexError):
            pool.page_view(bad)
    pool.close()
    with pytest.raises(StorageStateError):
        pool.page_view(0)
    view.release()  # the pool kept no export


def test_chunk_pool_rejects_views_it_cannot_use() -> None:
    with pytest.raises(TypeError):
        ChunkPool(memoryview(bytes(64)).cast("B", (4, 16)))  # read-only
    with pytest.raises(TypeError):
        ChunkPool(memoryview(bytearray(64)))  # 1-D
    with pytest.raises(TypeError):
        ChunkPool(memoryview(np.zeros((4, 32), dtype=np.int8)[:, ::2]))  # strided rows


# ---------------------------------------------------------------------------- keys, namespace

def test_page_key_is_the_offload_key_in_hex() -> None:
    key = block_keys(list(range(BLOCK)), group=3)[0]
    assert page_key(key) == key.hex() and offload_key_group(key) == 3
    for bad in (b"", b"\x00" * 4, "abc", None):
        with pytest.raises(ConfigError):
            page_key(bad)  # type: ignore[arg-type]


def test_namespace_carries_what_makes_kv_incompatible() -> None:
    base = offloading_config([])
    ns = tier_namespace(base, 4096)
    assert ns == tier_namespace(base, 4096) and ns.digest == tier_namespace(base, 4096).digest
    assert ns.model == "tiny/model" and ns.kv_dtype == "bfloat16"
    variants = [
        tier_namespace(offloading_config([], model="m2"), 4096),
        tier_namespace(offloading_config([], dtype="float16"), 4096),
        tier_namespace(offloading_config([], tp_size=2), 4096),
        tier_namespace(base, 8192),
        tier_namespace(base, 4096, salt="tenant"),
        tier_namespace(base, 4096, model_revision="r2"),
        tier_namespace(base, 4096, block_format="cpu_attn-vec"),
        tier_namespace(dataclasses.replace(base, cache=dataclasses.replace(base.cache, blocks_per_chunk=2)), 4096),
        tier_namespace(dataclasses.replace(base, groups=(dataclasses.replace(base.groups[0], layer_names=("x",)),)), 4096),
    ]
    digests = {v.digest for v in variants} | {ns.digest}
    assert len(digests) == len(variants) + 1


def test_parallelism_agnostic_chunks_share_across_tp_sizes() -> None:
    def agnostic(tp: int) -> object:
        cfg = offloading_config([], tp_size=tp)
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, is_parallelism_agnostic=True))

    assert tier_namespace(agnostic(1), 4096) == tier_namespace(agnostic(4), 4096)


def test_namespace_names_the_chunk_byte_format() -> None:
    """A direct-mode chunk is each layer's block copied raw, in the engine's KV cache layout;
    the namespace recorded only "direct", so engines of different layouts shared pages."""
    direct = tier_namespace(offloading_config([], layout="LBNHC"), 4096)
    assert dict(direct.extra)["canonical_layout"] == "direct-LBNHC"
    assert direct != tier_namespace(offloading_config([], layout="BLNHC"), 4096)
    # canonical namespaces are what they were (the layout), so their pages stay readable
    canonical = tier_namespace(offloading_config([], layout="LBHNC", canonical=True, agnostic=True), 4096)
    assert dict(canonical.extra)["canonical_layout"] == "LBHNC"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layout": None}, "has not resolved the KV cache layout"),
        ({"layout": "LBHNC", "block": 32}, "cannot key direct-mode chunks of KV cache layout LBHNC"),
        ({"layout": "BHLNC", "block": 128}, "cannot key direct-mode chunks of KV cache layout BHLNC"),
        ({"layout": "LBNHC", "canonical": True}, "cannot key canonical_layout chunks"),
    ],
    ids=["unresolved", "head-major", "block-head-major", "canonical-uncertified"],
)
def test_chunks_a_kernel_split_could_change_unseen_are_refused(change: dict, message: str) -> None:
    """The scheduler, where the tier names chunks, cannot see vLLM's kernel-block split, which
    changes a head-major block's bytes (and a canonical chunk's, where vLLM falls back to raw
    bytes for a layer it cannot map): those configurations fail at start, clearly."""
    with pytest.raises(ConfigError, match=message):
        tier_namespace(offloading_config([], **change), 4096)
    with pytest.raises(ConfigError, match=message):
        Engine([tier_config(backend="memory")], **change)


@pytest.mark.parametrize("change", [{"block": 16}, {"block": 128, "replicated": True}], ids=["16-token-blocks", "pure-mla"])
def test_head_major_chunks_no_kernel_split_can_reorder_are_keyed_by_their_layout(change: dict) -> None:
    """vLLM splits only a block size some attention backend does not take, and every backend
    takes 16 (vLLM's default on GPUs); a pure-MLA model's block has no head axis to reorder.
    Those head-major engines store the same bytes whatever their backend: taken, and keyed by
    their layout, apart from token-major engines."""
    ns = tier_namespace(offloading_config([], layout="LBHNC", **change), 4096)
    assert dict(ns.extra)["canonical_layout"] == "direct-LBHNC"
    assert ns != tier_namespace(offloading_config([], layout="LBNHC", **change), 4096)
    Engine([tier_config(backend="memory")], layout="LBHNC", **change)


def test_namespace_rejects_bad_values() -> None:
    base = offloading_config([])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError):
            tier_namespace(base, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        tier_namespace(base, 4096, salt="")
    for bad_format in ("", None):
        with pytest.raises(ConfigError, match="block_format"):
            tier_namespace(base, 4096, block_format=bad_format)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- runner

def test_parent_runs_split_where_the_chain_breaks() -> None:
    keys = ["a", "b", "c", "d", "e"]
    parents = [None, "a", "b", "x", "d"]
    assert parent_runs(range(5), keys, parents) == [[0, 1, 2], [3, 4]]
    assert parent_runs([0, 2, 3, 4], keys, parents) == [[0], [2], [3, 4]]  # b is already stored


def _wait(runner: TierRunner, n: int) -> list:
    assert runner.drain(timeout=30)
    out = runner.finished()
    assert len(out) == n
    return out


@pytest.fixture
def runner() -> TierRunner:
    backing, view = _view()
    r = TierRunner(create_async_storage("memory", None), ChunkPool(view))
    r.backing = backing  # type: ignore[attr-defined]
    yield r
    r.close()


def test_runner_bad_jobs_fail_alone(runner: TierRunner) -> None:
    backing = runner.backing  # type: ignore[attr-defined]
    backing[:] = np.arange(1, 9, dtype=np.int8)[:, None]  # chunk i holds bytes i + 1
    runner.submit_store(1, ["k0", "k1"], [0], [None, "k0"])  # lengths disagree
    runner.submit_store(2, ["k0", "k1", "k2"], [0, 1, 99], [None, "k0", "k1"])  # no chunk 99
    bad, partial = sorted(_wait(runner, 2), key=lambda o: o.job_id)
    assert bad.ok == (False, False) and not bad.success
    assert partial.ok == (True, True, False) and partial.nbytes == 2 * 256
    backing[:] = 0
    runner.submit_load(3, ["k0", "k1", "nope"], [4, 4, 5])  # two pages into one chunk; no page
    runner.submit_load(4, ["k1"], [1, 2])  # lengths disagree
    load, wrong = sorted(_wait(runner, 2), key=lambda o: o.job_id)
    assert load.ok == (True, False, False) and wrong.ok == (False,)
    assert (backing[4] == 1).all()  # the first page wins the chunk, whole
    assert not backing[5].any() and not backing[1].any()


def test_runner_after_close_answers_failures(runner: TierRunner) -> None:
    runner.close()
    runner.submit_load(1, ["k"], [0])
    assert [o.ok for o in runner.finished()] == [(False,)]
    assert runner.exists(["k"]) == [False]
    runner.close()  # idempotent


def test_runner_exists_is_bounded_by_its_timeout() -> None:
    _, view = _view()
    storage = create_async_storage("memory", None)
    slow = TierRunner(storage, ChunkPool(view), lookup_timeout=0.2)
    try:
        async def stuck(pages):  # a store that never answers
            import asyncio

            await asyncio.sleep(3600)

        storage._exists = stuck  # type: ignore[method-assign]
        t0 = time.monotonic()
        assert slow.exists(["a", "b"]) == [False, False]
        assert time.monotonic() - t0 < 5
    finally:
        slow.close()


def test_runner_exists_is_bounded_when_the_store_is_stuck_in_a_thread(tmp_path: Path, monkeypatch) -> None:
    """A shared ``file`` store probes the disk for pages its index lacks, in threads: on a hung
    mount a probe never returns and cannot be cut. The lookup still answers "miss" within
    ``lookup_timeout`` (vLLM's lookup thread must not wait for the probe: every request asking
    the tier would be told RETRY, and wait, for as long as the mount hangs)."""
    import threading

    from hicache_backends.file import io as page_io

    _, view = _view()
    storage = create_async_storage("file", None, root=str(tmp_path / "store"), min_free_bytes=0, shared=True)
    runner = TierRunner(storage, ChunkPool(view), lookup_timeout=0.3)
    hung = threading.Event()
    probe = page_io.probe_page
    monkeypatch.setattr(page_io, "probe_page", lambda *a: (hung.wait(30), probe(*a))[1])
    try:
        t0 = time.monotonic()
        assert runner.exists(["a", "b"]) == [False, False]
        assert time.monotonic() - t0 < 5
    finally:
        hung.set()  # the mount comes back
        runner.close()


# ---------------------------------------------------------------------------- config through vLLM

@pytest.mark.parametrize(
    ("tier", "error"),
    [
        ({"bogus": 1}, ConfigError),
        ({"backend": "no-such-backend"}, BackendNotFoundError),
        ({"options": "root=/x"}, ConfigError),
        ({"options": {"namespace": {}}}, ConfigError),
        ({"options": {"no_such_option": 1}}, ConfigError),
        ({"locality": "MARS"}, ConfigError),
        ({"lookup_timeout": 0}, ConfigError),
        # past what a thread can wait: every lookup failed (a miss), start-up raised OverflowError
        ({"lookup_timeout": float("inf")}, ConfigError),
        ({"open_timeout": 1e12}, ConfigError),
    ],
)
def test_bad_tier_config_fails_engine_start_clearly(
    tier: dict, error: type, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = TieringOffloadingSpec(offloading_config([{**tier_config(options={"root": str(tmp_path)}), **tier}]))
    with caplog.at_level(logging.WARNING), pytest.raises(error):
        spec.get_manager()
    # vLLM's clean-up of the half-built manager closes its mmap: nothing of ours holds it
    assert not [r for r in caplog.records if "Failed" in r.getMessage()], caplog.text


def test_unusable_root_fails_engine_start(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    spec = TieringOffloadingSpec(offloading_config([tier_config(options={"root": str(not_a_dir)})]))
    with pytest.raises(ConfigError, match="root"):
        spec.get_manager()


def test_memory_backend_works_as_a_tier() -> None:
    keys = block_keys(list(range(4 * BLOCK)))
    with Engine([tier_config("memory")]) as engine:
        engine.store(keys)
        engine.manager.reset_cache()  # the primary tier forgets; the secondary keeps the chunks
        got = engine.load(keys)
        assert all(g is not None for g in got)


def test_chunk_stored_while_its_lookup_is_in_flight_is_a_hit() -> None:
    """A lookup that asked the store before the tier's own write landed answers "miss"; the
    tier knows better by then (the write succeeded), and a later request must hit."""
    import threading

    keys = block_keys(list(range(4 * BLOCK)))
    with Engine([tier_config("memory")]) as engine:
        storage = engine.tier.storage
        real_exists, gate, asked = storage._exists, threading.Event(), threading.Event()

        async def first_answer_late(pages):  # the first lookup's answer predates the write
            import asyncio

            if not asked.is_set():
                asked.set()
                answer = [False] * len(pages)
                while not gate.is_set():
                    await asyncio.sleep(0.01)
                return answer
            return await real_exists(pages)

        storage._exists = first_answer_late  # type: ignore[method-assign]
        waiting = engine.begin(keys)
        assert {engine.manager.lookup(k, waiting) for k in keys} == {LookupResult.RETRY}
        engine.step()  # the lookup is in flight now
        assert asked.wait(10)
        engine.store(keys)  # another request computes and stores the prompt meanwhile
        gate.set()
        engine.manager.reset_cache()  # the primary tier forgets; the store has the chunks
        assert all(g is not None for g in engine.load(keys))
        engine.manager.on_request_finished(waiting)


def test_malformed_jobs_fail_without_raising_into_vllm(file_tier_options: dict) -> None:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    with Engine([tier_config(options=file_tier_options)]) as engine:
        tier, ctx = engine.tier, ReqContext("bad")
        tier.submit_store(TransferJob(1, [b"\x00\x01"], np.array([0]), False, ctx))
        tier.submit_load(TransferJob(2, [b"\x01" * 36], np.array(["x"]), True, ctx))
        assert tier._runner.drain(timeout=10)
        results = sorted(tier.get_finished_jobs(), key=lambda r: r.job_id)
        assert [(r.job_id, r.success) for r in results] == [(1, False), (2, False)]


def test_prefix_chains_link_each_key_to_the_one_before_it() -> None:
    from vllm.v1.kv_offload.base import ReqContext

    from hicache.integrations.vllm.tier_chains import PrefixChains

    keys = block_keys(list(range(6 * BLOCK)))
    other_group = block_keys(list(range(6 * BLOCK)), group=1)
    ctx = ReqContext("r")
    for i, (k, g) in enumerate(zip(keys, other_group)):
        ctx.set_offload_key_position(k, BLOCK * (i + 1))
        ctx.set_offload_key_position(g, BLOCK * (i + 1))
    chains = PrefixChains()
    chains.record([keys[4], keys[0], keys[2]], ctx)  # out of order, with gaps
    chains.record(other_group[:3], ctx)
    assert chains.parent(keys[0], ctx) is None
    assert chains.parent(keys[2], ctx) == keys[0]  # the closest ancestor seen
    assert chains.parent(keys[5], ctx) == keys[4]
    assert chains.parent(other_group[1], ctx) == other_group[0]  # groups do not mix
    assert chains.parent(b"\x09" * 36, ctx) is None  # no position known
    chains.forget("r")
    assert chains.parent(keys[5], ctx) is None


# ---------------------------------------------------------------------------- the attention backend's block format

def _on_platform(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """vLLM's current platform answers as ``kind`` (cuda, rocm, xpu, cpu) would."""
    from vllm.platforms import current_platform

    for check in ("is_cuda", "is_rocm", "is_xpu", "is_cpu"):
        monkeypatch.setattr(type(current_platform), check, lambda self, c=check: c == f"is_{kind}")
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: kind in ("cuda", "rocm"))


@pytest.mark.parametrize("canonical", [False, True], ids=["direct", "canonical"])
def test_engines_whose_attention_backends_write_other_bytes_never_share_a_namespace(
    monkeypatch: pytest.MonkeyPatch, platform_as_is: None, canonical: bool
) -> None:
    """A chunk holds each layer's block as the attention backend wrote it (direct mode: raw;
    canonical mode: its cells moved whole, see test_tier_vllm_config), and the backends vLLM
    runs on each platform write the same KV as other bytes: NVIDIA GPUs' FlashAttention,
    FlashInfer, Triton (token n's K then V in cell (h, n)) and MLA's concat_and_cache_mla, ROCm's
    and XPU's kernels their own packings, vLLM's CPU backend per head the block's K packed by
    its ISA then V. The namespace named only the KV cache layout, so engines on different
    platforms read each other's chunks as KV. It now names the block format of the platform's
    backends, and a platform whose format the tier cannot name is refused at start."""
    change = {"layout": "LBHNC", "canonical": True, "agnostic": True} if canonical else {}

    def namespace(kind: str) -> object:
        _on_platform(monkeypatch, kind)
        with Engine([tier_config(backend="memory")], **change) as engine:
            return engine.tier.namespace

    cuda = namespace("cuda")
    assert dict(cuda.extra)["block_format"] == "kv-cells|mla-concat"
    for kind, why in (("rocm", "RocmPlatform|ROCm"), ("xpu", "XPU"), ("cpu", "CPU")):
        with pytest.raises(ConfigError, match=rf"HiCacheTier cannot name the block format.*({why})"):
            namespace(kind)


def test_runner_logs_a_store_that_fails_to_open_after_start_up_went_on(caplog: pytest.LogCaptureFixture) -> None:
    """A store still opening after ``open_timeout`` opens in the background; when that late
    open fails, the tier says so (as the connector does), not only that it was slow."""
    import asyncio

    _, view = _view()
    storage = create_async_storage("memory", None)

    async def late_failure() -> None:
        await asyncio.sleep(0.5)
        raise StorageStateError("the store refused to open")

    storage.open = late_failure  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        runner = TierRunner(storage, ChunkPool(view), name="slow-tier", open_timeout=0.1)
        try:
            deadline = time.monotonic() + 10
            while "refused to open" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            runner.close()
    assert "slow-tier: opening the store failed" in caplog.text, caplog.text


def test_tier_shutdown_ends_inside_vllms_grace_and_reports_lost_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM SIGKILLs the engine core ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` after SIGTERM:
    a tier whose store hangs (a write, then its close) must end its shutdown inside that grace
    and log the chunks it gave up, not wait 60 s + 60 s and be killed silently."""
    import asyncio

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "4")
    keys = block_keys(list(range(2 * BLOCK)))
    with Engine([tier_config("memory")]) as engine:
        tier = engine.manager.secondary_tiers[0]
        storage = tier.storage

        async def hang(*args: object, **kwargs: object) -> None:
            await asyncio.sleep(3600)

        storage.batch_set_v2 = hang  # type: ignore[method-assign]
        storage.aclose = hang  # type: ignore[method-assign]
        engine.store(keys, settle=False)
        deadline = time.monotonic() + 10
        while not tier.has_pending_work() and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.01)
        assert tier.has_pending_work()
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            tier.shutdown()
            took = time.monotonic() - t0
    assert took < 4, took
    assert "chunks are lost" in caplog.text, caplog.text


def test_tier_shutdown_does_not_wait_out_lookups_queued_on_a_hung_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups of several requests queued while the store hangs each waited ``lookup_timeout``
    in vLLM's lookup thread, which the tier's shutdown joined before it closed anything: the
    engine core outlived vLLM's grace and was killed mid-close."""
    import asyncio

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "4")
    with Engine([tier_config("memory", lookup_timeout=3.0)]) as engine:
        tier = engine.manager.secondary_tiers[0]

        async def hang(*args: object, **kwargs: object) -> None:
            await asyncio.sleep(3600)

        tier.storage._exists = hang  # type: ignore[method-assign]
        for r in range(3):  # three requests, three batched lookups
            keys = block_keys(list(range(r * 1000, r * 1000 + BLOCK)))
            ctx = engine.begin(keys)
            assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * len(keys)
        engine.step()
        time.sleep(0.2)  # the lookup thread is waiting on the first batch
        t0 = time.monotonic()
        tier.shutdown()
        took = time.monotonic() - t0
    assert took < 4, took
