"""``flock`` with patience: the one way a file store waits for a lock another process holds.

Why not a plain blocking ``flock``: a process sharing the root can be frozen while it holds a
lock (SIGSTOP, a debugger, a paused container). The kernel releases the lock only when the
holder dies, so a blocking wait would park the waiting I/O thread for good, and after a few of
them every read and write of this store would queue behind it. A wait that gives up lets the
caller treat the lock's data (the usage ledger, the removal journal) as unavailable for now,
which both handle: they are advisory.

Both keep their lock file open between calls, as a :class:`SharedFile`: one that follows its
path, since a clear (or a cleaner deleting the namespace folder) leaves a descriptor opened
before on a file no process that opens the store afterwards locks.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

__all__ = ["LOCK_PATIENCE", "SharedFile", "create_in_place", "flock_within"]

LOCK_PATIENCE = 0.5  # seconds to wait for a lock before answering "unavailable"
_O_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def flock_within(fd: int, op: int, patience: float = LOCK_PATIENCE) -> None:
    """``flock(fd, op)`` that raises :class:`TimeoutError` (an ``OSError``) after ``patience``
    seconds instead of waiting for a holder that may never let go."""
    deadline = time.monotonic() + patience
    pause = 0.0005
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"lock held by another process for over {patience} s") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


def create_in_place(path: str, flags: int, mode: int = 0o644) -> int:
    """A new regular file at ``path``, opened with ``flags`` (``O_CREAT`` and ``O_EXCL`` added):
    whatever is there first (stale, or planted: a link, a FIFO) is removed, and only it, never
    what a link points to. Opened without ``O_EXCL``, a link planted at the name was followed
    and the file it points to, outside the root, written."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)


class SharedFile:
    """A small regular file at a fixed path, reopened when the path names another file (a clear
    renamed the namespace folder away; it was deleted and created again). Why: a lock taken on
    the descriptor of a file no longer at the path excludes nobody who opened the path since.
    Not thread-safe: its user's mutex guards it (the ledger's lock, the journal's mutex)."""

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
        folder = os.path.dirname(self.path)
        if os.path.islink(folder):  # the namespace folder swapped for a link: never create outside the root
            raise OSError(errno.ELOOP, f"{folder} is a symbolic link")
        try:
            fd = os.open(self.path, _O_FLAGS, 0o644)
        except OSError as exc:
            # a link planted here (never followed): kept, the file stayed unavailable for good,
            # and with it the shared count and every process's bound on it
            if exc.errno != errno.ELOOP:
                raise
            fd = self._replace_stray()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device planted here: not ours
            os.close(fd)
            fd = self._replace_stray()
            st = os.fstat(fd)
        self.fd, self.ino = fd, st.st_ino
        return fd, True

    def _replace_stray(self) -> int:
        """A link, FIFO or device at the path is not ours: a fresh regular file takes its place."""
        return create_in_place(self.path, _O_FLAGS)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)  # also releases our flock on it
            except OSError:
                pass
            self.fd = None
            self.ino = 0
