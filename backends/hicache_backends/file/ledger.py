"""The bytes a namespace takes on disk, shared by every process that uses it (``max_bytes``).

Each process only knows the pages it wrote or saw, so a per-process count lets N processes fill
N times ``max_bytes`` and leaves the excess behind when they exit. The ledger is one small file
in the namespace folder, ``usage``, holding counters that every process changes under an
exclusive ``flock`` (released by the kernel when a holder dies, so a SIGKILL never wedges it):

* ``used`` - bytes of page files and of writes in flight. A writer *reserves* its bytes here
  before it writes (and evicts if the total is then over ``max_bytes``), gives back what it did
  not publish, and an evictor subtracts what it actually unlinked. A writer killed in between
  leaves an over-count (the safe direction), which a later scan corrects (below).
* ``refused`` and ``refused_at`` - pages refused for lack of space, and when, so that
  ``hicache inspect`` (another process) can say that writes are being refused and why;
* ``seq`` - how many changes were made.

Correcting the count: a scan measures the pages on disk, but a write reserved before the scan
and published during it may be missed by the scan, so a measured total replaces ``used`` only
when nothing can have been in flight: this process had no write in flight when the scan began,
no other process had the namespace open at its start or its end (each open store holds a
shared ``flock`` on the ``users`` file; :meth:`UsageLedger.alone` tries for an exclusive one),
and ``seq`` did not move in between (nobody changed anything). Killed writers' reservations
are exactly what such a scan removes.

A clear renames the namespace folder away, and with it the ledger; the next operation notices
that the path now names another file and reopens it, and a delta reserved against the old file
is dropped (:class:`Token`). Every call here blocks (``flock``) and runs on executor threads.
Any OS error makes the ledger *unavailable* for that call (``None``): the store then falls back
to its own count, and a full disk never breaks the store.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass

from hicache_backends.file.locks import flock_within

__all__ = ["LEDGER_NAME", "USERS_NAME", "Usage", "UsageLedger", "read_usage"]

logger = logging.getLogger("hicache.storage.file")

LEDGER_NAME = "usage"
USERS_NAME = "users"
_FORMAT = struct.Struct("<8sqqdq")  # magic, used bytes, refused pages, last refusal, changes
_MAGIC = b"HKVUSE01"
_O_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True, slots=True)
class Usage:
    """One reading of the ledger; ``token`` names the ledger file it came from."""

    used: int
    refused: int
    refused_at: float
    seq: int  # changes so far: equal before and after a scan means nobody changed anything
    token: int


def _decode(raw: bytes) -> tuple[int, int, float, int]:
    if len(raw) != _FORMAT.size:
        return 0, 0, 0.0, 0
    magic, used, refused, refused_at, seq = _FORMAT.unpack(raw)
    if magic != _MAGIC:
        return 0, 0, 0.0, 0
    return max(0, used), max(0, refused), refused_at, seq


def read_usage(path: str) -> Usage | None:
    """The ledger at ``path`` without locking or creating it (for ``hicache inspect``)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return Usage(*_decode(os.pread(fd, _FORMAT.size, 0)), token=st.st_ino)
    except OSError:
        return None
    finally:
        os.close(fd)


class _SharedFile:
    """A small regular file at a fixed path, reopened when the path names another file (a clear
    renamed the namespace folder away). Not thread-safe: the ledger's lock guards it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.ino = 0

    def current(self) -> tuple[int, bool]:
        """The descriptor of the file now at ``path``, and whether it was (re)opened now."""
        if self.fd is not None:
            try:
                st = os.stat(self.path, follow_symlinks=False)
                if st.st_ino == self.ino and stat.S_ISREG(st.st_mode):
                    return self.fd, False
            except FileNotFoundError:
                pass
            self.close()
        fd = os.open(self.path, _O_FLAGS, 0o644)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device planted here: not ours
            os.close(fd)
            os.unlink(self.path)
            fd = os.open(self.path, _O_FLAGS | os.O_EXCL, 0o644)
            st = os.fstat(fd)
        self.fd, self.ino = fd, st.st_ino
        return fd, True

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)  # also releases our flock on it
            except OSError:
                pass
            self.fd = None
            self.ino = 0


class UsageLedger:
    """The shared counters of one namespace (see the module docstring). Thread-safe."""

    def __init__(self, ns_dir: str) -> None:
        self.path = os.path.join(ns_dir, LEDGER_NAME)
        self._lock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._counters = _SharedFile(self.path)
        self._users = _SharedFile(os.path.join(ns_dir, USERS_NAME))
        self._warned = False

    def add(
        self, delta: int, *, refused: int = 0, token: int | None = None, if_seq: int | None = None
    ) -> Usage | None:
        """Add ``delta`` bytes (and ``refused`` pages) atomically; the new totals, or ``None``
        when the ledger cannot be used. With ``token``, a delta meant for a ledger file that has
        since been replaced (a clear) is not applied; the current totals are still returned.
        With ``if_seq``, the delta is applied only if nobody changed the ledger since the
        reading that had that ``seq`` (a scan's correction, see the module docstring)."""
        with self._lock:
            try:
                self._join()
                fd, _ = self._counters.current()
                flock_within(fd, fcntl.LOCK_EX)
                try:
                    raw = os.pread(fd, _FORMAT.size, 0)
                    used, nref, at, seq = _decode(raw)
                    changed = len(raw) != _FORMAT.size
                    if delta and (token is None or token == self._counters.ino) and if_seq in (None, seq):
                        used, changed = max(0, used + delta), True
                    if refused:
                        nref, at, changed = nref + refused, time.time(), True
                    if changed:
                        seq += 1
                        os.pwrite(fd, _FORMAT.pack(_MAGIC, used, nref, at, seq), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError as exc:  # TimeoutError included
                self._counters.close()
                if not self._warned:
                    self._warned = True
                    logger.warning("file store: usage ledger %s unavailable (%s); counting this process only", self.path, exc)
                return None
            self._warned = False
            return Usage(used, nref, at, seq, self._counters.ino)

    def read(self) -> Usage | None:
        """The current totals (a locked read)."""
        return self.add(0, token=-1)

    def alone(self) -> bool:
        """Whether no other process has this namespace open right now (never blocks long:
        the exclusive lock is only tried, and given back at once)."""
        with self._lock:
            try:
                fd = self._join()
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                finally:
                    # back to shared (a failed conversion may have dropped the shared lock)
                    flock_within(fd, fcntl.LOCK_SH)
                return True
            except OSError:
                self._users.close()  # rejoin on the next call
                return False

    def close(self) -> None:
        with self._lock:
            self._counters.close()
            self._users.close()

    def _join(self) -> int:
        """Hold the shared ``users`` lock on the current namespace folder's file."""
        fd, fresh = self._users.current()
        if fresh:
            try:
                flock_within(fd, fcntl.LOCK_SH)
            except OSError:
                self._users.close()
                raise
        return fd
