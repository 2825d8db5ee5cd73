"""``BasePrefixCache``: the engine-facing interface every prefix cache implements.

It mirrors SGLang's abstract class as its scheduler and the session-aware cache use it, so a
cache can be wrapped (the session cache decorates one) or swapped without touching the engine.
Abstract: ``reset``, ``match_prefix``, ``cache_finished_req``, ``cache_unfinished_req``,
``evict``, ``inc_lock_ref``, ``dec_lock_ref``. Everything else has a harmless default so a
decorator can forward it blindly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

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

__all__ = ["BasePrefixCache"]


class BasePrefixCache(ABC):
    """Abstract prefix cache. Attributes every implementation sets: ``req_to_token_pool``,
    ``token_to_kv_pool_allocator``, ``page_size``, ``disable``."""

    req_to_token_pool: Any = None
    token_to_kv_pool_allocator: Any = None
    page_size: int = 1
    disable: bool = False
    metrics_collector: Any = None

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached prefix and return all memory the cache holds."""

    @abstractmethod
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` (see :class:`MatchResult`)."""

    @abstractmethod
    def cache_finished_req(self, req: Req, is_insert: bool = True, **kwargs: Any) -> None:
        """Take over a finished request's KV (insert it) and release its lock. The request's
        ``req_pool_idx`` slot stays allocated: the caller frees it (as SGLang's
        ``release_kv_cache`` does) unless a decorator took it over and set it to ``None``."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req, **kwargs: Any) -> None:
        """Insert the KV computed so far (after a prefill chunk) and move the request's lock to
        the new deepest node."""

    @abstractmethod
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device slots if that many are evictable."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Protect ``node`` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Undo one :meth:`inc_lock_ref` of ``node``."""

    # -- sizes (tokens on device)
    def evictable_size(self) -> int:
        return 0

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def swa_evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def full_protected_size(self) -> int:
        return self.protected_size()

    def swa_protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        raise NotImplementedError

    def pretty_print(self) -> str:
        raise NotImplementedError

    # -- host tier hooks (no-ops without one)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Start loading ``params.host_hit_length`` host tokens back to device; returns the
        newly loaded device indices and the new deepest device node."""
        raise NotImplementedError

    def ready_to_load_host_cache(self) -> Any:
        return None

    def flush_write_through_acks(self) -> None:
        return None

    def check_hicache_events(self) -> None:
        return None

    def take_events(self) -> list[Any]:
        return []

    # -- capability flags
    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def available_and_evictable_str(self) -> str:
        avail = self.token_to_kv_pool_allocator.available_size() if self.token_to_kv_pool_allocator else 0
        return f"available={avail}, evictable={self.evictable_size()}"

    def init_metrics_collector(self) -> None:
        return None

    def sanity_check(self) -> None:
        return None
