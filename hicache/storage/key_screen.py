"""Per-key screening of a batch for the blocking facade.

The async interface treats a batch holding an unstorable key as the caller's bug and raises
:class:`~hicache.errors.InvalidKeyError` for the whole batch. SGLang-style callers of the blocking
facade cannot tell which key was wrong and would lose every other page of the batch, so the
facade screens each batch first: a bad key becomes a clean miss (``False`` / ``None``) for that
key alone, counted in ``invalid_requests``, and the good keys go to the backend as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.errors import InvalidKeyError
from hicache.keys import validate_key

__all__ = ["is_storable", "first_unstorable", "storable_runs", "page_indices"]


def is_storable(key: object) -> bool:
    """Whether a backend may store ``key`` (see :func:`hicache.keys.validate_key`)."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def first_unstorable(keys: Sequence[object]) -> int | None:
    """Position of the first unstorable key, ``None`` when every key is storable."""
    for i, key in enumerate(keys):
        if not is_storable(key):
            return i
    return None


def storable_runs(keys: Sequence[object]) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of consecutive storable keys, in order.

    A run after a bad key has no storable parent page, so it is written as a chain of its own."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, key in enumerate(keys):
        if is_storable(key):
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(keys)))
    return runs


def page_indices(host_indices: torch.Tensor | None, n_pages: int, start: int, end: int) -> torch.Tensor | None:
    """The token indices of pages ``[start, end)`` of a transfer of ``n_pages`` pages, or
    ``None`` when ``host_indices`` does not split into whole pages (the backend then fails the
    batch itself, with its own error)."""
    if not isinstance(host_indices, torch.Tensor) or n_pages == 0 or host_indices.numel() % n_pages:
        return None
    per_page = host_indices.numel() // n_pages
    return host_indices.reshape(-1)[start * per_page : end * per_page]
