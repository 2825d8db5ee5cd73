"""The removal journal: how every process sharing a file store learns what the others removed.

Why: a process that evicts pages (to keep ``max_bytes``) or deletes a corrupt one knows what it
removed, but the other processes on the root only find out when a read misses, and a router
fed by *their* KV events would keep sending prompts to a prefix that is gone. So each removal
is appended, as one line, to ``removals`` in the namespace folder, and every open store tails
that file (``journal_poll_s``) and reports the lines other writers added as removals of its
own storage tier (``origin="peer"``), forgetting those pages in its index too.

Appends never wait long and never hold up page I/O: a store queues its lines
(:meth:`RemovalJournal.queue_removed`, on the loop) and one thread of its own writes everything
queued in one ``write`` (:meth:`RemovalJournal.flush`). The lock is waited for at most
``LOCK_PATIENCE`` (0.5 s): a peer frozen while holding it (SIGSTOP, a debugger, a paused
container) would otherwise park the writing thread for good. Lines that could not be written
then are dropped and counted (``dropped_lines``, the store's ``journal_dropped_lines``): the
journal is advisory, and a peer that misses a line finds the page gone at its next read.

Format: one JSON object per line, ``{"w": writer, "rm": [[key, pool], ...], "r": reason}`` or
``{"w": writer, "clear": 1}``; ``writer`` is a random id per open store, so a store skips its
own lines. Appends happen under an exclusive ``flock`` on ``removals.lock`` (released by the
kernel if the holder dies), one ``write`` per batch. An append that failed part-way (a full
disk, a writer killed mid-write) leaves part of a line: the next append ends it with a newline
first (``torn_lines``), and readers skip it alone (the journal only ever grows: see
:func:`_append_whole`). The lock file stays open between appends,
and is opened again when the path names another file (a clear, or a cleaner that deleted the
namespace folder, which the next write recreates): a writer locking the old file no longer
excluded those that opened the new one, and two of them rotating at once moved a journal that
was not full over the full one, whose lines the readers behind then never saw. Threads of one
process take turns on a mutex first (a ``flock`` on one open file does not exclude its
sharers), and a forked child opens its own (the inherited one is the parent's lock).

Bounded: an append that finds the journal over ``max_bytes`` first renames it to
``removals.1`` (replacing the previous one), so the journal never takes more than about twice
``max_bytes``. It is store metadata like the manifest and the ledger: the store's
``max_bytes`` bounds page files, and the journal adds at most ``2 * max_bytes`` of its own.
A reader keeps its file open across the rename and, once it sees a new file under the name,
reads the old one to its end *again* before it moves on: the rename happens under the lock,
after every append to the old file, so the old file is complete by then (a poll that read it
to the end and only then looked at the name missed a line appended in between). Only a
reader more than one whole rotation behind between two polls loses lines (the default
256 KiB holds about 3,000 removed pages): it finds a file it never read as ``removals.1``,
counts it (``missed_files``, the store's ``journal_missed_files``) and says so in what it
returns (a ``missed`` record); the store then checks its index against the disk.

A clear renames the whole namespace folder, journal included; the clearing store writes a
``clear`` line into the fresh journal, and readers, finding a new file under the name, read the
old one to its end and the new one from its start (a reader creates the journal when it opens,
so it holds the file before any line is written). A fresh file with no predecessor that holds
no clear line by the next poll is itself said (``replaced``): a clear killed before its line
leaves no other sign. One that holds a clear line (a peer's, or this store's own) is that
clear's: said as every peer's reader at every clear, the store checked its whole index against
the disk and ran a housekeeping pass beside each ordinary clear, and counted it
``namespace_folder_replaced``. Every call here blocks (``flock``, file I/O): run it on an executor thread.
Any ``OSError`` is logged and the call does nothing: a journal problem never breaks the store.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.errors import InvalidKeyError
from hicache.keys import validate_key
from hicache.storage.stats import Throttle
from hicache.storage.types import pool_name_str
from hicache_backends.file.locks import SharedFile, flock_within

__all__ = ["JOURNAL_NAME", "PeerRemoval", "RemovalJournal"]

logger = logging.getLogger("hicache.storage.file")

JOURNAL_NAME = "removals"
_LOCK_NAME = "removals.lock"
DEFAULT_JOURNAL_BYTES = 256 << 10
_READ_LIMIT = 16 << 20  # most bytes one poll reads (the rest waits for the next poll)
# read and write: an append reads the file's last byte first, to end a line left torn (_append_whole)
_O_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
# at most one warning of a kind (lines dropped, polls failed) per journal this often: a frozen
# peer fails every flush, a journal that cannot be read every poll, each about twice a second
_WARN_SECONDS = 60.0
# what a malformed line raises when parsed (RecursionError: nested deeper than the parser goes)
_BAD_LINE = (ValueError, KeyError, TypeError, InvalidKeyError, RecursionError)


@dataclass(frozen=True, slots=True)
class PeerRemoval:
    """What another process removed: ``pages`` as ``(key, pool)``, or everything (``cleared``),
    or an unknown set of pages (``missed``: lines that went by unread), or whatever the
    namespace folder held (``replaced``: a clear, or a deletion of the folder, whose clear line
    may never come: its process may have been killed before writing it)."""

    pages: tuple[tuple[str, str], ...] = ()
    reason: str = "evicted"
    cleared: bool = False
    missed: bool = False  # a journal file went by unread: removals of unknown pages were lost
    replaced: bool = False  # the journal is the first of a fresh namespace folder


def _append_whole(fd: int, data: bytes) -> bool:
    """(Under the lock.) Append ``data``, whole lines, after the last whole line in the file;
    whether a torn line had to be ended first. A short write raises (reported failed).

    An append that fails part-way (a write that runs out of room on a full disk or past a
    file-size limit, one that raises after some bytes went out, a writer killed in the middle
    of its write) leaves part of a line with no end. The next line appended joined it, and
    readers skipped both as one malformed line: a removal written right was lost too. So an
    append to a file whose last line has no end starts with a newline, and the part is a line
    of its own, skipped alone. The part is not cut off: readers tail the file by offset
    without the lock, and one that read the part before the cut read the next line from the
    wrong place and lost it all the same. The journal only ever grows."""
    size = os.fstat(fd).st_size  # where the append lands: every appender holds the lock
    torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
    if torn:
        data = b"\n" + data
    n = os.write(fd, data)
    if n != len(data):  # the part written is ended by the next append
        raise OSError(errno.ENOSPC, f"short write to the removal journal ({n} of {len(data)} bytes)")
    return torn


class RemovalJournal:
    """One store's end of a namespace's journal: appends its removals, tails the others'."""

    def __init__(self, ns_dir: str, *, max_bytes: int = DEFAULT_JOURNAL_BYTES) -> None:
        self.ns_dir = ns_dir
        self.path = os.path.join(ns_dir, JOURNAL_NAME)
        self.max_bytes = max_bytes
        self.writer = secrets.token_hex(8)
        self._fd: int | None = None
        self._lock_file = SharedFile(os.path.join(ns_dir, _LOCK_NAME))
        self._lock_pid = os.getpid()  # the process whose lock file _lock_file is
        self._append_mutex = threading.Lock()
        self._mutex_pid = os.getpid()
        self._queue_lock = threading.Lock()
        self._queued: list[bytes] = []
        self.dropped_lines = 0  # queued lines given up (lock not free in time, I/O error)
        self.torn_lines = 0  # lines left torn by a failed append (any writer's), ended by ours
        self._drop_warnings = Throttle(_WARN_SECONDS)
        self._poll_warnings = Throttle(_WARN_SECONDS)
        self._pos = 0
        self._tail = b""  # an incomplete last line, completed by a later poll
        self.malformed_lines = 0
        self.lines_read = 0
        self.missed_files = 0  # journal files rotated away before this reader read them
        #: the previous poll found the namespace folder without a journal (see _current_ino)
        self._found_none = False
        #: this reader moved to a fresh folder's journal and has read no clear line in it yet
        #: (see :meth:`poll`)
        self._unexplained = False
        #: this store is clearing the namespace (set on the loop before its rename, see
        #: :meth:`append_cleared`): the fresh folder its reader finds is its own clear's
        self.clearing = False
        self._open_reader(at_end=True)  # what was removed before we opened is not news

    # ------------------------------------------------------------------ writing

    def queue_removed(self, pages: Sequence[tuple[str, str]], reason: str) -> bool:
        """Queue a removal line (thread-safe, no I/O); whether the queue was empty, i.e. the
        caller must arrange a :meth:`flush` (one already arranged takes this line too)."""
        if not pages:
            return False
        return self._enqueue(self._line({"w": self.writer, "rm": [list(p) for p in pages], "r": reason}))

    def append_removed(self, pages: Sequence[tuple[str, str]], reason: str) -> bool:
        """Queue a removal line and write the queue now (blocks: an executor thread)."""
        self.queue_removed(pages, reason)
        return self.flush()

    def append_cleared(self) -> bool:
        """Write a clear line (and anything queued before it) now (blocks). This reader takes
        the fresh folder it finds for its own clear's (:attr:`clearing`) until it reads that
        line; one that could not be written ends that here (the folder is then taken for a
        replaced one, as by every peer)."""
        self._enqueue(self._line({"w": self.writer, "clear": 1}))
        written = self.flush()
        if not written:
            self.clearing = False
        return written

    @staticmethod
    def _line(record: dict) -> bytes:
        return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")

    def _enqueue(self, line: bytes) -> bool:
        with self._queue_lock:
            self._queued.append(line)
            return len(self._queued) == 1

    def flush(self) -> bool:
        """Write every queued line in one ``write`` under the lock (blocks at most
        ``LOCK_PATIENCE`` for it); whether they were written. Lines that were not are dropped
        and counted: retrying them later would only pile up behind a frozen peer."""
        with self._queue_lock:
            lines, self._queued = self._queued, []
        if not lines:
            return True
        with self._mutex():
            if os.path.islink(self.ns_dir):  # swapped for a link: never append outside the root
                self._drop(lines, f"{self.ns_dir} is a symbolic link")
                return False
            lock = self._lock()
            if lock is None:
                self._drop(lines, "the journal is unavailable")
                return False
            torn = False
            try:
                flock_within(lock, fcntl.LOCK_EX)
                try:
                    self._rotate()
                    fd = os.open(self.path, _O_APPEND, 0o644)
                    try:
                        torn = _append_whole(fd, b"".join(lines))
                    finally:
                        os.close(fd)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            except OSError as exc:  # TimeoutError included: a holder that does not let go
                self._drop(lines, str(exc))
                return False
            if torn:
                self.torn_lines += 1
                logger.warning("file store %s: ended a removal journal line left torn by a failed append "
                               "(skipped alone by readers)", self.ns_dir)
        return True

    def _drop(self, lines: list[bytes], why: str) -> None:
        """Count lines given up; said at most once a minute (a frozen peer fails every flush)."""
        self.dropped_lines += len(lines)
        count = self._drop_warnings.due(len(lines))
        if count:
            logger.warning("file store %s: %d removal journal line(s) not written since the last warning (%s); "
                           "other processes sharing the root learn of those removals at their next read",
                           self.ns_dir, count, why)

    def _mutex(self) -> threading.Lock:
        """This process's append mutex: a child forked while a thread of the parent held it
        would otherwise wait for it forever (only the forking thread lives on in the child)."""
        if self._mutex_pid != os.getpid():
            self._append_mutex = threading.Lock()
            self._mutex_pid = os.getpid()
        return self._append_mutex

    def _lock(self) -> int | None:
        """(Under the mutex.) This process's open lock file: the file now at its path."""
        if self._lock_pid != os.getpid():
            # inherited across fork: the parent's lock, left to the parent (not closed)
            self._lock_file = SharedFile(self._lock_file.path)
            self._lock_pid = os.getpid()
        try:
            return self._lock_file.current()[0]
        except OSError as exc:
            logger.warning("file store %s: removal journal unavailable: %s", self.ns_dir, exc)
            return None

    def _rotate(self) -> None:
        """(Under the lock.) Move a full journal aside, replacing the previous one."""
        try:
            if os.stat(self.path).st_size > self.max_bytes:
                os.replace(self.path, self.path + ".1")
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ reading

    def _open_reader(self, *, at_end: bool) -> None:
        try:
            # created if missing, so that a reader holds the file from the start and reads it to
            # its end even if a clear or a rotation moves it away before the first poll
            fd = os.open(self.path, _O_READ | (os.O_CREAT if at_end else 0), 0o644)
        except OSError:
            self._fd = None
            return
        self._fd = fd
        self._pos = os.fstat(fd).st_size if at_end else 0
        self._tail = b""

    def poll(self) -> list[PeerRemoval]:
        """Removals other writers appended since the last poll, oldest first; last, a fresh
        folder's journal this reader moved to at an earlier poll and has read no clear line in
        since (``replaced``: a clear killed before its line, or a folder deleted and made
        again)."""
        out: list[PeerRemoval] = []
        waited = self._unexplained
        try:
            if self._fd is None:
                self._open_reader(at_end=False)  # created after we opened: all of it is news
                if self._fd is None:
                    return out
            self._read_lines(out)
            now = self._current_ino()
            if now is not None and now != os.fstat(self._fd).st_ino:
                self._next_file(out)  # rotated or cleared, and the next file exists
        except OSError as exc:
            count = self._poll_warnings.due()  # every poll (twice a second) fails alike: once a minute
            if count:
                logger.warning("file store %s: reading the removal journal failed (%d poll(s) since the last "
                               "warning): %s", self.ns_dir, count, exc)
        if waited and self._unexplained:
            self._unexplained = False
            out.append(PeerRemoval(reason="replaced", replaced=True))
        return out

    def _current_ino(self) -> int | None:
        """The inode of the journal now under the name (``None``: none there). A folder found
        without one at two polls in a row gets one, as a reader's open makes it: a clear killed
        after setting up the fresh folder and before its clear line left none there, and a
        reader that waited for the next append to make it kept the cleared pages indexed for as
        long as no process removed one. Not at the first poll: a live clearer appends its clear
        line within moments, after the removal lines it was still writing (one append at a
        time); made at once, the new file moved this reader on while such a line, its file
        opened before the clear's rename, still went to the old one, and was lost. Never in a
        folder that is a link, nor a folder that is gone (a clear between its steps)."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            pass
        else:
            self._found_none = False
            return ino
        if os.path.islink(self.ns_dir):
            return None
        if not self._found_none:  # the first poll to find none: a live clearer is about to make it
            self._found_none = True
            return None
        try:
            os.close(os.open(self.path, _O_READ | os.O_CREAT, 0o644))
            return os.stat(self.path).st_ino
        except OSError:  # gone, or a dangling link planted there (never followed): nothing to follow
            return None

    def _next_file(self, out: list[PeerRemoval]) -> None:
        """Finish the old file and move to the one now under the name.

        The old file is read to its end once more first: a line appended after the read
        above and before the rotation that followed it is there, and nowhere else (the
        rotation is done under the lock, after every append to the file it moves, so no line
        reaches the old file once a new one is under the name). Then the new file is checked
        to be the old one's successor: a reader more than one rotation behind finds another
        file as ``removals.1`` (the old one was replaced there), one it never read."""
        assert self._fd is not None
        old = self._fd
        while self._read_lines(out) == _READ_LIMIT:
            pass
        was = os.fstat(old)
        self._fd = None
        self._open_reader(at_end=False)
        if self._fd is None:  # gone again meanwhile: keep the old one, the next poll retries
            self._fd = old
            return
        os.close(old)
        try:
            before = os.stat(self.path + ".1")
        except FileNotFoundError:
            # nothing rotated in this folder: the new file is its first, so the folder was
            # replaced (a clear, or deleted and made again): said unless a clear line comes
            # (poll), or this store is the clearer (of this one fresh folder)
            before = None
            self._unexplained, self.clearing = not self.clearing, False
        # .1 is the old file (the new one is its successor) or the new one (rotated right after
        # we opened it: its predecessor cannot be told, so counted as missed to be safe)
        if before is not None and (before.st_dev, before.st_ino) != (was.st_dev, was.st_ino):
            self.missed_files += 1
            out.append(PeerRemoval(reason="missed", missed=True))
            logger.warning("file store %s: the removal journal was rotated more than once since the last read; "
                           "removals by other processes were missed (the index is checked against the disk)",
                           self.ns_dir)
        self._read_lines(out)

    def _read_lines(self, out: list[PeerRemoval]) -> int:
        """Parse what was appended since the last read (at most ``_READ_LIMIT`` bytes of it,
        the count returned) into ``out``."""
        assert self._fd is not None
        data = os.pread(self._fd, _READ_LIMIT, self._pos)
        if not data:
            return 0
        read = len(data)
        self._pos += read
        data = self._tail + data
        *lines, self._tail = data.split(b"\n")
        for raw in lines:
            record = self._parse(raw)
            if record is not None:
                out.append(record)
        return read

    def _parse(self, raw: bytes) -> PeerRemoval | None:
        if not raw:
            return None
        self.lines_read += 1
        try:
            return self._record(raw)
        except _BAD_LINE as exc:
            self.malformed_lines += 1
            logger.warning("file store %s: skipped a malformed removal journal line (%s)", self.ns_dir, exc)
        # part of a line torn by a failed append, joined by the next line (its writer did not end
        # the part first: an older version): the line behind the part is whole. Every line starts
        # with '{"w":', and no line holds it anywhere else (a quote inside a string is escaped).
        start = raw.rfind(b'{"w":')
        if start > 0:
            try:
                return self._record(raw[start:])
            except _BAD_LINE:
                pass
        return None

    def _record(self, raw: bytes) -> PeerRemoval | None:
        """One line parsed (``None``: this store's own); raises ``_BAD_LINE`` for a malformed one."""
        rec = json.loads(raw.decode("utf-8", "surrogatepass"))
        if not isinstance(rec, dict):
            raise ValueError("not an object")
        own = rec.get("w") == self.writer
        if rec.get("clear"):
            self._unexplained = False  # the fresh folder is this clear's
            if own:
                self.clearing = False
                return None
            return PeerRemoval(cleared=True, reason="clear")
        if own:
            return None
        # what no store writes (a key or pool name that is not storable text) is a bad line,
        # not a removal: its page id cannot even be computed
        pages = tuple((validate_key(str(k)), pool_name_str(str(p))) for k, p in rec["rm"])
        return PeerRemoval(pages=pages, reason=str(rec.get("r", "evicted")))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with self._mutex():
            if self._lock_pid == os.getpid():  # (a forked child's is the parent's: _lock replaces it)
                self._lock_file.close()
