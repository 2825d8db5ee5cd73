"""Drive vLLM's own ``TieringOffloadingManager`` the way its scheduler does, with hicache's
tier loaded from config by vLLM's ``SecondaryTierFactory``.

:class:`Engine` is one engine's scheduler side: vLLM's ``TieringOffloadingSpec`` built from an
``OffloadingConfig``. ``store`` plays a finished prefill (the GPU->CPU worker's copy into the
primary tier is a write into the chunk, which is all that worker does on a GPU), ``load`` plays
a new request looking its prefix up, step by step, until every chunk is a hit or a miss.
Keys come from vLLM's own block hasher (``sha256``, as the engine's default).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK = 16
BLOCK_BYTES = 4096  # one worker's KV bytes per block (a page-aligned chunk: no padding)
TIER_MODULE = "hicache.integrations.vllm.tier"


def nvidia_gpu() -> type:
    """A stand-in for vLLM's platform on an NVIDIA GPU, as the tier's block format reads it
    (``hicache.integrations.vllm.block_format._platform``): vLLM's offloading worker does not
    run on its CPU platform, so the tier refuses that, and these tests play a GPU engine's
    scheduler side."""
    from hicache.integrations.vllm.block_format import PLATFORM_CHECKS

    return type("NvidiaGpu", (), {n: staticmethod(lambda n=n: n in ("is_cuda", "is_cuda_alike")) for n in PLATFORM_CHECKS})


def block_keys(tokens: Sequence[int], salt: str | None = None, group: int = 0) -> list[bytes]:
    """vLLM's offload keys of every full block of ``tokens`` (its chained sha256 block hash)."""
    kv_cache_utils.init_none_hash(sha256)
    keys, parent = [], None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        extra = (("cache_salt", salt),) if salt and start == 0 else None
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + BLOCK], extra)
        keys.append(make_offload_key(parent, group))
    return keys


@functools.lru_cache(maxsize=256)
def payload(key: bytes, nbytes: int) -> bytes:
    """Deterministic chunk bytes for a key (what the model's KV would be)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def tier_config(backend: str = "file", **tier: Any) -> dict[str, Any]:
    return {"type": "HiCacheTier", "module_path": TIER_MODULE, "backend": backend, **tier}


def offloading_config(
    tiers: list[dict[str, Any]],
    *,
    model: str = "tiny/model",
    dtype: str = "bfloat16",
    tp_size: int = 1,
    chunks: int = 64,
    block_bytes: int = BLOCK_BYTES,
    layout: str | None = "LBNHC",
    canonical: bool = False,
    agnostic: bool = False,
    block: int = BLOCK,
    replicated: bool = False,
    kv_events: bool = False,
    **extra: Any,
) -> OffloadingConfig:
    """An engine's ``OffloadingConfig``; ``layout`` is the KV cache layout vLLM's engine core
    resolved (token-major by default: direct-mode chunks of a head-major one whose blocks a
    kernel split could reorder are refused); ``block`` its block size in tokens; ``kv_events``
    vLLM's ``--kv-events-config`` enabling KV cache events."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(block, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), 0),),
        worker_kv_bytes_per_block=block_bytes // tp_size,
        enable_kv_cache_events=kv_events,
        extra_config={"cpu_bytes_to_use": chunks * block_bytes, "secondary_tiers": tiers, **extra},
        engine_id=f"hicache-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(block, 1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        canonical_layout=canonical,
        replicated_layout=replicated,
        kv_cache_layout=layout,
    )


class Engine:
    """One engine's scheduler-side offloading: vLLM's spec, manager and our tier."""

    def __init__(self, tiers: list[dict[str, Any]], **config: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tiers, **config))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.view = self.manager.primary_tier.get_kv_memoryview()
        self.chunk_bytes = self.view.strides[0]
        self._n = 0

    def begin(self, keys: Sequence[bytes]) -> ReqContext:
        """A new request whose offload keys are ``keys`` (vLLM records their positions)."""
        self._n += 1
        ctx = ReqContext(f"req-{self._n}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, BLOCK * (i + 1))
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no tier job is in flight (vLLM steps while has_pending_work())."""
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.step()
            time.sleep(0.005)
        self.step()

    def chunk(self, chunk_id: int) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint8).reshape(self.view.shape)[chunk_id]

    def store(self, keys: Sequence[bytes], jobs: int = 1, settle: bool = True) -> ReqContext:
        """A prefill whose chunks reach the primary tier in ``jobs`` transfers, then cascade."""
        ctx = self.begin(keys)
        per = -(-len(keys) // jobs)
        for start in range(0, len(keys), per):
            part = list(keys[start : start + per])
            out = self.manager.prepare_store(part, ctx)
            assert out is not None, "primary tier full"
            for key, chunk_id in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.chunk(int(chunk_id))[:] = np.frombuffer(payload(key, self.chunk_bytes), dtype=np.uint8)
            self.manager.complete_store(part, ctx)
        self.manager.on_request_finished(ctx)
        if settle:
            self.settle()
        return ctx

    def lookup(self, keys: Sequence[bytes], timeout: float = 30.0) -> tuple[ReqContext, list[LookupResult]]:
        """Look every key up, stepping while any answer is RETRY or HIT_PENDING."""
        ctx = self.begin(keys)
        deadline = time.monotonic() + timeout
        while True:
            results = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return ctx, results
            assert time.monotonic() < deadline, f"lookups never settled: {results}"
            self.step()
            time.sleep(0.005)

    def load(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The bytes vLLM would copy to the GPU for each key (``None``: recompute)."""
        ctx, results = self.lookup(keys)
        hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
        out: dict[bytes, bytes] = {}
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            for key, chunk_id in zip(hits, spec.chunk_ids):
                out[key] = self.chunk(int(chunk_id)).tobytes()
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        return [out.get(k) for k in keys]

    def close(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
