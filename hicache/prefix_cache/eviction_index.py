"""Eviction candidates of a radix tree, kept up to date as the tree changes, popped in policy order.

Why: finding what to evict by walking the whole tree costs O(nodes) per eviction, on the event
loop. Measured with 4-page requests under 100 shared prefixes, one page evicted per call: 2 ms at
1k nodes, 43 ms at 10k and 209 ms at 50k. Under memory pressure that walk runs on nearly every
allocation. The tree instead *notes* a node whenever a change may have made it a candidate
(device slots added, a lock released, a child removed, ...). An eviction then pops the smallest
key, which costs O(log n).

The heap is lazy, so that noting stays O(1) amortised and a node is never searched for in it:

* a node has at most one live entry, the key it had when it was queued (``_queued``); older
  entries of the same node are skipped when popped;
* a popped node that is no longer a candidate (locked again, given a child, deleted) is dropped.
  The change that makes it a candidate again notes it again;
* a popped node whose key grew since it was queued (it was used meanwhile) is queued again under
  its new key. Every policy key only grows (access time, hit count, priority), so nothing is
  evicted out of order.

``missing`` lists candidates the index does not hold: the tree's ``sanity_check`` asserts there
are none, so a change that forgets to note a node fails the tests instead of leaking capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from hicache.prefix_cache.node import TreeNode

__all__ = ["EvictionIndex"]

SortKey = Callable[[TreeNode], tuple[Any, ...]]


class EvictionIndex:
    """The nodes for which ``is_candidate`` holds, smallest ``key`` first."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool], key: SortKey) -> None:
        self._is_candidate = is_candidate
        self._key = key
        self._heap: list[tuple[tuple[Any, ...], int, TreeNode]] = []
        self._queued: dict[TreeNode, tuple[Any, ...]] = {}  # node -> key of its live entry
        #: times :meth:`rebuild` ran (a walk of the whole tree each)
        self.rebuilds = 0

    def __len__(self) -> int:
        """Nodes queued (some may have stopped being candidates since)."""
        return len(self._queued)

    def __contains__(self, node: object) -> bool:
        return node in self._queued

    def note(self, node: TreeNode | None) -> None:
        """``node`` may have become a candidate: queue it if it is one and is not queued."""
        if node is not None and node not in self._queued and self._is_candidate(node):
            self._push(node, self._key(node))

    def requeue(self, node: TreeNode) -> None:
        """``node``'s key may have *dropped* (the lazy heap only handles keys that grow): queue
        it under its current key if it is queued under another one."""
        old = self._queued.get(node)
        if old is not None:
            now = self._key(node)
            if now != old:
                self._push(node, now)

    def discard(self, node: TreeNode) -> None:
        """Forget ``node`` (it left the tree); its heap entry is skipped when popped."""
        self._queued.pop(node, None)

    def pop(self) -> TreeNode | None:
        """The candidate with the smallest key, removed from the index; ``None`` if none."""
        heap, queued = self._heap, self._queued
        while heap:
            key, _, node = heapq.heappop(heap)
            if queued.get(node) != key:
                continue  # superseded by a later entry, or discarded
            if not self._is_candidate(node):
                del queued[node]
                continue
            now = self._key(node)
            if now != key:
                self._push(node, now)  # used since it was queued: its turn comes later
                continue
            del queued[node]
            return node
        return None

    def rebuild(self, nodes: Iterable[TreeNode]) -> int:
        """Queue exactly the candidates among ``nodes`` (the whole tree); returns how many."""
        self._queued = {n: self._key(n) for n in nodes if self._is_candidate(n)}
        self._heap = [(k, n.id, n) for n, k in self._queued.items()]
        heapq.heapify(self._heap)
        self.rebuilds += 1
        return len(self._queued)

    def missing(self, nodes: Iterable[TreeNode]) -> list[TreeNode]:
        """Candidates among ``nodes`` that the index does not hold (should be none)."""
        return [n for n in nodes if self._is_candidate(n) and n not in self._queued]

    def _push(self, node: TreeNode, key: tuple[Any, ...]) -> None:
        self._queued[node] = key
        heapq.heappush(self._heap, (key, node.id, node))
        if len(self._heap) > 2 * len(self._queued) + 64:  # mostly dead entries: compact
            self._heap = [(k, n.id, n) for n, k in self._queued.items()]
            heapq.heapify(self._heap)
