"""Unit copies as byte spans, copied by the native span copier (``_spancopy``).

A CPU copy step (one backup, or one layer of a load) is thousands of contiguous pieces: a
scattered 32-page layer-wise load of Llama-8B geometry is 64 pieces of 128 KiB per layer. Python
loops over ``Tensor.copy_`` or ``np.copyto`` pay per call and, worse, copy with ordinary stores
that read every destination line before writing it. :func:`span_pair` describes a (device, host)
pair of unit views once, as a byte offset per unit and per contiguous piece of a unit in each
side's storage; :meth:`SpanPair.table` turns a :class:`~hicache.memory.transfer.TransferPlan`
into one int64 table of ``(dst, src, nbytes)`` rows, and :meth:`SpanPair.copy` hands it to
``copy_spans``, which checks every span against both storages, releases the GIL, and copies with
streaming stores when the step is big (measured on a 2-core box, 256 MiB in 128 KiB pieces:
memcpy 8.9 GB/s, streaming 13.4-14 GB/s, a contiguous two-thread torch copy 12.3-13.4 GB/s).

Pieces are as long as both sides allow: dims that are contiguous on both sides merge, and a run
of consecutive units merges into one span per piece when both sides lay units end to end.

Without the compiled extension (no C compiler at install time) :data:`NATIVE_AVAILABLE` is false
and the engine copies with numpy and torch (:mod:`hicache.memory.transfer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from hicache.memory.transfer import TransferPlan

try:
    from hicache.memory import _spancopy
except ImportError:  # built without a C compiler: the engine uses its numpy/torch path
    _spancopy = None  # type: ignore[assignment]  # the optional native module is not built

__all__ = [
    "NATIVE_AVAILABLE",
    "STREAM_KIND",
    "STREAM_MIN_BYTES",
    "SpanPair",
    "SpanSide",
    "span_pair",
    "split_table",
]

#: Whether the compiled span copier is importable.
NATIVE_AVAILABLE: bool = _spancopy is not None
#: Which streaming stores it uses: ``"avx2"``, ``"sse2"``, or ``"none"`` (plain memcpy).
STREAM_KIND: str = getattr(_spancopy, "STREAM_KIND", "none")
#: Copy steps of at least this many bytes use streaming stores; smaller ones use memcpy and
#: leave the destination in cache, where whoever reads it next is likely to find it.
STREAM_MIN_BYTES = 1024 * 1024
#: Below this many bytes per contiguous piece the span copier is not used (the span table would
#: outweigh the bytes; no pool in this library comes close).
MIN_PIECE_BYTES = 16


def storage_bytes(t: torch.Tensor) -> np.ndarray:
    """All bytes of ``t``'s storage as one writable uint8 numpy array (CPU tensors)."""
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return whole.numpy()


@dataclass(frozen=True, eq=False)
class SpanSide:
    """Where one side's units live: ``buffer[base + unit * unit_stride + pieces[p]]`` starts piece
    ``p`` of ``unit`` (plus ``layer * layer_stride`` for a per-layer copy)."""

    buffer: np.ndarray
    base: int
    unit_stride: int
    pieces: np.ndarray
    layer_stride: int

    @cached_property
    def piece_starts(self) -> np.ndarray:
        """``base + pieces``: where each piece of unit 0 starts (once per side, not per table)."""
        return self.base + self.pieces


@dataclass(frozen=True, eq=False)
class SpanPair:
    """A (device, host) pair of unit views with a common piece size, ready for span copies."""

    device: SpanSide
    host: SpanSide
    piece_bytes: int
    #: whether a unit's piece ends where the next unit's begins, on both sides (a run of units is
    #: then one span per piece)
    runs_merge: bool

    @property
    def unit_bytes(self) -> int:
        return self.piece_bytes * int(self.device.pieces.size)

    def table(self, plan: TransferPlan, *, to_host: bool) -> np.ndarray:
        """The ``(dst, src, nbytes)`` rows of ``plan`` (cached on the plan: a load reuses them for
        every layer, shifted)."""
        return plan.memo((self, to_host), lambda: self._table(plan, to_host))

    def _table(self, plan: TransferPlan, to_host: bool) -> np.ndarray:
        # As few numpy calls as it takes: a copy thread builds one table per backup, and each
        # call on thousands of rows lets go of the GIL and waits to take it back from the loop.
        dst, src = (self.host, self.device) if to_host else (self.device, self.host)
        table: np.ndarray = np.empty((plan.runs.shape[0] if self.runs_merge else plan.num_units, dst.pieces.size, 3), dtype=np.int64)
        if self.runs_merge:
            runs = plan.runs
            s_units, d_units = runs[:, 0], runs[:, 1]
            np.multiply(runs[:, 2, None], self.piece_bytes, out=table[:, :, 2])
        else:
            s_units, d_units = plan.src_units, plan.dst_units
            table[:, :, 2] = self.piece_bytes
        np.add.outer(d_units * dst.unit_stride, dst.piece_starts, out=table[:, :, 0])
        np.add.outer(s_units * src.unit_stride, src.piece_starts, out=table[:, :, 1])
        table = table.reshape(-1, 3)
        table.setflags(write=False)  # cached and shared by every layer (and thread) of a copy
        return table

    def halves(self, plan: TransferPlan, *, to_host: bool) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`table` cut in two tables of (nearly) equal bytes, for two threads (cached)."""
        def build() -> tuple[np.ndarray, np.ndarray]:
            halves = split_table(self.table(plan, to_host=to_host))
            for half in halves:
                half.setflags(write=False)
            return halves

        return plan.memo((self, to_host, "halves"), build)

    def copy(self, plan: TransferPlan, *, to_host: bool, layer: int = 0, half: int | None = None) -> int:
        """Copy ``plan``'s units (one layer of them for a per-layer pair), or only ``half`` 0 or 1
        of their bytes; returns the bytes copied."""
        if _spancopy is None:
            raise RuntimeError("the native span copier is not built (hicache.memory._spancopy)")
        dst, src = (self.host, self.device) if to_host else (self.device, self.host)
        table = self.table(plan, to_host=to_host) if half is None else self.halves(plan, to_host=to_host)[half]
        return _spancopy.copy_spans(
            dst.buffer, src.buffer, table,
            dst_shift=layer * dst.layer_stride, src_shift=layer * src.layer_stride,
            streaming=plan.num_units * self.unit_bytes >= STREAM_MIN_BYTES,
        )


def split_table(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dst, src, nbytes)`` rows split into two tables covering ``ceil(total / 2)`` and
    ``floor(total / 2)`` bytes, in order; the row straddling the middle is cut in two."""
    sizes = table[:, 2]
    total = int(sizes.sum())
    if total == 0:
        return table, table[:0]
    want = (total + 1) // 2
    ends = np.cumsum(sizes)
    i = int(np.searchsorted(ends, want))  # the first row that reaches the middle
    d, s, n = (int(x) for x in table[i])
    take = want - (int(ends[i]) - n)
    head = np.array([[d, s, take]], dtype=np.int64)
    tail = np.array([[d + take, s + take, n - take]], dtype=np.int64)
    first = np.concatenate([table[:i], head])
    second = np.concatenate([tail, table[i + 1 :]]) if n > take else table[i + 1 :]
    return first, second


def _piece_offsets(t: torch.Tensor, dims: list[int]) -> np.ndarray:
    """Byte offsets of every index combination of ``dims`` (C order), relative to index 0."""
    offsets = np.zeros(1, dtype=np.int64)
    for j in dims:
        offsets = np.add.outer(offsets, np.arange(t.shape[j], dtype=np.int64) * t.stride(j)).ravel()
    return offsets


def span_pair(device_view: torch.Tensor, host_view: torch.Tensor, *, layer_dim: int | None = None) -> SpanPair | None:
    """Describe a pair of byte unit views (dim 0: the unit; the other dims equal on both sides)
    for span copies, or ``None`` where the span copier cannot serve it (not built, not CPU, not
    bytes, pieces under :data:`MIN_PIECE_BYTES`, or both views in one storage).

    ``layer_dim``: a dim that a per-layer copy fixes (its stride becomes the layer shift); ``None``
    copies all of it."""
    views = (device_view, host_view)
    if (
        _spancopy is None
        or any(v.device.type != "cpu" or v.dtype != torch.uint8 for v in views)
        or device_view.shape[1:] != host_view.shape[1:]
        or device_view.dim() < 2
        or (layer_dim is not None and not 0 < layer_dim < device_view.dim())
    ):
        return None
    inner = [j for j in range(1, device_view.dim()) if j != layer_dim]
    # merge trailing dims that are contiguous on both sides into the piece; dims of size 1 never
    # move the offset, whatever their stride
    piece = 1
    rest: list[int] = []
    merging = True
    for j in reversed(inner):
        size = device_view.shape[j]
        if size == 1:
            continue
        if merging and all(v.stride(j) == piece for v in views):
            piece *= size
        else:
            merging = False
            rest.insert(0, j)
    if piece < MIN_PIECE_BYTES:
        return None
    buffers = [storage_bytes(v) for v in views]
    if np.may_share_memory(buffers[0], buffers[1]):
        return None  # one storage for both pools: a step split over two threads could race
    sides = [
        SpanSide(
            buffer=buf,
            base=int(v.storage_offset()),
            unit_stride=v.stride(0),
            pieces=_piece_offsets(v, rest),
            layer_stride=v.stride(layer_dim) if layer_dim is not None else 0,
        )
        for v, buf in zip(views, buffers)
    ]
    runs_merge = all(v.stride(0) == piece for v in views)
    return SpanPair(sides[0], sides[1], piece, runs_merge)
