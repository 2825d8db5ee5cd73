"""The bytes a namespace takes on disk, shared by every process that uses it (``max_bytes``).

Each process only knows the pages it wrote or saw, so a per-process count lets N processes fill
N times ``max_bytes`` and leaves the excess behind when they exit. The ledger is one small file
in the namespace folder, ``usage``, holding counters that every process changes under an
exclusive ``flock`` (released by the kernel when a holder dies, so a SIGKILL never wedges it):

* ``used`` - bytes of page files and of writes in flight. A writer *reserves* its bytes here
  before it writes (and evicts if the total is then over ``max_bytes``), gives back what it did
  not publish, and an evictor subtracts what it actually unlinked (having marked its victims'
  bytes in its slot of the table below first). A writer killed in between leaves an
  over-count (the safe direction), which a later scan corrects (below).
* ``refused`` and ``refused_at`` - pages refused for lack of space, and when, so that
  ``hicache inspect`` (another process) can say that writes are being refused and why;
* ``seq`` - how many changes were made;
* a table of in-flight reservations, one slot per writing process (machine and start time,
  pid, bytes; the start time tells a reused pid's new process from the dead one), and one per
  observing process (its corrupt pages' removals, :func:`mark`; apart from its writer slot):
  whoever next takes the lock gives back the reservations of processes of this machine that
  are gone (killed between reserving and settling: the OOM killer, a SIGKILL; or between an
  eviction's unlinks, or a read's removal of a corrupt page, and its subtraction: the removed
  bytes are marked there first). Without it a
  killed writer's bytes stayed counted for as long as any other process kept the namespace
  open (the scan's correction below needs the namespace to itself), so each kill shrank
  ``max_bytes`` for good: a 4 MiB store refused a 1 MiB write with nothing on disk.

Correcting the count: a scan measures the pages on disk, but a write reserved before the scan
and published during it may be missed by the scan, so a measured total replaces ``used`` only
when nothing can have been in flight: this process had no write in flight when the scan began,
no other process had the namespace open at its start or its end (each open store holds a
shared ``flock`` on the ``users`` file; :meth:`UsageLedger.alone` tries for an exclusive one,
under the ledger's lock: see there),
and ``seq`` did not move in between (nobody changed anything). Killed writers' reservations
are exactly what such a scan removes, slots included: those of writers on another machine or
in another PID namespace, which no process here may judge dead, go only then.

A clear renames the namespace folder away, and with it the ledger; the next operation notices
that the path now names another file and reopens it, and a delta reserved against the old file
is dropped (:class:`Token`). A ledger found cut short, overwritten or deleted (by hand, a
repair after a crash) reads as zeros: the call says so (:attr:`Usage.lost`), and its store
indexes the namespace again, its scan's floor counting the pages on disk back. Every call
here blocks (``flock``) and runs on executor threads. Any OS error makes the ledger
*unavailable* for that call (``None``): the store then falls back to its own count, and a
full disk never breaks the store.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache_backends.file.locks import SharedFile, flock_within
from hicache_backends.writers import MACHINE, pid_alive

__all__ = ["LEDGER_NAME", "USERS_NAME", "Usage", "UsageLedger", "give_back", "mark", "read_usage"]

logger = logging.getLogger("hicache.storage.file")

LEDGER_NAME = "usage"
USERS_NAME = "users"
_FORMAT = struct.Struct("<8sqqdq")  # magic, used bytes, refused pages, last refusal, changes
_MAGIC = b"HKVUSE01"
_SLOT = struct.Struct("<qqq")  # owner (see _owner), pid, bytes reserved and not settled (0: a free slot)
_SLOTS = 128  # writers at once that can be tracked; more are counted, only not reclaimable
_SIZE = _FORMAT.size + _SLOTS * _SLOT.size
_TABLE = struct.Struct("<" + "qqq" * _SLOTS)  # the whole table at once (same bytes as _SLOT each)


@dataclass(frozen=True, slots=True)
class Usage:
    """One reading of the ledger; ``token`` names the ledger file it came from."""

    used: int
    refused: int
    refused_at: float
    seq: int  # changes so far: equal before and after a scan means nobody changed anything
    token: int
    #: bytes of dead writers' reservations this call gave back: some of them may be pages
    #: the writer published before it died, so the caller re-indexes the namespace, and its
    #: scan raises the count to what is on disk (:meth:`UsageLedger.add`'s ``floor``)
    reclaimed: int = 0
    #: bytes every process reserved and has not settled (the reservation table's sum, in
    #: ``used``): writes in flight, each of which makes its own room before it writes
    inflight: int = 0
    #: this call found the counters it had read before gone (the file cut short, overwritten
    #: or deleted: by hand, a repair after a crash) and started them afresh, the pages on
    #: disk left out: the caller re-indexes the namespace, as after a reclaim
    lost: bool = False


def _decode(raw: bytes) -> tuple[int, int, float, int]:
    if len(raw) != _FORMAT.size:
        return 0, 0, 0.0, 0
    magic, used, refused, refused_at, seq = _FORMAT.unpack(raw)
    if magic != _MAGIC:
        return 0, 0, 0.0, 0
    return max(0, used), max(0, refused), refused_at, seq


def _lost(raw: bytes, first: bool) -> bool:
    """Whether the counters read as ``raw`` are gone: cut short or overwritten (read as
    zeros), or, unless the file is ``first`` opened in its folder, empty (it was deleted and
    made anew). Every ledger call leaves the whole ledger written, so only a hand or a repair
    after a crash does that; a file opened the first time may be empty still (its creator
    writes it in its first call)."""
    if raw[: len(_MAGIC)] == _MAGIC and len(raw) >= _FORMAT.size:
        return False
    return bool(raw) or not first


def _decode_slots(raw: bytes) -> list[int]:
    """The reservation table after the counters, flat: slot ``i`` is ``[3i, 3i + 3)``
    (owner, pid, bytes); empty slots for a file written before it. One ``unpack`` of the
    whole table: every write batch reads it twice (reserve, settle), and a call and a list per
    slot made most of a ledger call's ~50 us."""
    table = raw[_FORMAT.size : _SIZE]
    if len(table) != _TABLE.size:
        return [0] * (3 * _SLOTS)
    return list(_TABLE.unpack(table))


def _encode_slots(slots: list[int]) -> bytes:
    return _TABLE.pack(*slots)


def _taken(slots: list[int]) -> list[int]:
    """Where the slots in use start (bytes held: a free slot is all zeros)."""
    return [i for i in range(0, len(slots), 3) if slots[i + 2]]


_LOW = 0xFFFFFFFF
_owners: dict[int, int] = {}  # pid -> this process's owner (a fork child has its own)
#: how long a live slot's start time, once found to match, is taken on trust: reading it costs
#: ~15 us, for each slot of each ledger call (a writer's batch makes one or two); a pid reused
#: within that time is found on the next reading
_TRUST_SECONDS = 1.0
#: Linux's PID_MAX_LIMIT: no process has a pid outside ``1.._PID_LIMIT``; a slot naming one is
#: damage (``os.kill`` raises ``OverflowError``, no ``OSError``, for one beyond a C int, and
#: takes 0 and negative pids for process groups)
_PID_LIMIT = 1 << 22
_matched: dict[tuple[int, int], float] = {}  # (owner, pid) -> when its start time last matched
#: set in the pid field of an observer's slot (:func:`mark`): a process may hold a writer's
#: slot and an observer's at once (a server that runs ``hicache inspect`` in process, a test),
#: and one slot shared by both had each side's settlement move the other's bytes
_OBSERVING = 1 << 32


def _started(pid: int) -> int | None:
    """When process ``pid`` of this machine started (clock ticks since boot: the 22nd field
    of ``/proc/<pid>/stat``, after the parenthesised name), or ``None`` if it cannot be read
    (gone, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner() -> int:
    """Whose slot is this process's: :data:`MACHINE`'s low 32 bits (this machine and PID
    namespace) under the low 32 bits of the process's start time. A pid alone named a dead
    writer's slot and the next process to get its pid too: that process was judged to be the
    writer, alive, for as long as it lived, and took the slot as its own, so the writer's
    bytes stayed counted until it exited. Just :data:`MACHINE` (an older version's form: by
    the pid alone) where the start time cannot be read."""
    pid = os.getpid()
    owner = _owners.get(pid)
    if owner is None:
        started = _started(pid)
        owner = MACHINE if started is None else ((started & _LOW) << 32 | (MACHINE & _LOW))
        owner = owner - (1 << 64) if owner >= 1 << 63 else owner  # a signed 64-bit field
        _owners[pid] = owner
    return owner


def _gone(owner: int, pid: int) -> bool:
    """Whether the slot of ``owner`` and ``pid`` is a dead process's: only one of this
    machine can be (another machine or PID namespace has pids of its own); its pid runs no
    process, or one started at another time (reused), or it is this process's pid but not
    its slot."""
    if owner != MACHINE and (owner ^ MACHINE) & _LOW:
        return False  # another machine or PID namespace: never judged here
    pid &= ~_OBSERVING  # an observer's slot: judged by its process as a writer's is
    if not 0 < pid <= _PID_LIMIT:
        return True  # no process's: a damaged slot (judged alive, or raising, it stayed for good)
    if pid == os.getpid():
        return owner != _owner()
    if not pid_alive(pid):
        return True
    if owner == MACHINE:  # no start time in it: judged by the pid alone
        return False
    now = time.monotonic()
    if now - _matched.get((owner, pid), -_TRUST_SECONDS) < _TRUST_SECONDS:
        return False
    started = _started(pid)
    if started is not None and (started & _LOW) != (owner >> 32) & _LOW:
        _matched.pop((owner, pid), None)
        return True
    if len(_matched) >= 4 * _SLOTS:  # slots long gone
        _matched.clear()
    _matched[(owner, pid)] = now
    return False


def _held_here(slots: list[int]) -> bool:
    """Whether a slot in use is a live process's of this machine: a removal in flight (an
    observer's, which no ``users`` lock shows) whose page a lone scan may have found gone, its
    bytes then given back a second time once the scan's measure replaced the count."""
    return any((owner == MACHINE or not (owner ^ MACHINE) & _LOW) and not _gone(owner, pid)
               for owner, pid in (slots[i : i + 2] for i in _taken(slots)))


def _reclaim(slots: list[int]) -> int:
    """Free the slots of this machine's dead processes; returns the bytes they held (none
    below zero, which only a damaged slot holds: given back, they raised the count)."""
    freed = 0
    for i in _taken(slots):
        owner, pid, held = slots[i : i + 3]
        if _gone(owner, pid):
            freed += max(0, held)
            slots[i : i + 3] = (0, 0, 0)
    return freed


def _move_own(slots: list[int], amount: int, role: int = 0) -> None:
    """Add ``amount`` to this process's slot (taken when needed, freed at zero); ``role``
    :data:`_OBSERVING` for its observer's slot. With every slot taken the bytes are still
    counted in ``used``, only not given back on a death."""
    pid, owner = os.getpid() | role, _owner()
    own = next((i for i in _taken(slots) if slots[i] == owner and slots[i + 1] == pid), None)
    if own is None:
        if amount <= 0:
            return
        own = next((i for i in range(0, len(slots), 3) if not slots[i + 2]), None)
        if own is None:
            return
        slots[own : own + 3] = (owner, pid, 0)
    slots[own + 2] = max(0, slots[own + 2] + amount)
    if not slots[own + 2]:
        slots[own : own + 3] = (0, 0, 0)


def read_usage(path: str) -> Usage | None:
    """The ledger at ``path`` without locking or creating it (for ``hicache inspect``), its
    ``inflight`` the reservation table's sum: ``used`` holds the writes in flight too, and an
    observer that reported it as stored showed a namespace fuller than its pages."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        raw = os.pread(fd, _SIZE, 0)
        slots = _decode_slots(raw)
        inflight = sum(slots[i + 2] for i in _taken(slots))
        return Usage(*_decode(raw[: _FORMAT.size]), token=st.st_ino, inflight=max(0, inflight))
    except OSError:
        return None
    finally:
        os.close(fd)


def give_back(path: str, nbytes: int, token: int, release: int = 0) -> bool | None:
    """Subtract ``nbytes`` of pages an observer removed (a corrupt page ``hicache inspect``'s
    verification dropped) from the ledger at ``path``, if it is still the file ``token`` names
    (a clear since replaced it: the fresh namespace never counted that page), and free the
    ``release`` bytes its slot marked for them (:func:`mark`). An observer keeps out of the
    ledger (see ``FileStorage``'s ``read_only``): this neither creates it nor joins its
    ``users`` lock nor reclaims dead writers' slots; only the counters and its own slot change.
    Whether it was applied; ``None`` when the ledger could not be used (lock held too long)."""
    return _observer_change(path, token, -nbytes, -release)


def mark(path: str, nbytes: int, token: int) -> bool | None:
    """Mark ``nbytes`` of a page an observer is about to remove in its process's observer slot
    (never its writer slot, see :data:`_OBSERVING`) of the ledger at ``path``, if still the
    file ``token`` names, as a writer marks a corrupt page before its unlink: an observer
    killed between the unlink and its :func:`give_back` left the bytes counted for as long as
    any writer kept the namespace open; its dead slot now has the next writer to take the
    lock give them back. What :func:`give_back` answers."""
    return _observer_change(path, token, 0, nbytes)


def _observer_change(path: str, token: int, delta: int, own: int) -> bool | None:
    """Add ``delta`` to ``used`` and ``own`` to this process's observer slot in the ledger at
    ``path`` without creating or joining it (:func:`give_back`, :func:`mark`)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != token:
            return False
        flock_within(fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, _SIZE, 0)
            if len(raw) < _FORMAT.size or raw[: len(_MAGIC)] != _MAGIC:
                return False
            used, nref, at, seq = _decode(raw[: _FORMAT.size])
            out = _FORMAT.pack(_MAGIC, max(0, used + delta), nref, at, seq + 1)
            if own:
                slots = _decode_slots(raw)
                _move_own(slots, own, _OBSERVING)
                out += _encode_slots(slots)
            os.pwrite(fd, out, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


class UsageLedger:
    """The shared counters of one namespace (see the module docstring). Thread-safe."""

    def __init__(self, ns_dir: str) -> None:
        self.path = os.path.join(ns_dir, LEDGER_NAME)
        self._lock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._counters = SharedFile(self.path)
        self._users = SharedFile(os.path.join(ns_dir, USERS_NAME))
        self._warned = False
        self._closed = False
        self._pid = os.getpid()  # the process whose mutex and descriptors these are
        self._folder = 0  # the namespace folder's inode when the ledger file was last opened
        #: the ledger file whose counters ``add`` read last (its inode; 0: none yet). Whether a
        #: file is new to this ledger is asked of it, not of ``current()``: ``alone`` opens the
        #: file too, and one it opened first (a peer's clear's fresh folder, no ledger in it
        #: yet) was taken for a file read before and since emptied (a lost count)
        self._read_ino = 0

    def add(
        self, delta: int, *, refused: int = 0, token: int | None = None, if_seq: int | None = None,
        inflight: int = 0, floor: int | Callable[[int, int], int] | None = None,
    ) -> Usage | None:
        """Add ``delta`` bytes (and ``refused`` pages) atomically; the new totals, or ``None``
        when the ledger cannot be used. With ``token``, a delta meant for a ledger file that has
        since been replaced (a clear) is not applied; the current totals are still returned.
        With ``if_seq``, the delta is applied only if nobody changed the ledger since the
        reading that had that ``seq`` (a scan's correction, see the module docstring) and no
        live process of this machine holds a slot, and the reservation table is then emptied
        (only a scan of the namespace alone passes it).
        ``inflight``: bytes this process starts (> 0, with its reservation) or stops (< 0, when
        it settles) having reserved and not settled; given back for it if it dies between.
        ``floor``: bytes a scan found on disk; the count is raised to it if below (never
        lowered: always safe, whoever else is writing, since every page on disk is counted
        unless a dead writer's reclaimed reservation took it along). A callable ``floor`` is
        evaluated under the lock, given the count there and ``seq`` as it stands (a change this
        call made first, a reclaim, counted): what is on disk once every removal subtracted so
        far is in. A removal is subtracted after its unlink, so pages looked at after a reading
        with that same ``seq`` are all still counted; only otherwise, and only when that would
        raise the count, need it look at them again."""
        with self._own():
            try:
                if not self._closed:
                    self._join()
                fd, _ = self._counters.current()
                had, ino = self._read_ino, self._counters.ino
                fresh = had != ino  # a file this ledger has not read yet
                flock_within(fd, fcntl.LOCK_EX)
                try:
                    raw = os.pread(fd, _SIZE, 0)
                    self._read_ino = ino
                    used, nref, at, seq = _decode(raw[: _FORMAT.size])
                    lost = _lost(raw, fresh and not self._made_anew(had))
                    if lost:
                        logger.warning("file store: usage ledger %s was cut short, overwritten or deleted; "
                                       "counting the namespace's pages again", self.path)
                    slots = _decode_slots(raw)
                    changed = len(raw) != _SIZE
                    applies = token is None or token == self._counters.ino
                    lone = applies and if_seq == seq and not _held_here(slots)
                    if delta and applies and (if_seq is None or lone):
                        used, changed = max(0, used + delta), True
                    if lone and any(slots[2::3]):
                        # a lone scan's correction: nothing is in flight, so a slot left is a
                        # dead writer's that nobody here may judge (another machine or PID
                        # namespace); kept, its bytes passed for a write in flight for good
                        slots, changed = [0] * len(slots), True
                    reclaimed = _reclaim(slots)
                    if reclaimed:
                        used, changed = max(0, used - reclaimed), True
                        logger.warning("file store: %d byte(s) reserved by writers that died were given back", reclaimed)
                    if inflight and applies:
                        _move_own(slots, inflight)
                        changed = True
                    if floor is not None and applies:
                        least = floor(used, seq + 1 if changed else seq) if callable(floor) else floor
                        if used < least:
                            used, changed = least, True
                    if refused:
                        nref, at, changed = nref + refused, time.time(), True
                    if changed:
                        seq += 1
                        os.pwrite(fd, _FORMAT.pack(_MAGIC, used, nref, at, seq) + _encode_slots(slots), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                self._warned = False
                return Usage(used, nref, at, seq, self._counters.ino, reclaimed, sum(slots[2::3]), lost)
            except OSError as exc:  # TimeoutError included
                self._counters.close()
                if not self._warned:
                    self._warned = True
                    logger.warning("file store: usage ledger %s unavailable (%s); counting this process only", self.path, exc)
                return None
            finally:
                if self._closed:  # a call left running by a close cut short: see close
                    self._counters.close()

    def read(self) -> Usage | None:
        """The current totals (a locked read)."""
        return self.add(0, token=-1)

    def alone(self) -> bool:
        """Whether no other process has this namespace open right now (never blocks long:
        the ledger's lock is waited for as any call waits, the exclusive lock only tried, and
        given back at once).

        The exclusive lock is tried under the ledger's lock: the kernel converts a ``flock``
        by dropping the held one first, and a conversion refused (a peer is open) leaves none
        until it is taken again. Without the ledger's lock, a peer asking in that moment found
        the namespace to itself, and its scan replaced the count while this process had a write
        in flight (an under-count). Now every process that lets go of its shared lock while it
        still has the namespace open does so holding the ledger's lock, which the asker holds."""
        with self._own():
            if self._closed:
                return False
            try:
                fd = self._join()
                counters, _ = self._counters.current()
                flock_within(counters, fcntl.LOCK_EX)
            except OSError:  # not known (a peer frozen holding the ledger's lock): not alone
                return False
            try:
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
            finally:
                fcntl.flock(counters, fcntl.LOCK_UN)

    def close(self) -> None:
        """Let go of the files, the ``users`` lock with them, for good: a call still running
        (a settlement on an I/O thread a close cut short, see ``FileStorage``) is applied
        without joining and lets go of them again. Joined anew, it held the ``users`` lock for
        the life of the process, and no later store of the namespace found it to itself."""
        with self._own():
            self._closed = True
            self._counters.close()
            self._users.close()

    def _made_anew(self, had: int) -> bool:
        """(A ledger file ``add`` has not read yet.) Whether it replaced the one read before
        (``had``) in the same folder: deleted and created again, not gone with its folder (a
        clear renames the folder away, and the fresh folder's ledger is empty as it should be)."""
        try:
            folder = os.stat(os.path.dirname(self.path)).st_ino
        except OSError:
            folder = 0
        same, self._folder = bool(had) and folder == self._folder, folder
        return same

    def _own(self) -> threading.Lock:
        """This process's mutex, and its files: a child forked from a process with the ledger
        open takes a mutex and opens the files of its own (the inherited descriptors are left
        to the parent, as the removal journal leaves its lock file). Sharing the parent's, its
        ``flock`` did not exclude the parent (one open file's sharers are not excluded), so a
        change of each could be lost; and a child forked while a thread of the parent was in
        a ledger call waited for the parent's mutex forever (only the forking thread lives on
        in a child)."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._counters = SharedFile(self._counters.path)
            self._users = SharedFile(self._users.path)
            self._pid = os.getpid()
        return self._lock

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
