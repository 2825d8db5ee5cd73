"""The storage interface: SGLang-compatible types, the async backend base, the blocking facade,
the v2 hit policy, the shared page format, pages as pool memory pieces (scatter/gather I/O)
and the backend registry."""

from hicache.storage.base import AsyncHiCacheStorage, StorageState
from hicache.storage.hit_policy import resolve_v2_hits
from hicache.storage.page_format import PageCodec, Verdict
from hicache.storage.segments import PageSegments, StridedPiece
from hicache.storage.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    backend_class,
    create_async_storage,
    create_storage,
    refresh_backends,
    register_backend,
)
from hicache.storage.stats import StorageStats
from hicache.storage.sync import HiCacheStorage
from hicache.storage.types import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PageKey,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

__all__ = [
    "AsyncHiCacheStorage",
    "ENTRY_POINT_GROUP",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PageCodec",
    "PageKey",
    "PageSegments",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageState",
    "StorageStats",
    "StridedPiece",
    "Verdict",
    "available_backends",
    "backend_class",
    "create_async_storage",
    "create_storage",
    "refresh_backends",
    "register_backend",
    "resolve_v2_hits",
]
