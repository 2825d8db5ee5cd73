"""Small helpers shared by the controller's workers: per-pool transfer slices, per-page
success across pools, and guarded completion callbacks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from hicache.storage import PoolHitPolicy, PoolTransfer
from hicache.storage.types import pool_name_str

__all__ = ["all_pools_ok", "call_back", "slice_transfer", "trailing_at"]

logger = logging.getLogger("hicache.controller")


def call_back(cb: Callable[..., Any], *args: Any) -> None:
    """Run a completion callback; its failure is a bug in the cache, logged, never fatal to
    the worker that completes the job."""
    try:
        cb(*args)
    except Exception:  # noqa: BLE001
        logger.exception("completion callback %r failed", cb)


def slice_transfer(t: PoolTransfer, first_page: int, num_pages: int, total_pages: int) -> PoolTransfer:
    """The part of an extra pool's transfer covering KV pages ``[first, first+num)`` of
    ``total_pages`` (its host indices are split evenly per key).

    An ``ALL_PAGES`` pool has a key per KV page. A ``TRAILING_PAGES`` pool (Mamba or SWA state)
    has keys for the last ``len(keys)`` KV pages only: each key goes with the batch that holds
    its page (cut by KV page number, the state went out with the first batch and later ones
    carried none)."""
    keys = list(t.keys or [])
    host = t.host_indices
    per = host.numel() // max(1, len(keys)) if host is not None and keys else 0
    if t.hit_policy is PoolHitPolicy.TRAILING_PAGES:
        base = total_pages - len(keys)  # the KV page of the pool's first key
        lo = min(len(keys), max(0, first_page - base))
        hi = min(len(keys), max(0, first_page + num_pages - base))
    else:
        lo, hi = first_page, first_page + num_pages
    part = keys[lo:hi] or None
    if host is not None and keys:
        host = host[lo * per : hi * per]
    return PoolTransfer(t.name, host, keys=part, hit_policy=t.hit_policy)


def trailing_at(t: PoolTransfer, keys: Sequence[str], end: int) -> PoolTransfer:
    """A ``TRAILING_PAGES`` pool's transfer moved to the prefix of ``end`` pages of the chain
    ``keys``: its keys become that prefix's last ``N`` pages (the others are returned as they
    are). Why: its keys name the state snapshot at the end of the chain a request asked for,
    while storage may hold a shorter prefix only (its snapshot stored there by an earlier,
    shorter request), and host room may cut the fetch shorter still; the pages a prefetch
    hands over are restorable only with the snapshot at *their* end. The host slots stay the
    caller's; with fewer than ``N`` pages before ``end``, the last slots take them."""
    if t.hit_policy is not PoolHitPolicy.TRAILING_PAGES or not t.keys:
        return t
    n = len(t.keys)
    part = list(keys[max(0, end - n) : max(0, end)])
    host = t.host_indices
    if host is not None:
        per = host.numel() // n
        host = host[(n - len(part)) * per :]
    return PoolTransfer(t.name, host, keys=part or None, hit_policy=t.hit_policy)


def all_pools_ok(result: dict[str, list[bool]] | None, n: int,
                 transfers: Sequence[PoolTransfer] = ()) -> list[bool]:
    """Per KV page of a batch of ``n``: did every pool of the transfer succeed? (``None``
    result, or one that leaves out a pool of ``transfers``: nothing did.)

    A pool answers one flag per key it was given, and its keys are the batch's last pages: all
    of them for the KV pool and an ``ALL_PAGES`` pool, the trailing ones for a
    ``TRAILING_PAGES`` pool (see :func:`slice_transfer`); a flag left out is a miss. A pool not
    in ``transfers`` answers for every page."""
    if result is None:
        return [False] * n
    covers = {pool_name_str(t.name): min(n, len(t.keys or [])) for t in transfers}
    answered = {pool_name_str(name) for name in result}
    if any(k and name not in answered for name, k in covers.items()):
        return [False] * n  # a pool the call was asked about and did not answer: nothing landed
    flags: list[bool] | None = None  # all True until a pool failed a page
    for name, pool_flags in result.items():
        k = covers.get(pool_name_str(name), n)
        own = list(pool_flags[:k])
        if len(own) == k and all(own):
            continue  # the usual answer: no step per page
        head = [True] * (n - k) + [bool(f) for f in own] + [False] * (k - len(own))
        flags = head if flags is None else [a and f for a, f in zip(flags, head)]
    return [True] * n if flags is None else flags
