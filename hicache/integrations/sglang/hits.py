"""SGLang's v2 hit query over per-page existence flags, with ``restorable_prefix_pages``.

SGLang's controller for hybrid models reduces, across ranks, *which prefix lengths* are
restorable rather than one maximum: a trailing-state pool (Mamba, SWA) only holds windows that
end on offloaded node boundaries, so 5 pages may be restorable while 4 and 3 are not. This module
computes that set exactly as SGLang's own ``HiCacheFile.batch_exists_v2`` does, from flags that
hicache's backend answers in one batched call per pool: the core's per-pool rule
(:func:`hicache.storage.hit_policy.restorable_lengths`) plus SGLang's ``block_groups`` policy,
which the core does not have. No SGLang import: the caller wraps the result in SGLang's
``PoolTransferResult``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.storage.hit_policy import leading_run, restorable_lengths

__all__ = ["HitQuery", "policy_name", "resolve_hits"]


def policy_name(policy: Any) -> str:
    """``"all_pages"`` / ``"trailing_pages"`` / ``"block_groups"`` from SGLang's or hicache's enum."""
    return str(getattr(policy, "value", policy))


@dataclass
class HitQuery:
    """The answer before it becomes SGLang's ``PoolTransferResult``."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[Any, int] = field(default_factory=dict)
    restorable_prefix_pages: list[int] = field(default_factory=list)


def resolve_hits(
    kv_flags: Sequence[bool],
    pool_flags: Mapping[Any, Sequence[bool]],
    transfers: Sequence[Any],
    kv_name: Any = "kv",
) -> HitQuery:
    """Combine existence flags into SGLang's v2 hit answer.

    ``pool_flags[transfer.name]`` covers at least the first ``leading_run(kv_flags)`` pages of
    the query. Policies, as SGLang defines them:

    * ``all_pages``: every page of the prefix must exist; restorable lengths ``1..boundary``.
    * ``trailing_pages`` (N = ``len(transfer.keys)``, at least 1): a length ``p`` is restorable
      when pages ``[p - N, p)`` exist.
    * ``block_groups``: the pool's leading complete groups (``group_pages`` keys each, every key
      present) cover ``block_pages`` FULL pages per group; that is the pool's own verdict, and it
      never narrows the KV hit.

    The hit is the longest length restorable in every gating pool; evaluation stops once no
    length is left (as SGLang does).
    """
    kv_pages = leading_run(kv_flags)
    hits: dict[Any, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        name = transfer.name
        flags = list(pool_flags.get(name, ()))
        flags += [False] * max(0, kv_pages - len(flags))
        policy = policy_name(transfer.hit_policy)
        if policy in ("all_pages", "trailing_pages"):
            lengths = restorable_lengths(flags, kv_pages, policy, len(transfer.keys or ()) or 1)
            allowed = set(lengths)
            boundary = lengths[-1] if lengths else 0
        elif policy == "block_groups":
            group = max(1, int(getattr(transfer, "group_pages", 0) or 1))
            block = max(1, int(getattr(transfer, "block_pages", 0) or group))
            groups = 0
            while (groups + 1) * group <= len(flags) and all(flags[groups * group : (groups + 1) * group]):
                groups += 1
            boundary = min(kv_pages, groups * block)
            if boundary:
                hits[name] = boundary
            continue  # its own verdict only: it never gates the KV hit
        else:
            raise ValueError(f"unsupported pool hit policy {transfer.hit_policy!r}")
        if boundary:
            hits[name] = boundary
        restorable = [p for p in restorable if p in allowed]
    final = restorable[-1] if restorable else 0
    return HitQuery(final, hits, restorable)
