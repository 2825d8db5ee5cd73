"""A bounded ghost list: keys of pages dropped unwritten, remembered without their data.

Why: a page evicted from host before it proved reuse is not worth a storage write, but if the
same prefix comes back the first visit was not a fluke. Remembering only its key (a hash string,
no KV) is cheap, and a hit on the ghost is the evidence that admits the recomputed page
(ARC's and S3-FIFO's ghost queues play the same role).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["GhostList"]


class GhostList:
    """At most ``capacity`` keys, oldest dropped first (also the set of pages admitted ahead
    of their node's first hit)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ghost capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        #: keys found again (each counted once, then forgotten)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        if self.capacity == 0:
            return
        store = self._keys
        for key in keys:
            store[key] = None
            store.move_to_end(key)
        while len(store) > self.capacity:
            store.popitem(last=False)

    def take(self, key: str) -> bool:
        """Whether ``key`` was remembered (it is forgotten now)."""
        if key in self._keys:
            del self._keys[key]
            self.hits += 1
            return True
        return False
