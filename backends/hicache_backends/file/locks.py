"""``flock`` with patience: the one way a file store waits for a lock another process holds.

Why not a plain blocking ``flock``: a process sharing the root can be frozen while it holds a
lock (SIGSTOP, a debugger, a paused container). The kernel releases the lock only when the
holder dies, so a blocking wait would park the waiting I/O thread for good, and after a few of
them every read and write of this store would queue behind it. A wait that gives up lets the
caller treat the lock's data (the usage ledger, the removal journal) as unavailable for now,
which both handle: they are advisory.
"""

from __future__ import annotations

import fcntl
import os
import time

__all__ = ["LOCK_PATIENCE", "flock_within", "pid_alive"]

LOCK_PATIENCE = 0.5  # seconds to wait for a lock before answering "unavailable"


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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine may still be alive (``False`` only when it
    surely is gone: another user's process, or one the kernel will not tell about, counts as
    alive, so nobody takes over what it holds)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
