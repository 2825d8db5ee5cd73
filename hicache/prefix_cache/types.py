"""Parameter and result objects of the engine-facing prefix-cache interface.

Names, fields and defaults follow SGLang's ``base_prefix_cache`` so that code written against
SGLang (the session-aware cache seed in particular) constructs and reads them unchanged. Every
field has a default, because callers such as the session cache build results by keyword with
only the fields they know (``MatchResult(device_indices=..., last_device_node=...,
last_host_node=..., cache_protected_len=...)``).

Additions (ours) are marked; they never change the meaning of an SGLang field.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from hicache.prefix_cache.req import Req

__all__ = [
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "RadixKey",
]

#: typecodes of packed token runs a key keeps as they are
_PACKED = ("I", "q")


def _same_tokens(a: list[int] | array, b: list[int] | array) -> bool:
    """Equal token ids, whether held as a list or packed (a list never equals an array)."""
    if type(a) is type(b):
        return a == b
    return len(a) == len(b) and list(a) == list(b)


class RadixKey:
    """Token ids plus an optional namespace (``extra_key``: LoRA id, tenant, cache salt).

    Two keys with different ``extra_key`` never share a tree node or a storage page, even when
    their tokens are equal: KV computed under one adapter is wrong under another.
    """

    __slots__ = ("token_ids", "extra_key", "_run")

    def __init__(self, token_ids: Sequence[int], extra_key: str | None = None) -> None:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        # A list is kept as given; so is a packed run (``array('I')`` or ``array('q')``, see
        # :mod:`~hicache.prefix_cache.tokens`), which the tree then compares without
        # converting: a server that holds its requests' tokens packed (as SGLang holds them
        # in ``array('q')``) pays no conversion per walk. Anything else becomes a list.
        if not isinstance(token_ids, list) and not (
            type(token_ids) is array and token_ids.typecode in _PACKED
        ):
            token_ids = list(token_ids)
        self.token_ids: list[int] | array = token_ids
        self.extra_key: str | None = extra_key
        #: the tree's packed copy of a list ``token_ids`` (see ``prefix_cache.tokens.key_run``):
        #: a key matched and then inserted is converted once. Change a key's tokens by building
        #: a new key, not by editing its list in place.
        self._run: tuple[list[int] | array, int, array] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)

    def __getitem__(self, idx: slice | int) -> RadixKey | int:
        if isinstance(idx, slice):
            return RadixKey(self.token_ids[idx], self.extra_key)
        return self.token_ids[idx]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RadixKey)
            and self.extra_key == other.extra_key
            and _same_tokens(self.token_ids, other.token_ids)
        )

    def __repr__(self) -> str:
        head = self.token_ids[:8]
        more = "..." if len(self.token_ids) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self.token_ids)}, extra_key={self.extra_key!r})"


@dataclasses.dataclass
class MatchPrefixParams:
    """What to look up. ``req`` is optional; when given, namespace and priority come from it."""

    key: RadixKey
    cow_mamba: bool = False
    req: Req | None = None


class MatchResult(NamedTuple):
    """Result of :meth:`BasePrefixCache.match_prefix`.

    device_indices   : device KV slots of the prefix that is on device now (page-aligned).
                       Read-only: it may share memory with the tree's own slots (a prefix
                       held by one node comes back without a copy); reshaping it in place is
                       fine, writing into it is not.
    last_device_node : deepest matched node whose KV is on device (lock this one).
    last_host_node   : deepest matched node with KV on device *or* host; equal to
                       ``last_device_node`` for a cache without a host tier. Anchor of the
                       storage lookup.
    best_match_node  : anchor of the host->device load-back (= ``last_host_node`` here).
    host_hit_length  : tokens after the device hit whose KV is on host only.
    cache_protected_len: tokens the caller may treat as owned by the tree.
    full_kv_hit_length : device + host hit in tokens.
    storage_prior_hash : (ours) chain hash to continue from when asking storage for the pages
                       after ``last_host_node``, when the caller knows it. The tree leaves it
                       ``None``: only a storage prefetch needs it, and computing it hashes every
                       not yet hashed page on the path, so whoever needs it asks the cache for
                       ``storage_prior_hash(last_host_node, extra_key)`` (the prefetch does).
    """

    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any = None
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    full_kv_hit_length: int = 0
    storage_prior_hash: str | None = None

    @property
    def device_hit_length(self) -> int:
        """(ours) tokens of the prefix on device."""
        return int(self.device_indices.numel())


@dataclasses.dataclass
class InsertParams:
    """What to insert: page-aligned tokens and their device KV slots."""

    key: RadixKey | None = None
    value: torch.Tensor | None = None
    mamba_value: torch.Tensor | None = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0
    #: the inserting request already counted ``[0, inserted_len)`` (its match, its earlier
    #: chunks): only nodes past it count a hit, so a request counts each node once (SGLang's
    #: field; a chunked prefill's own chunks are not reuse)
    inserted_len: int = 0


@dataclasses.dataclass
class InsertResult:
    """``prefix_len``: tokens of the key that were already on device (their slots in ``value``
    are duplicates the caller must free)."""

    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None


@dataclasses.dataclass
class EvictParams:
    """How much device memory to free, in tokens."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass
class DecLockRefParams:
    """Receipt of an ``inc_lock_ref`` (SWA fields are carried for interface parity)."""

    node_id: int | None = None
    swa_uuid_for_lock: Any = None
    swa_uuid_for_host_lock: Any = None


@dataclasses.dataclass
class IncLockRefResult:
    """``delta``: change of the protected size in tokens caused by this lock."""

    delta: int | None = None
    node_id: int | None = None
    swa_uuid_for_lock: Any = None
    swa_uuid_for_host_lock: Any = None

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(
            node_id=self.node_id,
            swa_uuid_for_lock=self.swa_uuid_for_lock,
            swa_uuid_for_host_lock=self.swa_uuid_for_host_lock,
        )


@dataclasses.dataclass
class DecLockRefResult:
    delta: int | None = None


@dataclasses.dataclass
class InitLoadBackParams:
    """Load the host part of a match back to device.

    SGLang has named the anchor ``last_host_node`` and later ``best_match_node``; both are
    accepted (``best_match_node`` wins when both are given).
    """

    best_match_node: Any = None
    host_hit_length: int = 0
    mem_quota: int | None = None
    req: Req | None = None
    last_host_node: Any = None

    @property
    def node(self) -> Any:
        return self.best_match_node if self.best_match_node is not None else self.last_host_node
