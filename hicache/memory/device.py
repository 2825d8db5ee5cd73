"""Choosing the device the pools live on, and index normalisation shared by the pools.

The whole memory package runs on CUDA when a GPU is present and on CPU otherwise, so that the
same code paths (and tests) run on a laptop and on a server.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["device_for", "as_index", "as_index_array", "has_integer_dtype", "integer_tensor_array", "is_one_run"]

logger = logging.getLogger(__name__)

IndexLike = torch.Tensor | Sequence[int] | np.ndarray | int


def device_for(preferred: str | torch.device | None = None) -> torch.device:
    """The device to put pools on: ``preferred`` if usable, else CUDA when present, else CPU.

    A CUDA device asked for on a machine without CUDA falls back to CPU (logged) instead of
    failing, because configs are shared between GPU servers and CPU test machines.
    """
    if preferred is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(preferred)
    if dev.type == "cuda" and not torch.cuda.is_available():
        logger.info("CUDA requested (%s) but not available; using CPU", dev)
        return torch.device("cpu")
    return dev


def is_one_run(arr: np.ndarray) -> bool:
    """Whether non-empty ``arr`` is ``start, start+1, ...`` (strictly increasing and spanning
    exactly its length): what a sorted free list hands out and a backup of one node copies, so
    callers check it first and validate page by page only otherwise (one byte a token of
    scratch instead of nine)."""
    # count_nonzero: a third of the time of .all() on the thousands of indices of a batch
    return int(arr[-1]) - int(arr[0]) == arr.size - 1 and np.count_nonzero(arr[1:] > arr[:-1]) == arr.size - 1


def has_integer_dtype(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds integers that can index: not floats, complex numbers or bools
    (a bool tensor indexes as a mask)."""
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def integer_tensor_array(indices: torch.Tensor) -> np.ndarray:
    """An integer tensor's values as a 1-D int64 numpy array on the host (a view when the tensor
    is a CPU int64 one). The caller has checked the dtype (:func:`as_index_array` does)."""
    if indices.dtype is torch.int64 and indices.device.type == "cpu" and not indices.requires_grad:
        # the usual case in numpy: each torch call (detach, reshape) releases and retakes the GIL
        return indices.numpy().reshape(-1)
    flat = indices.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.int64:
        flat = flat.to("cpu", torch.int64)
    return flat.numpy()


def as_index(value: object, *, what: str = "index") -> int:
    """One index (a page's first token, a state slot) as a Python int: an int, a numpy integer or
    a one-element integer tensor. A bool, a float or a string is a ``TypeError``: ``int()`` made
    8.5 index 8 and ``True`` slot 1, so another page's bytes were read or overwritten."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and not has_integer_dtype(value)):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # TypeError below for what has no __index__
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def as_index_array(indices: IndexLike, *, what: str = "indices") -> np.ndarray:
    """Indices as a 1-D int64 numpy array on the host.

    Bookkeeping (free lists, run detection) happens on the host in numpy because it is a few
    thousand integers at most, and doing it in torch on a GPU would force a sync per call anyway.
    """
    if isinstance(indices, torch.Tensor):
        if not has_integer_dtype(indices):
            raise TypeError(f"{what} must be an integer tensor, got {indices.dtype}")
        arr = integer_tensor_array(indices)
    elif isinstance(indices, bool):  # an int to Python: free(True) freed slot 1
        raise TypeError(f"{what} must be integers, got a bool")
    elif isinstance(indices, (int, np.integer)):
        arr = np.asarray([int(indices)], dtype=np.int64)
    else:
        arr = np.asarray(indices)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{what} must be integers, got {arr.dtype}")
        arr = arr.reshape(-1).astype(np.int64, copy=False)
    return arr
