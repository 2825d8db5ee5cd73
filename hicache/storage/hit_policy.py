"""The v2 hit policy: how far a prefix is usable when several pools must be present.

This lives once, here, and every backend inherits it: a backend only answers "does page
(key, pool) exist" for many pages at once.

* KV: the longest run of existing KV pages from the start.
* An extra pool with ``ALL_PAGES`` can restore a prefix of length ``p`` when every page of
  ``[0, p)`` exists.
* An extra pool with ``TRAILING_PAGES`` (N = ``len(transfer.keys)``, at least 1) can restore
  length ``p`` when the last N pages before ``p``, ``[p - N, p)``, exist (a state snapshot at
  that point); its boundary is the longest such ``p``.
* The usable hit is the longest length every pool can restore (the lengths are intersected,
  not the boundaries' minimum taken: with a trailing pool restorable at 2 and 5 and an
  all-pages pool up to 4, the minimum, 4, names a prefix whose state page does not exist, and
  the answer is 2). A pool whose boundary is 0 is left out of the per-pool counts, and
  evaluation stops once no length is left (as SGLang does). ``restorable_prefix_pages`` lists
  every usable length, which SGLang's hybrid controller reduces across ranks.
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

__all__ = ["checked_policies", "leading_run", "restorable_lengths", "resolve_v2_hits"]


def leading_run(flags: Sequence[bool]) -> int:
    """Number of consecutive true flags from the start."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def checked_policies(transfers: Sequence[PoolTransfer]) -> None:
    """Raise ``ValueError`` naming the pool for a transfer whose ``hit_policy`` is not one of
    :class:`PoolHitPolicy`.

    Why before the lookups: :func:`resolve_v2_hits` reads a pool's policy only while some
    prefix is usable, so a bad one passed every lookup of an empty store (a test) and failed
    every lookup once pages were stored (production), with an error that named no pool."""
    for transfer in transfers:
        try:
            PoolHitPolicy(transfer.hit_policy)
        except ValueError:
            allowed = ", ".join(p.value for p in PoolHitPolicy)
            raise ValueError(f"pool {pool_name_str(transfer.name)!r}: hit_policy {transfer.hit_policy!r:.80} "
                             f"is not one of {allowed}") from None


def restorable_lengths(flags: Sequence[bool], limit: int, policy: PoolHitPolicy | str, trailing: int = 1) -> list[int]:
    """Prefix lengths ``1..limit`` (ascending) a pool with existence ``flags`` can restore
    under ``policy`` (``trailing``: N of ``TRAILING_PAGES``); one pass over the flags."""
    if PoolHitPolicy(policy) is PoolHitPolicy.ALL_PAGES:
        return list(range(1, min(limit, leading_run(flags)) + 1))
    trailing = max(1, trailing)
    out: list[int] = []
    run = 0
    for i in range(min(limit, len(flags))):
        run = run + 1 if flags[i] else 0
        if run >= min(trailing, i + 1):
            out.append(i + 1)
    return out


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
    usable = list(range(1, kv_pages + 1))
    for transfer in transfers or ():
        if not usable:
            break
        name = pool_name_str(transfer.name)
        lengths = restorable_lengths(pool_flags.get(name, ()), kv_pages, transfer.hit_policy,
                                     len(transfer.keys or ()) or 1)
        if lengths:
            hits[name] = lengths[-1]
        allowed = set(lengths)
        usable = [p for p in usable if p in allowed]
    return PoolTransferResult(usable[-1] if usable else 0, hits, usable)
