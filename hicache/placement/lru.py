"""``lru``: what every peer does, kept as the baseline and the default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.placement.base import PlacementPolicy

if TYPE_CHECKING:
    from hicache.prefix_cache.node import TreeNode

__all__ = ["LruPlacement"]


class LruPlacement(PlacementPolicy):
    """Host evicts least recently used leaves; every backed-up page goes to storage."""

    name = "lru"

    def host_key(self, node: TreeNode) -> tuple[Any, ...]:
        return (node.last_access_time,)

    def storage_pages(self, node: TreeNode) -> int:
        return len(node.hash_value)
