"""Planning and executing page copies between two pools' unit views.

The plan (:func:`make_plan`) serves every path. On CPU the engine copies through the native
span copier (:mod:`hicache.memory.spans`) where it is built; the copy functions here are the
CUDA path and the CPU fallback without it.

Both pools expose *unit views*: byte tensors whose dim 0 is the unit (a page, or a state slot)
and whose remaining dims match on both sides (``(C, L, page_bytes)`` for KV). A transfer is a
list of (source unit, destination unit) pairs; the plan groups them into *runs* where both sides
are consecutive, and each run is one strided ``copy_`` covering every layer at once.

Why runs and not ``index_select``/``index_copy_`` everywhere: measured on CPU (torch 2.13, bf16
Llama-8B geometry, 64-token pages) a run copy moves 12-17 GB/s, the same as a contiguous
``copy_``, while index ops on the same bytes reach 0.5-2.6 GB/s (they materialise a temporary
and copy element-wise through strided views). Index ops win only when runs are tiny (a few KiB
per copy: page size 1, small models), so they are used exactly then. On CUDA the device side is
gathered/scattered with index ops (fast in device memory) and the host side is copied run by run.

CPU runs averaging under ``NUMPY_RUN_MAX_BYTES`` (scattered layer-wise loads: one 256 KiB
page-layer per run) are copied by the engine with ``np.copyto`` on numpy views of the same
memory: same bytes, GIL released likewise, but ~1 us per call instead of ``Tensor.copy_``'s
TensorIterator set-up, which dominated those loads (paired with a contiguous torch copy on a
2-core box: 0.46-0.79x with ``copy_``, 0.59-0.99x with ``np.copyto``). Bigger runs keep
``copy_``, whose intra-op threads win there. Splitting a step over two Python threads (per layer
or pipelined across layers) was measured too and did not help layer-wise loads on 2 cores.
Where a backup moves scattered whole pages (8 MiB each, strided per layer), splitting *does*
help: the engine copies them page by page with ``np.copyto`` on two threads at once
(``prefers_unitwise_split``; 0.67-0.75x -> 0.93-1.04x of a contiguous copy on a 2-core box,
against 0.67x for the same numpy copies on one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from hicache.memory.allocator import AllocatorError, pages_of
from hicache.memory.device import IndexLike

_T = TypeVar("_T")

__all__ = [
    "TransferPlan",
    "make_plan",
    "copy_units",
    "copy_units_cuda",
    "copy_across",
    "widen_pair",
    "numpy_view",
    "prefers_runs",
    "prefers_numpy_runs",
    "prefers_split",
    "prefers_unitwise_split",
    "copy_runs_np",
    "split_runs",
    "RUN_COPY_MIN_BYTES",
    "SPLIT_MIN_BYTES",
    "SPLIT_UNIT_MIN_BYTES",
    "SPLIT_UNIT_MAX_RUN_BYTES",
    "NUMPY_RUN_MAX_BYTES",
]

#: Below this many bytes per run copy (on average), CPU copies switch to index gather/scatter.
RUN_COPY_MIN_BYTES = 8 * 1024  # measured crossover: between 4 and 16 KiB per copy
#: CPU runs averaging fewer bytes than this are copied with ``np.copyto`` (one thread, ~1 us per
#: call) instead of ``Tensor.copy_`` (~10x the per-call cost, but split across torch's intra-op
#: threads, which wins for big runs).
NUMPY_RUN_MAX_BYTES = 1024 * 1024
#: A CPU copy step (a whole backup, or one layer of a load) of at least this many bytes may be
#: split in two halves copied by two threads at once, where the machine has two or more CPUs.
SPLIT_MIN_BYTES = 4 * 1024 * 1024
#: Units of at least this many bytes (a whole page, all layers: a backup) in such a step are
#: copied unit by unit with ``np.copyto``, half of them on a second thread: faster than
#: ``Tensor.copy_`` per run for scattered pages (small runs of 256 KiB page-layers are not
#: split: that measured no better).
SPLIT_UNIT_MIN_BYTES = 1024 * 1024
#: ... but only where runs average fewer bytes than this (scattered pages); long runs keep
#: ``Tensor.copy_`` (one threaded copy per run), which measured faster for them.
SPLIT_UNIT_MAX_RUN_BYTES = 32 * 1024 * 1024
#: Upper bound of the device-side temporary the CUDA path gathers into, per chunk.
CUDA_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TransferPlan:
    """Unit pairs sorted by source unit, and their runs ``(src_start, dst_start, length)``."""

    src_units: np.ndarray
    dst_units: np.ndarray
    runs: np.ndarray
    _run_list: list[tuple[int, int, int]] | None = field(default=None, init=False, repr=False, compare=False)
    _unit_halves: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_units(self) -> int:
        return int(self.src_units.size)

    def memo(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()``, computed once per plan and ``key`` (what a copy derives from the plan and
        reuses for every layer of a load)."""
        try:
            return self._memo[key]
        except KeyError:
            return self._memo.setdefault(key, build())

    def run_list(self) -> list[tuple[int, int, int]]:
        """The runs as Python tuples (cached: a load reuses them for every layer)."""
        runs = self._run_list
        if runs is None:
            runs = [(s, d, k) for s, d, k in self.runs.tolist()]
            object.__setattr__(self, "_run_list", runs)  # frozen dataclass: a write-once cache
        return runs

    def unit_halves(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Every unit pair as its own run ``(s, d, 1)``, in two halves (cached)."""
        halves = self._unit_halves
        if halves is None:
            units = [(s, d, 1) for s, d in zip(self.src_units.tolist(), self.dst_units.tolist())]
            halves = split_runs(units)
            object.__setattr__(self, "_unit_halves", halves)
        return halves


def _runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    n = src.size
    if n == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [n]])
    return np.stack([src[starts], dst[starts], ends - starts], axis=1).astype(np.int64)


def make_plan(
    src_indices: IndexLike,
    src_size: int,
    dst_indices: IndexLike,
    dst_size: int,
    unit: int,
    *,
    src_what: str,
    dst_what: str,
) -> TransferPlan:
    """Validate token indices on both sides (whole units, in range, same count, no destination
    written twice) and group them into runs. Raises ``AllocatorError`` on misuse."""
    su = pages_of(src_indices, unit, src_size, what=src_what)
    du = pages_of(dst_indices, unit, dst_size, what=dst_what)
    if su.size != du.size:
        raise AllocatorError(
            f"{src_what} covers {su.size} pages but {dst_what} covers {du.size}; they must match"
        )
    if du.size > 1:
        sorted_du = np.sort(du)
        if (sorted_du[1:] == sorted_du[:-1]).any():
            raise AllocatorError(f"{dst_what} names a destination page twice")
    if su.size > 1 and (su[1:] < su[:-1]).any():
        order = np.argsort(su, kind="stable")
        su, du = su[order], du[order]
    return TransferPlan(su, du, _runs(su, du))


def _widest_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8) reinterpreted as the widest integer type its strides allow; index kernels
    move one element per step, so 8-byte elements are ~8x faster than bytes."""
    for dtype, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % w == 0 and t.storage_offset() % w == 0 and all(
            s % w == 0 for s in t.stride()[:-1]
        ):
            try:
                return t.view(dtype)
            except RuntimeError:
                continue
    return t


def widen_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two byte views reinterpreted with the widest element type both allow (same bytes).

    Wide elements matter twice: index kernels move one element per step, and torch splits a
    copy across threads by element count, so with 8-byte elements only big copies pay the
    fork/join (which on a busy machine costs more than a 256 KiB copy itself)."""
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        return a, b
    wa, wb = _widest_view(a), _widest_view(b)
    if wa.dtype == wb.dtype:
        return wa, wb
    size = min(wa.element_size(), wb.element_size())
    narrow = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
    return a.view(narrow), b.view(narrow)


def prefers_runs(plan: TransferPlan, bytes_per_unit: int) -> bool:
    """Whether ``plan`` is copied run by run (else by one index gather/scatter)."""
    nruns = plan.runs.shape[0]
    return nruns <= 4 or plan.num_units * bytes_per_unit / nruns >= RUN_COPY_MIN_BYTES


def prefers_numpy_runs(plan: TransferPlan, bytes_per_unit: int) -> bool:
    """Whether a CPU run-by-run copy of ``plan`` should go through ``np.copyto`` (small runs:
    per-call overhead dominates) rather than ``Tensor.copy_`` (big runs)."""
    nruns = plan.runs.shape[0]
    return nruns > 0 and prefers_runs(plan, bytes_per_unit) and (
        plan.num_units * bytes_per_unit / nruns < NUMPY_RUN_MAX_BYTES
    )


def prefers_unitwise_split(plan: TransferPlan, bytes_per_unit: int) -> bool:
    """Whether a split CPU step copies ``plan`` unit by unit with numpy (big units)."""
    nruns = plan.runs.shape[0]
    return (
        bytes_per_unit >= SPLIT_UNIT_MIN_BYTES
        and prefers_split(plan, bytes_per_unit)
        and plan.num_units * bytes_per_unit / nruns < SPLIT_UNIT_MAX_RUN_BYTES
    )


def prefers_split(plan: TransferPlan, bytes_per_unit: int) -> bool:
    """Whether a numpy run copy of ``plan`` (``bytes_per_unit`` over all its segments) is big
    enough to split over two threads."""
    return plan.num_units >= 2 and plan.num_units * bytes_per_unit >= SPLIT_MIN_BYTES


def numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy array sharing ``t``'s memory (CPU tensors of numpy-known dtypes), else ``None``.

    The engine copies CPU runs with ``np.copyto`` on these: it moves the same bytes as
    ``Tensor.copy_`` (and releases the GIL likewise) at a fraction of the per-call cost, which
    dominates when a layer is many 128 KiB pieces (scattered pages)."""
    if t.device.type != "cpu" or t.requires_grad:
        return None
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


def copy_runs_np(segments: list[tuple[np.ndarray, np.ndarray]], runs: list[tuple[int, int, int]]) -> None:
    """``dst[d : d + k] = src[s : s + k]`` for each run ``(s, d, k)`` and each ``(dst, src)``."""
    copyto = np.copyto
    for dst, src in segments:
        for s, d, k in runs:
            if k == 1:
                copyto(dst[d], src[s])
            else:
                copyto(dst[d : d + k], src[s : s + k])


def split_runs(
    runs: list[tuple[int, int, int]],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """``runs`` split into two lists covering ``ceil(n / 2)`` and ``floor(n / 2)`` units (``n``:
    all units); the run straddling the middle is cut in two."""
    total = sum(k for _, _, k in runs)
    want = (total + 1) // 2
    first: list[tuple[int, int, int]] = []
    second: list[tuple[int, int, int]] = []
    taken = 0
    for s, d, k in runs:
        if taken >= want:
            second.append((s, d, k))
        elif taken + k <= want:
            first.append((s, d, k))
        else:
            a = want - taken
            first.append((s, d, a))
            second.append((s + a, d + a, k - a))
        taken += k
    return first, second


def copy_units(dst: torch.Tensor, src: torch.Tensor, plan: TransferPlan) -> None:
    """Copy units on one device (CPU-CPU, or GPU-GPU): ``dst[d] = src[s]`` for the plan's pairs."""
    n = plan.num_units
    if n == 0:
        return
    runs = plan.runs
    src, dst = widen_pair(src, dst)
    bytes_per_unit = src[0].numel() * src.element_size()
    if prefers_runs(plan, bytes_per_unit):
        for s, d, k in runs.tolist():
            dst[d : d + k].copy_(src[s : s + k])
        return
    s_idx = torch.from_numpy(plan.src_units).to(src.device)
    d_idx = torch.from_numpy(plan.dst_units).to(dst.device)
    dst.index_copy_(0, d_idx, src.index_select(0, s_idx))


def _consecutive_runs(units: np.ndarray) -> list[tuple[int, int, int]]:
    """``(position, first unit, length)`` of maximal runs of consecutive units."""
    if units.size == 0:
        return []
    breaks = np.nonzero(np.diff(units) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [units.size]])
    return [(int(a), int(units[a]), int(b - a)) for a, b in zip(starts, ends)]


def copy_units_cuda(dst: torch.Tensor, src: torch.Tensor, plan: TransferPlan) -> None:
    """Copy between host and a CUDA device, enqueued on the current stream.

    Device side: one ``index_select`` (gather) or ``index_copy_`` (scatter) per chunk, in device
    memory. Host side: one ``copy_(non_blocking=True)`` per run of consecutive host units, which
    is a single DMA when the host run is contiguous (``page_first``). Must be called with the
    copy stream current; temporaries are allocated on, and recycled by, that stream.
    """
    if plan.num_units == 0:
        return
    if src.is_cuda == dst.is_cuda:
        copy_units(dst, src, plan)
        return
    copy_across(dst, src, plan, src_is_device=src.is_cuda)


def copy_across(dst: torch.Tensor, src: torch.Tensor, plan: TransferPlan, *, src_is_device: bool) -> None:
    """The device/host copy of :func:`copy_units_cuda` with the direction given explicitly, so
    its gather/run/scatter logic also runs (and is tested) on CPU tensors."""
    n = plan.num_units
    unit_bytes = src[0].numel() * src.element_size()
    chunk = max(1, CUDA_CHUNK_BYTES // max(1, unit_bytes))
    if src_is_device:  # device -> host: gather on device, then host runs in host order
        order = np.argsort(plan.dst_units, kind="stable")
        s_units, d_units = plan.src_units[order], plan.dst_units[order]
        for a in range(0, n, chunk):
            s_part, d_part = s_units[a : a + chunk], d_units[a : a + chunk]
            tmp = src.index_select(0, torch.from_numpy(s_part).to(src.device, non_blocking=True))
            for pos, first, k in _consecutive_runs(d_part):
                dst[first : first + k].copy_(tmp[pos : pos + k], non_blocking=True)
    else:  # host -> device: host runs into a device temporary, then scatter on device
        s_units, d_units = plan.src_units, plan.dst_units
        for a in range(0, n, chunk):
            s_part, d_part = s_units[a : a + chunk], d_units[a : a + chunk]
            tmp = torch.empty((s_part.size, *src.shape[1:]), dtype=src.dtype, device=dst.device)
            for pos, first, k in _consecutive_runs(s_part):
                tmp[pos : pos + k].copy_(src[first : first + k], non_blocking=True)
            dst.index_copy_(0, torch.from_numpy(d_part).to(dst.device, non_blocking=True), tmp)
