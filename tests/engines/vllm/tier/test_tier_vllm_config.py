"""The tier route as a vLLM user turns it on: ``--kv-transfer-config`` with vLLM's
``OffloadingConnector`` and ``TieringOffloadingSpec``, built by vLLM's ``KVConnectorFactory``
from a real ``VllmConfig``; real ``Request`` objects with vLLM's own block hasher.

The scheduler side is vLLM's end to end here: a fresh engine's connector reports the prompt's
tokens as cached from hicache. The worker side is where this stops on CPU: vLLM's native
GPU<->CPU offloading worker refuses a non-CUDA/XPU platform
(``CPUOffloadingSpec.get_worker``), so a CPU engine cannot start with this connector at all;
:func:`test_worker_side_needs_a_gpu` pins that boundary, and fails (asking for a real-engine
test here) the day vLLM lifts it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _block_formats import backend_cache
from _tiering import BLOCK, TIER_MODULE, payload
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.request import Request

from hicache.errors import ConfigError
from hicache.integrations.vllm.tier import HiCacheTier

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(300, 300 + 5 * BLOCK))


def kv_transfer_config(root: str, **extra: Any) -> dict[str, Any]:
    """Exactly what a user passes as ``--kv-transfer-config`` (docs/vllm-tier.md)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 << 20,
            "secondary_tiers": [
                {"type": "HiCacheTier", "module_path": TIER_MODULE, "backend": "file",
                 "options": {"root": root, "min_free_bytes": 0}},
            ],
            **extra,
        },
    }


def engine_config(model_dir: str, root: str, layout: str | None = "LBNHC", block: int = BLOCK,
                  **extra: Any) -> VllmConfig:
    """A real ``VllmConfig`` with the tier; ``layout`` is the KV cache layout the engine core
    resolves before it builds the scheduler (``VLLM_KV_CACHE_LAYOUT=NHD`` gives ``LBNHC``)."""
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        cache_config=CacheConfig(block_size=block),
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(root, **extra)),
    )
    config.cache_config.kv_cache_layout = layout
    return config


def connector(model_dir: str, root: str, role: KVConnectorRole, layout: str | None = "LBNHC", block: int = BLOCK,
              **extra: Any) -> Any:
    config = engine_config(model_dir, root, layout, block, **extra)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    with set_current_vllm_config(config):
        return KVConnectorFactory.create_connector(config, role, kv_cache_config)


def request(request_id: str) -> Request:
    init_none_hash(sha256)
    return Request(request_id, list(PROMPT), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def settle(manager: Any) -> None:
    deadline = time.monotonic() + 30
    while manager.has_pending_work():
        assert time.monotonic() < deadline
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.005)
    manager.on_schedule_end(ScheduleEndContext((), ()))


def test_fresh_engine_reports_prompt_cached_from_hicache(model_dir: str, tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    first = connector(model_dir, root, KVConnectorRole.SCHEDULER)
    manager = first.scheduler.manager
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, HiCacheTier)
    # the namespace comes from the engine's real config
    assert tier.namespace.model == model_dir and tier.namespace.kv_dtype == "bfloat16"
    keys = [make_offload_key(h, 0) for h in request("r1").block_hashes]
    assert len(keys) == len(PROMPT) // BLOCK
    # a finished prefill: the worker's GPU->CPU copy lands in the chunks, then vLLM cascades
    ctx = ReqContext("prefill")
    manager.on_new_request(ctx)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, BLOCK * (i + 1))
    out = manager.prepare_store(keys, ctx)
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
        rows[int(chunk)] = np.frombuffer(payload(key, view.strides[0]), dtype=np.uint8)
    del rows, view
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    settle(manager)
    assert tier.storage.get_stats()["write_ok"] == len(keys)
    first.shutdown()

    # a fresh engine on the same store: vLLM's own lookup path asks hicache, step by step
    second = connector(model_dir, root, KVConnectorRole.SCHEDULER)
    manager = second.scheduler.manager
    req = request("r2")
    second.on_new_request(req)
    deadline = time.monotonic() + 30
    while (answer := second.get_num_new_matched_tokens(req, 0)) == (None, False):
        assert time.monotonic() < deadline, "lookup never settled"
        manager.on_schedule_end(ScheduleEndContext((), ()))  # build_connector_meta does this per step
        time.sleep(0.005)
    assert answer == (len(PROMPT), True)
    assert manager.secondary_tiers[0].storage.get_stats()["read_hits"] == len(keys)
    # the promoted chunks hold the stored bytes (what the worker would copy to the GPU)
    check = ReqContext("check")
    manager.on_new_request(check)
    assert [manager.lookup(k, check) for k in keys] == [LookupResult.HIT] * len(keys)
    load = manager.prepare_load(keys, check)
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
    assert all(rows[int(c)].tobytes() == payload(k, view.strides[0]) for k, c in zip(keys, load.chunk_ids))
    del rows, view
    manager.complete_load(keys, check)
    manager.on_request_finished(check)
    second.shutdown()


def test_worker_side_needs_a_gpu(model_dir: str, tmp_path: Path) -> None:
    worker = connector(model_dir, str(tmp_path / "store"), KVConnectorRole.WORKER)
    caches = {name: torch.zeros(64, 2, BLOCK, 2, 16, dtype=torch.bfloat16) for name in LAYERS}
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU"):
        worker.register_kv_caches(caches)


# ---------------------------------------------------------------------------- chunk byte format

def block_bytes(model_dir: str, layout: str, kernel_block_size: int) -> list[bytes]:
    """Each block's bytes as vLLM's offloading worker copies them in direct mode, for the same
    KV (every element a distinct value): 3 blocks of 64 tokens, 2 KV heads, allocated by vLLM
    (``allocate_kv_cache``) in the kernel blocks ``prepare_kernel_block_sizes`` picks for a CPU
    attention backend that takes only ``kernel_block_size``-token blocks (what FlashInfer's
    16/32/64 do to ``--block-size 128``), then viewed by ``group_kernel_blocks`` as the worker
    does (``OffloadingConnectorWorker.register_kv_caches``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import group_kernel_blocks
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

    class FixedKernelBlocks(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [kernel_block_size]

    config = engine_config(model_dir, "/nonexistent", layout)
    config.cache_config.block_size = 64
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(LAYERS[:1], spec)], 3 * spec.page_size_bytes)
        kernel = prepare_kernel_block_sizes(kv_cache_config, [[AttentionGroup(FixedKernelBlocks, LAYERS[:1], spec, 0)]])
        cache = allocate_kv_cache(kv_cache_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout(), kernel)[LAYERS[0]]
    assert kv_cache_config.num_blocks == 3 and kernel == [kernel_block_size]
    ratio = 64 // kernel_block_size
    blocks, heads, _, content = cache.shape[0] // ratio, cache.shape[1], cache.shape[2], cache.shape[3]
    kv = torch.arange(blocks * heads * 64 * content, dtype=torch.float32).to(torch.bfloat16).view(blocks, heads, 64, content)
    # the same logical KV: token t of block b is token t % k of kernel block b * ratio + t // k
    cache.copy_(kv.view(blocks, heads, ratio, 64 // ratio, content).transpose(1, 2).reshape(cache.shape))
    ref = group_kernel_blocks(cache, blocks)
    page = spec.page_size_bytes
    raw = torch.tensor([], dtype=torch.int8).set_(ref.untyped_storage(), ref.storage_offset() * ref.element_size(),
                                                  (blocks, page), (ref.stride(0) * ref.element_size(), 1))
    return [raw[b].numpy().tobytes() for b in range(blocks)]


def test_a_kernel_split_reorders_only_head_major_chunks(model_dir: str) -> None:
    """What the tier's rule rests on, pinned on vLLM's own allocation: in the head-major layout
    vLLM picks for ``OffloadingConnector`` (``LBHNC``) a block split into two kernel blocks is
    not the whole block's bytes for the same KV; in the token-major one (``LBNHC``) it is."""
    assert block_bytes(model_dir, "LBHNC", 32) != block_bytes(model_dir, "LBHNC", 64)
    assert block_bytes(model_dir, "LBNHC", 32) == block_bytes(model_dir, "LBNHC", 64)


def test_direct_mode_in_a_head_major_layout_is_refused_at_start(model_dir: str, tmp_path: Path) -> None:
    """The engine core resolves ``OffloadingConnector``'s own layout, ``LBHNC``, unless told
    otherwise; direct-mode chunks there depend on a kernel split only the workers know, and the
    namespace recorded no layout at all, so an engine with split blocks and one without (a
    FlashInfer and a FlashAttention engine of one model, say) read each other's chunks as KV.
    The tier now refuses that at start, saying why and what works, where a split can happen:
    not for vLLM's default 16-token blocks, which no attention backend splits."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    config = engine_config(model_dir, str(tmp_path / "store"), None)
    default_preference = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    with set_current_vllm_config(config):
        assert resolve_kv_cache_layout(config, [default_preference]).name == "LBHNC"
    with pytest.raises(ConfigError, match=r"cannot key direct-mode chunks of KV cache layout LBHNC.*"
                                          r"canonical_layout.*VLLM_KV_CACHE_LAYOUT=NHD"):
        connector(model_dir, str(tmp_path / "store"), KVConnectorRole.SCHEDULER, "LBHNC", 64)
    conn = connector(model_dir, str(tmp_path / "store16"), KVConnectorRole.SCHEDULER, "LBHNC", 16)
    try:
        tier = conn.scheduler.manager.secondary_tiers[0]
        assert dict(tier.namespace.extra)["canonical_layout"] == "direct-LBHNC"
    finally:
        conn.shutdown()
    with pytest.raises(ConfigError, match="has not resolved the KV cache layout"):
        connector(model_dir, str(tmp_path / "store"), KVConnectorRole.SCHEDULER, None)


def test_canonical_layout_in_a_head_major_layout_is_keyed_by_it(model_dir: str, tmp_path: Path) -> None:
    """With ``canonical_layout`` vLLM maps each layer to a canonical page at worker start, and,
    because it declares this engine's chunks parallelism-agnostic, refuses a layer it cannot map:
    a split one gets only its raw-bytes fallback (pinned here). So the tier takes ``LBHNC`` there,
    and its namespace records the layout."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings

    conn = connector(model_dir, str(tmp_path / "store"), KVConnectorRole.SCHEDULER, "LBHNC", canonical_layout=True)
    try:
        tier = conn.scheduler.manager.secondary_tiers[0]
        assert dict(tier.namespace.extra)["canonical_layout"] == "LBHNC"
    finally:
        conn.shutdown()
    config = engine_config(model_dir, "/nonexistent", "LBHNC", canonical_layout=True)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS[:1], spec)])
    whole = torch.zeros(4, 2, BLOCK, 32, dtype=torch.bfloat16)
    split = torch.zeros(8, 2, BLOCK // 2, 32, dtype=torch.bfloat16)
    assert derive_canonical_mappings(config, kv_cache_config, {LAYERS[0]: whole})[LAYERS[0]].parallelism_agnostic
    assert not derive_canonical_mappings(config, kv_cache_config, {LAYERS[0]: split})[LAYERS[0]].parallelism_agnostic


# ---------------------------------------------------------------------------- the attention backend's bytes

def test_a_chunks_bytes_are_the_attention_backends_in_direct_and_canonical_mode(model_dir: str) -> None:
    """What the tier's ``block_format`` rests on, pinned on vLLM's own code: the same tokens' KV
    written by two attention backends is two chunks of different bytes in both of the
    offloading worker's modes. Direct mode copies a layer's block raw
    (``OffloadingConnectorWorker.register_kv_caches``); canonical mode derives one mapping from
    the cache's shape and strides alone (``derive_canonical_mappings``: the same runs for both
    backends), which moves whole (token, head) cells of the logical view and never reads what a
    cell holds, so the canonical page is the backend's bytes rearranged, not a normal form."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings

    g = torch.Generator().manual_seed(5)
    key, value = (torch.randn(BLOCK, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    caches = {"flash_attn": backend_cache(None, key, value), "cpu_attn-vec": backend_cache("vec", key, value)}
    direct = {name: cache[1].contiguous().view(torch.uint8).flatten().numpy().tobytes() for name, cache in caches.items()}
    assert direct["flash_attn"] != direct["cpu_attn-vec"]

    config = engine_config(model_dir, "/nonexistent", "LBHNC", canonical_layout=True)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=2, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS[:1], spec)])
    mappings = {name: derive_canonical_mappings(config, kv_cache_config, {LAYERS[0]: cache})[LAYERS[0]]
                for name, cache in caches.items()}
    assert mappings["flash_attn"] == mappings["cpu_attn-vec"] and mappings["flash_attn"].parallelism_agnostic

    def canonical(local: bytes) -> bytes:
        mapping = mappings["flash_attn"]
        page = bytearray(mapping.canonical_page_size_bytes)
        for run in mapping.runs:
            for i in range(run.num_fragments):
                src, dst = run.local_offset + i * run.local_stride, run.canonical_offset + i * run.canonical_stride
                page[dst : dst + run.fragment_size] = local[src : src + run.fragment_size]
        return bytes(page)

    assert canonical(direct["flash_attn"]) != canonical(direct["cpu_attn-vec"])
    assert sorted(canonical(direct["cpu_attn-vec"])) == sorted(direct["cpu_attn-vec"])  # the same bytes, moved
