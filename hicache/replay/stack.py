"""Building a complete cache stack (pools, copy engine, storage, controller, cache) from sizes.

Replay and tests need the same wiring with different capacities; doing it in one place keeps
them honest (tests exercise exactly what the replay measures). Capacities are in pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hicache.controller.config import ControllerConfig
from hicache.controller.controller import HiCacheController
from hicache.keys import Namespace
from hicache.memory import CopyEngine, MHATokenToKVPool, MHATokenToKVPoolHost, PagedTokenAllocator, ReqToTokenPool
from hicache.prefix_cache.hiradix import HiRadixCache
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, create_async_storage

__all__ = ["StackConfig", "CacheStack", "build_stack", "storage_namespace"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(kw_only=True)
class StackConfig:
    """Geometry and capacities. ``storage_backend`` ``None`` means no L3; ``storage_pages``
    sizes a ``memory`` store (``max_bytes``); other backends take ``storage_options``."""

    page_size: int = 64
    layer_num: int = 1
    head_num: int = 1
    head_dim: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    device_pages: int = 64
    host_pages: int = 256
    storage_backend: str | None = "memory"
    storage_pages: int | None = None
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    host_layout: str = "page_first"
    eviction_policy: str = "lru"
    req_slots: int = 8
    max_context_len: int = 1 << 18
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.layer_num * self.head_num * self.head_dim * itemsize * self.page_size


@dataclasses.dataclass
class CacheStack:
    """Everything a server (or the replay) holds; :meth:`aclose` closes it in order."""

    config: StackConfig
    device_pool: MHATokenToKVPool
    allocator: PagedTokenAllocator
    req_to_token_pool: ReqToTokenPool
    host_pool: MHATokenToKVPoolHost
    copy_engine: CopyEngine
    storage: AsyncHiCacheStorage | None
    controller: HiCacheController
    cache: HiRadixCache

    async def aclose(self) -> Any:
        """Close the cache and controller (which closes a storage the stack created) and
        the copy engine. A storage passed to :func:`build_stack` stays open."""
        report = await self.cache.aclose()
        await self.copy_engine.aclose()
        return report


def storage_namespace(host_pool: MHATokenToKVPoolHost, storage_config: HiCacheStorageConfig | None = None) -> Namespace:
    """The namespace a backend built with ``storage_config`` gives ``host_pool``'s pages (the
    same one it would derive itself)."""
    ns = Namespace.from_storage_config(storage_config or HiCacheStorageConfig())
    return ns.with_signature(host_pool.storage_signature())


def build_stack(cfg: StackConfig, *, storage: AsyncHiCacheStorage | None = None) -> CacheStack:
    """Wire a stack. Pass ``storage`` to share one store between two stacks."""
    ps = cfg.page_size
    device_pool = MHATokenToKVPool(
        cfg.device_pages * ps, ps, cfg.torch_dtype, cfg.head_num, cfg.head_dim, cfg.layer_num, cfg.device
    )
    allocator = PagedTokenAllocator(cfg.device_pages * ps, ps, cfg.device)
    req_pool = ReqToTokenPool(cfg.req_slots, cfg.max_context_len, cfg.device)
    host_pool = MHATokenToKVPoolHost(
        device_pool, host_size_bytes=cfg.host_pages * cfg.page_nbytes, page_size=ps, layout=cfg.host_layout,
        pin_memory=False if cfg.device == "cpu" else None,
    )
    engine = CopyEngine(device_pool, host_pool)
    own = storage is None and cfg.storage_backend is not None
    if storage is None and cfg.storage_backend is not None:
        options = dict(cfg.storage_options)
        if cfg.storage_backend == "memory" and cfg.storage_pages is not None:
            options.setdefault("max_bytes", cfg.storage_pages * cfg.page_nbytes)
        options.setdefault("namespace", storage_namespace(host_pool))
        storage = create_async_storage(cfg.storage_backend, None, **options)
    if storage is not None and "kv" not in storage.registered_pools:
        storage.register_mem_pool_host(host_pool)
    controller = HiCacheController(
        copy_engine=engine, host_pool=host_pool, storage=storage, config=cfg.controller, own_storage=own
    )
    cache = HiRadixCache(
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=ps,
        host_pool=host_pool,
        controller=controller,
        eviction_policy=cfg.eviction_policy,
    )
    return CacheStack(cfg, device_pool, allocator, req_pool, host_pool, engine, storage, controller, cache)
