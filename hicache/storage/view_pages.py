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

Which pools: the probe below cannot see what else a pool's ``set_from_flat_data_page`` does
(a valid mark, a mirror), and reading past it would skip that. So the path is taken only for
pools known to do nothing more than place the bytes: SGLang's host pools (subclasses of its
``HostKVCache`` whose page methods are SGLang's own; 0.5.23's MHA, MLA, DSA, MiniMax and unified
pools were read for this), and a pool that says so with ``hicache_view_reads = True``. ``hicache_view_reads = False`` opts out.

A view is used only once such a pool has shown, on a page the read targets, that it is the
pool's memory and that it is what ``set_from_flat_data_page`` writes:

* two calls for the same page, both alive at once, give the same memory (a fresh copy per
  call would not), on the CPU, of the page's size;
* a random page committed with ``set_from_flat_data_page`` reads back, byte for byte, from the
  view in row-major order - so reading the stored bytes into the view gives exactly the pool
  state that staging plus ``set_from_flat_data_page`` would. The page's own bytes are put back
  afterwards, whatever the outcome (the read may yet miss); a pool that refuses them fails
  its probe.

The verdict is kept per pool object (weakly, and as numbers only: no memory is held); when two
batches probe or refuse at once, the first to finish decides. A probe goes to the first page
of the batch the pool hands a whole page out for; one that raises is tried again on a later
batch, three times at most. A later page in other memory than the probed one makes the pool
stage for good (logged once); one in that memory but of another shape or dtype fails alone (an
index past the pool's end, which staging would fail too).

The contract this relies on: a view stays the page's memory until the storage call returns,
unless the call itself commits. SGLang's controller holds its host pool's layout lease around
every storage call, and hicache ends every read before the call returns, cancelled or not.

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

from hicache.storage.pages import as_bytes
from hicache.storage.segments import PageSegments, row_major_runs

__all__ = ["MIN_RUN_BYTES", "PROBE_ATTEMPTS", "LivePageViews", "runs_of", "trusted"]

logger = logging.getLogger("hicache.storage")

#: Shortest contiguous run read straight into pool memory: below it a page is many tiny
#: iovecs, and staging (one read, one cache-warm copy) is the better path.
MIN_RUN_BYTES = 4096

def runs_of(view: torch.Tensor) -> tuple[int, list[int]] | None:
    """The contiguous runs of ``view``'s memory in row-major order: ``(run bytes, byte offsets
    of each run from the view's first element)``, or ``None`` when a run would be shorter than
    :data:`MIN_RUN_BYTES` (or the view has negative or overlapping strides)."""
    item = view.element_size()
    if any(s < 0 for s in view.stride()) or view.numel() == 0:
        return None
    run, offsets = row_major_runs(view.shape, [s * item for s in view.stride()], item)
    if run < MIN_RUN_BYTES:
        return None
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


_REFUSED = object()  # a pool that failed the probe: staging, not probed again
#: Probes that may raise (a bad index, a pool mid-setup) before a pool stages for good.
PROBE_ATTEMPTS = 3
#: Pages of a batch tried, in order, for one the pool answers for, to probe on.
PROBE_PAGES = 8


def trusted(pool: Any) -> bool:
    """Whether ``pool`` may be read straight into: it says so (``hicache_view_reads``), or it is
    one of SGLang's host pools, whose ``set_from_flat_data_page`` only places the bytes - a
    subclass of its ``HostKVCache`` whose page methods are SGLang's own (a fork's override of
    them may do more, so it is not trusted by class)."""
    said = getattr(pool, "hicache_view_reads", None)
    if said is not None:
        return said is True
    cls = type(pool)
    if not any(c.__name__ == "HostKVCache" and c.__module__.startswith("sglang.") for c in cls.__mro__):
        return False
    return all(
        (getattr(getattr(cls, name, None), "__module__", None) or "").startswith("sglang.")
        for name in ("get_data_page", "set_from_flat_data_page")
    )


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

    def _swap(self, pool: Any, seen: Any, verdict: Any) -> bool:
        """Set ``pool``'s entry to ``verdict`` if it still is ``seen`` (two batches may probe or
        refuse at once: the first to finish decides, the other's result is dropped)."""
        try:
            with self._lock:
                now = self._verdicts.get(pool)
                if now is not seen and now != seen:
                    return False
                self._verdicts[pool] = verdict
                return True
        except TypeError:
            return False

    def may_read(self, pool: Any) -> bool:
        """Whether :meth:`read_segments` could answer for ``pool`` (cheap, on the loop): not for
        a pool that is not :func:`trusted` or was refused, so those skip a thread hop per batch."""
        return trusted(pool) and self._known(pool) is not _REFUSED

    def read_segments(self, pool: Any, starts: Sequence[int], nbytes_hint: int | None) -> list[PageSegments | None] | None:
        """Each page of ``starts`` as pieces of the pool's live memory (``None`` for an index
        the pool rejects: that page fails), or ``None`` for the batch: take the staging path.
        A pool not yet probed is probed on a page this read targets (the first it answers for)."""
        if not starts or not trusted(pool):
            return None
        verdict = self._known(pool)
        if verdict is _REFUSED:
            return None
        if not isinstance(verdict, _Verdict):
            before, verdict = verdict, self._probe(pool, starts, nbytes_hint, failed=verdict or 0)
            if not self._swap(pool, before, verdict):
                return None  # another batch probed meanwhile: this one stages, the next reads
            if not isinstance(verdict, _Verdict):
                return None
        views: list[torch.Tensor | None] = []
        for start in starts:
            try:
                view = pool.get_data_page(int(start), flat=False)
            except Exception:  # noqa: BLE001 - a bad index fails its page alone
                views.append(None)
                continue
            if not isinstance(view, torch.Tensor) or view.untyped_storage().data_ptr() != verdict.storage_ptr:
                if not self._swap(pool, verdict, _REFUSED):
                    return None  # refused (or probed again) by another batch meanwhile
                logger.info(
                    "host pool %s: a page is no longer a view of the memory it was probed on; its "
                    "storage reads go through staging pages from now on", type(pool).__name__,
                )
                return None
            if not _same_shape(view, verdict):  # the probed memory, but not a page of it (past its end)
                views.append(None)
                continue
            views.append(view)
        live = next((v for v in views if v is not None), None)
        if live is None:
            return [None] * len(starts)
        mem = _storage_bytes(live)  # made per batch: no verdict keeps a pool's memory alive
        run, offsets = verdict.run_bytes, verdict.run_offsets
        out: list[PageSegments | None] = []
        seen: set[int] = set()
        for view in views:
            at = -1 if view is None else int(view.storage_offset()) * view.element_size()
            if at < 0 or at in seen:  # a bad index, or memory an earlier page of the batch takes
                out.append(None)
                continue
            seen.add(at)
            out.append(PageSegments([mem[at + o : at + o + run] for o in offsets]))
        return out

    def _probe(self, pool: Any, starts: Sequence[int], nbytes_hint: int | None, failed: int) -> Any:
        """The pool's verdict, or ``_REFUSED``, or (the probe raised) how many probes failed."""
        name = type(pool).__name__
        index = None
        try:
            like = pool.get_dummy_flat_data_page()  # asked once: a fresh (pinned) page each time
            if not isinstance(like, torch.Tensor):
                raise TypeError("get_dummy_flat_data_page() is not a tensor")
            nbytes = nbytes_hint or like.numel() * like.element_size()
            index, first = _answering(pool, starts, nbytes)
            if index is None:
                raise LookupError(f"no whole page of {nbytes} bytes among the batch's first {PROBE_PAGES}")
            verdict, why = _probe(pool, index, first, like)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot be probed stages its reads
            if failed + 1 < PROBE_ATTEMPTS:
                logger.debug("host pool %s: probe at %s raised; staging this batch", name, index, exc_info=True)
                return failed + 1
            verdict, why = None, f"the probe raised {type(exc).__name__}: {exc}"
        if verdict is None:
            logger.info("host pool %s: storage reads go through staging pages (%s)", name, why)
            return _REFUSED
        logger.info(
            "host pool %s: get_data_page(flat=False) is live pool memory; storage reads go straight "
            "into it (%d run(s) of %d bytes a page)", name, len(verdict.run_offsets), verdict.run_bytes,
        )
        return verdict


def _answering(pool: Any, starts: Sequence[int], nbytes: int) -> tuple[int | None, Any]:
    """The first of the batch's first :data:`PROBE_PAGES` pages the pool hands out a whole page
    for (``nbytes``), and that page's view: an index it rejects, or answers with a short slice
    past its end, does not cost the pool its probe."""
    for start in starts[:PROBE_PAGES]:
        try:
            view = pool.get_data_page(int(start), flat=False)
        except Exception:  # noqa: BLE001 - a bad index
            continue
        if isinstance(view, torch.Tensor) and view.numel() * view.element_size() == nbytes:
            return int(start), view
    return None, None


def _storage_bytes(view: torch.Tensor) -> memoryview:
    """The whole storage ``view`` lives in, as a writable byte memoryview (it keeps it alive)."""
    storage = view.untyped_storage()
    return as_bytes(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))


def _same_shape(view: Any, verdict: _Verdict) -> bool:
    """Whether ``view`` is a CPU page of the probed one's dtype, shape and strides."""
    return (
        isinstance(view, torch.Tensor)
        and view.device.type == "cpu"
        and view.dtype == verdict.dtype
        and tuple(view.shape) == verdict.shape
        and tuple(view.stride()) == verdict.strides
    )


def _probe(pool: Any, index: int, first: torch.Tensor, like: torch.Tensor) -> tuple[_Verdict | None, str]:
    """Whether ``first``, ``pool``'s ``get_data_page(index, flat=False)`` (a whole page), is the
    live memory that ``set_from_flat_data_page(index, ...)`` writes; ``like`` is the pool's
    dummy page. Writes one random page at ``index``, then puts the page's bytes back."""
    second = pool.get_data_page(index, flat=False)
    if not isinstance(second, torch.Tensor):
        return None, "get_data_page does not return tensors"
    if first.device.type != "cpu":
        return None, f"its pages are on {first.device}"
    if first.requires_grad:
        return None, "its pages require grad"
    nbytes = first.numel() * first.element_size()
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
    if like.numel() * like.element_size() != nbytes:
        return None, "get_dummy_flat_data_page() is not a page of get_data_page's size"
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    page = torch.empty(like.shape, dtype=like.dtype)
    page.view(torch.uint8).reshape(-1).copy_(pattern)
    own = pool.get_data_page(index, flat=True).clone()  # put back after: the read may yet miss
    try:
        pool.set_from_flat_data_page(index, page)
        shows = as_bytes(first.contiguous()) == pattern.numpy().data
    finally:
        pool.set_from_flat_data_page(index, own)  # if this raises, the probe fails: staging
    if not shows:
        return None, "set_from_flat_data_page does not write what get_data_page(flat=False) shows"
    run, offsets = runs
    verdict = _Verdict(
        storage_ptr=first.untyped_storage().data_ptr(),
        dtype=first.dtype,
        shape=tuple(first.shape),
        strides=tuple(first.stride()),
        run_bytes=run,
        run_offsets=tuple(offsets),
    )
    return verdict, ""
