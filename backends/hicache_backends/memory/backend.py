"""The ``memory`` backend: the simplest complete backend, and the one tests lean on.

Pages live in a :class:`MemoryMedium` - an LRU dict bounded by bytes. Two ``MemoryStorage``
objects given the same ``store_id`` share one medium (as two processes share a file root), each
seeing only its own namespace. Everything is in-process, so small batches run inline (a
``memcpy`` of a small page is cheaper than a hop to a thread); a batch of at least
``OFFLOAD_MIN_BYTES`` is copied on a worker thread so the event loop never stalls on it (a batch
of 8 MiB pages is hundreds of MiB), and a cancelled caller waits for that copy to finish.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any, ClassVar

import numpy as np

from hicache.errors import ConfigError
from hicache.keys import Namespace
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, PageKey
from hicache.storage.offload import OFFLOAD_MIN_BYTES, copy_bytes, run_to_completion

__all__ = ["MemoryMedium", "MemoryStorage"]

_Entry = tuple[str, str, str]  # (namespace digest, key, pool)

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


class MemoryMedium:
    """A byte-bounded LRU map of pages shared by every store that names the same ``store_id``."""

    _shared: ClassVar[dict[str, MemoryMedium]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pages: OrderedDict[_Entry, Payload] = OrderedDict()
        #: the page each held page was written after (its parent), where it had one: what a
        #: chained write must not evict for room (see :meth:`chain_of`)
        self.links: dict[_Entry, _Entry | None] = {}
        self.nbytes = 0
        self.evicted_pages = 0
        self.evicted_bytes = 0
        self.lock = threading.Lock()

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

    def put(self, entry: _Entry, payload: Payload, evicted: list[_Entry] | None = None, *,
            parent: _Entry | None = None, protect: set[_Entry] | None = None) -> bool:
        """Store a page, evicting least recently used ones for room (appended to ``evicted``),
        never one of ``protect``: ``False`` (nothing evicted) when only they could make room."""
        with self.lock:
            return self._put_locked(entry, payload, evicted, parent, protect)

    def _put_locked(self, entry: _Entry, payload: Payload, evicted: list[_Entry] | None,
                    parent: _Entry | None = None, protect: set[_Entry] | None = None) -> bool:
        """:meth:`put` with the lock held."""
        size = len(payload)
        if size > self.max_bytes:
            return False
        pages = self.pages
        old = pages.get(entry)
        need = self.nbytes - (len(old) if old is not None else 0) + size - self.max_bytes
        if need > 0:
            # the victims are chosen before any goes: a page that cannot have its room is
            # refused without evicting anything for it
            victims: list[_Entry] = []
            for victim, held in pages.items():  # least recently used first
                if victim == entry or (protect is not None and victim in protect):
                    continue
                victims.append(victim)
                need -= len(held)
                if need <= 0:
                    break
            if need > 0:
                return False
            for victim in victims:
                gone = pages.pop(victim)
                self.links.pop(victim, None)
                self.nbytes -= len(gone)
                self.evicted_pages += 1
                self.evicted_bytes += len(gone)
                if evicted is not None:
                    evicted.append(victim)
        if old is not None:
            del pages[entry]  # put again: most recently used
            self.nbytes -= len(old)
        pages[entry] = payload
        self.nbytes += size
        if parent is not None:
            self.links[entry] = parent
        else:
            self.links.pop(entry, None)
        return True

    def chain_of(self, entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> set[_Entry]:
        """What a chained batch (``parents``: the page before each) must never evict for its
        own room: its pages and every held ancestor of them. Evicted for the batch's tail,
        they left the tail stored after a prefix no lookup finds (a lookup stops at the first
        missing page): the tail then took the room of pages that were useful, for nothing."""
        with self.lock:
            return self._chain_locked(entries, parents)

    def _chain_locked(self, entries: Sequence[_Entry], parents: Sequence[_Entry | None]) -> set[_Entry]:
        """:meth:`chain_of`, the held ancestors also made most recently used (a write that
        continues them uses them), so the victim scan of :meth:`_put_locked`, least recently
        used first, meets every page it may take before any it must skip: the batch's own
        prefix sat at the front of the LRU order, and every page of the batch stepped over all
        of it (a put of 64 pages after a 20,000-page chain took 128 ms under the lock)."""
        keep = set(entries)
        pages, links = self.pages, self.links
        for parent in parents:
            while parent is not None and parent not in keep and parent in pages:
                keep.add(parent)
                pages.move_to_end(parent)
                parent = links.get(parent)
        return keep

    def _put_chain_locked(self, entries: Sequence[_Entry], payloads: Sequence[Payload],
                          parents: Sequence[_Entry | None], evicted: list[_Entry] | None,
                          keep: set[_Entry] | None = None) -> list[bool]:
        """Each page in turn, never evicting the batch's own pages or what they chain from
        (:meth:`chain_of`); a page after one refused is refused too (no lookup reaches it).
        So a batch longer than the medium stores its leading pages that fit and refuses the
        rest, without evicting anything for them."""
        if keep is None and self.nbytes + sum(map(len, payloads)) > self.max_bytes:
            keep = self._chain_locked(entries, parents)  # only a batch that may evict needs it
        return put_in_order(entries, parents, lambda i: self._put_locked(entries[i], payloads[i], evicted, parents[i], keep))

    def put_many(
        self, entries: Sequence[_Entry], payloads: Sequence[Payload], evicted: list[_Entry] | None = None,
        parents: Sequence[_Entry | None] | None = None,
    ) -> list[bool]:
        """:meth:`put` of each ``(entry, payload)`` in turn, under one lock acquisition.

        Why: a storage batch of small pages is dozens of puts on an I/O thread, and each call
        and lock round trip is Python the server's event loop waits on for the GIL. The outcome
        (pages kept, evictions and their order, counters) is that of the puts one by one; a
        batch of new pages that fits without evicting (the usual one) is stored by one
        ``update`` without a Python iteration per page. ``parents`` (the page before each):
        a chained batch, stored as :meth:`_put_chain_locked` does.
        """
        n = len(entries)
        if len(payloads) != n or (parents is not None and len(parents) != n):
            raise ValueError(f"put_many: {n} entries but {len(payloads)} payloads")
        total = sum(map(len, payloads))
        with self.lock:
            pages = self.pages
            if self.nbytes + total <= self.max_bytes and pages.keys().isdisjoint(entries):
                before = len(pages)
                pages.update(zip(entries, payloads))
                if len(pages) == before + n:
                    self.nbytes += total
                    if parents is not None:  # a None parent is no link: links.get() says the same
                        self.links.update(zip(entries, parents))
                    return [True] * n
                for e in entries:  # an entry twice in the batch (rare): undo, then one by one
                    pages.pop(e, None)
            if parents is not None:
                return self._put_chain_locked(entries, payloads, parents, evicted)
            return [self._put_locked(e, p, evicted) for e, p in zip(entries, payloads)]

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
            self.links.pop(entry, None)
            self.nbytes -= len(gone)
            return True

    def drop_namespace(self, digest: str) -> int:
        with self.lock:
            doomed = [e for e in self.pages if e[0] == digest]
            for e in doomed:
                self.nbytes -= len(self.pages.pop(e))
                self.links.pop(e, None)
            return len(doomed)


class MemoryStorage(AsyncHiCacheStorage):
    """In-process storage bounded by ``max_bytes`` with LRU eviction.

    Options:
        max_bytes: capacity of the medium in bytes (default 1 GiB).
        store_id: share the medium with every other store of this process that names the same
            id (default: a private medium).
        namespace: override the namespace derived from the storage config.
    """

    backend_name = "memory"
    # a separate inspect process has none of the pages, whatever ROOT it is given
    not_inspectable_why = "keeps its pages in the memory of the process that wrote them: there is nothing on disk to inspect"

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
            return await run_to_completion(self._store, pages, buffers, parents)
        return self._store(pages, buffers, parents)

    def _entries(self, pages: Sequence[PageKey]) -> Iterable[_Entry]:
        """The medium's entry of each page, built in C (a page key is a ``(key, pool)`` tuple):
        no Python call per page."""
        if not pages:
            return ()
        return zip(repeat(self.namespace.digest), *zip(*pages))

    def _store(self, pages: Sequence[PageKey], buffers: Sequence[memoryview],
               parents: Sequence[PageKey | None] | None = None) -> list[bool]:
        """Store a batch; ``parents`` (the page before each) chain it: then it never evicts
        its own pages or what they chain from, and stores the leading pages that fit
        (:func:`put_in_order`). Pages refused for room are counted in
        ``rejected_pages_no_space``, and, since nothing this store may evict could make that
        room (a page bigger than the medium, ``oversized_pages``, or a chain longer than it),
        in ``rejected_pages_beyond_capacity``: that tells a writer retrying them is useless."""
        evicted: list[_Entry] = []
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
            ok = medium.put_many(entries, list(map(bytes, buffers[:n])), evicted, links)
        elif links is None:  # big pages are copied outside the lock, with the GIL released, one at a time
            ok = [medium.put(e, _snapshot(b), evicted) for e, b in zip(entries, buffers)]
        else:
            # always (cheap: the walk moves the prefix to the MRU end): the pages are put one by
            # one, each under its own lock hold, and a writer filling the medium in between
            # would have them evict their own prefix if the batch had looked like it fit
            keep = medium.chain_of(entries, links)
            ok = put_in_order(entries, links, lambda i: medium.put(entries[i], _snapshot(buffers[i]), evicted,
                                                                     parent=links[i], protect=keep))
        if evicted:
            self._settle_evictions(pages[:n], entries, ok, was, evicted)
        if not all(ok):
            oversized = sum(1 for b, f in zip(buffers, ok) if not f and len(b) > medium.max_bytes)
            if oversized:
                self.stats.incr("oversized_pages", oversized)
            if n - sum(ok) - oversized:
                self.stats.incr("rejected_pages_no_space", n - sum(ok) - oversized)
                self.stats.incr("rejected_pages_beyond_capacity", n - sum(ok) - oversized)
        return ok

    def _settle_evictions(self, pages: Sequence[PageKey], entries: list[_Entry], ok: list[bool],
                          was: list[bool] | None, evicted: list[_Entry]) -> None:
        """After a batch that evicted: a page of the batch it evicted again (a batch bigger than
        the medium) was not stored (``False``, and no STORED for it); the batch's pages held
        before and gone now, and older pages of ours it evicted, are reported REMOVED. A page
        whose old copy was evicted and that was put again is stored (``True``). A shared medium
        evicts other namespaces' pages too: only ours are reported."""
        digest = self.namespace.digest
        now = self.medium.present(entries)
        batch = set(pages)
        removed = [PageKey(k, p) for d, k, p in evicted if d == digest and PageKey(k, p) not in batch]
        for i, page in enumerate(pages):
            if ok[i] and not now[i]:
                ok[i] = False
            if was is not None and was[i] and not now[i]:
                removed.append(page)  # it was reported stored before this batch
        if removed:
            self.report_removed(list(dict.fromkeys(removed)), reason="evicted")

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        payload = self.medium.get(self._entry(page))
        return payload if payload is None or isinstance(payload, bytes) else payload.tobytes()

    async def _delete(self, pages: Sequence[PageKey]) -> list[bool]:
        return [self.medium.remove(self._entry(p)) for p in pages]

    async def _clear(self) -> None:
        self.medium.drop_namespace(self.namespace.digest)

    async def list_pages(self) -> list[tuple[PageKey, int]]:
        digest = self.namespace.digest
        with self.medium.lock:
            return [(PageKey(k, p), len(v)) for (d, k, p), v in self.medium.pages.items() if d == digest]

    def _backend_stats(self) -> dict[str, Any]:
        return {
            "stored_pages": len(self.medium.pages),
            "stored_bytes": self.medium.nbytes,
            "max_bytes": self.medium.max_bytes,
            "evicted_pages": self.medium.evicted_pages,
            "evicted_bytes": self.medium.evicted_bytes,
        }
