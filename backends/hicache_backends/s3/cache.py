"""A bounded cache of objects known to exist, so repeated lookups of a prefix cost no HEADs.

Only *positive* answers are cached (another process may write a page at any time, so a miss is
never remembered). An entry expires after ``ttl`` seconds, bounding how long a page removed by
someone else (bucket lifecycle, another process's clear) is still reported - and such a page
then reads as a miss and is dropped here. Pages removed by *this* process are never reported:
deletes, clears and corrupt reads invalidate, and the ticket a request takes before it starts
(``generation``) stops an answer older than a clear, or than the removal of its page, from
re-adding the page after it (a HEAD that S3 answered before a delete, processed after it). Stores of one process that open
the same namespace at the same location share one cache (:meth:`ExistsCache.shared`), so a clear
through any of them is seen by all.

A page a read found missing is also remembered as *gone* (:meth:`ExistsCache.mark_gone`, as
many as entries and at least 4,096, also with the cache off; no TTL): a run index written before that page was deleted still lists it, and
without the mark every lookup after the TTL would re-learn the page from the index and serve it
as a hit again, one failed read per TTL, forever. Only a fresh answer about that one object (a
HEAD, a read or a write of it) clears the mark; the mark costs a lookup one HEAD, never a hit.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import ClassVar

__all__ = ["ExistsCache"]

#: gone marks kept at least, whatever the cache's size (0 turns positive answers off, not these)
_MIN_GONE = 4096


class ExistsCache:
    """LRU of object paths with a time-to-live; thread-safe."""

    _shared: ClassVar[weakref.WeakValueDictionary[Hashable, ExistsCache]] = weakref.WeakValueDictionary()
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, scope: Hashable, max_entries: int, ttl: float) -> ExistsCache:
        """The process-wide cache of ``scope`` (location + namespace); the first store to ask
        sets its size and TTL. It lives as long as some store holds it."""
        with cls._shared_lock:
            cache = cls._shared.get(scope)
            if cache is None:
                cache = cls(max_entries, ttl)
                cls._shared[scope] = cache
            return cache

    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max(0, int(max_entries))
        self.ttl = float(ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, float] = OrderedDict()
        #: paths found missing or removed here (LRU order), each with the tick of its removal
        self._gone: OrderedDict[str, int] = OrderedDict()
        self._tick = 0  # advances at every removal and clear
        self._cleared_at = 0  # the tick of the last clear
        self._clearing = 0  # clears in progress (between begin_clear and end_clear)

    @property
    def generation(self) -> int:
        """The ticket to take before a request and pass to :meth:`add` with its answer: an
        answer is refused when a clear, or a removal of its path, came after the ticket."""
        return self._tick

    def cleared_since(self, generation: int) -> bool:
        """Whether a clear began after the ticket ``generation`` (see :attr:`generation`) or
        is still running: its listing may have missed an object stored since the ticket."""
        with self._lock:
            return generation < self._cleared_at or self._clearing > 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, path: str) -> bool:
        """Whether ``path`` is present on evidence younger than the TTL. An expired entry
        answers no (the caller asks the store again) but is kept: it is what :meth:`known`
        reads, and a write of a page this process announced must not announce it again (a
        router that counts stores against removals held it after its one removal); a removal
        made or seen here, the LRU bound and a clear are what drop it."""
        if not self.max_entries:
            return False
        with self._lock:
            stamp = self._entries.get(path)
            if stamp is None or self._clock() - stamp > self.ttl:
                return False
            self._entries.move_to_end(path)
            return True

    def known(self, path: str) -> bool:
        """Whether ``path`` is remembered as present, expired or not: learned here (a write, a
        HEAD, a read) with no removal made or seen here since. Unlike :meth:`contains`, changes
        nothing. A write asks it to tell a page this process announced stored from a new one."""
        with self._lock:
            return path in self._entries

    def add(self, path: str, generation: int) -> None:
        """Remember ``path`` as present (a fresh answer about it: also clears a gone mark)."""
        with self._lock:
            if generation < self._cleared_at:
                return  # a clear happened while the request was in flight
            removed = self._gone.get(path)
            if removed is not None and removed > generation:
                return  # removed here after the request started: its answer may predate that
            self._gone.pop(path, None)
            if not self.max_entries:
                return
            self._entries[path] = self._clock()
            self._entries.move_to_end(path)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def discard(self, path: str) -> bool:
        """Forget ``path``; whether it was remembered as present (expired or not)."""
        with self._lock:
            return self._entries.pop(path, None) is not None

    def mark_gone(self, path: str) -> bool:
        """A read found ``path`` missing: forget it, and distrust second-hand claims (run
        indexes) that it exists until a fresh answer about it. Whether it was remembered."""
        with self._lock:
            known = self._entries.pop(path, None) is not None
            # kept even with the cache off (size 0): run indexes are trusted either way
            self._tick += 1
            self._gone[path] = self._tick
            self._gone.move_to_end(path)
            while len(self._gone) > max(self.max_entries, _MIN_GONE):
                self._gone.popitem(last=False)
            return known

    def removed_since(self, path: str, generation: int) -> bool:
        """Whether a removal of ``path`` was made or seen here after the ticket ``generation``
        (see :attr:`generation`), with no fresh answer about it since."""
        with self._lock:
            removed = self._gone.get(path)
            return removed is not None and removed > generation

    def is_gone(self, path: str) -> bool:
        """Whether a read found ``path`` missing, with no fresh answer about it since."""
        with self._lock:
            return path in self._gone

    def clear(self) -> None:
        with self._lock:
            self._clear_locked()

    def begin_clear(self) -> None:
        """A clear of the store starts: :meth:`clear`, and :meth:`cleared_since` answers yes
        to every ticket until the matching :meth:`end_clear`."""
        with self._lock:
            self._clearing += 1
            self._clear_locked()

    def end_clear(self) -> None:
        """The clear is done (also when it failed): :meth:`clear` again, which drops the
        answers of lookups that overlapped its deletes."""
        with self._lock:
            self._clearing -= 1
            self._clear_locked()

    def _clear_locked(self) -> None:
        self._tick += 1
        self._cleared_at = self._tick
        self._entries.clear()
        self._gone.clear()
