"""The v2 hit policy: how far a prefix is usable when several pools must be present.

This lives once, here, and every backend inherits it: a backend only answers "does page
(key, pool) exist" for many pages at once.

* KV: the longest run of existing KV pages from the start.
* An extra pool with ``ALL_PAGES`` needs every page of ``[0, boundary)``.
* An extra pool with ``TRAILING_PAGES`` (N = ``len(transfer.keys)``, at least 1) needs only the
  last N pages before ``boundary``; the boundary is the longest KV prefix whose trailing N pages
  all exist (a state snapshot at that point).
* The usable hit is the minimum over pools; a pool whose boundary is 0 is left out of the
  per-pool counts, and evaluation stops once the hit is 0 (as SGLang does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.storage.types import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    pool_name_str,
)

__all__ = ["leading_run", "trailing_boundary", "resolve_v2_hits"]


def leading_run(flags: Sequence[bool]) -> int:
    """Number of consecutive true flags from the start."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def trailing_boundary(flags: Sequence[bool], limit: int, trailing: int) -> int:
    """Largest ``p <= limit`` whose pages ``[max(0, p - trailing), p)`` all exist; 0 if none."""
    trailing = max(1, trailing)
    run = 0
    best = 0
    for i in range(limit):
        run = run + 1 if flags[i] else 0
        if run >= min(trailing, i + 1):
            best = i + 1
    return best


def resolve_v2_hits(
    kv_flags: Sequence[bool],
    pool_flags: Mapping[str, Sequence[bool]],
    transfers: Sequence[PoolTransfer] | None,
) -> PoolTransferResult:
    """Combine per-page existence flags into SGLang's ``PoolTransferResult``.

    ``pool_flags[name]`` must cover at least the first ``leading_run(kv_flags)`` pages.
    """
    kv_pages = leading_run(kv_flags)
    hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
    final = kv_pages
    for transfer in transfers or ():
        if final == 0:
            break
        name = pool_name_str(transfer.name)
        flags = pool_flags.get(name, ())
        if len(flags) < kv_pages:
            flags = list(flags) + [False] * (kv_pages - len(flags))
        if PoolHitPolicy(transfer.hit_policy) is PoolHitPolicy.ALL_PAGES:
            boundary = leading_run(flags[:kv_pages])
        else:
            boundary = trailing_boundary(flags, kv_pages, len(transfer.keys or ()) or 1)
        if boundary:
            hits[name] = boundary
        final = min(final, boundary)
    return PoolTransferResult(final, hits)
