"""Token ids checked where they enter hicache (the facade's request path, the engine).

Why a module of its own: the engine validates prompts with the same rule as
:meth:`HiCache.begin <hicache.facade.HiCache.begin>`, and must not import the facade for it
(the facade pulls in the whole controller; the recompute baseline runs without it).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Set
from typing import Any

import torch

__all__ = ["token_ids_of"]


def token_ids_of(values: Any, what: str = "token_ids") -> list[int]:
    """``values`` as a list of token ids, each an integer in ``0..2**32-1`` (a vocabulary index).

    Why at the boundary, before anything is claimed: a float (``1.5``), a string (``"12"``) or a float tensor
    converted with ``int()`` would quietly become other tokens and other page keys, and an id
    outside uint32 only fails later, inside the tree's insert or a session's release (a half-done
    insert, a close that raises). A bad value is a ``TypeError``/``ValueError`` naming it."""
    if isinstance(values, (str, bytes, bytearray, Set, Mapping)):
        # text, or unordered: a set drops repeated tokens and a dict gives its keys, neither in
        # the prompt's order (other tokens, other page keys)
        raise TypeError(f"{what} must be a sequence of integer token ids, not {type(values).__name__}")
    if hasattr(values, "tolist"):  # torch tensors, numpy arrays: a 1-D array of integers
        dtype = getattr(values, "dtype", None)
        is_float = getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False) \
            or getattr(dtype, "kind", "") in ("f", "c")
        if is_float:
            raise TypeError(f"{what} must hold integers, got a {dtype} array")
        if dtype is torch.bool or getattr(dtype, "kind", "") == "b":  # a mask, not token ids
            raise TypeError(f"{what} must hold integers, got a {dtype} array")
        values = values.tolist()
    elif not isinstance(values, (list, tuple, range)):
        try:
            values = list(values)  # an iterator: read once, so the error below can name the bad id
        except TypeError:
            raise TypeError(f"{what} must be a sequence of integer token ids, not {type(values).__name__}") from None
    try:
        return array("I", values).tolist()
    except OverflowError:
        bad = next((t for t in values if not 0 <= t <= 0xFFFFFFFF), None)
        raise ValueError(f"{what}: token id {bad!r} is outside 0..4294967295 (uint32)") from None
    except TypeError:
        try:
            bad = next((t for t in values if not isinstance(t, int)), None)
        except TypeError:
            raise TypeError(f"{what} must be a sequence of integer token ids, not {type(values).__name__}") from None
        raise TypeError(f"{what} must hold integers, got {bad!r} ({type(bad).__name__})") from None
