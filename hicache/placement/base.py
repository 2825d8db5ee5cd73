"""The interface between the radix tree and a placement policy.

Why an interface the tree calls rather than a policy that walks the tree: the tree already knows
every fact a policy needs at the moment it changes (a node created, hit, written, evicted), so a
policy keeps O(1) state per event and never scans. Every hook runs on the event loop, must not
block and must not raise for any node it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.placement.stored import StoredPages
    from hicache.prefix_cache.node import TreeNode


__all__ = ["PlacementPolicy", "default_victim_write_limit", "node_end_tokens"]


def node_end_tokens(node: TreeNode) -> int:
    """Tokens from the root through the end of ``node`` (its depth plus its own length)."""
    total = 0
    n: TreeNode | None = node
    while n is not None and n.parent is not None:
        total += len(n.key)
        n = n.parent
    return total


def default_victim_write_limit(host_pages: int, device_pages: int) -> int:
    """Pages write-back at host eviction may hold on host at once: a quarter of the host pages
    that device copies do not take (at least 1).

    Why not a quarter of host: a page queued for its write stays on host until it lands, and the
    host copies of device-resident pages cannot be evicted either, so both take room a prefetch
    from storage needs. Where host is small next to the device (the agents workload: 136 host
    pages, 64 device pages), a quarter of host left prefetches no room and storage hits were
    skipped (tiered lost to lru); bounding by the room the device leaves keeps that share free
    whatever the ratio, and is a quarter of host where device is small next to host."""
    return max(1, (host_pages - min(device_pages, host_pages)) // 4)


class PlacementPolicy(ABC):
    """What each tier keeps and admits. Subclasses set ``name``."""

    name: str = ""
    #: the pages storage holds, when this policy chooses storage's evictions (``None``: the
    #: backend's own bound decides); the tree feeds it and deletes what it picks
    stored: StoredPages | None = None

    @abstractmethod
    def host_key(self, node: TreeNode) -> tuple[Any, ...]:
        """Sort key of a host-only leaf; the smallest is evicted from host first. It ends in
        ``last_access_time`` so ties break LRU-wise."""

    @abstractmethod
    def storage_pages(self, node: TreeNode) -> int:
        """How many of ``node``'s pages, counted from its first, may be in storage now
        (``len(node.hash_value)`` admits all; the tree writes those not written yet)."""

    def victim_pages(self, node: TreeNode) -> int:
        """How many of ``node``'s pages, from its first, storage should hold before host drops
        ``node`` (write-back at host eviction; 0: none, the page is dropped as before). The
        tree writes the unwritten ancestors in the same job, so a stored page's prefix is
        always stored."""
        return 0

    def on_new_node(self, node: TreeNode) -> None:
        """An insert created ``node`` (device KV, hashes set)."""

    def on_host_evicted(self, node: TreeNode) -> None:
        """``node``'s host copy is being dropped (it is not on device)."""

    def stats(self) -> dict[str, int]:
        """Counters for the replay report."""
        return {}
