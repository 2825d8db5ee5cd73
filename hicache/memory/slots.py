"""Copying and joining slot index tensors on the event loop without torch's intra-op thread pool.

Why: the tree copies slot indices on the event loop for every request (a node's slots are a
copy of the request's row, a match joins the slots along its path), and the controller joins
the slots of every backup batch it sends. On CPU, torch runs a copy
of more than ~32k elements on its OpenMP pool, whose threads then spin waiting for more work.
On a busy host (a server's other threads, or neighbours on a shared machine) a 200k-slot
``clone`` measured 8.7 ms against 0.7 ms for the same copy on one thread, and the spinning
threads slow every later step of the loop too: the whole radix benchmark ran 3-7x slower with
two torch threads than with one. numpy copies on the calling thread, so CPU slots go through
it; device tensors (CUDA slots) keep torch's own ops, which only launch kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["cat_slots", "copy_slots", "empty_slots", "read_slots"]


def _host(t: torch.Tensor) -> bool:
    return t.is_cpu and not t.requires_grad  # is_cpu: a flag, 4x cheaper than t.device.type


def empty_slots(device: torch.device | str | None = None) -> torch.Tensor:
    """No slots: a fresh int64 tensor (never a shared one: a caller may reshape its result in
    place). On CPU it is made through numpy: a torch op lets go of the GIL, and with the storage
    threads busy the loop then waits to get it back (the tiered radix benchmark's match+insert
    ran 30% slower with ``torch.empty`` on its no-hit matches)."""
    if device is None or str(device).startswith("cpu"):
        return torch.from_numpy(np.empty(0, dtype=np.int64))
    return torch.empty((0,), dtype=torch.int64, device=device)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype  # asked once per dtype


def copy_slots(t: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """A private copy of ``t[start:stop]`` (the caller may reuse ``t``'s memory afterwards).
    The range is cut in numpy, not by slicing ``t`` first: a torch slice costs about 2 us of
    loop time on every insert."""
    if _host(t):
        return torch.from_numpy(t.numpy()[start:stop].copy())
    return t[start:stop].clone()


def cat_slots(
    parts: Sequence[torch.Tensor], empty: Callable[[], torch.Tensor] = empty_slots, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``parts``, flattened, joined into one new tensor (of ``dtype`` if given); ``empty()``
    when there are none (made only then: a tensor made on every match, for nothing, cost
    2-40 us of the loop's time)."""
    if not parts:
        return empty()
    if len(parts) == 1 and dtype in (None, parts[0].dtype) and parts[0].dim() == 1:
        return copy_slots(parts[0])
    if all(_host(p) for p in parts):
        np_dtype = None if dtype is None else _numpy_dtype(dtype)
        return torch.from_numpy(np.concatenate([p.numpy().reshape(-1) for p in parts], dtype=np_dtype))
    joined = torch.cat([p.reshape(-1) for p in parts])
    return joined if dtype is None else joined.to(dtype)


def read_slots(parts: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``parts`` joined for a caller that only reads the result: a lone 1-D part of ``dtype``
    is returned as it is, anything else as :func:`cat_slots` joins it.

    Why: the controller joins the slots of each backup batch only to plan the copy from them,
    and nearly every batch is one job (1,398 of the tiered radix benchmark's 1,428 backups).
    Copying that job's device and host slots (11k each in a typical prompt) cost the loop two
    ~90 KiB copies of fresh memory per backup, between the requests it serves."""
    if len(parts) == 1 and parts[0].dim() == 1 and dtype in (None, parts[0].dtype):
        return parts[0]
    return cat_slots(parts, dtype=dtype)
