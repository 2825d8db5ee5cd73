"""A node of the radix tree: one run of whole pages and where its KV lives in each tier.

A node's KV may be on device (``value``), on host (``host_value``), both, or - only while a
prefetch still owns it - neither. Storage holds pages under ``hash_value`` (one chained key per
page); ``storage_pages`` counts how many of them are known to be written.
"""

from __future__ import annotations

import itertools
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
        "hash_value",
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

    def __init__(self, parent: TreeNode | None = None, extra_key: str | None = None) -> None:
        self.id: int = next(_ids)
        self.children: dict[Any, TreeNode] = {}
        self.parent: TreeNode | None = parent
        self.key: TokenRun = empty_run()  # packed token ids (see prefix_cache.tokens)
        self.extra_key: str | None = extra_key
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[str] = []
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
        return self.storage_pages >= len(self.hash_value) > 0

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
