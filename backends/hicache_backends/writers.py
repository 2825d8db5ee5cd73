"""Whose temporary file this is, and whether its writer surely gave up on it: the one rule the
backends that write local files (``file``, and ``fsspec`` on a ``file://`` URL) sweep by.

A writer writes a temporary file and renames it into place; one killed mid-write leaves the
temporary file behind. Its name carries the writer's pid *and* machine (:data:`MACHINE`): a
root may sit on a shared mount, and a writer in another container or on another machine has
pids of its own, so its pid number says nothing here (the same number may be a live local
process, or no process at all while that writer is busy). Hence :func:`tmp_abandoned`: a
writer is judged dead by its pid only on its own machine; every other temporary file goes by
its age alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

__all__ = ["MACHINE", "MACHINE_HEX", "STALE_TMP_SECONDS", "machine_id", "parse_machine", "pid_alive",
           "remove_if_abandoned", "tmp_abandoned", "writer_gone"]

#: a temporary file older than this is garbage whoever wrote it (no write takes an hour)
STALE_TMP_SECONDS = 3600.0


def machine_id() -> int:
    """This machine (and PID namespace): whose pids this process may test for life. Another
    machine sharing the root (NFS), or a container in another PID namespace, is never judged."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts = [f.read().strip()]
    except OSError:
        parts = [os.uname().nodename]
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


#: this machine and PID namespace (see :func:`machine_id`)
MACHINE = machine_id()

#: :data:`MACHINE` as temporary file names carry it (16 hex digits)
MACHINE_HEX = MACHINE.to_bytes(8, "little", signed=True).hex()


def parse_machine(text: str) -> int | None:
    """The machine a temporary file name carries (:data:`MACHINE_HEX`'s form), or ``None``
    if ``text`` is not hex."""
    try:
        return int.from_bytes(bytes.fromhex(text), "little", signed=True)
    except ValueError:
        return None


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


def writer_gone(pid: int, machine: int | None) -> bool:
    """Whether writer ``pid`` of ``machine`` (``None``: a name from before machines were
    written there) is surely dead: only a process of this machine, not this one, can be."""
    return machine == MACHINE and pid != os.getpid() and not pid_alive(pid)


def tmp_abandoned(path: str, pid: int, machine: int | None, stale_seconds: float = STALE_TMP_SECONDS,
                  now: float | None = None) -> bool:
    """Whether the temporary file at ``path``, written by ``pid`` of ``machine``, is garbage:
    its writer is surely dead (:func:`writer_gone`), or the file is older than
    ``stale_seconds`` at ``now`` (default: the time of the call), the one test for a writer
    elsewhere. ``FileNotFoundError`` when the file is gone meanwhile (renamed into place,
    removed by another sweep)."""
    if writer_gone(pid, machine):
        return True
    age = (time.time() if now is None else now) - os.stat(path, follow_symlinks=False).st_mtime
    return age > stale_seconds


def remove_if_abandoned(path: str, pid: int, machine: int | None) -> bool:
    """Unlink the temporary file at ``path``, written by ``pid`` of ``machine``, if it is
    garbage (:func:`tmp_abandoned`): whether it was removed. Gone meanwhile (renamed into place,
    removed by another sweep) is no error; another failure is logged, and the file left for
    the next sweep. A link planted there: only the link goes."""
    try:
        if tmp_abandoned(path, pid, machine):
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    except OSError as exc:
        logging.getLogger("hicache.storage").warning("could not remove %s: %s", path, exc)
    return False
