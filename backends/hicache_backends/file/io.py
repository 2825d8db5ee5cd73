"""Blocking page I/O for the ``file`` backend. Everything here runs on executor threads.

Functions return facts (what was found, how big, which parent) instead of touching the index:
the index belongs to the event loop thread, which applies the facts.

Reads fetch header, payload and footer with one ``preadv`` whose payload buffer *is* the
destination (the host pool's page when it is contiguous), then verify before saying yes.
Writes checksum the payload on this thread, ``pwritev`` header + payload view + footer to a
temporary file in the page's own folder and publish it by rename (:func:`_publish`): a reader,
or a process restarted after a crash at any instant, sees the old page, the new page or none,
never a torn one. Any failure removes the temporary file.

A page given as :class:`~hicache.storage.segments.PageSegments` (pieces of a host pool page
that is not contiguous) moves piece by piece: runs of direct pieces with one vector call each,
strided pieces through this thread's cache-resident bounce buffer, and each run hashed right
after its read or right before its write, while it is still in the CPU cache. A read checks
the header before it reads any payload into the pool; a write puts the payload first and the
header (which holds the checksum) last, into the same unpublished temporary file.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import itertools
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


from hicache.observability.throttle import Throttle
from hicache.storage.page_format import PageCodec, PageHeader, Verdict, checksum, checksum_stream
from hicache.storage.segments import RUN_BYTES, PageSegments, StridedPiece, bounce, io_runs
from hicache.storage.staging import PoolPage, StagedPage

from hicache_backends.file.layout import (
    FOOTER_LEN,
    ID_LEN,
    PAGE_SUFFIX,
    Footer,
    NamespaceLayout,
    decode_footer,
    encode_footer,
    parse_manifest_tmp_name,
    parse_tmp_name,
)
from hicache_backends.file.locks import create_in_place
from hicache_backends.writers import (
    MACHINE, MACHINE_HEX, STALE_TMP_SECONDS, parse_machine, pid_alive, remove_if_abandoned, tmp_abandoned,
)

__all__ = [
    "Discard",
    "PartialScan",
    "ReadResult",
    "ReadStatus",
    "ScanEntry",
    "WriteResult",
    "clear_namespace",
    "cleared_identities",
    "ensure_subdirs",
    "free_bytes",
    "is_no_space",
    "linked_folder",
    "list_subdirs",
    "missing_files",
    "payload_checksum",
    "prepare_namespace",
    "probe_page",
    "probe_removable",
    "read_page_bytes",
    "read_page_into",
    "read_small_file",
    "remove_files",
    "remove_stale_trash",
    "remove_tree",
    "scan_subdir",
    "write_page",
]

logger = logging.getLogger("hicache.storage.file")

_serial = itertools.count()
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Page paths are hashed, but a symlink planted at one must not redirect a read elsewhere, and a
# FIFO or device planted at one must not block the opening thread forever: O_NONBLOCK makes
# ``open`` of a FIFO return at once (it changes nothing for regular files), and every reader
# checks ``S_ISREG`` on the open fd before reading a byte.
_O_READ = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
#: a page of more pieces than this takes the run-by-run path even when small (one vector call
#: takes at most a few hundred buffers; see ``segments._IOV_MAX``)
_SMALL_PAGE_PIECES = 256
_MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes; anything huge is not ours
_ID_HEX = frozenset("0123456789abcdef")
# The functions tests patch to simulate a full disk (ENOSPC) without a real one.
_pwritev = os.pwritev
_preadv = os.preadv


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such file (never written, evicted or cleared by anyone)
    SIZE_MISMATCH = "size_mismatch"  # a sound page, but not of the size the caller asked for
    CORRUPT = "corrupt"  # failed verification; the file was removed
    ERROR = "error"  # an I/O error (EIO, EACCES...); the file is left alone
    REFUSED = "refused"  # a sound page the host pool refused to take (set_from_flat_data_page)


@dataclass(slots=True)
class ReadResult:
    status: ReadStatus
    size: int = 0  # file size (what capacity counts)
    parent: str | None = None
    mtime: float = 0.0
    reason: str = ""
    payload: bytes | None = None  # only for read_page_bytes
    errno: int | None = None  # of an ERROR, where the OS gave one
    removed: bool = False  # a CORRUPT page file this read removed (not one replaced meanwhile)


@dataclass(slots=True)
class WriteResult:
    ok: bool
    size: int = 0
    skipped: bool = False  # an identical-size page was already there (keys are content hashes)
    errno: int | None = None
    reason: str = ""
    replaced: int = 0  # bytes of the page file this write replaced (the shared usage ledger)
    pool_error: bool = False  # the host pool could not produce the page (nothing was written)
    #: the namespace folder was gone (a cleaner deleted it, or a clear was between its two
    #: steps) and this write created it again, with no manifest and no other page folder
    remade_namespace: bool = False


@dataclass(slots=True)
class ScanEntry:
    pid: str
    size: int
    parent: str | None
    atime: float


# ---------------------------------------------------------------------- full-length vector I/O


def _advance(bufs: list[memoryview], done: int) -> list[memoryview]:
    out: list[memoryview] = []
    for b in bufs:
        if done >= len(b):
            done -= len(b)
            continue
        out.append(b[done:] if done else b)
        done = 0
    return out


def _write_all(fd: int, bufs: Sequence[bytes | memoryview], start: int = 0) -> None:
    """Write all of ``bufs`` at file offset ``start``."""
    views = [memoryview(b).cast("B") if not isinstance(b, memoryview) or b.format != "B" else b for b in bufs]
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        n = _pwritev(fd, views, start + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n
        views = _advance(views, n)


def _read_all(fd: int, bufs: list[memoryview], start: int = 0) -> int:
    """Fill ``bufs`` from file offset ``start``; returns bytes read (less only at end of file)."""
    total = sum(len(v) for v in bufs)
    done = 0
    views = bufs
    while done < total:
        n = _preadv(fd, views, start + done)
        if n <= 0:
            break
        done += n
        views = _advance(views, n)
    return done




def payload_checksum(data: memoryview | bytes | bytearray) -> int:
    """The PageCodec checksum (xxh3_64; the core releases the GIL for large payloads)."""
    return checksum(data)


def _stream_digest(views: Sequence[memoryview]) -> int:
    digest = checksum_stream()
    for v in views:
        digest.update(v)
    return digest.intdigest()


def _as_bytes_view(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


# ---------------------------------------------------------------------- reads


def _open_page(path: str) -> int | ReadResult:
    """An fd for reading a page, or the result that explains why there is none."""
    try:
        return os.open(path, _O_READ)
    except FileNotFoundError:
        return ReadResult(ReadStatus.MISSING)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink where a page belongs: not ours, remove it
            if _inside_root(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            return ReadResult(ReadStatus.CORRUPT, reason="symlink")
        return ReadResult(ReadStatus.ERROR, reason=f"open: {exc}", errno=exc.errno)


def _not_regular(path: str, st: os.stat_result) -> ReadResult:
    """A FIFO, device, socket or folder where a page belongs: not ours, removed, a miss."""
    _remove_stray(path, st)
    return ReadResult(ReadStatus.CORRUPT, reason="not a regular file")


def _inside_root(path: str) -> bool:
    """Whether removing the file at ``path`` stays inside the store: a read that finds a bad
    page removes it, and through a folder swapped for a link while the store runs (see
    :func:`linked_folder`) that removal would delete a file outside the root. Checked only
    on that rare path: a read that finds its page whole removes nothing."""
    linked = linked_folder(path)
    if linked is not None:
        logger.warning("not removing %s: %s is a symbolic link", path, linked)
    return linked is None


def _remove_stray(path: str, st: os.stat_result) -> None:
    try:
        if not stat.S_ISDIR(st.st_mode):
            _discard(path, st)
        elif _inside_root(path):
            os.rmdir(path)  # only an empty one: a folder tree is left for a human
    except OSError as exc:
        logger.warning("could not remove %s (not a regular file): %s", path, exc)


def read_small_file(path: str, limit: int = _MANIFEST_MAX_BYTES) -> bytes | None:
    """The bytes of a small regular file (a manifest), or ``None`` if it is absent, not a
    regular file (a FIFO there must not block us), a symlink, or larger than ``limit``."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.pread(fd, limit + 1, 0)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


#: How a read removes a page that failed verification: called with the page's path, its
#: file's bytes and the removal itself (which answers whether it removed the file: not one
#: replaced since the read opened it), it answers what the removal did. A shared store's
#: marks the bytes in its usage ledger slot first (``SpaceAccountant.discard``).
Discard = Callable[[str, int, Callable[[], bool]], bool]


def _just_remove(path: str, nbytes: int, remove: Callable[[], bool]) -> bool:
    return remove()


def _discard(path: str, st: os.stat_result) -> bool:
    """Remove a corrupt page, unless another writer replaced it since we opened it; whether
    this call removed it (its bytes leave the store's count only then)."""
    if not _inside_root(path):
        return False
    try:
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove corrupt page %s: %s", path, exc)
    return False


def _corrupt(path: str, st: os.stat_result, reason: str, discard: Discard) -> ReadResult:
    removed = discard(path, st.st_size, lambda: _discard(path, st))
    return ReadResult(ReadStatus.CORRUPT, st.st_size, reason=reason, removed=removed)


def _check_header(
    codec: PageCodec, header: bytes | memoryview, key: str, pool: str, expected_len: int | None = None
) -> PageHeader | Verdict:
    """The header parsed once: the :class:`PageHeader` if it is this page's, else why not."""
    parsed = codec.parse(header)
    if parsed is None:
        return Verdict.BAD_HEADER
    verdict = codec.check(parsed, key, pool, expected_len)
    return parsed if verdict is Verdict.OK else verdict


def _verify(codec: PageCodec, header: memoryview, payload: memoryview, key: str, pool: str) -> Verdict:
    """Header (parsed once) and payload (one checksum pass, :func:`payload_checksum`) of a page."""
    parsed = _check_header(codec, header, key, pool, len(payload))
    if isinstance(parsed, Verdict):
        return parsed
    return Verdict.OK if payload_checksum(payload) == parsed.checksum else Verdict.BAD_CHECKSUM


def _small_page_iov(page: PageSegments) -> list[memoryview] | None:
    """A small page's payload as one vector of byte views, its strided pieces gathered into
    this thread's bounce buffer at their offsets (direct pieces stay where they are): a page
    that fits in one I/O run then moves in one ``pwritev``. ``None`` for a page too large for
    one run (its runs go one by one, each hashed while it is in the CPU cache)."""
    if page.nbytes > RUN_BYTES or len(page.pieces) > _SMALL_PAGE_PIECES:
        return None
    strided = sum(p.nbytes for p in page.pieces if isinstance(p, StridedPiece))
    array = view = None
    if strided:
        array, view = bounce(strided)
    iov: list[memoryview] = []
    at = 0
    for p in page.pieces:
        if isinstance(p, memoryview):
            iov.append(p)
        else:
            assert array is not None and view is not None
            p.gather(array[at:])
            iov.append(view[at : at + p.nbytes])
            at += p.nbytes
    return iov


def _read_small(
    fd: int, codec: PageCodec, header: memoryview, page: PageSegments, footer: memoryview, key: str, pool: str
) -> Verdict:
    """A page of one I/O run: header, payload and footer in one ``preadv`` into this thread's
    bounce buffer, checked whole, then copied into the pool's pieces. Nothing reaches the pool
    before the header and the checksum check out."""
    _, view = bounce(page.nbytes)
    want = len(header) + page.nbytes + FOOTER_LEN
    if _read_all(fd, [header, view, footer]) != want:
        return Verdict.WRONG_LENGTH
    verdict = _verify(codec, header, view, key, pool)
    if verdict is Verdict.OK:
        page.scatter_bytes(view)
    return verdict


def _read_segments(
    fd: int, codec: PageCodec, header: memoryview, page: PageSegments, footer: memoryview, key: str, pool: str
) -> Verdict:
    """Read a page of the expected file size into its pieces, hashing as it goes; the header is
    checked first, so a foreign page puts no byte into the pool. A page of one I/O run takes
    one call (:func:`_read_small`)."""
    if page.nbytes <= RUN_BYTES and len(page.pieces) <= _SMALL_PAGE_PIECES:
        return _read_small(fd, codec, header, page, footer, key, pool)
    hlen = len(header)
    if _read_all(fd, [header]) != hlen:
        return Verdict.WRONG_LENGTH
    parsed = _check_header(codec, header, key, pool, page.nbytes)
    if isinstance(parsed, Verdict):
        return parsed
    digest = checksum_stream()
    offset = hlen
    runs = list(io_runs(page))
    last = len(runs) - 1
    for i, run in enumerate(runs):
        tail = [footer] if i == last else []  # the footer comes with the last run: one call less
        if isinstance(run, list):
            n = sum(len(v) for v in run)
            if _read_all(fd, [*run, *tail], offset) != n + len(tail) * FOOTER_LEN:
                return Verdict.WRONG_LENGTH
            for v in run:
                digest.update(v)
        else:
            n = run.nbytes
            array, view = bounce(n)
            if _read_all(fd, [view, *tail], offset) != n + len(tail) * FOOTER_LEN:
                return Verdict.WRONG_LENGTH
            digest.update(view)
            run.scatter(array)
        offset += n
    if not runs and _read_all(fd, [footer], offset) != FOOTER_LEN:
        return Verdict.WRONG_LENGTH
    return Verdict.OK if digest.intdigest() == parsed.checksum else Verdict.BAD_CHECKSUM


def _write_segments(fd: int, codec: PageCodec, key: str, pool: str, page: PageSegments, footer: bytes) -> None:
    """Write a page's pieces after its header's place, then the header and footer; a page of
    one I/O run goes whole, header first, in one call (:func:`_small_page_iov`)."""
    iov = _small_page_iov(page)
    if iov is not None:
        whole = checksum(iov[0]) if len(iov) == 1 else _stream_digest(iov)
        _write_all(fd, [codec.encode(key, pool, page, whole), *iov, footer], 0)
        return
    hlen = codec.header_len(key, pool)
    digest = checksum_stream()
    offset = hlen
    runs = list(io_runs(page))
    last = len(runs) - 1
    for i, run in enumerate(runs):
        tail = [footer] if i == last else []  # the footer goes with the last run: one call less
        if isinstance(run, list):
            for v in run:
                digest.update(v)
            _write_all(fd, [*run, *tail], offset)
            offset += sum(len(v) for v in run)
        else:
            array, view = bounce(run.nbytes)
            run.gather(array)
            digest.update(view)
            _write_all(fd, [view, *tail], offset)
            offset += run.nbytes
    if not runs:
        _write_all(fd, [footer], offset)
    _write_all(fd, [codec.encode(key, pool, page, digest.intdigest())], 0)


def read_page_into(
    path: str, codec: PageCodec, key: str, pool: str, buf: memoryview | PageSegments | StagedPage,
    discard: Discard = _just_remove,
) -> ReadResult:
    """Read and verify one page whose payload must be exactly ``len(buf)`` bytes (a
    :class:`StagedPage`: into a staging page, committed to its pool once verified); a page
    that fails verification is removed through ``discard``."""
    if isinstance(buf, StagedPage):
        return _read_staged(path, codec, key, pool, buf, discard)
    if not isinstance(buf, PageSegments):
        buf = _as_bytes_view(buf)
    fd = _open_page(path)
    if isinstance(fd, ReadResult):
        return fd
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _not_regular(path, st)
        hlen = codec.header_len(key, pool)
        want = hlen + len(buf) + FOOTER_LEN
        if st.st_size != want:
            # Either the caller asked for another size (a miss, the page stays) or the file is
            # damaged. The header alone tells which; the caller's buffer is never touched.
            parsed = _check_header(codec, os.pread(fd, hlen, 0), key, pool)
            if isinstance(parsed, Verdict):
                return _corrupt(path, st, parsed.value, discard)
            if st.st_size == hlen + parsed.payload_len + FOOTER_LEN:
                return ReadResult(ReadStatus.SIZE_MISMATCH, st.st_size, reason="size")
            return _corrupt(path, st, "truncated", discard)
        header = memoryview(bytearray(hlen))
        footer = memoryview(bytearray(FOOTER_LEN))
        if isinstance(buf, PageSegments):
            verdict = _read_segments(fd, codec, header, buf, footer, key, pool)
            if verdict is not Verdict.OK:
                return _corrupt(path, st, verdict.value, discard)
        else:
            got = _read_all(fd, [header, buf, footer])
            if got != want:
                return _corrupt(path, st, "short_read", discard)
            verdict = _verify(codec, header, buf, key, pool)
            if verdict is not Verdict.OK:
                return _corrupt(path, st, verdict.value, discard)
        foot = decode_footer(footer)
        if foot is None:
            return _corrupt(path, st, "bad_footer", discard)
        return ReadResult(ReadStatus.OK, st.st_size, foot.parent, st.st_mtime)
    except OSError as exc:
        return ReadResult(ReadStatus.ERROR, reason=f"read: {exc}")
    finally:
        os.close(fd)


def _read_staged(path: str, codec: PageCodec, key: str, pool: str, page: StagedPage, discard: Discard) -> ReadResult:
    """Read and verify a page into a staging page, then commit it to its pool, on this thread:
    the bytes are still in the CPU cache for the checksum and the pool's copy."""
    stage, view = page.take()
    try:
        result = read_page_into(path, codec, key, pool, view, discard)
        if result.status is ReadStatus.OK and not page.commit(stage):
            return ReadResult(ReadStatus.REFUSED, result.size, result.parent, result.mtime, reason="host pool refused it")
        return result
    finally:
        page.give(stage)


def read_page_bytes(
    path: str, codec: PageCodec, key: str, pool: str, max_bytes: int = 1 << 34, discard: Discard = _just_remove
) -> ReadResult:
    """Read and verify one page of unknown size; ``payload`` holds it on success (a page that
    fails verification is removed through ``discard``)."""
    fd = _open_page(path)
    if isinstance(fd, ReadResult):
        return fd
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _not_regular(path, st)
        hlen = codec.header_len(key, pool)
        plen = st.st_size - hlen - FOOTER_LEN
        if plen < 0 or plen > max_bytes:
            return _corrupt(path, st, "truncated", discard)
        # The header first: a stray or foreign file is rejected before its size is allocated.
        header = memoryview(bytearray(hlen))
        if _read_all(fd, [header]) != hlen:
            return _corrupt(path, st, "short_read", discard)
        parsed = _check_header(codec, header, key, pool, plen)
        if isinstance(parsed, Verdict):
            return _corrupt(path, st, parsed.value, discard)
        payload = bytearray(plen)
        footer = memoryview(bytearray(FOOTER_LEN))
        if _read_all(fd, [memoryview(payload), footer], hlen) != plen + FOOTER_LEN:
            return _corrupt(path, st, "short_read", discard)
        if payload_checksum(payload) != parsed.checksum:
            return _corrupt(path, st, Verdict.BAD_CHECKSUM.value, discard)
        foot = decode_footer(footer)
        if foot is None:
            return _corrupt(path, st, "bad_footer", discard)
        return ReadResult(ReadStatus.OK, st.st_size, foot.parent, st.st_mtime, payload=bytes(payload))
    except OSError as exc:
        return ReadResult(ReadStatus.ERROR, reason=f"read: {exc}")
    finally:
        os.close(fd)


def _read_footer(path: str, size: int) -> Footer | None:
    """A page's footer, or ``None`` when the file cannot be a whole page: shorter than a
    footer, or a footer that does not check out. Pages are published by rename, so such a file
    was torn by a crash before its data reached the disk (zero-length, or zero-filled at its
    full size) or is not ours: it is never reported as present, since a positive ``exists``
    must be readable (its read would be a miss)."""
    raw = _footer_bytes(path, size)
    return decode_footer(raw) if raw else None


def _footer_bytes(path: str, size: int) -> bytes | None:
    """The bytes where a page's footer goes: ``b""`` for a file shorter than a footer, ``None``
    for one that is no regular file any more (swapped for a FIFO since the stat)."""
    if size < FOOTER_LEN:
        return b""
    fd = os.open(path, _O_READ)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, FOOTER_LEN, size - FOOTER_LEN)
    finally:
        os.close(fd)


def probe_page(path: str) -> ReadResult:
    """Whether a page file exists (written by anyone), with its size and parent; no payload read."""
    if not os.access(path, os.F_OK):  # the common miss, without raising an exception
        return ReadResult(ReadStatus.MISSING)
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):  # a FIFO, device, folder or symlink is no page
            _remove_stray(path, st)
            return ReadResult(ReadStatus.MISSING)
        foot = _read_footer(path, st.st_size)
    except FileNotFoundError:
        return ReadResult(ReadStatus.MISSING)
    except OSError as exc:
        return ReadResult(ReadStatus.ERROR, reason=str(exc))
    if foot is None:  # torn: a miss (a read of it would delete it as corrupt)
        return ReadResult(ReadStatus.MISSING)
    return ReadResult(ReadStatus.OK, st.st_size, foot.parent, max(st.st_mtime, st.st_atime))


def probe_removable(path: str) -> int | None:
    """The size of the page file at ``path`` when a delete may remove it: a whole page, as
    :func:`probe_page` finds one, in folders that are no symbolic links (a folder swapped for
    a link leads outside the root: nothing there is ours to delete). ``None`` otherwise."""
    found = probe_page(path)
    if found.status is not ReadStatus.OK or linked_folder(path) is not None:
        return None
    return found.size


# ---------------------------------------------------------------------- writes


def write_page(
    layout: NamespaceLayout,
    codec: PageCodec,
    pid: str,
    key: str,
    pool: str,
    payload: memoryview | PageSegments | PoolPage,
    parent: str | None,
    fsync: bool,
    skip_size: int | None,
) -> WriteResult:
    """Publish one page atomically (see the module docstring). A :class:`PoolPage` is copied
    out of its pool here, after the skip check and right before it is hashed and written."""
    path = layout.path(pid)
    if skip_size is not None:
        try:
            if os.stat(path).st_size == skip_size:
                return WriteResult(True, skip_size, skipped=True)
        except OSError:
            pass
    if isinstance(payload, PoolPage):
        try:
            _, payload = payload.produce()  # the view keeps the copy alive until we return
        except Exception as exc:  # noqa: BLE001 - a page the pool cannot produce fails alone
            return WriteResult(False, reason=f"host pool: {exc}", pool_error=True)
    segments: PageSegments | None = None
    flat: memoryview | None = None
    if isinstance(payload, PageSegments):
        segments = payload
    else:
        flat = _as_bytes_view(payload)
        header = codec.encode(key, pool, flat, payload_checksum(flat))  # the hash pass, off the GIL
    footer = encode_footer(parent)
    size = codec.header_len(key, pool) + len(payload) + FOOTER_LEN
    tmp = layout.tmp_path(pid, next(_serial))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
    linked = linked_folder(path)
    if linked is not None:  # planted: writing through it would leave the root
        return WriteResult(False, reason=f"create: {linked} is a symbolic link, not a folder of the store")
    remade = False
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # folder gone (a concurrent clear, a cleaner): recreate it once
            remade = not os.path.isdir(layout.ns_dir)
            os.makedirs(layout.subdir(pid), exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        return WriteResult(False, errno=exc.errno, reason=f"create: {exc}", remade_namespace=remade)
    try:
        try:
            if segments is not None:
                _write_segments(fd, codec, key, pool, segments, footer)
            else:
                assert flat is not None
                _write_all(fd, [header, flat, footer])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        replaced = _publish(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            return WriteResult(False, errno=exc.errno, reason=f"write: {exc}", remade_namespace=remade)
        raise
    if fsync:
        _fsync_dir(layout.subdir(pid))
    return WriteResult(True, size, replaced=replaced, remade_namespace=remade)


def linked_folder(path: str) -> str | None:
    """The first of a page file's folders inside the root (its hashed folder, ``pages``, the
    namespace folder) that is a symbolic link, or ``None``.

    Why all three, on every write: the open checks the namespace folders once, but a folder
    swapped for a link while the store runs (``mv ns elsewhere; ln -s elsewhere ns``) was
    followed by every later write, which then created page files outside the root. The root
    itself is the user's choice and may be a link. Not remembered for a batch: a folder
    swapped between two pages of one batch would let the later ones out."""
    folder = path
    for _ in range(3):
        folder = os.path.dirname(folder)
        if os.path.islink(folder):
            return folder
    return None


# renameat2(2) (Linux 3.15+, glibc 2.28+), for :func:`_publish`
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_PUBLISH_ATTEMPTS = 8  # a page that comes and goes under every try: published by os.replace


def _load_renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without the wrapper
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def _rename2(src: bytes, dst: bytes, flags: int) -> int:
    """``renameat2`` of ``src`` to ``dst``: 0, or the errno."""
    assert _renameat2 is not None
    return 0 if _renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, flags) == 0 else ctypes.get_errno()


def _publish(tmp: str, path: str) -> int:
    """Rename the finished page ``tmp`` to ``path``; returns the bytes of the page file it
    replaced (0 if none), which the shared ledger takes off the write's count.

    Why not ``stat`` then ``os.replace``: another process may publish or remove the same page
    in between. Two stores writing one page at once (data-parallel servers sharing a prompt
    prefix do it all the time) both found no file there, both counted the page whole, and the
    ledger held it twice for as long as peers kept the namespace open (only a scan alone
    corrects it); a peer's unlink in between had the new page counted nowhere. So the size is
    learnt in the same step as the publish: a no-replace rename says there was no file (the
    page is new), else the rename *exchanges* the two files, and ``tmp`` then holds exactly
    the file replaced - measured, then unlinked. The page's path holds a whole page
    throughout (the old one, then the new one), as with ``os.replace``. A file system or
    kernel without ``renameat2`` and its flags (another OS, NFS, Linux < 3.15) falls back to
    ``stat`` + ``os.replace`` and its window.
    """
    global _renameat2
    if _renameat2 is not None:
        src, dst = os.fsencode(tmp), os.fsencode(path)
        for _ in range(_PUBLISH_ATTEMPTS):
            err = _rename2(src, dst, _RENAME_NOREPLACE)
            if not err:
                return 0
            if err == errno.EEXIST:
                err = _rename2(src, dst, _RENAME_EXCHANGE)
                if not err:
                    return _swapped_out(src, dst, tmp)
                if err == errno.ENOENT:  # the page went meanwhile: a new page after all
                    continue
            if err == errno.ENOSYS:  # the kernel has no renameat2: never ask again
                _renameat2 = None
                break
            if err == errno.EINVAL:  # this file system refuses the flag: os.replace below
                break
            raise OSError(err, os.strerror(err), path)
    replaced = _regular_size(path)
    os.replace(tmp, path)
    return replaced


def _swapped_out(src: bytes, dst: bytes, tmp: str) -> int:
    """After :func:`_publish`'s exchange, ``tmp`` names the file that was at the page's path:
    its size is what the write replaced; it is unlinked. A folder there goes back (a rename
    over a folder fails, and so does this write). Swept meanwhile by a scan (it judged the old
    page's mtime stale), its size is unknown: counted 0, an over-count, the safe direction."""
    replaced = _regular_size(tmp)
    try:
        os.unlink(tmp)
    except IsADirectoryError:
        _rename2(src, dst, _RENAME_EXCHANGE)
        raise
    except FileNotFoundError:
        pass
    except OSError as exc:  # published all the same; a scan sweeps the old file later
        logger.warning("could not remove %s, which a write replaced: %s", tmp, exc)
    return replaced


def _regular_size(path: str) -> int:
    """The size of the regular file at ``path`` (0 if none): what replacing it frees."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_files(paths: Sequence[str], sizes: Sequence[int], warn: Throttle | None = None) -> tuple[int, list[int]]:
    """Unlink each path; returns the bytes (``sizes``) of those this call removed (a file
    gone already - another process evicted it - frees nothing here), and the positions of
    those left in place (an unlink refused: another user's folder; a folder replaced by a
    link): still pages every read finds, which no one may be told are gone.

    Refused unlinks are logged as one line per call, naming the first error, and at most once
    a period of ``warn`` (the store's; this module's own when None): a medium that refuses
    every unlink (remounted read-only) logged a warning per page at every eviction pass."""
    freed = 0
    kept: list[int] = []
    refused: tuple[str, OSError] | None = None
    for i, (p, size) in enumerate(zip(paths, sizes)):
        if not _inside_root(p):  # a folder replaced by a link: not ours to empty
            kept.append(i)
            continue
        try:
            os.unlink(p)
            freed += size
        except FileNotFoundError:
            pass
        except OSError as exc:
            kept.append(i)
            refused = refused or (p, exc)
    if refused is not None:
        count = (warn or _REMOVAL_WARNINGS).due(len(kept))
        if count:
            logger.warning("could not remove %d of %d evicted page(s) (%d since the last warning); they stay "
                           "stored; the first: %r: %s", len(kept), len(paths), count, refused[0], refused[1])
    return freed, kept


def missing_files(paths: Sequence[str], stop: threading.Event | None = None) -> list[int]:
    """The positions of ``paths`` where no file is (one ``lstat`` each); a path that cannot
    be checked counts as present. Gives up early (what was found so far) when ``stop`` is set."""
    out: list[int] = []
    for i, p in enumerate(paths):
        if stop is not None and stop.is_set():
            break
        try:
            os.lstat(p)
        except FileNotFoundError:
            out.append(i)
        except OSError:
            pass
    return out


def published_sizes(paths: Sequence[str]) -> list[int | None]:
    """The size of the regular page file at each path, ``None`` where there is none: which
    writes that raced a ``clear()`` published into the namespace that followed it."""
    out: list[int | None] = []
    for p in paths:
        try:
            st = os.stat(p, follow_symlinks=False)
        except OSError:
            out.append(None)
            continue
        out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
    return out


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ---------------------------------------------------------------------- namespace set-up and scan


def _write_manifest(layout: NamespaceLayout, manifest: dict) -> None:
    text = json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    if read_small_file(layout.manifest_path) == text.encode():
        return
    tmp = layout.manifest_tmp_path(next(_serial))
    try:
        # created in place of whatever is at the name (a pid and a counter: easy to guess and
        # plant a link at), never through it
        with os.fdopen(create_in_place(tmp, os.O_WRONLY | _O_CLOEXEC), "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, layout.manifest_path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_stale_manifest_tmps(layout: NamespaceLayout) -> int:
    """Remove the manifest's temporary files (``manifest.json.<pid>.<n>[.<machine>].tmp``)
    whose writer surely gave up: killed between writing one and renaming it into place. The
    rule of a page's temporary file (:func:`~hicache_backends.writers.tmp_abandoned`): its
    pid dead on this machine and PID namespace, or older than the bound (a name without a
    machine, or another machine's, goes by age alone), so never one a live process is
    writing. Scans visit only the page folders: left, such a file stayed for good. Returns
    how many were removed."""
    try:
        names = os.listdir(layout.ns_dir)
    except OSError:
        return 0
    removed = 0
    for name in names:
        writer = parse_manifest_tmp_name(name)
        if writer is not None and remove_if_abandoned(os.path.join(layout.ns_dir, name), *writer):
            removed += 1
    return removed


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


#: times a namespace is set up again when another process's clear renamed it away meanwhile
_PREPARE_ATTEMPTS = 8
# refused removals of evicted pages, for callers without a throttle of their own (remove_files)
_REMOVAL_WARNINGS = Throttle(60.0)


def prepare_namespace(layout: NamespaceLayout, manifest: dict) -> bool:
    """Create the namespace folder and its manifest (idempotent); ``False`` if the disk is too
    full for them just now (the caller retries once space is reclaimed: a store must open on a
    full disk, or it could never delete the garbage that fills it). Other errors raise.

    The 256 hashed page folders are created by the first write into each: creating them all
    up front costs hundreds of milliseconds on a busy journaling file system.
    """
    for folder in (layout.ns_dir, layout.pages_dir):
        if os.path.islink(folder):
            raise OSError(errno.ELOOP, f"{folder} is a symbolic link; every folder below the store's root must "
                                       "be a real one (pages are never written, nor deleted, outside the root)")
    for attempt in range(_PREPARE_ATTEMPTS):
        try:
            os.makedirs(layout.pages_dir, exist_ok=True)
            _write_manifest(layout, manifest)
        except (FileNotFoundError, FileExistsError):
            # another process's clear renamed the namespace folder away between the two steps,
            # or under makedirs (which then finds the folder it was told exists gone: EEXIST, not
            # a folder): set it up again, as that clear does too
            if attempt + 1 == _PREPARE_ATTEMPTS:
                raise
            continue
        except OSError as exc:
            if is_no_space(exc):
                return False
            raise
        return True
    raise AssertionError("unreachable")


def _replace_link(folder: str) -> None:
    """A hashed page folder found to be a symbolic link (nothing this store makes) is removed
    and made a real folder: only the link goes, never what it points to."""
    logger.warning("%s is a symbolic link; replaced by a real folder (pages stay inside the root)", folder)
    os.unlink(folder)
    os.makedirs(folder, exist_ok=True)


def ensure_subdirs(layout: NamespaceLayout, stop: threading.Event | None = None) -> int:
    """Create the hashed page folders that do not exist yet (in the background, after the scan,
    so that writes find their folder and never pay a ``mkdir``); returns how many were made."""
    made = 0
    if os.path.islink(layout.ns_dir) or os.path.islink(layout.pages_dir):  # swapped for a link while running
        return made
    for d in layout.subdirs:
        if stop is not None and stop.is_set():
            break
        if os.path.islink(d):
            _replace_link(d)
            made += 1
            continue
        if not os.path.isdir(d):
            try:
                os.makedirs(d, exist_ok=True)
            except (FileNotFoundError, FileExistsError):
                # a clear (this process's or another's) renamed the namespace folder away
                # meanwhile; it sets up the fresh one, and writes create their folder when they can
                break
            except OSError as exc:
                if is_no_space(exc):  # a full disk: writes create their folder when they can
                    break
                raise
            made += 1
    return made


def list_subdirs(layout: NamespaceLayout) -> list[str]:
    """The hashed page folders that exist, so a scan visits only those."""
    try:
        names = os.listdir(layout.pages_dir)
    except FileNotFoundError:
        return []
    wanted = {os.path.basename(d) for d in layout.subdirs}
    # a linked folder is not scanned (its files are not the store's; ensure_subdirs replaces it)
    return [p for p in (os.path.join(layout.pages_dir, n) for n in sorted(names) if n in wanted)
            if not os.path.islink(p)]


def clear_namespace(layout: NamespaceLayout, manifest: dict) -> tuple[str | None, bool]:
    """Empty this namespace (and only it) at once; returns the folder left to delete and
    whether the fresh manifest could be written (not on a full disk: retried later, after the
    old files are gone - which is what frees the disk).

    The namespace folder is renamed aside and set up afresh, so the clear is instant for
    every reader, and a write racing with it lands in the doomed folder or the fresh one,
    never half in each. Deleting the old files (slow: minutes for 10^5 files on a busy disk)
    is left to :func:`remove_tree`, which the caller runs in the background.

    The trash is named ``.trash-<digest>-<pid>-<n>-<machine>``: like a temporary file's, its
    pid means something only on its own machine and PID namespace (see
    :func:`remove_stale_trash`); older versions, which read ``<pid>`` and ``<n>`` only, still
    parse it.
    """
    trash = os.path.join(layout.root, f".trash-{layout.digest}-{os.getpid()}-{next(_serial)}-{MACHINE_HEX}")
    try:
        os.rename(layout.ns_dir, trash)
    except FileNotFoundError:
        return None, prepare_namespace(layout, manifest)
    return trash, prepare_namespace(layout, manifest)


def cleared_identities(layout: NamespaceLayout, trash: str, pids: Sequence[str]) -> list[tuple[str, str]] | None:
    """(key, pool) of each page of ``pids``, from its header in ``trash`` (the folder
    :func:`clear_namespace` set aside, not deleted yet); ``None`` at the first one that cannot
    be read: the clear cannot name every page it dropped."""
    out: list[tuple[str, str]] = []
    for pid in pids:
        ident = page_identity(os.path.join(trash, os.path.relpath(layout.path(pid), layout.ns_dir)))
        if ident is None:
            return None
        out.append(ident)
    return out


_removing: set[str] = set()  # trash folders this process is deleting right now
_removing_lock = threading.Lock()


def remove_tree(path: str, stop: threading.Event | None = None) -> bool:
    """Delete a folder tree bottom-up, giving up early when ``stop`` is set; True if all gone.

    Unlike ``shutil.rmtree`` it can be interrupted, so closing a store never waits for the
    deletion of a huge cleared namespace; what is left is finished by the next open.
    """
    if os.path.islink(path) or not os.path.isdir(path):
        # a link (a namespace folder or a trash name planted as one): only the link goes,
        # never what it points to; os.walk would follow it at the top
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove %s: %s", path, exc)
        return not os.path.lexists(path)
    with _removing_lock:
        _removing.add(path)
    try:
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):
            # os.walk lists a symlink to a folder among the folders and never enters it
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            for name in filenames + links:
                if stop is not None and stop.is_set():
                    return False
                try:
                    os.unlink(os.path.join(dirpath, name))
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        return not os.path.lexists(path)
    finally:
        with _removing_lock:
            _removing.discard(path)


def remove_stale_trash(root: str, digest: str, stop: threading.Event | None = None, now: float | None = None) -> int:
    """Finish deletions of cleared namespaces that nobody is doing any more
    (``.trash-<digest>-<pid>-<n>-<machine>`` of a dead process, or an interrupted one of
    ours; see :func:`_trash_abandoned`)."""
    removed = 0
    prefix = f".trash-{digest}-"
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(root, name)
        parts = name[len(prefix) :].split("-")
        if not parts or not parts[0].isdigit():
            continue
        owner = int(parts[0])
        machine = parse_machine(parts[2]) if len(parts) > 2 else None
        with _removing_lock:
            busy = path in _removing
        try:
            if busy or not _trash_abandoned(path, owner, machine, now):
                continue
        except FileNotFoundError:  # its owner finished meanwhile
            continue
        if remove_tree(path, stop):
            removed += 1
    return removed


def _trash_abandoned(path: str, owner: int, machine: int | None, now: float | None) -> bool:
    """Whether nobody is deleting the trash folder at ``path`` of a clear by ``owner`` of
    ``machine`` (``None``: a name from before machines were written in it). The rule of
    temporary files (:func:`~hicache_backends.writers.tmp_abandoned`): the pid is judged only
    on its own machine and PID namespace, anything else goes by age. A clearing server in a
    container is typically pid 1, alive in every other PID namespace: judged by its pid here,
    a close that stopped its deletion left its cleared pages on disk, outside every count
    and bound, for good. An older name is judged both ways: by its pid, as before (a clear
    killed on this machine goes at once), or by age (one from elsewhere still goes); taking
    a live clearer's trash early only shares its deletion. Age: since the rename made it
    trash (``st_ctime``; ``st_mtime`` is the namespace folder's last change of entries,
    maybe long before); ``FileNotFoundError`` when it is gone."""
    if machine == MACHINE or machine is None:
        if owner == os.getpid() or not pid_alive(owner):  # an interrupted one of ours, or its owner died
            return True
    st = os.stat(path, follow_symlinks=False)
    return (time.time() if now is None else now) - max(st.st_mtime, st.st_ctime) > STALE_TMP_SECONDS


class PartialScan(OSError):
    """Some files of a folder could not be read (another user's page this process may not
    open, an I/O error): ``entries`` and ``removed`` are what the rest of the folder gave,
    ``unreadable`` how many were skipped. Raised after the whole folder was looked at, so one
    such file costs only itself, not every page beside it."""

    def __init__(self, entries: list[ScanEntry], removed: int, torn: int, unreadable: int, first: OSError) -> None:
        super().__init__(first.errno, f"{unreadable} file(s) could not be read ({first})")
        self.entries, self.removed, self.torn, self.unreadable = entries, removed, torn, unreadable


def scan_subdir(path: str, stale_tmp_seconds: float, *, remove: bool = True) -> tuple[list[ScanEntry], int, int]:
    """Every page file in one hashed folder, how many dead writers' temp files were removed,
    and how many torn page files were.

    A temporary file is garbage when its writer (pid and machine in the name) is a dead
    process of this machine and PID namespace, or when it is older than ``stale_tmp_seconds``
    (a writer in another container or on another machine sharing the root cannot be judged by
    its pid: its file is only judged by its age).
    A page file torn by a crash (shorter than a footer, or zeros where it should be: pages are
    published whole, by rename, so a crash leaves these and nothing else) is removed: no lookup
    reports it, so no read would ever find and remove it, and a later write of its key counted
    its bytes as replaced though no count held them. A footer that is not ours but not zeros
    (another program's file, another version's format) is left alone. A file that cannot be read is skipped and the rest of
    the folder scanned; the scan then raises :class:`PartialScan` with what it found.
    ``remove=False`` (a read-only store's scan): nothing is removed, only pages listed.
    """
    entries: list[ScanEntry] = []
    removed = torn = 0
    unreadable = 0
    first_error: OSError | None = None
    now = time.time()
    try:
        it = os.scandir(path)
    except FileNotFoundError:
        return entries, removed, torn
    with it:
        for e in it:
            name = e.name
            try:
                if name.endswith(PAGE_SUFFIX):
                    pid = name[: -len(PAGE_SUFFIX)]
                    if len(pid) != 2 * ID_LEN or not set(pid) <= _ID_HEX:
                        continue
                    st = e.stat(follow_symlinks=False)
                    if not e.is_file(follow_symlinks=False):
                        continue
                    raw = _footer_bytes(e.path, st.st_size)
                    foot = decode_footer(raw) if raw else None
                    if foot is None:  # not indexed, so never claimed; removed if torn by a crash
                        if remove and raw is not None and not any(raw) and _discard(e.path, st):
                            torn += 1
                        continue
                    entries.append(ScanEntry(pid, st.st_size, foot.parent, max(st.st_mtime, st.st_atime)))
                else:
                    parsed = parse_tmp_name(name)
                    if parsed is None or not remove:
                        continue
                    if tmp_abandoned(e.path, *parsed, stale_tmp_seconds, now):
                        os.unlink(e.path)
                        removed += 1
            except FileNotFoundError:
                continue  # removed while we looked: someone else's business
            except OSError as exc:  # this file alone (EACCES, EIO): the folder goes on
                unreadable += 1
                first_error = first_error or exc
    if first_error is not None:
        raise PartialScan(entries, removed, torn, unreadable, first_error)
    return entries, removed, torn


# ---------------------------------------------------------------------- introspection (inspect)


def namespace_dirs(root: str) -> list[str]:
    """The namespace digests that have a folder under ``root``, sorted (one ``listdir``)."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [name for name in names if len(name) == 32 and set(name) <= _ID_HEX]


def read_manifests(root: str) -> dict[str, dict | str]:
    """The manifest of every namespace folder under ``root`` by digest, or, for a folder whose
    manifest cannot be read as a JSON object, why not (``hicache inspect`` lists those folders as
    corrupt rather than leaving them out)."""
    out: dict[str, dict | str] = {}
    for name in namespace_dirs(root):
        raw = read_small_file(os.path.join(root, name, "manifest.json"))
        if raw is None:
            out[name] = ("manifest.json is not a regular file, or too large"
                         if os.path.lexists(os.path.join(root, name, "manifest.json"))
                         else "no manifest.json (a full disk defers writing it)")
            continue
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # a UnicodeDecodeError too; nesting too deep
            out[name] = f"manifest.json is not JSON: {type(exc).__name__}: {exc}"
            continue
        out[name] = manifest if isinstance(manifest, dict) else f"manifest.json is not a JSON object ({type(manifest).__name__})"
    return out


def page_identity(path: str) -> tuple[str, str] | None:
    """(key, pool) from a page file's header, without reading its payload."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, 4096, 0)
    finally:
        os.close(fd)
    parsed = PageCodec.parse(head)
    return None if parsed is None else (parsed.key, parsed.pool)


def list_pages(layout: NamespaceLayout) -> list[tuple[str, str, int]]:
    """(key, pool, file size) of every readable page file of a namespace (:func:`survey_pages`)."""
    return survey_pages(layout)[0]


def survey_pages(layout: NamespaceLayout) -> tuple[list[tuple[str, str, int]], int]:
    """(key, pool, file size) of every readable page file of a namespace, and how many page
    files could not be read (torn, a damaged footer or header, an I/O error), from one listing
    of each folder: a page file is either listed or counted unreadable, and one removed while
    we looked (a live writer evicts all the time) is neither. Counted from a second listing,
    a writer's new pages - or its evictions - showed up as unreadable ones. Nothing is removed
    (``hicache inspect`` surveys a read-only store: a torn page is the scans' to sweep)."""
    out: list[tuple[str, str, int]] = []
    unreadable = 0
    for subdir in list_subdirs(layout):
        try:
            with os.scandir(subdir) as it:
                paths = [e.path for e in it if _page_file_name(e.name) and e.is_file(follow_symlinks=False)]
        except OSError:
            continue
        for path in paths:
            try:
                row = _surveyed_page(path)
            except FileNotFoundError:
                continue  # removed since the listing: no page, and no damage
            except OSError:
                row = None
            if row is None:
                unreadable += 1
            else:
                out.append(row)
    return out, unreadable


def _page_file_name(name: str) -> bool:
    """Whether a file name is a page's (what a scan indexes; other files are not pages)."""
    pid = name[: -len(PAGE_SUFFIX)]
    return name.endswith(PAGE_SUFFIX) and len(pid) == 2 * ID_LEN and set(pid) <= _ID_HEX


def _surveyed_page(path: str) -> tuple[str, str, int] | None:
    """(key, pool, size) of one page file whose footer and header read as ours, else ``None``;
    raises ``FileNotFoundError`` for a file gone since it was listed."""
    size = os.stat(path, follow_symlinks=False).st_size
    raw = _footer_bytes(path, size)  # the scan's own check of a footer
    if not raw or decode_footer(raw) is None:
        return None
    fd = os.open(path, _O_READ)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        parsed = PageCodec.parse(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)
    return None if parsed is None else (parsed.key, parsed.pool, size)
