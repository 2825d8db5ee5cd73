"""A page as pieces of host-pool memory, so a backend moves it without a staging copy.

hicache stores every page in one canonical byte order, but an engine's host pool may keep a
page scattered: SGLang's ``layer_first`` pool holds each page as one run per (K/V, layer), its
``page_head`` pool interleaves heads and layers. Gathering such a page into a contiguous
staging page before a write (and scattering it after a read) costs a full extra pass over
the bytes, plus a staging page in main memory.

A pool that can describe a page as :class:`PageSegments` (``page_segments(index)``: the pieces
in canonical order) lets a backend that declares ``supports_segments`` do the I/O piece by
piece instead:

* a contiguous piece is a ``memoryview`` of the pool's memory: it is read into or written
  from directly (``preadv``/``pwritev`` take many of them at once);
* a piece that is strided in the pool (a (K/V, layers) block of a ``page_head`` page) is a
  :class:`StridedPiece`: it goes through a small per-thread bounce buffer that stays in the
  CPU cache, so the reorder costs no extra trip to main memory.

The checksum is computed over the pieces in order (a streaming hash), which gives the digest
of the contiguous page: the bytes on the medium are the same whatever the pool's layout.
Backends without segment support never see a ``PageSegments``: the base class then takes
the staging path (:mod:`hicache.storage.staging`), a gather copy.

Pieces read into the pool before the page is verified: a page that then fails verification
is reported as a miss, and what landed in its host page is not KV anybody may use (the same
contract as a read into a live page view).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BOUNCE_BYTES",
    "RUN_BYTES",
    "PageSegments",
    "StridedPiece",
    "bounce",
    "io_runs",
    "segment_sources",
]

#: Bytes of direct pieces moved by one vector call: enough to amortize the syscall, small
#: enough that the hash pass right after a read (or right before a write) finds the bytes in
#: the CPU's L2 cache.
RUN_BYTES = 512 << 10
#: Largest strided piece a pool should hand out (the bounce buffer's size): L2-resident.
BOUNCE_BYTES = 512 << 10
_IOV_MAX = 512  # well below Linux's 1024 iovecs per call


class StridedPiece:
    """A run of the canonical page that is strided in the pool: a numpy view of it.

    ``view``'s row-major bytes are this piece's payload bytes. It is copied through a
    contiguous bounce buffer with numpy, which copies on the calling thread with the GIL
    released (a torch copy would start its own intra-op threads from every I/O thread and
    oversubscribe the cores).
    """

    __slots__ = ("view", "nbytes")

    def __init__(self, view: np.ndarray) -> None:
        if not isinstance(view, np.ndarray):
            raise TypeError(f"a strided page piece is a numpy view, got {type(view).__name__}")
        self.view = view
        self.nbytes = int(view.nbytes)

    def _typed(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[: self.nbytes].view(self.view.dtype).reshape(self.view.shape)

    def gather(self, buffer: np.ndarray) -> None:
        """Copy the piece into the first ``nbytes`` of ``buffer`` (uint8, contiguous)."""
        np.copyto(self._typed(buffer), self.view)

    def scatter(self, buffer: np.ndarray) -> None:
        """Copy the first ``nbytes`` of ``buffer`` into the pool."""
        np.copyto(self.view, self._typed(buffer))

    def __repr__(self) -> str:
        return f"StridedPiece({self.view.shape}, {self.view.dtype}, {self.nbytes} B)"


Piece = memoryview | StridedPiece


class PageSegments:
    """One page as pieces of pool memory in payload order; ``len()`` is the payload size.

    Pieces are byte ``memoryview`` objects (contiguous pool memory) or :class:`StridedPiece`.
    """

    __slots__ = ("pieces", "nbytes")

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces: tuple[Piece, ...] = tuple(pieces)
        total = 0
        for p in self.pieces:
            if isinstance(p, memoryview):
                if p.format != "B" or p.ndim != 1:
                    raise ValueError("a direct page piece must be a 1-D byte memoryview")
                total += len(p)
            elif isinstance(p, StridedPiece):
                total += p.nbytes
            else:
                raise TypeError(f"a page piece is a memoryview or a StridedPiece, got {type(p).__name__}")
        self.nbytes = total

    def __len__(self) -> int:
        return self.nbytes

    def gather_bytes(self) -> bytearray:
        """The page as one contiguous copy (for a caller that cannot take pieces)."""
        out = bytearray(self.nbytes)
        view = memoryview(out)
        offset = 0
        for p in self.pieces:
            if isinstance(p, memoryview):
                view[offset : offset + len(p)] = p
                offset += len(p)
            else:
                p.gather(np.frombuffer(view[offset : offset + p.nbytes], dtype=np.uint8))
                offset += p.nbytes
        return out

    def scatter_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Store a contiguous page (exactly ``nbytes``) into the pieces."""
        src = memoryview(data).cast("B")
        if len(src) != self.nbytes:
            raise ValueError(f"page has {len(src)} bytes, expected {self.nbytes}")
        offset = 0
        for p in self.pieces:
            if isinstance(p, memoryview):
                p[:] = src[offset : offset + len(p)]
                offset += len(p)
            else:
                p.scatter(np.frombuffer(src[offset : offset + p.nbytes], dtype=np.uint8))
                offset += p.nbytes

    def __repr__(self) -> str:
        direct = sum(isinstance(p, memoryview) for p in self.pieces)
        return f"PageSegments({self.nbytes} B, {direct} direct + {len(self.pieces) - direct} strided pieces)"


def io_runs(segments: PageSegments, run_bytes: int = RUN_BYTES) -> Iterator[list[memoryview] | StridedPiece]:
    """The pieces grouped for I/O, in order: lists of consecutive direct pieces (at most
    ``run_bytes`` together unless one piece is larger, at most a safe iovec count), and each
    strided piece on its own."""
    run: list[memoryview] = []
    size = 0
    for p in segments.pieces:
        if isinstance(p, memoryview):
            if run and (size + len(p) > run_bytes or len(run) >= _IOV_MAX):
                yield run
                run, size = [], 0
            run.append(p)
            size += len(p)
        else:
            if run:
                yield run
                run, size = [], 0
            yield p
    if run:
        yield run


_local = threading.local()


def bounce(nbytes: int) -> tuple[np.ndarray, memoryview]:
    """This thread's bounce buffer, at least ``nbytes`` long, as a uint8 array and a byte view
    of the same memory (first ``nbytes`` bytes). Reused by every call on the thread."""
    have: np.ndarray | None = getattr(_local, "buffer", None)
    if have is None or have.size < nbytes:
        have = np.empty(max(nbytes, BOUNCE_BYTES), dtype=np.uint8)
        _local.buffer = have
        _local.view = memoryview(have).cast("B")
    return have, _local.view[:nbytes]


def segment_sources(pool: Any, starts: Sequence[int]) -> list[PageSegments | None] | None:
    """``pool.page_segments(start)`` for each page (``None`` for an index the pool rejects
    with an error: that page fails), or ``None`` for the whole batch when the pool does not
    describe its pages as segments - it has no such method, or answers ``None`` (or something
    else) for a page it accepts - so that the batch takes the staging path."""
    fn = getattr(pool, "page_segments", None)
    if not callable(fn):
        return None
    out: list[PageSegments | None] = []
    for start in starts:
        try:
            seg = fn(start)
        except Exception:  # noqa: BLE001 - a bad index is a failed page, not a failed batch
            out.append(None)
            continue
        if not isinstance(seg, PageSegments):
            return None
        out.append(seg)
    return out
