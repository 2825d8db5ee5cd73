"""Data types of the storage interface, with SGLang's names, fields and semantics.

Code written against SGLang's ``hicache_storage`` module constructs these the same way here.
Differences are additions only: every field of :class:`HiCacheStorageConfig` has a default so a
single-process user can write ``HiCacheStorageConfig(model_name="m")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch

from hicache.keys import validate_text

__all__ = [
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PageKey",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
]


@dataclass
class HiCacheStorageConfig:
    """Where this process sits in the parallel layout, and what model it serves."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    extra_config: dict | None = None


@dataclass
class HiCacheStorageExtraInfo:
    """Per-call hints. ``prefix_keys`` are the keys of the pages before this batch (the last one is
    the parent of the batch's first page)."""

    prefix_keys: list[str] | None = None
    extra_info: dict | None = None


class PoolName(str, Enum):
    """Well-known pool names used as PoolTransfer identifiers."""

    KV = "kv"
    MAMBA = "mamba"
    INDEXER = "indexer"


class PoolHitPolicy(str, Enum):
    """Hit policy of an extra pool in ``batch_exists_v2``.

    ALL_PAGES      : every page in ``[0, kv_hit)`` must exist (e.g. DeepSeek's DSA indexer).
    TRAILING_PAGES : only the last N pages of the prefix must exist (Mamba / SWA state).
    """

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass
class PoolTransfer:
    """One pool's part of a v2 transfer.

    device<->host : ``host_indices`` + ``device_indices``
    host<->storage: ``host_indices`` + ``keys`` (``host_indices`` holds ``len(keys) * page_size``
    token indices of that pool; page ``i`` starts at ``host_indices[i * page_size]``).
    """

    name: PoolName | str
    host_indices: torch.Tensor | None = None
    device_indices: torch.Tensor | None = None
    keys: list[str] | None = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES


@dataclass
class PoolTransferResult:
    """How many pages were found or moved, for the KV pool and each extra pool."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[str, int] = field(default_factory=dict)
    #: every prefix length (pages, ascending) all pools can restore, from an existence query;
    #: ``kv_hit_pages`` is the last. Empty where not computed (transfers' results)
    restorable_prefix_pages: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls) -> PoolTransferResult:
        return cls(0, {})

    def update_kv_hit_pages(self, kv_hit_pages: int) -> None:
        """Accumulate across batches: the result is the furthest successful batch."""
        self.kv_hit_pages = max(self.kv_hit_pages, kv_hit_pages)

    def update_extra_pool_hit_pages(self, results: dict[str, list[bool]]) -> None:
        """Record per-pool success counts of a ``batch_get_v2``/``batch_set_v2`` result."""
        self.extra_pool_hit_pages.update({name: sum(rs) for name, rs in results.items()})


#: Longest pool name in UTF-8 bytes; pool names are stored in every page header beside the key.
MAX_POOL_NAME_BYTES = 255


def pool_name_str(name: PoolName | str | Any) -> str:
    """The plain string of a pool name (``PoolName.KV`` -> ``"kv"``).

    Raises ``TypeError`` for a non-string and :class:`~hicache.errors.InvalidKeyError` for a
    name no backend can store (empty, NUL, not UTF-8, over ``MAX_POOL_NAME_BYTES``)."""
    if isinstance(name, PoolName):
        return name.value
    if not isinstance(name, str):
        raise TypeError(f"pool name must be a PoolName or str, got {type(name).__name__}")
    return validate_text(name, "pool name", MAX_POOL_NAME_BYTES)


class PageKey(NamedTuple):
    """What a backend stores one page under: the page key and its pool's name."""

    key: str
    pool: str = PoolName.KV.value

    def label(self) -> str:
        """Human-readable form for logs: ``key`` or ``key.pool``."""
        return self.key if self.pool == PoolName.KV.value else f"{self.key}.{self.pool}"
