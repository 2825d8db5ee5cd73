"""Tier sizing from a trace: the LRU miss-ratio curve in one pass (Mattson's stack distances).

Why stack distances: an LRU cache of ``C`` blocks hits a reference exactly when fewer than ``C``
distinct blocks were referenced since the previous reference to the same block (its *stack
distance*). One pass over the trace computes every reference's distance (a Fenwick tree over
reference times counts the distinct blocks in between, O(log n) each), and the hit ratio at
*every* capacity follows from the histogram of distances: no replay per size.

Why LRU: it is the reference the replay's ``lru`` is set beside (the nested LRU of
:mod:`~hicache.replay.reference`, equal to this curve at its largest tier), and the other
policies hit more than ``lru`` on the traffic described in ``docs/placement.md``. It is not
exactly what ``placement = "lru"`` gets, either way: the cache evicts a prefix's leaves first
where a block-level LRU drops the oldest block whatever hangs under it (the replay's ``lru``
hit 0.411 of the Mooncake trace's tokens, this curve 0.398 at its storage size), and a cache of
512-token pages never holds a prompt's partial last block, which the curve counts (one prompt
of 1,300 tokens asked 20 times: 0.75 replayed, 0.95 here; smaller pages hold most of it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hicache.replay.trace import BLOCK_TOKENS, TICK_MASK, References, TraceRequest, block_references

__all__ = ["MissRatioCurve", "lru_miss_ratio_curve"]



@dataclasses.dataclass(frozen=True)
class MissRatioCurve:
    """Hits of an LRU cache of every size, from one trace.

    ``distance_tokens[d]`` sums the tokens a cache of more than ``d`` blocks hits at references
    whose stack distance is ``d``: what earlier requests had of the block, the rule of the bounds
    (:func:`~hicache.replay.trace.block_references`); cold references (first sight) never hit.
    """

    unique_blocks: int
    references: int
    total_tokens: int
    distance_blocks: np.ndarray  # references per stack distance
    distance_tokens: np.ndarray  # tokens per stack distance

    def hit_ratio(self, capacity_blocks: int, *, tokens: bool = True) -> float:
        """Hit ratio of an LRU cache of ``capacity_blocks`` blocks (tokens or blocks)."""
        c = max(0, min(int(capacity_blocks), len(self.distance_blocks)))
        if tokens:
            return float(self.distance_tokens[:c].sum()) / self.total_tokens if self.total_tokens else 0.0
        return float(self.distance_blocks[:c].sum()) / self.references if self.references else 0.0

    def curve(self, capacities: Sequence[int], *, tokens: bool = True) -> list[tuple[int, float]]:
        """``(capacity, hit ratio)`` for each capacity, from cumulative sums (O(1) each)."""
        cum = np.concatenate([[0], np.cumsum(self.distance_tokens if tokens else self.distance_blocks)])
        total = self.total_tokens if tokens else self.references
        out = []
        for cap in capacities:
            c = max(0, min(int(cap), len(cum) - 1))
            out.append((int(cap), float(cum[c]) / total if total else 0.0))
        return out


def lru_miss_ratio_curve(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS, *,
                         references: References | None = None,
                         tick: Callable[[int], object] | None = None) -> MissRatioCurve:
    """Stack distances of every block reference of ``requests`` (in order), in one pass.
    ``references``: the requests' :func:`~hicache.replay.trace.block_references`, when the caller
    has them already; ``tick(n)`` is called every ``n`` references done (a progress bar)."""
    blocks, tokens, reusable = references or block_references(requests, block_tokens)
    n = len(blocks)
    tree = [0] * (n + 1)  # Fenwick tree: 1 at the time of each block's latest reference

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum over times [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    dist_blocks = np.zeros(len(set(blocks)) + 1, dtype=np.int64)
    dist_tokens = np.zeros_like(dist_blocks)
    live = 0  # blocks with a latest reference so far (= prefix(t))
    for t, (b, tok) in enumerate(zip(blocks, reusable)):
        if tick is not None and t & TICK_MASK == TICK_MASK:
            tick(TICK_MASK + 1)
        prev = last.get(b)
        if prev is not None:
            d = live - prefix(prev + 1)  # distinct blocks referenced after prev
            dist_blocks[d] += 1
            dist_tokens[d] += tok
            add(prev, -1)
        else:
            live += 1
        add(t, 1)
        last[b] = t
    if tick is not None:
        tick(n & TICK_MASK)
    return MissRatioCurve(
        unique_blocks=len(last), references=n, total_tokens=int(sum(tokens)),
        distance_blocks=dist_blocks, distance_tokens=dist_tokens,
    )
