"""Radix prefix caches over paged KV, with SGLang's engine-facing interface.

* :class:`RadixCache` - device tier only.
* :class:`HiRadixCache` - device, host and storage tiers, moved by a
  :class:`~hicache.controller.HiCacheController`.
* :class:`BasePrefixCache` - the abstract interface (the session cache decorates one).
* :class:`Req`, :class:`Session` - the request fields caches read and write.
* params/results: :class:`MatchPrefixParams`, :class:`MatchResult`, :class:`EvictParams`, ...
"""

from hicache.prefix_cache.base import BasePrefixCache
from hicache.prefix_cache.hashing import fast_page_hashes, namespace_seed
from hicache.prefix_cache.facade import AdmitResult
from hicache.prefix_cache.hiradix import HiRadixCache
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.policy import EVICTION_POLICIES, eviction_key
from hicache.prefix_cache.radix import RadixCache, free_token_pages
from hicache.prefix_cache.req import Req, Session
from hicache.prefix_cache.types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)

__all__ = [
    "AdmitResult",
    "BasePrefixCache",
    "DecLockRefParams",
    "DecLockRefResult",
    "EVICTION_POLICIES",
    "EvictParams",
    "EvictResult",
    "HiRadixCache",
    "IncLockRefResult",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "Req",
    "Session",
    "TreeNode",
    "eviction_key",
    "fast_page_hashes",
    "free_token_pages",
    "namespace_seed",
]
