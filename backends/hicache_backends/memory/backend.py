"""The ``memory`` backend: the simplest complete backend, and the one tests lean on.

Pages live in a :class:`MemoryMedium` - a dict bounded by bytes that evicts the least recently
used leaf of each chain first (a chain is trimmed from its tail). Two ``MemoryStorage``
objects given the same ``store_id`` share one medium (as two processes share a file root), each
seeing only its own namespace. Everything is in-process, so small batches run inline (a
``memcpy`` of a small page is cheaper than a hop to a thread); a batch of at least
``OFFLOAD_MIN_BYTES`` is copied on a worker thread so the event loop never stalls on it (a batch
of 8 MiB pages is hundreds of MiB), and a cancelled caller waits for that copy to finish.
"""

from __future__ import annotations

import heapq
import os
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, count, repeat
from operator import lt, not_
from typing import Any, ClassVar

import numpy as np

from hicache.errors import ConfigError
from hicache.keys import Namespace
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, PageKey
from hicache.storage.changes import Written, report_cleared
from hicache.storage.offload import OFFLOAD_MIN_BYTES, copy_bytes, run_to_completion

__all__ = ["MemoryMedium", "MemoryStorage"]

_Entry = tuple[str, str, str]  # (namespace digest, key, pool)


class _Evictions(list[_Entry]):
    """The pages a store's puts evicted, in order, and their bytes (``nbytes``): what that store
    counts as its evictions. A medium's own totals are every store's on it: exported by each
    store, a sum over the caches sharing a ``store_id`` counted each eviction once per cache."""

    nbytes: int = 0


#: A page at least this large is stored as a read-only view of a numpy array filled by
#: ``np.copyto``, which releases the GIL while it copies (and takes the page faults of the fresh
#: memory). ``bytes(view)`` holds the GIL for the whole copy: a batch of 16 pages of 256 KiB took
#: 1-4 ms, and the server's event loop thread waited that long for the GIL. Smaller pages stay
#: ``bytes`` (cheaper than an array for a few hundred bytes).
_ARRAY_MIN_BYTES = 64 << 10

#: A stored payload: ``bytes``, or a read-only byte ``memoryview`` (compares, hashes and
#: converts like ``bytes``).
Payload = bytes | memoryview


def _snapshot(buf: memoryview) -> Payload:
    """An immutable copy of ``buf`` (see ``_ARRAY_MIN_BYTES``)."""
    if len(buf) < _ARRAY_MIN_BYTES:
        return bytes(buf)
    arr = np.empty(len(buf), dtype=np.uint8)
    np.copyto(arr, np.frombuffer(buf, dtype=np.uint8))  # GIL released
    return memoryview(arr.data).toreadonly()


#: a memory store's bound when none is given
DEFAULT_MAX_BYTES = 1 << 30


def put_in_order(entries: Sequence[_Entry], parents: Sequence[_Entry | None], put: Callable[[int], bool]) -> list[bool]:
    """Put a chained batch's pages in order, page ``i`` with ``put(i)``; a page after one refused
    is refused too, without a put (no lookup reaches it: it would only take room)."""
    refused: set[_Entry] = set()
    ok: list[bool] = []
    for i, (entry, parent) in enumerate(zip(entries, parents)):
        done = (parent is None or parent not in refused) and put(i)
        if not done:
            refused.add(entry)
        ok.append(done)
    return ok


def _is_chain(entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> bool:
    """Whether each page of a batch is the parent of the next, and the first's parent (if any)
    is not in the batch: a chained write's batch, checked in C."""
    return len(parents) > 0 and list(parents[1:]) == list(entries[:-1]) and parents[0] not in entries


def _links_back(entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> bool:
    """Whether each page's parent comes before it in the batch, or is not in it: then new
    pages nothing chains from yet close no loop. In C, no Python per page."""
    at: dict[_Entry | None, int] = dict(zip(entries, count()))
    return all(map(lt, map(at.get, parents, repeat(-1)), count()))


class MemoryMedium:
    """A byte-bounded map of pages shared by every store that names the same ``store_id``.

    Eviction takes leaves first: a page no other stored page chains from (its ``parent``), the
    least recently used of them first, so a chain is trimmed from its tail and every stored
    page's parent stays stored. Plain LRU evicted a chain's root (written and read first, so
    the oldest) and orphaned the rest: those pages took room though no lookup, which walks a
    prefix from its first page, could reach them, and the next write of the prefix rewrote
    them. Pages stored without a parent are all leaves: plain LRU among themselves. A link
    that would close a loop (``batch_set(["a", "b", "a"])`` chains a to b to a) is not made:
    no page of a loop is ever a leaf, so none could be evicted.

    The leaves wait in a heap by last use (``_leaves``, ``(stamp, entry)``), entries checked
    when popped: a page used since (its stamp moved on: pushed again with it), no longer a
    leaf, or gone is skipped; so a use costs no heap operation, and an eviction O(log n)
    amortised. ``pages`` keeps its LRU order too (``list_pages``, and tests, read it).
    """

    _shared: ClassVar[dict[str, MemoryMedium]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pages: OrderedDict[_Entry, Payload] = OrderedDict()
        #: the page each held page was written after (its parent), where it had one: what a
        #: chained write must not evict for room (see :meth:`chain_of`)
        self.links: dict[_Entry, _Entry | None] = {}
        #: how many held pages chain from each entry (entries with none left out): a page with
        #: none is a leaf, and only a leaf is evicted (see the class docstring). A Counter for
        #: its ``update``, which counts a batch's parents in C.
        self.children: Counter[_Entry] = Counter()
        #: each held page's last use, on ``_clock``
        self.stamps: dict[_Entry, int] = {}
        self._clock = 0
        #: the leaves, ``(stamp, entry)``; stale entries are skipped when popped. Every held
        #: leaf has an entry with a stamp no newer than its own.
        self._leaves: list[tuple[int, _Entry]] = []
        self.nbytes = 0
        self.evicted_pages = 0
        self.evicted_bytes = 0
        self.lock = threading.Lock()
        #: the open stores on this medium, by namespace digest: a store's write evicts other
        #: stores' pages too, and each must hear of its own (see :meth:`sharers`)
        self._stores: dict[str, weakref.WeakSet[Any]] = {}

    @classmethod
    def shared(cls, store_id: str, max_bytes: int | None) -> MemoryMedium:
        """The medium ``store_id`` names, made with ``max_bytes`` (default 1 GiB) if new."""
        with cls._shared_lock:
            medium = cls._shared.get(store_id)
            if medium is None:
                medium = cls._shared[store_id] = cls(max_bytes or DEFAULT_MAX_BYTES)
            elif max_bytes is not None and medium.max_bytes != max_bytes:
                # one medium, one bound: a second store asking for another silently got the
                # first one's (a 1 GiB store bounded at 1 kB refused every write)
                raise ConfigError(f"memory store {store_id!r} is already open with max_bytes={medium.max_bytes}, "
                                  f"not {max_bytes}: stores sharing a store_id share one bound")
            return medium

    @classmethod
    def drop_shared(cls, store_id: str) -> None:
        with cls._shared_lock:
            cls._shared.pop(store_id, None)

    def join(self, digest: str, store: Any) -> None:
        """``store`` (of namespace ``digest``) is open on this medium: told of its pages other
        stores' writes evict."""
        with self.lock:
            self._stores.setdefault(digest, weakref.WeakSet()).add(store)

    def leave(self, digest: str, store: Any) -> None:
        with self.lock:
            stores = self._stores.get(digest)
            if stores is not None:
                stores.discard(store)
                if not stores:
                    del self._stores[digest]

    def sharers(self, digest: str) -> list[Any]:
        """The open stores of namespace ``digest`` on this medium."""
        with self.lock:
            stores = self._stores.get(digest)
            return list(stores) if stores is not None else []

    def put(self, entry: _Entry, payload: Payload, evicted: list[_Entry] | None = None, *,
            parent: _Entry | None = None, protect: set[_Entry] | None = None,
            held: dict[_Entry, bool] | None = None) -> bool:
        """Store a page, evicting least recently used leaves for room (appended to ``evicted``),
        never one of ``protect``: ``False`` (nothing evicted) when only they could make room.
        ``held``: whether the page replaced a copy held is recorded there, by its first put
        only (decided under the lock, so of two writers racing with the same new page, one
        finds it new; a batch naming a new page twice finds it new, not held by its own put)."""
        with self.lock:
            return self._put_locked(entry, payload, evicted, parent, protect, held)

    def _put_locked(self, entry: _Entry, payload: Payload, evicted: list[_Entry] | None,
                    parent: _Entry | None = None, protect: set[_Entry] | None = None,
                    held: dict[_Entry, bool] | None = None) -> bool:
        """:meth:`put` with the lock held."""
        size = len(payload)
        if size > self.max_bytes:
            return False
        pages, links, children = self.pages, self.links, self.children
        old = pages.get(entry)
        if parent is not None and (parent == entry or entry in children) and self._descends_locked(parent, entry):
            parent = None  # a link that closes a loop: no page of the loop would ever be a leaf
        need = self.nbytes - (len(old) if old is not None else 0) + size - self.max_bytes
        if need > 0:
            # the victims are chosen before any goes: a page that cannot have its room is
            # refused without evicting anything for it
            victims = self._victims_locked(entry, parent, need, protect)
            if victims is None:
                return False
            for victim in victims:
                self._evict_locked(victim, evicted)
        if old is not None:
            del pages[entry]  # put again: most recently used
            self.nbytes -= len(old)
        if held is not None:
            held.setdefault(entry, old is not None)
        pages[entry] = payload
        self.nbytes += size
        self._clock += 1
        self.stamps[entry] = self._clock
        if links.get(entry) != parent:  # (a new page has no link)
            if old is not None:
                self._unlink_locked(entry)
            if parent is not None:
                links[entry] = parent
                children[parent] = children.get(parent, 0) + 1
        if old is None and entry not in children:
            self._push_leaf_locked(entry)  # a held leaf (put again) has its heap entry already
        return True

    def _descends_locked(self, page: _Entry, entry: _Entry) -> bool:
        """Whether ``page`` is ``entry`` or chains from it through held pages. Only a page
        others chain from has descendants (rarely one being put: :meth:`_put_locked` asks
        only then), so the usual put walks nothing."""
        links = self.links
        up: _Entry | None = page
        while up is not None:
            if up == entry:
                return True
            up = links.get(up)
        return False

    def _victims_locked(self, entry: _Entry | None, parent: _Entry | None, need: int,
                        protect: set[_Entry] | None) -> list[_Entry] | None:
        """The pages to evict, in order, so that ``need`` more bytes fit for ``entry`` (to be
        linked to ``parent``), or ``None`` when they cannot be found (the heap is left as it
        was, but for stale entries dropped). Leaves first, least recently used first; a page
        whose last child is chosen is a leaf for the rest of the choice. Never ``entry``,
        nor one of ``protect``, nor ``parent`` (it is to have a child)."""
        pages, children, stamps, links = self.pages, self.children, self.stamps, self.links
        lost: dict[_Entry, int] = {}  # children a page loses (gains: negative) by this put
        relinked = links.get(entry) if entry is not None and entry in pages else None
        heap = self._leaves
        if relinked != parent:
            if relinked is not None:
                lost[relinked] = 1
                if children.get(relinked) == 1 and relinked in pages:  # ``entry`` was its last child
                    heapq.heappush(heap, (stamps[relinked], relinked))
            if parent is not None:
                lost[parent] = -1
        chosen: list[_Entry] = []
        picked: set[_Entry] = set()
        aside: list[tuple[int, _Entry]] = []  # leaves kept: pushed back after the choice
        while need > 0 and heap:
            item = heapq.heappop(heap)
            stamp, victim = item
            last = stamps.get(victim)  # (held pages only)
            if last is None or victim in picked:
                continue  # gone, or a second entry of a page already chosen
            if (victim in children or victim in lost) and children.get(victim, 0) - lost.get(victim, 0) > 0:
                if victim not in children:
                    aside.append(item)  # a leaf still, but this put chains from it
                continue  # not a leaf (its entry comes back when it is one)
            if last != stamp:
                heapq.heappush(heap, (last, victim))  # used since: at its place now
                continue
            if victim == entry or (protect is not None and victim in protect):
                aside.append(item)
                continue
            chosen.append(victim)
            picked.add(victim)
            need -= len(pages[victim])
            up = links.get(victim)
            if up is not None and up in stamps:
                left = lost[up] = lost.get(up, 0) + 1
                if children.get(up) == left:  # its last child chosen: a leaf now
                    heapq.heappush(heap, (stamps[up], up))
        for item in aside:
            heapq.heappush(heap, item)
        if need > 0:
            for victim in chosen:
                heapq.heappush(heap, (stamps[victim], victim))
            if len(heap) > 2 * len(pages) + 1024:
                self._compact_leaves_locked()
            return None
        return chosen

    def _evict_locked(self, victim: _Entry, evicted: list[_Entry] | None) -> None:
        """Evict a victim :meth:`_victims_locked` chose (which pushed its parent, where this
        leaves it a leaf)."""
        gone = self.pages.pop(victim)
        del self.stamps[victim]
        up = self.links.pop(victim, None)
        if up is not None:
            children = self.children
            left = children[up] - 1
            if left:
                children[up] = left
            else:
                children.pop(up)
        self.nbytes -= len(gone)
        self.evicted_pages += 1
        self.evicted_bytes += len(gone)
        if evicted is not None:
            evicted.append(victim)
            if isinstance(evicted, _Evictions):
                evicted.nbytes += len(gone)

    def _unlink_locked(self, entry: _Entry) -> None:
        """Drop ``entry``'s link to its parent; a held parent left without children is a leaf."""
        up = self.links.pop(entry, None)
        if up is None:
            return
        children = self.children
        left = children.get(up, 0) - 1
        if left > 0:
            children[up] = left
            return
        children.pop(up, None)
        if up in self.pages:
            self._push_leaf_locked(up)

    def _push_leaf_locked(self, entry: _Entry) -> None:
        heapq.heappush(self._leaves, (self.stamps[entry], entry))
        if len(self._leaves) > 2 * len(self.pages) + 1024:
            self._compact_leaves_locked()

    def _compact_leaves_locked(self) -> None:
        """Rebuild the heap, which stale entries have come to outnumber the pages twice: its
        rebuild, O(n), comes after n pushes at least (amortised O(1) a push)."""
        children, stamps = self.children, self.stamps
        self._leaves = [(stamps[e], e) for e in self.pages if e not in children]
        heapq.heapify(self._leaves)

    def chain_of(self, entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> set[_Entry]:
        """What a chained batch (``parents``: the page before each) must never evict for its
        own room: its pages and every held ancestor of them. Evicted for the batch's tail,
        they left the tail stored after a prefix no lookup finds (a lookup stops at the first
        missing page): the tail then took the room of pages that were useful, for nothing."""
        with self.lock:
            return self._chain_locked(entries, parents)

    def _chain_locked(self, entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> set[_Entry]:
        """:meth:`chain_of`, the held ancestors also made most recently used (a write that
        continues them uses them), so the victim choice of :meth:`_put_locked`, least recently
        used first, meets every page it may take before any it must skip: the batch's own
        prefix sat at the front of the LRU order, and every page of the batch stepped over all
        of it (a put of 64 pages after a 20,000-page chain took 128 ms under the lock)."""
        keep = set(entries)
        pages, links = self.pages, self.links
        stamps = self.stamps
        for parent in parents:
            while parent is not None and parent not in keep and parent in pages:
                keep.add(parent)
                pages.move_to_end(parent)
                self._clock += 1
                stamps[parent] = self._clock
                parent = links.get(parent)
        return keep

    def _put_chain_locked(self, entries: Sequence[_Entry], payloads: Sequence[Payload],
                          parents: Sequence[_Entry | None], evicted: list[_Entry] | None,
                          keep: set[_Entry] | None = None, held: dict[_Entry, bool] | None = None) -> list[bool]:
        """Each page in turn, never evicting the batch's own pages or what they chain from
        (:meth:`chain_of`); a page after one refused is refused too (no lookup reaches it).
        So a batch longer than the medium stores its leading pages that fit and refuses the
        rest, without evicting anything for them."""
        if keep is None and self.nbytes + sum(map(len, payloads)) > self.max_bytes:
            keep = self._chain_locked(entries, parents)  # only a batch that may evict needs it
        return put_in_order(entries, parents,
                            lambda i: self._put_locked(entries[i], payloads[i], evicted, parents[i], keep, held))

    def put_many(
        self, entries: Sequence[_Entry], payloads: Sequence[Payload], evicted: list[_Entry] | None = None,
        parents: Sequence[_Entry | None] | None = None, held: dict[_Entry, bool] | None = None,
    ) -> list[bool]:
        """:meth:`put` of each ``(entry, payload)`` in turn, under one lock acquisition.

        Why: a storage batch of small pages is dozens of puts on an I/O thread, and each call
        and lock round trip is Python the server's event loop waits on for the GIL. The outcome
        (pages kept, evictions and their order, counters) is that of the puts one by one; a
        batch of new pages that fits without evicting (the usual one) is stored by one
        ``update`` without a Python iteration per page, and a batch of new pages that must
        evict has its victims chosen once, for all of it. ``parents`` (the page before each):
        a chained batch, stored as :meth:`_put_chain_locked` does. ``held``: as :meth:`put`
        (a batch of new pages adds nothing).
        """
        n = len(entries)
        if len(payloads) != n or (parents is not None and len(parents) != n):
            raise ValueError(f"put_many: {n} entries but {len(payloads)} payloads")
        total = sum(map(len, payloads))
        chain = parents is not None and _is_chain(entries, parents)
        with self.lock:
            pages = self.pages
            keep: set[_Entry] | None = None
            if (pages.keys().isdisjoint(entries) and self.children.keys().isdisjoint(entries)
                    and (parents is None or chain or _links_back(entries, parents))):
                need = self.nbytes + total - self.max_bytes
                if need <= 0:
                    before = len(pages)
                    pages.update(zip(entries, payloads))
                    if len(pages) == before + n:
                        self.nbytes += total
                        self._book_new_locked(entries, parents, chain)
                        return [True] * n
                    for e in entries:  # an entry twice in the batch (rare): undo, then one by one
                        pages.pop(e, None)
                elif total <= self.max_bytes and len(set(entries)) == n:
                    keep = self._chain_locked(entries, parents) if parents is not None else None
                    if self._make_room_locked(need, keep, evicted):
                        pages.update(zip(entries, payloads))
                        self.nbytes += total
                        self._book_new_locked(entries, parents, chain)
                        return [True] * n
            if parents is not None:
                return self._put_chain_locked(entries, payloads, parents, evicted, keep, held)
            return [self._put_locked(e, p, evicted, held=held) for e, p in zip(entries, payloads)]

    def _make_room_locked(self, need: int, keep: set[_Entry] | None, evicted: list[_Entry] | None) -> bool:
        """Evict for a batch of new pages what their puts one by one would, or nothing when
        that cannot free ``need`` bytes (the puts one by one then store what fits). The same
        victims: each put takes the least recently used leaves in turn, and none of the batch's
        own pages, which are protected (a chained batch) or the newest leaves, needed only by
        a batch bigger than the medium (the caller's check)."""
        victims = self._victims_locked(None, None, need, keep)
        if victims is None:
            return False
        for victim in victims:
            self._evict_locked(victim, evicted)
        return True

    def _book_new_locked(self, entries: Sequence[_Entry], parents: Sequence[_Entry | None] | None,
                         chain: bool) -> None:
        """The links, stamps and leaves of new pages just stored (none held or chained from
        before; parents as :func:`_links_back` checked; ``chain``: :func:`_is_chain`), as
        their puts one by one would leave them, in C: each page used last, so appended in
        order their heap entries keep the heap a heap (every stamp in it is older)."""
        n = len(entries)
        clock = self._clock + 1
        self._clock += n
        self.stamps.update(zip(entries, count(clock)))
        stamped = zip(count(clock), entries)
        if parents is None:
            self._leaves.extend(stamped)  # every page a leaf
        else:
            self.links.update(zip(entries, parents))  # a None parent is no link: links.get() says the same
            children = self.children
            if chain:  # each page the parent of the next: the last is the leaf
                dict.update(children, zip(entries[:-1], repeat(1)))
                if parents[0] is not None:
                    children[parents[0]] = children.get(parents[0], 0) + 1
                self._leaves.append((clock + n - 1, entries[-1]))
            else:
                children.update(filter(None, parents))
                self._leaves.extend(compress(stamped, map(not_, map(children.__contains__, entries))))
        if len(self._leaves) > 2 * len(self.pages) + 1024:
            self._compact_leaves_locked()

    def present(self, entries: Sequence[_Entry]) -> list[bool]:
        """Whether each entry is held now."""
        with self.lock:
            pages = self.pages
            return [e in pages for e in entries]

    def get(self, entry: _Entry) -> Payload | None:
        with self.lock:
            payload = self.pages.get(entry)
            if payload is not None:
                self.pages.move_to_end(entry)
                self._clock += 1
                self.stamps[entry] = self._clock  # its heap entry, if a leaf, is checked when popped
            return payload

    def has(self, entry: _Entry) -> bool:
        with self.lock:
            return entry in self.pages

    def remove(self, entry: _Entry) -> bool:
        """Drop one page; whether it was stored."""
        with self.lock:
            gone = self.pages.pop(entry, None)
            if gone is None:
                return False
            del self.stamps[entry]
            self._unlink_locked(entry)
            self.nbytes -= len(gone)
            return True

    def drop_namespace(self, digest: str) -> list[PageKey]:
        """Drop every page of namespace ``digest``; answers them."""
        with self.lock:
            doomed = [e for e in self.pages if e[0] == digest]
            for e in doomed:
                self.nbytes -= len(self.pages.pop(e))
                del self.stamps[e]
                self._unlink_locked(e)
        return [PageKey(k, p) for _, k, p in doomed]


class MemoryStorage(AsyncHiCacheStorage):
    """In-process storage bounded by ``max_bytes``, evicting the least recently used leaves of
    its chains first (see :class:`MemoryMedium`).

    Options:
        max_bytes: capacity of the medium in bytes (default 1 GiB).
        store_id: share the medium with every other store of this process that names the same
            id (default: a private medium).
        namespace: override the namespace derived from the storage config.

    Its ``evicted_pages`` and ``evicted_bytes`` count the evictions its own writes made (on a
    shared medium, of any store's pages): summed over the stores of a medium, the medium's.
    """

    backend_name = "memory"
    # a separate inspect process has none of the pages, whatever ROOT it is given
    not_inspectable_why = "keeps its pages in the memory of the process that wrote them: there is nothing on disk to inspect"
    process_local = True

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        *,
        max_bytes: int | None = None,
        store_id: str | None = None,
        namespace: Namespace | dict[str, Any] | None = None,
    ) -> None:
        """``max_bytes``: the medium's bound (default 1 GiB); a store joining a shared medium
        (``store_id``) takes the medium's, and naming another one is a :class:`ConfigError`."""
        super().__init__(storage_config, namespace=namespace)
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ConfigError(f"memory backend: max_bytes must be a positive integer, got {max_bytes!r}")
        self.medium = MemoryMedium.shared(store_id, max_bytes) if store_id else MemoryMedium(max_bytes or DEFAULT_MAX_BYTES)
        self.store_id = store_id

    async def _open(self) -> None:
        self.medium.join(self.namespace.digest, self)

    async def _close(self) -> None:
        self.medium.leave(self.namespace.digest, self)

    def _entry(self, page: PageKey) -> _Entry:
        return (self.namespace.digest, page.key, page.pool)

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        return [self.medium.has(self._entry(p)) for p in pages]

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        if sum(map(len, buffers)) >= OFFLOAD_MIN_BYTES:
            return await run_to_completion(self._read_into, pages, buffers)
        return self._read_into(pages, buffers)

    def _read_into(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = []
        for page, buf in zip(pages, buffers):
            payload = self.medium.get(self._entry(page))
            if payload is None or len(payload) != len(buf):
                ok.append(False)
                continue
            copy_bytes(buf, payload)
            ok.append(True)
        return ok

    async def _write(
        self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]
    ) -> list[bool]:
        if sum(map(len, buffers)) >= OFFLOAD_MIN_BYTES:
            return await self._store_offloaded(pages, buffers, parents)
        return self._store(pages, buffers, parents)

    async def _store_offloaded(
        self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]
    ) -> list[bool]:
        """:meth:`_store` on a thread; what it evicted is reported back on the loop, and a page
        another batch evicted meanwhile is not stored (``False``, no STORED for it).

        Why: the STORED of a batch is reported on the loop once this returns (the base class),
        while a concurrent batch on another thread may have evicted its pages in between.
        Reported from that thread, the removal came before the STORED, and a subscriber (a
        router) held the page stored for good. Checked and reported here, in one step of the
        loop with that STORED, every removal follows the STORED of the page it removes."""
        removals: list[Callable[[], None]] = []
        try:
            ok = await run_to_completion(self._store, pages, buffers, parents, removals)
            now = self.medium.present(list(self._entries(pages[: len(ok)])))
            return Written([done and there for done, there in zip(ok, now)], ok.held)
        finally:  # a cancelled caller too: the thread's evictions happened
            for report in removals:
                report()

    def _entries(self, pages: Sequence[PageKey]) -> Iterable[_Entry]:
        """The medium's entry of each page, built in C (a page key is a ``(key, pool)`` tuple):
        no Python call per page."""
        if not pages:
            return ()
        return zip(repeat(self.namespace.digest), *zip(*pages))

    def _store(self, pages: Sequence[PageKey], buffers: Sequence[memoryview],
               parents: Sequence[PageKey | None] | None = None,
               removals: list[Callable[[], None]] | None = None) -> Written:
        """Store a batch; ``parents`` (the page before each) chain it: then it never evicts
        its own pages or what they chain from, and stores the leading pages that fit
        (:func:`put_in_order`). Pages refused for room are counted in
        ``rejected_pages_no_space``, and, since nothing this store may evict could make that
        room (a page bigger than the medium, ``oversized_pages``, or a chain longer than it),
        in ``rejected_pages_beyond_capacity``: that tells a writer retrying them is useless.
        ``removals``: the reports of what it evicted are added there, not made (see
        :meth:`_store_offloaded`). Answers which pages it held before (not announced stored
        again): those a put found held, and those the batch itself evicted and put again
        (held before it, as :meth:`_settle_evictions` counts them: no removal reported)."""
        evicted = _Evictions()
        held: dict[_Entry, bool] = {}
        n = min(len(pages), len(buffers))
        entries = list(self._entries(pages[:n]))
        links = None
        if parents is not None:
            digest = self.namespace.digest
            links = [None if p is None else (digest, p.key, p.pool) for p in parents[:n]]
        medium = self.medium
        # which pages were held before (reported stored): only a batch that may evict asks
        was = medium.present(entries) if medium.nbytes + sum(map(len, buffers[:n])) > medium.max_bytes else None
        if buffers and max(map(len, buffers)) < _ARRAY_MIN_BYTES:
            # small pages (see _snapshot): snapshotted in C and stored under one lock; the
            # copies of a batch live together for a moment, a small batch by definition
            ok = medium.put_many(entries, list(map(bytes, buffers[:n])), evicted, links, held)
        elif links is None:  # big pages are copied outside the lock, with the GIL released, one at a time
            ok = [medium.put(e, _snapshot(b), evicted, held=held) for e, b in zip(entries, buffers)]
        else:
            # always (cheap: the walk moves the prefix to the MRU end): the pages are put one by
            # one, each under its own lock hold, and a writer filling the medium in between
            # would have them evict their own prefix if the batch had looked like it fit
            keep = medium.chain_of(entries, links)
            ok = put_in_order(entries, links, lambda i: medium.put(entries[i], _snapshot(buffers[i]), evicted,
                                                                     parent=links[i], protect=keep, held=held))
        if evicted:
            self.stats.incr("evicted_pages", len(evicted))
            self.stats.incr("evicted_bytes", evicted.nbytes)
            self._settle_evictions(pages[:n], entries, ok, was, evicted, removals)
        if not all(ok):
            oversized = sum(1 for b, f in zip(buffers, ok) if not f and len(b) > medium.max_bytes)
            if oversized:
                self.stats.incr("oversized_pages", oversized)
            if n - sum(ok) - oversized:
                self.stats.incr("rejected_pages_no_space", n - sum(ok) - oversized)
                self.stats.incr("rejected_pages_beyond_capacity", n - sum(ok) - oversized)
        if evicted:
            held.update(dict.fromkeys(evicted, True))
        return Written(ok, list(map(held.get, entries, repeat(False))) if any(held.values()) else None)

    def _settle_evictions(self, pages: Sequence[PageKey], entries: list[_Entry], ok: list[bool],
                          was: list[bool] | None, evicted: list[_Entry],
                          removals: list[Callable[[], None]] | None = None) -> None:
        """After a batch that evicted: a page of the batch it evicted again (a batch bigger than
        the medium) was not stored (``False``, and no STORED for it); the batch's pages held
        before and gone now, and older pages of ours it evicted, are reported REMOVED. A page
        whose old copy was evicted and that was put again is stored (``True``). A shared medium
        evicts other stores' pages too: each open store of the page's namespace hears of it as a
        peer's removal (:meth:`_tell_sharers`), or its subscribers would hold it stored forever."""
        digest = self.namespace.digest
        now = self.medium.present(entries)
        batch = set(pages)
        removed = [PageKey(k, p) for d, k, p in evicted if d == digest and PageKey(k, p) not in batch]
        for i, page in enumerate(pages):
            if ok[i] and not now[i]:
                ok[i] = False
            if was is not None and was[i] and not now[i]:
                removed.append(page)  # it was reported stored before this batch
        removed = list(dict.fromkeys(removed))

        def report() -> None:
            if removed:
                self.report_removed(removed, reason="evicted")
            self._tell_sharers(evicted, removed)

        if removals is None:
            report()
        else:
            removals.append(report)

    def _tell_sharers(self, evicted: list[_Entry], ours: list[PageKey]) -> None:
        """Report to the other open stores on the medium the pages of theirs a write evicted
        (``ours``: what this store reported of its own namespace, which a store of the same
        namespace holds too), on this thread, as this store reports its own."""
        digest = self.namespace.digest
        by_digest: dict[str, list[PageKey]] = {}
        for d, k, p in evicted:
            if d != digest:
                by_digest.setdefault(d, []).append(PageKey(k, p))
        if ours:
            by_digest[digest] = ours
        for d, pages in by_digest.items():
            for store in self._sharers(d):
                store.report_removed(pages, reason="evicted", origin="peer")

    def _sharers(self, digest: str) -> list[MemoryStorage]:
        """The other open stores of namespace ``digest`` on this store's medium."""
        return [s for s in self.medium.sharers(digest) if s is not self]

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        payload = self.medium.get(self._entry(page))
        return payload if payload is None or isinstance(payload, bytes) else payload.tobytes()

    async def _delete(self, pages: Sequence[PageKey]) -> list[bool]:
        """Remove pages; the other stores of this namespace on the medium, which held them
        too, hear of them as a peer's removal (as a file store's peers do from its journal)."""
        flags = [self.medium.remove(self._entry(p)) for p in pages]
        gone = [p for p, f in zip(pages, flags) if f]
        if gone:
            for store in self._sharers(self.namespace.digest):
                store.report_removed(gone, reason="deleted", origin="peer")
        return flags

    async def _clear(self) -> list[PageKey]:
        """Drop the namespace's pages and name them; its other stores on the medium hear of a
        peer's clear of the same pages."""
        digest = self.namespace.digest
        dropped = self.medium.drop_namespace(digest)
        for store in self._sharers(digest):
            report_cleared(store.tier_changes, store.backend_name, dropped, origin="peer")
        return dropped

    async def list_pages(self) -> list[tuple[PageKey, int]]:
        digest = self.namespace.digest
        with self.medium.lock:
            return [(PageKey(k, p), len(v)) for (d, k, p), v in self.medium.pages.items() if d == digest]

    def _backend_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stored_pages": len(self.medium.pages),
            "stored_bytes": self.medium.nbytes,
            "max_bytes": self.medium.max_bytes,
        }
        # the medium the store-wide figures describe, shared by every store of this process
        # naming its store_id: a scrape counts it once, not once per cache on it. Every medium
        # has one of its own (a medium lives in one process; a private one is its store's):
        # left empty, ``max by (instance, store)`` took all private ones, or one store_id's in
        # several processes of a server, for one medium
        medium = f"id={self.store_id}" if self.store_id else f"private@{id(self.medium):x}"
        out["store"] = f"memory:{os.getpid()}:{medium}"
        return out
