"""Moving page bytes between host pools and storage buffers without extra copies.

Host pools follow the page protocol (see ``docs/architecture.md``). When a pool offers a live
contiguous view of a page (``page_view``), storage reads straight into it and writes straight
from it; a page that then fails verification is a miss whose host page holds bytes nobody may
use (so does a page read straight into ``get_data_page`` views, :mod:`~hicache.storage.view_pages`).
Otherwise reads land in a staging page that is committed with ``set_from_flat_data_page`` only
after the backend verified it, so a failed read leaves the pool's page as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from hicache.memory.device import has_integer_dtype, integer_tensor_array, is_one_run

__all__ = [
    "HostPagePool",
    "ReadTarget",
    "as_bytes",
    "checked_starts",
    "indices_refusal",
    "page_nbytes",
    "read_targets",
    "commit_reads",
    "live_views",
    "write_sources",
]


@runtime_checkable
class HostPagePool(Protocol):
    """The page protocol every host pool implements (SGLang's ``HostKVCache`` included)."""

    page_size: int

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None: ...


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"storage I/O needs CPU tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("storage I/O needs a contiguous tensor")
    # As few torch calls as it takes: each one hands the GIL around the I/O threads that move
    # pages, which costs more than the call (numpy flattens a contiguous array for free).
    flat = tensor.detach() if tensor.requires_grad else tensor
    if flat.dim() == 0:
        flat = flat.reshape(1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")


def page_nbytes(pool: Any) -> int:
    """Bytes of one flat page of ``pool``."""
    n = getattr(pool, "page_nbytes", None)
    if isinstance(n, int) and n > 0:
        return n
    dummy = pool.get_dummy_flat_data_page()
    return dummy.numel() * dummy.element_size()


def page_nbytes_hint(pool: Any) -> int | None:
    """The pool's ``page_nbytes`` when it says (ours do), else ``None`` (no page is made)."""
    n = getattr(pool, "page_nbytes", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _fits(host_indices: torch.Tensor | None, num_keys: int, page_size: int) -> bool:
    """Whether ``host_indices`` is an integer tensor of ``num_keys * page_size`` indices."""
    return (
        isinstance(host_indices, torch.Tensor)
        and host_indices.numel() == num_keys * page_size
        and has_integer_dtype(host_indices)
    )


def indices_refusal(host_indices: object) -> str:
    """What is wrong with host indices :func:`checked_starts` refused as a whole, for its error
    ("got ..."): no tensor, a dtype that is no integer one, or the count (and shape, where not
    1-D). Why: the error once named the count alone, so float indices of the right count read
    "expects 48 integer host indices ..., got 48", and a list read "got None"."""
    if host_indices is None:
        return "got None"
    if not isinstance(host_indices, torch.Tensor):
        return f"got a {type(host_indices).__name__}, not a tensor"
    got = f"got {host_indices.numel()}"
    if host_indices.dim() != 1:
        got += f" (shape {tuple(host_indices.shape)})"
    if not has_integer_dtype(host_indices):
        got += f" of dtype {host_indices.dtype}, not an integer dtype"
    return got


def checked_starts(host_indices: torch.Tensor | None, num_keys: int, page_size: int) -> tuple[list[int] | None, list[int]]:
    """A batch's host indices checked: ``(None, [])`` when they are malformed as a whole
    (not an integer tensor of ``num_keys * page_size`` indices), else ``(starts, bad)``: the
    first token index of each page, and the positions of pages whose ``page_size`` indices are
    not one run ``start, start+1, ...`` from a non-negative start. A page is moved as a whole
    from its first index, so such a page's bytes would land on (or come from) tokens the caller
    did not name: another request's KV.

    Why one call: a storage write checks every batch on its I/O thread, and each torch call
    there hands the GIL around; the indices are checked and turned into numpy once.
    """
    if not _fits(host_indices, num_keys, page_size):
        return None, []
    assert host_indices is not None
    if num_keys == 0:
        return [], []
    arr = integer_tensor_array(host_indices)
    return arr[::page_size].tolist(), _malformed(arr, num_keys, page_size)


def _malformed(arr: np.ndarray, num_keys: int, page_size: int) -> list[int]:
    """The malformed pages (see :func:`checked_starts`) of a 1-D int64 index array."""
    if page_size == 1:
        return np.flatnonzero(arr < 0).tolist()
    if arr[0] >= 0 and is_one_run(arr):
        return []  # every page of one run of consecutive indices is one
    grid = arr.reshape(num_keys, page_size)
    bad = (grid[:, 0] < 0) | ~(grid - grid[:, :1] == np.arange(page_size)).all(axis=1)
    return np.flatnonzero(bad).tolist()


def _live_view(pool: Any, index: int) -> torch.Tensor | None:
    view_fn = getattr(pool, "page_view", None)
    if view_fn is None:
        return None
    view = view_fn(index)
    if view is None or view.device.type != "cpu" or not view.is_contiguous():
        return None
    return view


def live_views(pool: Any, starts: Sequence[int]) -> list[memoryview] | None:
    """Byte views of all pages in one call, when the pool offers ``page_views`` (ours, for
    ``page_first``) and accepts every index; ``None``: ask page by page.

    A pool's ``page_views`` answers a list only where ``page_view`` gives each page a live
    contiguous CPU view, so a list also says that :func:`needs_thread` is false."""
    views_fn = getattr(pool, "page_views", None)
    if views_fn is None:
        return None
    try:
        return views_fn(starts)
    except Exception:  # noqa: BLE001 - a bad index: the page-by-page path fails only that page
        return None


def write_sources(pool: Any, starts: Sequence[int], nbytes: int | None = None) -> list[memoryview | None]:
    """Byte views of each page to write; ``None`` for a page the pool cannot produce, or
    (``nbytes`` given) one that is not ``nbytes`` long.

    Why the length check: SGLang's pools slice their buffers without a bounds check, so a
    start past the pool's end (or near it) gives an empty or short page instead of an error;
    stored, it would be a page every lookup reports present and no read can use.
    """
    views = live_views(pool, starts)
    if views is not None:
        return list(views)
    out: list[memoryview | None] = []
    for index in starts:
        try:
            view = _live_view(pool, index)
            if view is None:
                page = pool.get_data_page(index, flat=True)
                if page.device.type != "cpu":
                    page = page.cpu()
                view = page if page.is_contiguous() else page.contiguous()
            data = as_bytes(view)
        except Exception:  # noqa: BLE001 - a bad index is a failed page, not a failed batch
            out.append(None)
            continue
        out.append(data if nbytes is None or len(data) == nbytes else None)
    return out


@dataclass
class ReadTarget:
    """Where one page's payload goes: the pool's own memory, or a staging page to commit."""

    index: int
    buffer: memoryview
    staging: torch.Tensor | None


def read_targets(pool: Any, starts: Sequence[int]) -> list[ReadTarget | None]:
    """One target per page; ``None`` for an index the pool rejects.

    Every staged page gets its own memory: a pool whose ``get_dummy_flat_data_page`` hands out
    one shared scratch tensor (fine for a read-then-commit loop) would otherwise have every page
    of the batch read into the same bytes and commit the last page's payload under every key.
    """
    views = live_views(pool, starts)
    if views is not None:
        return [ReadTarget(index, view, None) for index, view in zip(starts, views)]
    out: list[ReadTarget | None] = []
    staged: set[int] = set()
    for index in starts:
        try:
            view = _live_view(pool, index)
            if view is not None:
                out.append(ReadTarget(index, as_bytes(view), None))
                continue
            staging = pool.get_dummy_flat_data_page()
            if staging.device.type != "cpu" or not staging.is_contiguous():
                staging = torch.empty(staging.shape, dtype=staging.dtype)
            elif staging.numel() and staging.data_ptr() in staged:
                staging = torch.empty_like(staging)
            if staging.numel():
                staged.add(staging.data_ptr())
            out.append(ReadTarget(index, as_bytes(staging), staging))
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def commit_reads(pool: Any, targets: Sequence[ReadTarget | None], ok: list[bool]) -> list[bool]:
    """Copy verified staging pages into the pool; returns the final per-page success."""
    for i, target in enumerate(targets):
        if target is None or not ok[i] or target.staging is None:
            continue
        try:
            pool.set_from_flat_data_page(target.index, target.staging)
        except Exception:  # noqa: BLE001
            ok[i] = False
    return ok


def needs_thread(pool: Any, starts: Sequence[int]) -> bool:
    """Whether page access on ``pool`` copies tensors (then it belongs off the event loop)."""
    try:
        return not starts or _live_view(pool, starts[0]) is None
    except Exception:  # noqa: BLE001
        return True
