"""Eviction policies: which unlocked leaf goes first.

A policy is a sort key over nodes; the smallest key is evicted first. Keys end in the access
time so ties break LRU-wise and the order is total (deterministic tests, no heap comparisons of
nodes).

* ``lru``      - least recently used.
* ``lfu``      - fewest hits, then LRU.
* ``slru``     - segmented LRU: nodes hit once (probation) go before nodes hit twice or more
                 (protected); LRU within a segment. Scan-resistant: one long unique prompt
                 cannot flush the reused system prompts.
* ``priority`` - lowest request priority first, then LRU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.errors import ConfigError
from hicache.prefix_cache.node import TreeNode

__all__ = ["EVICTION_POLICIES", "eviction_key"]

SortKey = Callable[[TreeNode], tuple[Any, ...]]


def _lru(node: TreeNode) -> tuple[Any, ...]:
    return (node.last_access_time,)


def _lfu(node: TreeNode) -> tuple[Any, ...]:
    return (node.hit_count, node.last_access_time)


def _slru(node: TreeNode) -> tuple[Any, ...]:
    return (1 if node.hit_count >= 2 else 0, node.last_access_time)


def _priority(node: TreeNode) -> tuple[Any, ...]:
    return (node.priority, node.last_access_time)


EVICTION_POLICIES: dict[str, SortKey] = {"lru": _lru, "lfu": _lfu, "slru": _slru, "priority": _priority}


def eviction_key(name: str) -> SortKey:
    """The sort key of policy ``name``; unknown names are a :class:`ConfigError`."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; allowed: {sorted(EVICTION_POLICIES)}"
        ) from None
