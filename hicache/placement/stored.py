"""A directory of the pages storage holds, and the storage eviction it makes possible.

Why inside the placement policy: host eviction deletes tree nodes, so the tree forgets pages
that only storage holds, and a backend's own eviction (LRU by page or file) knows neither the
prefix structure nor what other tiers saw. A storage write job is root first (every
page's parent is stored or written ahead of it), and its keys chain page to page. Recording
each written page with its parent gives the stored subtree; evicting only its leaves keeps it
*prefix closed*: a stored page's parent is stored, since a page whose parent is gone can never
be found by a prefix lookup and only wastes room (SGLang's LRU deletes middle pages and orphans
their descendants).

Rank among the leaves: least recently used, where *used* means a hit in any tier (device, host
or storage), not only a storage read. A backend's LRU sees reads only, so a page hit on device
and host for hours looks idle to it.

The directory does no I/O: the tree asks it which pages to delete to make room for a write
(:meth:`StoredPages.make_room`) and sends those deletions ahead of the write
(``AsyncHiCacheStorage.batch_delete``), in the same job, so the write never lands before the
room it needs. Pages a prefetch is reading are pinned and never chosen.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["StoredPages"]

#: removed keys remembered at least (see ``StoredPages.reachable``)
_GONE_MIN = 1 << 16


class _Page:
    __slots__ = ("parent", "children", "tick", "pins", "orphan")

    def __init__(self, parent: str | None, tick: int, orphan: bool) -> None:
        self.parent = parent
        self.children: set[str] | None = None  # made on the first child: most pages are leaves
        self.tick = tick
        self.pins = 0
        self.orphan = orphan


class _Pins(list):  # type: ignore[type-arg]
    """The keys a :meth:`StoredPages.pin` took (a list of them), with the page entries."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, _Page]] = []


class StoredPages:
    """Pages storage holds, as a tree of keys; evicts leaves, orphans first, then LRU.

    Args:
        capacity: pages storage holds (its bound); ``None``: unknown, nothing is evicted
            here and the backend's own bound applies.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"storage capacity must be at least 1 page, got {capacity}")
        self.capacity = capacity
        self._pages: dict[str, _Page] = {}
        # candidate leaves: (not orphan, tick, key); stale entries are skipped when popped
        self._heap: list[tuple[bool, int, str]] = []
        self._tick = 0
        #: pages of writes queued but not landed (room already made for them)
        self.reserved = 0
        # orphans by the key of their missing parent: re-linked if that page is written again
        self._waiting: dict[str, set[str]] = {}
        # keys deleted or removed since they were last written, most recent last (bounded: a
        # removal forgotten leaves the tree's count as it was, and a lookup misses cleanly)
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._gone_limit = max(_GONE_MIN, 2 * (capacity or 0))
        #: pages chosen for deletion so far; pages the backend removed by itself
        self.evicted_pages = 0
        self.removed_pages = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages

    def parent_of(self, key: str) -> str | None:
        return self._pages[key].parent

    def children_of(self, key: str) -> set[str]:
        return set(self._pages[key].children or ())

    def is_orphan(self, key: str) -> bool:
        return self._pages[key].orphan

    def reachable(self, keys: Sequence[str], upto: int) -> int:
        """How many of ``keys[:upto]``, from the first, storage may still hold: the leading
        run of keys not known to be gone (deleted by this directory or removed by the backend
        since they were last written). The tree checks its nodes' ``storage_pages`` with it,
        since pages leave storage without the tree hearing of it per node.

        A page whose prefix was removed (an orphan below a gone page) is held but no prefix
        lookup reaches it, so it stops the run too. A key the directory never listed counts as
        held, and so does an orphan whose missing parent it never listed: pages a prefetch
        found (an earlier process's, a peer's) are in storage though nothing here wrote them,
        and taking them for lost counted them lost and wrote them again. (A clear, which loses
        everything, the tree applies to its nodes itself.)"""
        gone, pages = self._gone, self._pages
        n, upto = 0, min(upto, len(keys))
        while n < upto:
            key = keys[n]
            if key in gone:
                break
            page = pages.get(key)
            if page is not None and page.orphan and self._prefix_gone(page):
                break
            n += 1
        return n

    def _prefix_gone(self, page: _Page) -> bool:
        """Whether the first ancestor of orphan ``page`` that the directory lacks is known
        gone (rather than never listed here)."""
        while page.orphan and page.parent is not None:
            up = self._pages.get(page.parent)
            if up is None:
                return page.parent in self._gone
            page = up
        return False

    # ------------------------------------------------------------------ events

    def add(self, keys: Sequence[str], prior: str | None) -> None:
        """``keys`` were written, chained from ``prior`` (the key before the first; ``None``
        at the root). A page whose parent storage does not hold (as far as is known) is an
        orphan: it cannot be hit, so it is the first to go."""
        parent = prior
        gone = self._gone
        for key in keys:
            self._tick += 1
            gone.pop(key, None)  # stored again
            page = self._pages.get(key)
            if page is None:
                up = self._pages.get(parent) if parent is not None else None
                orphan = parent is not None and (up is None or up.orphan)
                page = self._pages[key] = _Page(parent, self._tick, orphan)
                if up is not None:
                    if up.children is None:
                        up.children = set()
                    up.children.add(key)
                elif parent is not None:
                    self._waiting.setdefault(parent, set()).add(key)
                self._adopt(key, page)
            else:
                page.tick = self._tick
            self._push(key, page)
            parent = key

    def touch(self, keys: Iterable[str]) -> None:
        """A hit in any tier on these pages: they are the most recently used now."""
        for key in keys:
            page = self._pages.get(key)
            if page is not None:
                self._tick += 1
                page.tick = self._tick
                if not page.children:
                    self._push(key, page)

    def pin(self, keys: Iterable[str]) -> list[str]:
        """Keep these pages (a prefetch reads them, a write chains from one); returns the keys
        pinned, for :meth:`unpin`."""
        pinned = _Pins()
        for key in keys:
            page = self._pages.get(key)
            if page is not None:
                page.pins += 1
                pinned.append(key)
                pinned.entries.append((key, page))
        return pinned

    def unpin(self, keys: Iterable[str]) -> None:
        """Give back pins :meth:`pin` took: on the very page entries it pinned (a page removed
        and written again meanwhile is another entry, whose pins are others')."""
        entries = getattr(keys, "entries", None)
        pairs: Iterable[tuple[str, _Page | None]] = (
            entries if entries is not None else [(key, self._pages.get(key)) for key in keys])
        for key, page in pairs:
            if page is not None and self._pages.get(key) is page and page.pins > 0:
                page.pins -= 1
                if not page.pins and not page.children:
                    self._push(key, page)

    def remove(self, keys: Iterable[str]) -> None:
        """The backend removed these pages by itself (its own bound, a corrupt page): forget
        them; their stored descendants become orphans."""
        for key in keys:
            if self._drop(key):
                self.removed_pages += 1

    def clear(self) -> None:
        """Storage lost every page (a namespace clear)."""
        self._pages.clear()
        self._heap.clear()
        self._waiting.clear()
        self._gone.clear()  # every key is gone: the tree resets its nodes' counts itself

    # ------------------------------------------------------------------ eviction

    def make_room(self, pages: int) -> list[str]:
        """Pages to delete so that a write of ``pages`` more fits, leaves first (orphans
        first, then least recently used); they are forgotten now. The room is reserved until
        :meth:`landed`. Fewer (maybe none) when the rest are pinned or in flight: the backend's
        own bound then takes over for the difference."""
        self.reserved += pages
        if self.capacity is None:
            return []
        out: list[str] = []
        held: list[tuple[bool, int, str]] = []
        # self._heap each time, never a local: a drop pushes the parent, which may rebuild the
        # heap (stale entries piled up); popping the old list then missed every leaf made
        # since and evicted the hot leaves it still held
        while len(self._pages) + self.reserved > self.capacity and self._heap:
            entry = heapq.heappop(self._heap)
            rooted, tick, key = entry
            page = self._pages.get(key)
            if page is None or page.tick != tick or page.children or page.orphan == rooted:
                continue  # stale: gone, touched since, no longer a leaf, or orphaned since
            if page.pins:
                held.append(entry)
                continue
            self._drop(key)
            out.append(key)
        for entry in held:
            heapq.heappush(self._heap, entry)
        self.evicted_pages += len(out)
        return out

    def room_for_write(self, pages: int, after: str | None) -> tuple[list[str], int, list[str]]:
        """:meth:`make_room` for a write of ``pages`` chained after the stored page ``after``:
        returns the pages to delete, how many of the write's pages fit, and the pins to hand
        back to :meth:`landed`. ``after`` (and so its stored ancestors) is never chosen, now or
        by another write's room-making while this one is in flight: deleted ahead of the
        write, it would leave the new pages orphans. Pages that do not fit, all leaves being
        pinned or the write's own prefix, get no reserved room: the caller does not send them
        (the backend's own bound would make room by evicting the oldest pages, on a chain its
        root)."""
        pinned = self.pin([after] if after is not None else [])
        try:
            doomed = self.make_room(pages)
        except BaseException:
            self.unpin(pinned)
            raise
        short = 0 if self.capacity is None else min(pages, max(0, len(self._pages) + self.reserved - self.capacity))
        self.reserved -= short
        return doomed, pages - short, pinned

    def landed(self, reserved: int, keys: Sequence[str], prior: str | None, pinned: Sequence[str] = ()) -> None:
        """A write for which ``reserved`` pages of room were made ended; ``keys`` (its
        leading pages) were written; ``pinned``: what :meth:`room_for_write` pinned for it."""
        self.reserved = max(0, self.reserved - reserved)
        if keys:
            self.add(keys, prior)
        self.unpin(pinned)

    def _push(self, key: str, page: _Page) -> None:
        heap = self._heap
        heapq.heappush(heap, (not page.orphan, page.tick, key))
        if len(heap) > 4 * len(self._pages) + 1024:  # stale entries (touches) pile up: rebuild
            self._heap = [(not p.orphan, p.tick, k) for k, p in self._pages.items() if not p.children]
            heapq.heapify(self._heap)

    def _adopt(self, key: str, page: _Page) -> None:
        """``key`` was written again: the orphans waiting for it are its children once more,
        and, if it is itself reachable, they and their descendants are no orphans."""
        waiting = self._waiting.pop(key, None)
        if not waiting:
            return
        for child_key in waiting:
            child = self._pages.get(child_key)
            if child is None or child.parent != key:
                continue
            if page.children is None:
                page.children = set()
            page.children.add(child_key)
            if page.orphan:
                continue
            stack = [child_key]
            while stack:
                k = stack.pop()
                p = self._pages.get(k)
                if p is None or not p.orphan:
                    continue
                p.orphan = False
                if not p.children:
                    self._push(k, p)
                stack.extend(p.children or ())

    def _drop(self, key: str) -> bool:
        page = self._pages.pop(key, None)
        if page is None:
            return False
        gone = self._gone
        gone[key] = None
        gone.move_to_end(key)
        if len(gone) > self._gone_limit:
            gone.popitem(last=False)
        if page.parent is not None:
            up = self._pages.get(page.parent)
            if up is not None:
                if up.children:
                    up.children.discard(key)
                if not up.children:
                    self._push(page.parent, up)
            else:  # it was an orphan waiting for its parent: it waits no more
                waiting = self._waiting.get(page.parent)
                if waiting is not None:
                    waiting.discard(key)
                    if not waiting:
                        del self._waiting[page.parent]
        if page.children:  # they wait for this page to be written again
            self._waiting.setdefault(key, set()).update(page.children)
        stack = list(page.children or ())
        while stack:  # a gone page's descendants cannot be hit: they go first
            child_key = stack.pop()
            child = self._pages.get(child_key)
            if child is None or child.orphan:
                continue
            child.orphan = True
            if not child.children:
                self._push(child_key, child)
            stack.extend(child.children or ())
        return True
