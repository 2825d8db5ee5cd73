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
  :class:`StridedPiece`: it goes through a per-thread bounce buffer of a few MiB that stays in
  the CPU's last-level cache, so the reorder costs no extra trip to main memory. Pieces are
  large on purpose: a piece of many layers covers long runs of the pool (a whole K or V half
  of a 4 MiB page is one sequential region), which a gather reads at main memory's streaming
  rate; 8-layer pieces read 2 KiB of every 8 KiB (``page_head``) and cost a write up to 1.25x
  more CPU (see :data:`BOUNCE_BYTES`). Where the native span copier
  is built and the pool described the piece's runs (:class:`PieceSpans`), the copy into the
  pool uses streaming stores: the host page is not read again by this CPU soon, and skipping
  the read-for-ownership of every destination line makes the scatter 1.4-1.6x faster (a
  read's CPU time in SGLang's ``page_first``/``page_head`` pools, 2 KiB / 256 B runs).

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

try:  # the native span copier (optional: without it strided pieces are copied with numpy)
    from hicache.memory._spancopy import copy_spans as _native_copy_spans

    _copy_spans: Callable[..., int] | None = _native_copy_spans
except ImportError:
    _copy_spans = None

__all__ = [
    "BOUNCE_BYTES",
    "RUN_BYTES",
    "PageSegments",
    "PieceSpans",
    "StridedPiece",
    "bounce",
    "io_runs",
    "row_major_runs",
    "segment_sources",
]

#: Bytes of direct pieces moved by one vector call: enough to amortize the syscall, small
#: enough that the hash pass right after a read (or right before a write) finds the bytes in
#: the CPU's L2 cache.
RUN_BYTES = 512 << 10
#: Largest strided piece a pool should hand out (the bounce buffer's size). Measured through
#: SGLang's controller (24 x 4 MiB pages, 2 cores, two interleaved runs of 9-11 reps): raising it
#: from 512 KiB to 2 MiB (a whole K or V half of such a page) cut a write's CPU by 13-21% and a
#: read's by 3-20% in ``page_first`` and ``page_head``: the gather then reads the pool
#: sequentially. Not larger: with 8 MiB pages (4 MiB halves) a whole-half piece of 4 MiB made a
#: write cost 1.9x the CPU of 2 MiB pieces (4 I/O threads' bounce buffers no longer stay in the
#: last-level cache), while 2 MiB beat 512 KiB there too (set CPU 55 vs 71 ms per 96 MiB).
BOUNCE_BYTES = 2 << 20
_IOV_MAX = 512  # well below Linux's 1024 iovecs per call


#: Shortest contiguous run worth a span-table row (shorter runs: numpy copies the piece).
MIN_SPAN_BYTES = 64


def row_major_runs(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> tuple[int, np.ndarray]:
    """The contiguous runs of a strided view's memory in row-major order: the bytes of one run
    (its trailing dimensions that are contiguous, merged) and each run's byte offset from the
    view's first element, as an int64 array in the view's order."""
    run, k = itemsize, len(shape)
    while k > 0 and (shape[k - 1] == 1 or byte_strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    offsets = np.zeros(1, dtype=np.int64)
    for j in range(k):
        offsets = np.add.outer(offsets, np.arange(shape[j], dtype=np.int64) * byte_strides[j]).ravel()
    return run, offsets


class PieceSpans:
    """A strided piece's contiguous runs as two span tables for the native span copier.

    Built once per piece position of a pool from the piece's view in the first page: every
    page of the pool has the same strides, so a page reuses the tables with a byte shift
    (:class:`StridedPiece` ``shift``). The copier checks every span, shifted, against the pool
    and the bounce buffer before it copies anything: a wrong table or shift raises and copies
    nothing, it can never write outside either buffer.
    """

    __slots__ = ("pool_bytes", "to_pool", "from_pool")

    def __init__(self, pool_bytes: np.ndarray, to_pool: np.ndarray, from_pool: np.ndarray) -> None:
        self.pool_bytes = pool_bytes
        self.to_pool = to_pool  # rows (pool offset, piece offset, bytes), in piece order
        self.from_pool = from_pool  # rows (piece offset, pool offset, bytes), in pool order

    @classmethod
    def of_view(cls, pool_bytes: np.ndarray, view: np.ndarray) -> PieceSpans | None:
        """The tables of ``view`` (a strided view into ``pool_bytes``' memory, whose row-major
        bytes are the piece), or ``None`` where the copier is not built or the runs are too
        short to pay for a table."""
        if _copy_spans is None or pool_bytes.dtype != np.uint8 or pool_bytes.ndim != 1:
            return None
        run, offsets = row_major_runs(view.shape, view.strides, view.itemsize)
        if run < MIN_SPAN_BYTES:
            return None
        base = view.__array_interface__["data"][0] - pool_bytes.__array_interface__["data"][0]
        pool_at = offsets + base
        piece_at = np.arange(len(offsets), dtype=np.int64) * run
        sizes = np.full(len(offsets), run, dtype=np.int64)
        # writes into the pool go in the piece's order (streaming stores, measured best); reads
        # from it in the pool's address order, so main memory is walked sequentially and the
        # scattered side is the cache-resident bounce buffer (page_head gather 1.09x faster)
        to_pool = np.ascontiguousarray(np.stack([pool_at, piece_at, sizes], axis=1))
        order = np.argsort(pool_at, kind="stable")
        from_pool = np.ascontiguousarray(np.stack([piece_at[order], pool_at[order], sizes], axis=1))
        for table in (to_pool, from_pool):
            table.setflags(write=False)
        return cls(pool_bytes, to_pool, from_pool)


class StridedPiece:
    """A run of the canonical page that is strided in the pool: a numpy view of it.

    ``view``'s row-major bytes are this piece's payload bytes. It is copied through a
    contiguous bounce buffer with numpy, which copies on the calling thread with the GIL
    released (a torch copy would start its own intra-op threads from every I/O thread and
    oversubscribe the cores), or, given ``spans`` (the tables of this piece's position in the
    pool's first page) and ``shift`` (this page's byte distance from that one), with the
    native span copier: streaming stores into the pool, plain ones into the bounce buffer.
    """

    __slots__ = ("_view", "_of", "nbytes", "spans", "shift")

    def __init__(self, view: np.ndarray, spans: PieceSpans | None = None, shift: int = 0) -> None:
        if not isinstance(view, np.ndarray):
            raise TypeError(f"a strided page piece is a numpy view, got {type(view).__name__}")
        self._view: np.ndarray | None = view
        self._of: StridedPiece | None = None
        self.nbytes = int(view.nbytes)
        self.spans = spans
        self.shift = int(shift)

    @classmethod
    def of_page(cls, first: StridedPiece, shift: int) -> StridedPiece:
        """The same piece of the page ``shift`` bytes after ``first``'s, where ``first`` has
        span tables: made without a numpy view (the span copier needs only the shift; a view
        is made if anything asks for one). A batch builds a page's pieces in ~1 us this way
        instead of ~5 (slicing, transposing and locating numpy views per page)."""
        if first.spans is None:
            raise ValueError("only a piece with span tables can be shifted to another page")
        piece = cls.__new__(cls)
        piece._view = None
        piece._of = first
        piece.nbytes = first.nbytes
        piece.spans = first.spans
        piece.shift = first.shift + int(shift)
        return piece

    @property
    def view(self) -> np.ndarray:
        """The piece as a (strided) numpy view of the pool's memory."""
        if self._view is None:
            first = self._of
            assert first is not None and first.spans is not None
            v0, pool = first.view, first.spans.pool_bytes
            at = v0.__array_interface__["data"][0] - pool.__array_interface__["data"][0] + self.shift - first.shift
            self._view = np.ndarray(v0.shape, v0.dtype, buffer=pool, offset=at, strides=v0.strides)
        return self._view

    def _typed(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[: self.nbytes].view(self.view.dtype).reshape(self.view.shape)

    def gather(self, buffer: np.ndarray) -> None:
        """Copy the piece into the first ``nbytes`` of ``buffer`` (uint8, contiguous)."""
        spans = self.spans
        if spans is not None and _copy_spans is not None:
            _copy_spans(buffer, spans.pool_bytes, spans.from_pool, src_shift=self.shift)
        else:
            np.copyto(self._typed(buffer), self.view)

    def scatter(self, buffer: np.ndarray) -> None:
        """Copy the first ``nbytes`` of ``buffer`` into the pool."""
        spans = self.spans
        if spans is not None and _copy_spans is not None:
            _copy_spans(spans.pool_bytes, buffer, spans.to_pool, dst_shift=self.shift, streaming=True)
        else:
            np.copyto(self.view, self._typed(buffer))

    def __repr__(self) -> str:
        native = ", native" if self.spans is not None else ""
        return f"StridedPiece({self.view.shape}, {self.view.dtype}, {self.nbytes} B{native})"


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
        _local.view = have.data.cast("B")
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
