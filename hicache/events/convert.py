"""Tier changes (:class:`~hicache.observability.TierChange`) as vLLM-schema KV events.

Block hashes: a hicache page key is the hex of a chained sha256 digest (``hicache.keys``: each
page's digest covers the previous page's digest), so ``bytes.fromhex(key)`` is a 32-byte hash
chained exactly as vLLM's default sha256 block hashes are, and ``parent_block_hash`` is the key
of the page before (``None`` for a prompt's first page: a namespace seed is not a block). With
``block_hash="int"`` a hash is the low 64 bits of those bytes, big-endian, as vLLM computes its
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` form. A key that is not 64 hex digits (keys made by
someone else's scheme) is hashed with sha256 of its UTF-8 first, so it still maps to one stable
32-byte value.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from hicache.observability.tier_events import ChangeKind, Tier, TierChange

__all__ = ["HashFormat", "MEDIUMS", "block_hash", "to_event"]

HashFormat = Literal["bytes", "int"]

#: the medium of each tier in vLLM's names
MEDIUMS: dict[Tier, str] = {Tier.DEVICE: MEDIUM_GPU, Tier.HOST: MEDIUM_CPU, Tier.STORAGE: MEDIUM_STORAGE}

_MASK64 = (1 << 64) - 1


def block_hash(key: str, fmt: HashFormat = "bytes") -> BlockHash:
    """The block hash of a page key (see the module docstring)."""
    raw: bytes | None = None
    if len(key) == 64:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = None
    if raw is None:
        raw = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    if fmt == "int":
        return int.from_bytes(raw, "big") & _MASK64
    return raw


def to_event(change: TierChange, fmt: HashFormat = "bytes") -> KVEvent | None:
    """The event of one change; ``None`` for a change that says nothing (no keys).

    A clear is ``AllBlocksCleared`` only when the tier cannot name what it dropped (a store's
    ``clear()`` that cannot list them); one that lists its pages (``keys_complete``) is a
    ``BlockRemoved`` of exactly those on its medium, since vLLM-schema consumers take any
    ``AllBlocksCleared`` as "every tier of the replica is empty"."""
    medium = MEDIUMS[change.tier]
    if change.kind is ChangeKind.CLEARED and not change.keys_complete:
        return AllBlocksCleared(medium=medium)
    if not change.keys:
        return None
    hashes = [block_hash(k, fmt) for k in change.keys]
    if change.kind is not ChangeKind.STORED:
        # a clear that names its pages (the tree's reset of device and host) is their removal:
        # vLLM's AllBlocksCleared has no medium, so a router would forget what storage still serves
        return BlockRemoved(block_hashes=hashes, medium=medium)
    parent = block_hash(change.parent_key, fmt) if change.parent_key else None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(change.token_ids),
        block_size=change.page_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
