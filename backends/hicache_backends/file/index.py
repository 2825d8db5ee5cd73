"""The in-memory index of one namespace: which pages exist, their sizes, and the parent tree.

Why an index: answering ``exists`` from memory keeps lookups O(keys asked) whatever the number
of stored pages (SGLang's file backend lists the whole directory per call). Why a parent tree:
a page key is a chained hash, so a page whose parent is gone is unreachable; evicting only
*leaves* (pages with no stored children) never orphans a descendant. Among leaves the least
recently used goes first.

The index is changed only on the event loop thread, so it needs no lock; blocking work that
discovers facts (a scan, a stat, a read that finds a corrupt file) hands them back to the loop.
Other threads may test membership of ``entries`` (one dictionary lookup, atomic under the GIL):
the lookup a blocking caller answers on its own thread (``FileStorage._exists_prefix_now``).
Children are tracked per parent id whether or not the parent itself is stored, so a parent that
appears after its child (concurrent writes, the background scan) immediately counts as
non-leaf (the map holds counts, not sets). Reads and writes count as use; ``exists`` does not (a probe is not a hit).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterator
from typing import NamedTuple

__all__ = ["Entry", "PageIndex"]


class Entry(NamedTuple):
    """One stored page: bytes on disk, parent page id, last use (``time.time()`` seconds).

    A tuple of atoms, and the children map holds plain counts, so the garbage collector stops
    tracking them: with 10^5 pages a full collection would otherwise walk every entry and add
    milliseconds to an unlucky lookup.
    """

    size: int
    parent: str | None
    atime: float


class PageIndex:
    """Pages of one namespace with leaf-first LRU eviction."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.children: dict[str, int] = {}  # parent id -> stored children (parent stored or not)
        self.nbytes = 0
        # Leaf candidates as (atime, seq, id); stale items (page gone, touched since, or no
        # longer a leaf) are skipped when popped, which keeps touch() O(log n).
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    # ------------------------------------------------------------------ queries

    def __contains__(self, pid: object) -> bool:
        return pid in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def get(self, pid: str) -> Entry | None:
        return self.entries.get(pid)

    def is_leaf(self, pid: str) -> bool:
        return not self.children.get(pid)

    # ------------------------------------------------------------------ updates

    def add(self, pid: str, size: int, parent: str | None, atime: float) -> Entry:
        """Record (or replace) a page; returns its entry."""
        if parent == pid:
            parent = None  # a page cannot be its own parent; never let it pin itself
        old = self.entries.get(pid)
        attach = True
        if old is not None:
            self.nbytes -= old.size
            if old.parent == parent:
                attach = False  # already counted under this parent
            else:
                self._detach(old.parent)
        entry = Entry(size, parent, atime)
        self.entries[pid] = entry
        self.nbytes += size
        if parent is not None and attach:
            self.children[parent] = self.children.get(parent, 0) + 1
        if self.is_leaf(pid):
            self._push(pid, entry)
        self._maybe_compact()
        return entry

    def touch(self, pid: str, atime: float) -> None:
        """Mark a page as used now."""
        entry = self.entries.get(pid)
        if entry is None or atime <= entry.atime:
            return
        entry = self.entries[pid] = entry._replace(atime=atime)
        if self.is_leaf(pid):
            self._push(pid, entry)
            self._maybe_compact()

    def remove(self, pid: str) -> Entry | None:
        """Forget a page; its parent may become a leaf."""
        entry = self.entries.pop(pid, None)
        if entry is None:
            return None
        self.nbytes -= entry.size
        self._detach(entry.parent)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self.children.clear()
        self._heap.clear()
        self.nbytes = 0

    # ------------------------------------------------------------------ eviction

    def pick_victims(self, need: int, protect: Collection[str] = ()) -> list[tuple[str, Entry]]:
        """Remove and return pages (leaves first, oldest first) totalling at least ``need`` bytes.

        Pages in ``protect`` (being read or written, or parents of pages being written) are
        kept. Returns fewer bytes than asked when nothing else may go. Only when no leaf is
        evictable does it break a parent *cycle* (possible only when keys are reused with
        different parents), since that is the one case where no leaf can ever appear.
        """
        victims: list[tuple[str, Entry]] = []
        freed = 0
        held: list[tuple[float, int, str]] = []
        while freed < need and self._heap:
            item = heapq.heappop(self._heap)
            atime, _, pid = item
            entry = self.entries.get(pid)
            if entry is None or entry.atime != atime or not self.is_leaf(pid):
                continue  # stale heap item
            if pid in protect:
                held.append(item)
                continue
            self.remove(pid)
            victims.append((pid, entry))
            freed += entry.size
        for item in held:
            heapq.heappush(self._heap, item)
        if freed < need:
            for pid in self._cycle_members(protect):
                entry = self.remove(pid)
                if entry is None:
                    continue
                victims.append((pid, entry))
                freed += entry.size
                if freed >= need:
                    break
        return victims

    def orphans(self) -> list[str]:
        """Pages whose parent is not stored (for diagnostics and tests)."""
        return [p for p, e in self.entries.items() if e.parent is not None and e.parent not in self.entries]

    # ------------------------------------------------------------------ internals

    def _cycle_members(self, protect: Collection[str]) -> list[str]:
        """One page of each parent cycle, oldest first (slow path; cycles are abnormal)."""
        found: list[str] = []
        state: dict[str, int] = {}  # 1 = on current walk, 2 = done
        for start in self.entries:
            if start in state:
                continue
            walk: list[str] = []
            pid: str | None = start
            while pid is not None and pid in self.entries and pid not in state:
                state[pid] = 1
                walk.append(pid)
                pid = self.entries[pid].parent
            if pid is not None and state.get(pid) == 1:  # closed a cycle on this walk
                cycle = walk[walk.index(pid):]
                free = [p for p in cycle if p not in protect]
                if free:
                    found.append(min(free, key=lambda p: self.entries[p].atime))
            for p in walk:
                state[p] = 2
        found.sort(key=lambda p: self.entries[p].atime)
        return found

    def _detach(self, parent: str | None) -> None:
        if parent is None:
            return
        n = self.children.get(parent)
        if n is None:
            return
        if n > 1:
            self.children[parent] = n - 1
            return
        del self.children[parent]
        pentry = self.entries.get(parent)
        if pentry is not None:
            self._push(parent, pentry)

    def _push(self, pid: str, entry: Entry) -> None:
        heapq.heappush(self._heap, (entry.atime, next(self._seq), pid))

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self.entries) + 1024:
            self._heap = [
                (e.atime, next(self._seq), p) for p, e in self.entries.items() if self.is_leaf(p)
            ]
            heapq.heapify(self._heap)
