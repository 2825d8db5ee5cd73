"""Small helpers shared by the controller's workers: per-pool transfer slices, per-page
success across pools, and guarded completion callbacks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hicache.storage import PoolTransfer

__all__ = ["all_pools_ok", "call_back", "slice_transfer"]

logger = logging.getLogger("hicache.controller")


def call_back(cb: Callable[..., Any], *args: Any) -> None:
    """Run a completion callback; its failure is a bug in the cache, logged, never fatal to
    the worker that completes the job."""
    try:
        cb(*args)
    except Exception:  # noqa: BLE001
        logger.exception("completion callback %r failed", cb)


def slice_transfer(t: PoolTransfer, first_page: int, num_pages: int) -> PoolTransfer:
    """The part of an extra pool's transfer covering pages ``[first, first+num)`` (its host
    indices are split evenly per page)."""
    keys = (t.keys or [])[first_page : first_page + num_pages] or None
    host = t.host_indices
    if host is not None and t.keys:
        per = host.numel() // max(1, len(t.keys))
        host = host[first_page * per : (first_page + num_pages) * per]
    return PoolTransfer(t.name, host, keys=keys, hit_policy=t.hit_policy)


def all_pools_ok(result: dict[str, list[bool]] | None, n: int) -> list[bool]:
    """Per page: did every pool of the transfer succeed? (``None`` result: nothing did.)"""
    if result is None:
        return [False] * n
    flags: list[bool] | None = None  # all True until a pool failed a page
    for pool_flags in result.values():
        head = list(pool_flags[:n])
        if len(head) == n and all(head):
            continue  # the usual answer: no step per page
        head += [False] * (n - len(head))
        flags = [bool(f) for f in head] if flags is None else [a and bool(f) for a, f in zip(flags, head)]
    return [True] * n if flags is None else flags
