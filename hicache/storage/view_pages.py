"""Storage reads straight into the pages a seed-protocol pool hands out.

A host pool that follows only the seed page protocol (no ``page_view``, no ``page_segments``)
is read through staging: each page lands in a staging page, is verified, then copied into the
pool by ``set_from_flat_data_page``. That second pass over every byte is what held such pools
at 0.8-0.95x a plain ``readinto`` loop (128 x 4 MiB pages on 2 cores).

Yet most such pools already hand out their memory: SGLang's host pools answer
``get_data_page(index, flat=False)`` with a view of ``kv_buffer`` in every layout (only the
flat form is a copy, where the page is not contiguous). A backend that takes
:class:`~hicache.storage.segments.PageSegments` can read into that view's contiguous runs with
one ``preadv`` and skip staging altogether.

A view is used only once the pool has shown, on a page a read was about to overwrite anyway,
that it is the pool's memory and that it is what ``set_from_flat_data_page`` writes:

* two calls for the same page, both alive at once, give the same memory (a fresh copy per
  call would not), on the CPU, of the page's size;
* a random page committed with ``set_from_flat_data_page`` reads back, byte for byte, from the
  view in row-major order - so reading the stored bytes into the view gives exactly the pool
  state that staging plus ``set_from_flat_data_page`` would.

The verdict is kept per pool object (weakly). Every later page must be a view of the same
memory with the same shape and strides, or the batch takes the staging path (and the pool is
probed again). A pool opts out with ``hicache_view_reads = False`` - one whose
``set_from_flat_data_page`` does more than place the bytes (a mirror, a dirty mark) must.

As with any read into pool memory, a page that fails verification leaves unusable bytes in its
host page and is reported as a miss; nobody may use them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.storage.segments import PageSegments

__all__ = ["MIN_RUN_BYTES", "LivePageViews", "runs_of"]

logger = logging.getLogger("hicache.storage")

#: Shortest contiguous run read straight into pool memory: below it a page is many tiny
#: iovecs, and staging (one read, one cache-warm copy) is the better path.
MIN_RUN_BYTES = 4096

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def runs_of(view: torch.Tensor) -> tuple[int, list[int]] | None:
    """The contiguous runs of ``view``'s memory in row-major order: ``(run bytes, byte offsets
    of each run from the view's first element)``, or ``None`` when a run would be shorter than
    :data:`MIN_RUN_BYTES` (or the view has negative or overlapping strides)."""
    shape, strides = list(view.shape), list(view.stride())
    item = view.element_size()
    if any(s < 0 for s in strides) or view.numel() == 0:
        return None
    run, k = item, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] * item == run):
        run *= shape[k - 1]
        k -= 1
    if run < MIN_RUN_BYTES:
        return None
    offsets = np.zeros(1, dtype=np.int64)
    for j in range(k):
        offsets = np.add.outer(offsets, np.arange(shape[j], dtype=np.int64) * strides[j] * item).ravel()
    ends = np.sort(offsets)
    if len(ends) > 1 and (np.diff(ends) < run).any():
        return None  # runs that overlap: not one page's bytes each stored once
    return run, offsets.tolist()


@dataclass(frozen=True)
class _Verdict:
    """A pool whose ``get_data_page(flat=False)`` views were shown to be its live memory."""

    storage_ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    run_bytes: int
    run_offsets: tuple[int, ...]
    memory: memoryview  # the whole storage the views live in, as bytes (keeps no pool alive)


_REFUSED = object()  # a pool that failed the probe: staging, not probed again


class LivePageViews:
    """Per-pool verdicts on ``get_data_page(flat=False)``, and the read segments they allow.

    Thread-safe; :meth:`read_segments` touches pool memory (the probe writes one page), so it
    runs on a thread the caller waits out on cancellation."""

    def __init__(self) -> None:
        self._verdicts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _known(self, pool: Any) -> Any:
        try:
            with self._lock:
                return self._verdicts.get(pool)
        except TypeError:  # not weakly referenceable: never probed (the probe writes a page)
            return _REFUSED

    def _keep(self, pool: Any, verdict: Any) -> None:
        try:
            with self._lock:
                self._verdicts[pool] = verdict
        except TypeError:
            pass

    def may_read(self, pool: Any) -> bool:
        """Whether :meth:`read_segments` could answer for ``pool`` (cheap, on the loop): not for
        a pool that opted out or failed its probe, so those skip a thread hop per batch."""
        return getattr(pool, "hicache_view_reads", True) is not False and self._known(pool) is not _REFUSED

    def read_segments(self, pool: Any, starts: Sequence[int], nbytes_hint: int | None) -> list[PageSegments | None] | None:
        """Each page of ``starts`` as pieces of the pool's live memory (``None`` for an index
        the pool rejects: that page fails), or ``None`` for the batch: take the staging path.
        The first batch of a pool probes it on ``starts[0]``, a page this read overwrites."""
        if not starts or getattr(pool, "hicache_view_reads", True) is False:
            return None
        verdict = self._known(pool)
        if verdict is _REFUSED:
            return None
        if verdict is None:
            verdict = self._probe(pool, int(starts[0]), nbytes_hint)
            self._keep(pool, verdict)
            if verdict is _REFUSED:
                return None
        out: list[PageSegments | None] = []
        seen: set[int] = set()
        for start in starts:
            try:
                view = pool.get_data_page(int(start), flat=False)
            except Exception:  # noqa: BLE001 - a bad index fails its page alone
                out.append(None)
                continue
            if not _same_memory(view, verdict):
                # the pool moved or changed its memory: staging now, a fresh probe next batch
                self._keep(pool, None)
                return None
            at = view.storage_offset() * view.element_size()
            if at in seen:  # two pages of one batch on the same memory: only the first is read
                out.append(None)
                continue
            seen.add(at)
            run, mem = verdict.run_bytes, verdict.memory
            out.append(PageSegments([mem[at + o : at + o + run] for o in verdict.run_offsets]))
        return out

    def _probe(self, pool: Any, index: int, nbytes_hint: int | None) -> Any:
        name = type(pool).__name__
        try:
            verdict, why = _probe(pool, index, nbytes_hint)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot be probed stages its reads
            verdict, why = None, f"the probe raised {type(exc).__name__}: {exc}"
        if verdict is None:
            logger.info("host pool %s: storage reads go through staging pages (%s)", name, why)
            return _REFUSED
        logger.info(
            "host pool %s: get_data_page(flat=False) is live pool memory; storage reads go straight "
            "into it (%d run(s) of %d bytes a page)", name, len(verdict.run_offsets), verdict.run_bytes,
        )
        return verdict


def _same_memory(view: Any, verdict: _Verdict) -> bool:
    return (
        isinstance(view, torch.Tensor)
        and view.device.type == "cpu"
        and view.dtype == verdict.dtype
        and tuple(view.shape) == verdict.shape
        and tuple(view.stride()) == verdict.strides
        and view.untyped_storage().data_ptr() == verdict.storage_ptr
    )


def _bytes_of(view: torch.Tensor) -> np.ndarray:
    """``view``'s bytes in row-major order (a copy), whatever its dtype and strides."""
    as_int = view.view(_SAME_SIZE_INT[view.element_size()]) if view.dtype not in _SAME_SIZE_INT.values() else view
    return np.ascontiguousarray(as_int.numpy()).view(np.uint8).reshape(-1)


def _probe(pool: Any, index: int, nbytes_hint: int | None) -> tuple[_Verdict | None, str]:
    """Whether ``pool``'s ``get_data_page(index, flat=False)`` is the live memory that
    ``set_from_flat_data_page(index, ...)`` writes. Writes one random page at ``index``."""
    first = pool.get_data_page(index, flat=False)
    second = pool.get_data_page(index, flat=False)
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        return None, "get_data_page does not return tensors"
    if first.device.type != "cpu":
        return None, f"its pages are on {first.device}"
    if first.element_size() not in _SAME_SIZE_INT or first.is_complex():
        return None, f"dtype {first.dtype} is not read straight into"
    if first.requires_grad:
        return None, "its pages require grad"
    nbytes = first.numel() * first.element_size()
    if nbytes_hint is not None and nbytes != nbytes_hint:
        return None, f"get_data_page(flat=False) is {nbytes} bytes but a page is {nbytes_hint}"
    if (
        first.data_ptr() != second.data_ptr()
        or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
        or first.shape != second.shape
        or first.stride() != second.stride()
    ):
        return None, "get_data_page(flat=False) returns copies"
    runs = runs_of(first)
    if runs is None:
        return None, f"a page's contiguous runs are shorter than {MIN_RUN_BYTES} bytes"
    like = pool.get_dummy_flat_data_page()
    if not isinstance(like, torch.Tensor) or like.numel() * like.element_size() != nbytes:
        return None, "get_dummy_flat_data_page() is not a page of get_data_page's size"
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    page = torch.empty(like.shape, dtype=like.dtype)
    page.view(torch.uint8).reshape(-1).copy_(pattern)
    pool.set_from_flat_data_page(index, page)
    if not np.array_equal(_bytes_of(first), pattern.numpy()):
        return None, "set_from_flat_data_page does not write what get_data_page(flat=False) shows"
    storage = first.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    run, offsets = runs
    verdict = _Verdict(
        storage_ptr=storage.data_ptr(),
        dtype=first.dtype,
        shape=tuple(first.shape),
        strides=tuple(first.stride()),
        run_bytes=run,
        run_offsets=tuple(offsets),
        memory=memoryview(whole.numpy()).cast("B"),
    )
    return verdict, ""
