"""A node of the radix tree: one run of whole pages and where its KV lives in each tier.

A node's KV may be on device (``value``), on host (``host_value``), both, or - only while a
prefetch still owns it - neither. Storage holds pages under ``hash_value`` (one chained key per
page); ``storage_pages`` counts how many of them are known to be written.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from hicache.prefix_cache.tokens import TokenRun, empty_run

__all__ = ["TreeNode"]

_ids = itertools.count(1)


class TreeNode:
    """One edge of the radix tree.

    Invariants kept by the cache:

    * ``key`` holds whole pages; ``value``/``host_value`` (when present) have ``len(key)`` slots.
    * ``lock_ref`` counts locks passing through this node (a lock on a node locks its
      ancestors); a locked node's device and host copies stay put.
    * ``host_ref`` counts host-side protections passing through this node (prefetch anchors).
    * ``backup_op`` / ``storage_op`` name a device->host / host->storage copy in flight; split
      copies them to the new parent so both halves stay protected until it completes.
    """

    __slots__ = (
        "id",
        "children",
        "parent",
        "key",
        "extra_key",
        "value",
        "host_value",
        "_hash_value",
        "hasher",
        "lock_ref",
        "host_ref",
        "last_access_time",
        "hit_count",
        "priority",
        "backup_op",
        "storage_op",
        "storage_pages",
        "tree",
    )

    def __init__(self, parent: TreeNode | None = None, extra_key: str | None = None, key: TokenRun | None = None) -> None:
        self.id: int = next(_ids)
        self.children: dict[Any, TreeNode] = {}
        self.parent: TreeNode | None = parent
        #: packed token ids (see prefix_cache.tokens); given by the caller that has them, so no
        #: empty run is made only to be replaced
        self.key: TokenRun = key if key is not None else empty_run()
        self.extra_key: str | None = extra_key
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        #: ``None``: not computed yet, ``hasher`` computes it on first use (see ``hash_value``)
        self._hash_value: list[str] | None = []
        self.hasher: Callable[[TreeNode], list[str]] | None = None
        self.lock_ref: int = 0
        self.host_ref: int = 0
        self.last_access_time: int = 0
        self.hit_count: int = 0
        self.priority: int = 0
        self.backup_op: Any = None
        self.storage_op: Any = None
        self.storage_pages: int = 0
        #: the tree this node belongs to (a token its root holds): nodes of a reset tree differ
        self.tree: object = parent.tree if parent is not None else None

    @property
    def hash_value(self) -> list[str]:
        """Storage keys of this node's pages, one chained hash per page.

        A tree with a storage tier may leave them to be computed on first use (``hasher``):
        hashing every inserted page on the request's path cost more than the rest of the
        insert, and most pages are never asked for by key (matched on device, or evicted
        before storage takes them)."""
        hv = self._hash_value
        if hv is None:
            assert self.hasher is not None, self
            hv = self._hash_value = self.hasher(self)
        return hv

    @hash_value.setter
    def hash_value(self, value: list[str]) -> None:
        self._hash_value = value

    @property
    def evicted(self) -> bool:
        """No device copy (the KV lives on host, or is being fetched)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """A complete host copy exists (not one still being written)."""
        return self.host_value is not None and self.backup_op is None

    @property
    def on_storage(self) -> bool:
        """Every page of this node is known to be in storage."""
        if self.storage_pages <= 0:  # no need to compute keys to know that
            return False
        return self.storage_pages >= len(self.hash_value)

    def get_last_hash_value(self) -> str | None:
        return self.hash_value[-1] if self.hash_value else None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        tiers = ("D" if self.value is not None else "") + ("H" if self.host_value is not None else "")
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, tiers={tiers or '-'}, "
            f"lock={self.lock_ref}, host_ref={self.host_ref}, storage={self.storage_pages}/{len(self.hash_value)})"
        )
