"""``ForwardingCache``: a prefix cache that forwards everything to the cache it wraps.

Why a base of its own: a decorator must stay a drop-in :class:`BasePrefixCache` (the engine's
scheduler reads ``req_to_token_pool``, ``page_size``, sizes and capability flags from whatever
cache it holds, and sets some of them), yet the session cache changes only a handful of
methods. Keeping the plumbing here leaves ``cache.py`` with the session logic alone.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.prefix_cache.base import BasePrefixCache
from hicache.prefix_cache.req import Req
from hicache.prefix_cache.types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)

__all__ = ["ForwardingCache"]


class ForwardingCache(BasePrefixCache):
    """Forwards every attribute and method of the prefix-cache interface to ``inner``;
    anything else (``controller``, ``host_pool``, ``evict_host``, ...) is looked up on
    ``inner`` too."""

    def __init__(self, inner: BasePrefixCache) -> None:
        self.inner = inner

    # ------------------------------------------------------------------ forwarded attributes

    @property
    def req_to_token_pool(self) -> Any:  # type: ignore[override]
        return self.inner.req_to_token_pool

    @req_to_token_pool.setter
    def req_to_token_pool(self, value: Any) -> None:
        self.inner.req_to_token_pool = value

    @property
    def token_to_kv_pool_allocator(self) -> Any:  # type: ignore[override]
        return self.inner.token_to_kv_pool_allocator

    @token_to_kv_pool_allocator.setter
    def token_to_kv_pool_allocator(self, value: Any) -> None:
        self.inner.token_to_kv_pool_allocator = value

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.inner.page_size

    @page_size.setter
    def page_size(self, value: int) -> None:
        self.inner.page_size = value

    @property
    def disable(self) -> bool:  # type: ignore[override]
        return self.inner.disable

    @disable.setter
    def disable(self, value: bool) -> None:
        self.inner.disable = value

    @property
    def metrics_collector(self) -> Any:  # type: ignore[override]
        return self.inner.metrics_collector

    @metrics_collector.setter
    def metrics_collector(self, value: Any) -> None:
        self.inner.metrics_collector = value

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found normally: cache-specific extras of the inner
        # cache (controller, host_pool, evict_host, drain, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ the abstract interface

    def reset(self) -> None:
        self.inner.reset()

    def match_prefix(self, params: MatchPrefixParams, **kwargs: Any) -> MatchResult:
        return self.inner.match_prefix(params, **kwargs)

    def cache_finished_req(self, req: Req, is_insert: bool = True, **kwargs: Any) -> None:
        return self.inner.cache_finished_req(req, is_insert=is_insert, **kwargs)

    def cache_unfinished_req(self, req: Req, **kwargs: Any) -> None:
        return self.inner.cache_unfinished_req(req, **kwargs)

    def evict(self, params: EvictParams) -> EvictResult:
        return self.inner.evict(params)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        return self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        return self.inner.dec_lock_ref(node, params)

    # ------------------------------------------------------------------ pass-through

    def evictable_size(self) -> int:
        return self.inner.evictable_size()

    def full_evictable_size(self) -> int:
        return self.inner.full_evictable_size()

    def swa_evictable_size(self) -> int:
        return self.inner.swa_evictable_size()

    def protected_size(self) -> int:
        return self.inner.protected_size()

    def full_protected_size(self) -> int:
        return self.inner.full_protected_size()

    def swa_protected_size(self) -> int:
        return self.inner.swa_protected_size()

    def total_size(self) -> int:
        return self.inner.total_size()

    def pretty_print(self) -> str:
        return self.inner.pretty_print()

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        return self.inner.init_load_back(params)

    def ready_to_load_host_cache(self) -> Any:
        return self.inner.ready_to_load_host_cache()

    def flush_write_through_acks(self) -> None:
        return self.inner.flush_write_through_acks()

    def prepare_write_backup_for_req(self, req: Req) -> None:
        fn = getattr(self.inner, "prepare_write_backup_for_req", None)
        if fn is not None:
            fn(req)

    def check_hicache_events(self) -> None:
        return self.inner.check_hicache_events()

    def take_events(self) -> list[Any]:
        return self.inner.take_events()

    def supports_swa(self) -> bool:
        return self.inner.supports_swa()

    def supports_mamba(self) -> bool:
        return self.inner.supports_mamba()

    def is_chunk_cache(self) -> bool:
        return self.inner.is_chunk_cache()

    def is_tree_cache(self) -> bool:
        return self.inner.is_tree_cache()

    def init_metrics_collector(self) -> None:
        return self.inner.init_metrics_collector()

    def available_and_evictable_str(self) -> str:
        return self.inner.available_and_evictable_str()

    def sanity_check(self) -> None:
        self.inner.sanity_check()
