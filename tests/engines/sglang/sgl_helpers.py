"""Builders of SGLang's own objects on CPU: device pools, host pools in every layout, the
pool group and the controller every 0.5.23 stack uses (``HybridCacheController``)."""

from __future__ import annotations

import threading
from typing import Any

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: a host layout SGLang 0.5.23's MHA and MLA host pools build, whose pages its own page methods
#: and its CPU transfers do not move (storage moves them through hicache's canonical adapter)
UNIFIED = "page_unified"
MODULE = "hicache.integrations.sglang"
CLASS = "HiCacheSGLangStorage"


def s3_backend_options(endpoint: str, bucket: str) -> dict[str, Any]:
    return {
        "url": f"s3://{bucket}/kv",
        "storage_options": {
            "endpoint_url": endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        },
    }


def extra_config(backend: str = "file", **options: Any) -> dict[str, Any]:
    """What a user passes as ``--hicache-storage-backend-extra-config``."""
    return {
        "backend_name": "hicache",
        "module_path": MODULE,
        "class_name": CLASS,
        "hicache_backend": backend,
        "hicache_options": options,
    }


def storage_config(root: Any, model_name: str, *, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of a one-rank MHA server (page-first host layout,
    metrics off) storing in a ``file`` store at ``root``; ``extra`` adds adapter keys,
    ``fields`` replace the config's own."""
    base: dict[str, Any] = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model_name,
                                extra_config={**extra_config("file", root=str(root)), **(extra or {})})
    return HiCacheStorageConfig(**{**base, **fields})


def device_pool(
    *, size: int = 512, page_size: int = 16, layers: int = 4, heads: int = 2, head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16, mla: bool = False,
) -> Any:
    if mla:
        return MLATokenToKVPool(
            size, page_size, dtype, kv_lora_rank=head_dim, qk_rope_head_dim=16, layer_num=layers,
            device="cpu", enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
        )
    return MHATokenToKVPool(
        size, page_size, dtype, heads, head_dim, layers, "cpu", enable_memory_saver=False,
        start_layer=0, end_layer=layers - 1,
    )


def host_pool(dev: Any, layout: str, *, ratio: float = 2.0, head_group_num: int = 1) -> Any:
    """SGLang's host pool of ``dev`` in ``layout``; ``head_group_num``: the kv-head groups of
    an MHA ``page_unified`` page."""
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                  start_layer=dev.start_layer, end_layer=dev.end_layer)
    if isinstance(dev, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, ratio, 0, dev.page_size, layout, target_layer_num=dev.layer_num, **common)
    return MHATokenToKVPoolHost(info, ratio, 0, dev.page_size, layout, head_group_num=head_group_num, **common)


def fill_random(host: Any, seed: int = 0) -> None:
    """Distinct values everywhere, so a reordered page can never compare equal by accident."""
    g = torch.Generator().manual_seed(seed)
    buf = host.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).to(buf.dtype))


def controller(
    dev: Any, host: Any, extra: dict[str, Any], *, backend: str = "dynamic",
    extra_entries: list[PoolEntry] | None = None, metrics: bool = False,
) -> HybridCacheController:
    """SGLang's HybridCacheController over ``host``, with storage attached as at start-up."""
    allocator = PagedTokenToKVPoolAllocator(dev.size, dev.page_size, torch.int64, "cpu", dev, need_sort=False)
    entries = [PoolEntry(name=PoolName.KV, host_pool=host, device_pool=dev, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    entries += extra_entries or []
    group = HostPoolGroup(entries)
    return HybridCacheController(
        allocator, group, dev.page_size, None, threading.Event(),
        storage_backend=backend, model_name="test/model", storage_backend_extra_config=extra,
        transfer_layer_id_max=dev.layer_num, enable_storage_metrics=metrics,
    )


def swa_entry(page_size: int) -> tuple[Any, PoolEntry]:
    """A hybrid model's SWA host pool (page_first, filled at random) and its pool entry, for
    :func:`controller`'s ``extra_entries``."""
    swa_dev = device_pool(page_size=page_size, layers=2, heads=1, head_dim=16)
    swa_host = host_pool(swa_dev, "page_first")
    fill_random(swa_host, 7)
    return swa_host, PoolEntry(name=PoolName.SWA, host_pool=swa_host, device_pool=swa_dev, layer_mapper=lambda i: i)


def mamba_server(root: str, ssm_dtype: torch.dtype = torch.bfloat16, ratio: float = 2.0, *,
                 metrics: bool = False, fill: bool = False, side_state: bool = False) -> tuple[Any, Any]:
    """A hybrid model's rank through SGLang's factory (``dynamic`` -> hicache's file store at
    ``root``): its KV host pool (page 16, 4 layers, page_first) and a Mamba state pool (SSM
    state of ``ssm_dtype``, conv bf16) registered as v2 pools. Returns the storage and the Mamba
    pool. ``metrics``: SGLang's storage metrics on; ``fill``: the KV pool filled at random;
    ``side_state``: a per-slot side state kept in each state page (``extra_checkpoint_buffers``)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    dev = device_pool(page_size=16, layers=4)
    kv = host_pool(dev, "page_first")
    if fill:
        fill_random(kv)
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 8, dtype=ssm_dtype),
                                conv=(torch.zeros(2, 8, 3, 8, dtype=torch.bfloat16),),
                                extra_checkpoint_buffers=(torch.zeros(8, 5),) if side_state else ())
    mamba = MambaPoolHost(info, ratio, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    cfg = storage_config(root, "m", enable_storage_metrics=metrics)
    st = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(kv, PoolName.KV)
    st.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    st.on_host_pools_registered()
    return st, mamba
