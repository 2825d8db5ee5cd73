"""Building a complete cache stack (pools, copy engine, storage, controller, cache) from sizes.

The facade, the replay and the tests all wire the same pieces; doing it in one place keeps them
honest (tests exercise exactly what the server runs and the replay measures). Capacities are in
pages; :func:`stack_config_from` derives them from a deployment config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hicache.config.budget import check_memory, memory_needs, system_memory_bytes
from hicache.config.schema import UNNAMED_MODEL
from hicache.controller.config import ControllerConfig
from hicache.controller.controller import HiCacheController
from hicache.errors import ConfigError
from hicache.events.convert import HashFormat
from hicache.keys import Namespace
from hicache.memory import (
    CopyEngine,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    PagedTokenAllocator,
    ReqToTokenPool,
    device_for,
)
from hicache.memory.host_alloc import units_of_ratio
from hicache.memory.layouts import PAGE_FORMAT
from hicache.observability.attribution import Attributor
from hicache.observability.attribution_flow import TreeAttribution
from hicache.observability.tier_events import TierChangeHub
from hicache.options import check_option_types
from hicache.placement import make_placement
from hicache.prefix_cache.hiradix import HiRadixCache
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, create_async_storage
from hicache.storage.registry import backend_class, backend_options

__all__ = [
    "CacheStack",
    "StackConfig",
    "build_stack",
    "controller_options",
    "placement_defaults",
    "require_model_name",
    "stack_config_from",
    "storage_namespace",
    "torch_dtype",
]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's ``kv_dtype`` name (a clear error when torch lacks it)."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"kv dtype {name!r} is not available in this torch; allowed: "
                          f"{sorted(k for k, v in _DTYPES.items() if v is not None)}")
    return dtype


@dataclasses.dataclass(kw_only=True)
class StackConfig:
    """Geometry and capacities. ``storage_backend`` ``None`` means no L3; ``storage_pages``
    sizes a store that takes ``max_bytes`` (``memory``, ``file``) unless ``storage_options``
    sets it; other options go in ``storage_options``."""

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
    host_size_bytes: int | None = None
    pin_memory: bool | None = None
    eviction_policy: str = "lru"
    #: host eviction order and storage admission (:mod:`hicache.placement`)
    placement: str = "lru"
    placement_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    req_slots: int = 8
    max_context_len: int = 1 << 18
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    attention: str = "mha"
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    namespace: Namespace | None = None
    #: per-request attribution of hits and misses (:mod:`hicache.observability.attribution`)
    attribution: bool = True
    #: explain mode: probe other namespaces of the store for pages never stored here
    explain_misses: bool = False
    #: page keys the attribution's ledger remembers (about 200 bytes each); default twice the
    #: pages device, host and a sized store hold, at least 16Ki and at most 256Ki
    attribution_ledger_pages: int | None = None
    #: the block hashes and tiers of the tree's ``take_events()`` (the config's ``[events]``
    #: ``hash_format`` and ``tiers``; ``None``: every tier)
    events_hash_format: HashFormat = "bytes"
    events_tiers: list[str] | None = None
    #: storage calls on the controller's private I/O loop thread (a server's choice); ``False``
    #: runs them on the cache's loop, so when a write lands does not hang on thread timing
    storage_thread: bool = True

    def __post_init__(self) -> None:
        # a value of another type failed deep in the build, naming no field ("'dict' object
        # has no attribute 'io_thread_nice'" for a dict given as ``controller``)
        check_option_types(self, "stack")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of this geometry's KV, every layer (what host and store sizes count)."""
        if self.attention == "mla":
            itemsize = self.torch_dtype.itemsize
            return self.layer_num * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize * self.page_size
        return mha_page_nbytes(self.page_size, self.layer_num, self.head_num, self.head_dim, self.dtype)


def mha_page_nbytes(page_size: int, layer_num: int, head_num: int, head_dim: int, dtype: str) -> int:
    """Bytes of one page of MHA KV (K and V, every layer) in ``dtype`` (a config's dtype name)."""
    return 2 * layer_num * head_num * head_dim * page_size * torch_dtype(dtype).itemsize


@dataclasses.dataclass
class CacheStack:
    """Everything a server (or the replay) holds; :meth:`aclose` closes it in order."""

    config: StackConfig
    device_pool: MHATokenToKVPool | MLATokenToKVPool
    allocator: PagedTokenAllocator
    req_to_token_pool: ReqToTokenPool
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost
    copy_engine: CopyEngine
    storage: AsyncHiCacheStorage | None
    controller: HiCacheController
    cache: HiRadixCache
    #: the one hub every tier of this stack reports page changes to
    tier_changes: TierChangeHub = dataclasses.field(default_factory=TierChangeHub)
    _detach_storage: Any = None
    #: explains each request's misses (``None`` when ``config.attribution`` is off)
    attributor: Attributor | None = None

    async def aclose(self, *, deadline: float | None = None) -> Any:
        """Close the cache and controller (which closes a storage the stack created) and
        the copy engine. A storage passed to :func:`build_stack` stays open. ``deadline``
        (``time.monotonic()``): when the cache's close, the storage's included, must end."""
        try:
            try:
                report = await self.cache.aclose(deadline=deadline)
            finally:  # its copy threads go even when the cache's close failed
                await self.copy_engine.aclose()
        finally:
            if self._detach_storage is not None:
                self._detach_storage()
            if self.attributor is not None:
                self.attributor.close()
        return report


def storage_namespace(host_pool: MHATokenToKVPoolHost, storage_config: HiCacheStorageConfig | None = None) -> Namespace:
    """The namespace a backend built with ``storage_config`` gives ``host_pool``'s pages (the
    same one it would derive itself)."""
    ns = Namespace.from_storage_config(storage_config or HiCacheStorageConfig())
    return ns.with_signature(host_pool.storage_signature())


def build_stack(cfg: StackConfig, *, storage: AsyncHiCacheStorage | None = None) -> CacheStack:
    """Wire a stack. Pass ``storage`` to share one store between two stacks."""
    ps = cfg.page_size
    host_bytes = cfg.host_size_bytes or cfg.host_pages * cfg.page_nbytes
    pin = False if str(cfg.device) == "cpu" else cfg.pin_memory
    if cfg.attention == "mla":
        device_pool: Any = MLATokenToKVPool(
            cfg.device_pages * ps, ps, cfg.torch_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.layer_num, cfg.device,
        )
        host_pool: Any = MLATokenToKVPoolHost(
            device_pool, host_size_bytes=host_bytes, page_size=ps, layout=cfg.host_layout, pin_memory=pin
        )
    elif cfg.attention == "mha":
        device_pool = MHATokenToKVPool(
            cfg.device_pages * ps, ps, cfg.torch_dtype, cfg.head_num, cfg.head_dim, cfg.layer_num, cfg.device
        )
        host_pool = MHATokenToKVPoolHost(
            device_pool, host_size_bytes=host_bytes, page_size=ps, layout=cfg.host_layout, pin_memory=pin
        )
    else:
        raise ConfigError(f"attention {cfg.attention!r} unknown; allowed: ['mha', 'mla']")
    allocator = PagedTokenAllocator(cfg.device_pages * ps, ps, cfg.device)
    req_pool = ReqToTokenPool(cfg.req_slots, cfg.max_context_len, cfg.device)
    engine = CopyEngine(device_pool, host_pool)
    own = storage is None and cfg.storage_backend is not None
    if storage is None and cfg.storage_backend is not None:
        options = dict(cfg.storage_options)
        if cfg.storage_pages is not None and "max_bytes" in backend_options(cfg.storage_backend):
            # any store that takes a bound gets the tier's size (a file store's own default,
            # 64 GiB, kept every page of a tier sized in pages)
            options.setdefault("max_bytes", cfg.storage_pages * stored_page_nbytes(cfg.storage_backend,
                                                                                   cfg.page_nbytes))
        options.setdefault("namespace", cfg.namespace or storage_namespace(host_pool))
        storage = create_async_storage(cfg.storage_backend, None, **options)
    if storage is not None and "kv" not in storage.registered_pools:
        storage.register_mem_pool_host(host_pool)
    controller = HiCacheController(
        copy_engine=engine, host_pool=host_pool, storage=storage, config=cfg.controller, own_storage=own,
        storage_thread=cfg.storage_thread,
    )
    hub = TierChangeHub()
    cache = HiRadixCache(
        tier_changes=hub,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=ps,
        host_pool=host_pool,
        controller=controller,
        eviction_policy=cfg.eviction_policy,
        placement=make_placement(cfg.placement, cfg.placement_options, defaults=placement_defaults(cfg)),
        event_hash_format=cfg.events_hash_format,
        event_tiers=cfg.events_tiers,
    )
    detach = None
    if own:
        storage.tier_changes = hub  # type: ignore[union-attr]
    elif storage is not None:  # shared by several stacks: each gets the store's changes forwarded
        detach = storage.tier_changes.subscribe(hub.emit)
    stack = CacheStack(cfg, device_pool, allocator, req_pool, host_pool, engine, storage, controller, cache, hub,
                       detach)
    _wire_attribution(stack)
    return stack


def stored_page_nbytes(backend: str, page_nbytes: int) -> int:
    """Bytes one page of ``page_nbytes`` takes of ``backend``'s ``max_bytes``
    (:meth:`AsyncHiCacheStorage.stored_page_nbytes`: a ``file`` store counts each page file
    whole, header and footer too, 224 bytes for a 64-byte page). A store
    bounded to ``storage_pages`` pages of payload held fewer (4 of 16) while the placement
    directory counted ``storage_pages``, so the store's own LRU evicted pages the tree kept."""
    return int(backend_class(backend).stored_page_nbytes(page_nbytes))


def _wire_attribution(stack: CacheStack) -> None:
    """Give the tree its miss attribution, fed by the stack's hub."""
    cfg, hub = stack.config, stack.tier_changes
    if cfg.attribution:
        pages = cfg.attribution_ledger_pages
        if pages is None:
            pages = min(1 << 18, max(1 << 14, 2 * (cfg.device_pages + cfg.host_pages + (cfg.storage_pages or 0))))
        stack.attributor = Attributor(hub, page_size=cfg.page_size, ledger_pages=pages, explain=cfg.explain_misses,
                                      metrics=stack.controller.metrics)
        stack.cache.explain_admit = TreeAttribution(stack.cache, stack.attributor)


def placement_defaults(cfg: StackConfig) -> dict[str, Any]:
    """Sizes a placement policy takes from the stack: a ghost list twice the pages host and
    storage can hold (a page dropped unwritten is remembered about as long as it could have been
    kept)."""
    return {"ghost_pages": 2 * (cfg.host_pages + (cfg.storage_pages or 0)),
            "storage_capacity_pages": storage_capacity_pages(cfg)}


def storage_capacity_pages(cfg: StackConfig) -> int | None:
    """Pages the store the stack builds holds (``None``: unknown, e.g. a file store sized by its
    own options): a memory store's ``max_bytes`` in pages, else ``storage_pages``."""
    if not cfg.storage_backend:
        return None
    max_bytes = cfg.storage_options.get("max_bytes") if cfg.storage_backend == "memory" else None
    if isinstance(max_bytes, int) and cfg.page_nbytes:
        return max(1, max_bytes // cfg.page_nbytes)
    return cfg.storage_pages or None


def controller_options(config: Any) -> dict[str, Any]:
    """:class:`ControllerConfig` options from a deployment config's ``cache`` section."""
    cache, prefetch, ps = config.cache, config.cache.prefetch, config.device.page_size
    options: dict[str, Any] = {
        "write_policy": cache.write_policy,
        "backup_queue_size": cache.queue_size,
        "storage_queue_size": cache.queue_size,
        "storage_batch_pages": cache.backup_batch_pages,
        "storage_max_retries": cache.backup_retries,
        "close_timeout_s": cache.close_timeout_s,
        "prefetch_policy": prefetch.policy,
        "prefetch_threshold": prefetch.threshold_tokens,
        "prefetch_timeout_base_s": prefetch.timeout_base_s,
        "prefetch_timeout_per_ki_token_s": prefetch.timeout_per_ki_token_s,
        "prefetch_timeout_max_s": prefetch.timeout_max_s,
        "prefetch_recompute_tokens_per_s": prefetch.recompute_tokens_per_s,
        "max_inflight_prefetch_tokens": prefetch.max_inflight_pages * ps,
    }
    if cache.write_policy == "write_through_selective":
        options["write_through_threshold"] = cache.write_through_threshold
    return options


def config_namespace(config: Any) -> Namespace:
    """The storage namespace of a deployment: what makes its pages incompatible with others'.

    The layout is the canonical flat page format (the same bytes whatever the host layout), so
    deployments that differ only in host layout share pages. A store other than the in-process
    ``memory`` one needs ``model.name`` set (:func:`require_model_name`)."""
    require_model_name(config)
    m = config.model
    return Namespace(
        model=m.name,
        revision=m.revision,
        kv_dtype=m.kv_dtype,
        layout=PAGE_FORMAT,
        page_size=config.device.page_size,
        num_layers=m.num_layers,
        num_kv_heads=None if m.attention == "mla" else m.num_kv_heads,
        head_dim=(m.kv_lora_rank + m.qk_rope_head_dim) if m.attention == "mla" else m.head_dim,
        is_mla=m.attention == "mla",
        salt=config.storage.namespace_salt,
    )


def require_model_name(config: Any) -> None:
    """A :class:`ConfigError` where ``config`` names no model (``model.name`` left unset, or
    blank) and its store is shared: any backend but ``memory``, and ``memory`` with a
    ``store_id`` (a medium every store of the process naming it shares).

    Why: a page is found by its token hashes within the namespace, and a file, S3 or plugin
    store outlives the process and is shared; two models of one geometry whose configs both
    left the name unset had one namespace, and each was served the other's KV (wrong answers,
    no error). A private ``memory`` store dies with the cache that wrote it, so a test or demo
    need not name its model."""
    backend = config.storage.backend
    store_id = config.storage.options.get("store_id") if backend == "memory" else None
    if backend is None or (backend == "memory" and not store_id):
        return
    name = config.model.name
    if name.strip() and name != UNNAMED_MODEL:
        return
    shared = (f"storage backend 'memory' with store_id {store_id!r} shares its pages with every store of this "
              "process naming it" if store_id else f"storage backend {backend!r} keeps pages beyond this process")
    raise ConfigError(f"model.name is not set: {shared}, found by model and geometry, and unnamed models of one "
                      "geometry would read each other's KV; set model.name (or HICACHE__MODEL__NAME) to the served "
                      "model's id, e.g. meta-llama/Llama-3.1-8B-Instruct")


def stack_config_from(config: Any, *, namespace: bool = True) -> StackConfig:
    """A :class:`StackConfig` for a deployment config (``hicache.config.HiCacheConfig``).

    ``namespace=False``: the caller stores pages under a namespace of its own (the replay's, one
    per run), so the config's is not made, nor its model name required; ``namespace`` is ``None``."""
    m, d, h, st = config.model, config.device, config.host, config.storage
    device = str(device_for(None if d.device == "auto" else d.device))
    ps = d.page_size
    device_pages = d.size_tokens // ps
    probe = StackConfig(page_size=ps, layer_num=m.num_layers, head_num=m.num_kv_heads, head_dim=m.head_dim,
                        dtype=m.kv_dtype, attention=m.attention, kv_lora_rank=m.kv_lora_rank,
                        qk_rope_head_dim=m.qk_rope_head_dim)
    if not h.size_bytes and not math.isfinite(device_pages * h.ratio):
        # a finite ratio whose product is not (1e308): math.floor(inf) was an OverflowError
        raise ConfigError(f"host: host.ratio ({h.ratio:g}) of {device_pages} device pages is more pages than can be "
                          "counted; size the host pool with a ratio of a few, or with host.size_bytes")
    host_pages = (h.size_bytes // probe.page_nbytes) if h.size_bytes else units_of_ratio(device_pages, h.ratio)
    if host_pages <= 0:
        # named by what sized it: with ratio the message read "None bytes hold no page"
        given = (f"host.size_bytes ({h.size_bytes})" if h.size_bytes else
                 f"host.ratio ({h.ratio:g}) of {device_pages} device pages")
        raise ConfigError(f"host: {given} holds no page of {probe.page_nbytes} bytes")
    on_host = not device.startswith("cuda")
    check_memory(
        memory_needs(config, page_nbytes=probe.page_nbytes, host_pages=host_pages, device_is_host=on_host),
        host_bytes=system_memory_bytes(),
        device_bytes=None if on_host else int(torch.cuda.mem_get_info(torch.device(device))[1]),
    )
    return dataclasses.replace(
        probe,
        device=device,
        device_pages=device_pages,
        host_pages=host_pages,
        host_layout=h.layout,
        pin_memory=h.pin_memory,
        storage_backend=st.backend or None,
        storage_options=dict(st.options),
        eviction_policy=config.cache.eviction_policy,
        placement=config.cache.placement,
        placement_options=dict(config.cache.placement_options),
        req_slots=d.max_requests,
        max_context_len=d.max_context_len,
        controller=ControllerConfig.from_dict(controller_options(config)),
        namespace=config_namespace(config) if namespace else None,
        explain_misses=config.cache.explain_misses,
        attribution_ledger_pages=config.cache.attribution_ledger_pages,
        events_hash_format=config.events.hash_format,
        events_tiers=list(config.events.tiers),
    )
