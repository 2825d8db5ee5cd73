"""Bounds computed from the trace alone: what any cache of a given size could hit.

Why: a policy's hit rate means little without the ceiling. ``infinite`` hits every block seen
before (no capacity limit: only the first reference of a block misses). ``belady`` is the
offline optimum of one cache of ``capacity`` blocks (Belady's MIN with bypass: on a miss, keep
the new block only if it is used again sooner than the cached block used farthest in the
future). A prefix cache hits a block only with its whole prefix, so its hits are those of
some block-level schedule: what bounds every block-level cache bounds it.

Both count blocks and tokens: a hit's tokens are what earlier requests had of the block, at most
this reference's length (:func:`~hicache.replay.trace.block_references`: a partial last block
counts its own length, and a block first seen short only that part). Belady's blocks are MIN's,
exact; its tokens are a bound (see :func:`belady`): MIN keeps the blocks used soonest, whatever
their tokens, so the tokens of its schedule were not the most any cache could hit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from hicache.replay.trace import BLOCK_TOKENS, TICK_MASK, References, TraceRequest, block_references

__all__ = ["belady", "infinite_cache"]

_NEVER = float("inf")


def _result(hit_blocks: int, hit_tokens: int, blocks: list[int], tokens: list[int]) -> dict[str, float]:
    total_tokens = sum(tokens)
    return {
        "hit_blocks": hit_blocks,
        "hit_tokens": hit_tokens,
        "hit_ratio_blocks": hit_blocks / len(blocks) if blocks else 0.0,
        "hit_ratio_tokens": hit_tokens / total_tokens if total_tokens else 0.0,
    }


def infinite_cache(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS, *,
                   references: References | None = None) -> dict[str, float]:
    """Hits of a cache that never evicts (``references``: the requests' block references, when
    the caller has them already)."""
    blocks, tokens, reusable = references or block_references(requests, block_tokens)
    return _result(len(blocks) - len(set(blocks)), sum(reusable), blocks, tokens)  # all but first sights hit


def belady(requests: Sequence[TraceRequest], capacity: int, block_tokens: int = BLOCK_TOKENS, *,
           references: References | None = None, tick: Callable[[int], object] | None = None) -> dict[str, float]:
    """Hits of the offline-optimal cache of ``capacity`` blocks: ``hit_blocks`` exactly (MIN with
    bypass), ``hit_tokens`` at least what any cache of ``capacity`` blocks hits.

    Why tokens are not MIN's: MIN keeps the block used again soonest, so it gave its place to a
    prompt's short tail used next (10 tokens) over a whole block used after it (512), and the
    tokens of its schedule were below what every policy of the real cache hit on such a trace
    (0.0096 "bound", 0.4904 replayed: a cache of 512-token pages never even holds the tail). A
    whole-block hit needs a place from the previous reference on, so whole-block hits are at most
    MIN's hits counting only references that hit whole blocks; a partial hit (a reference hitting
    fewer than ``block_tokens``) is counted as if it took no place; and no cache hits more than
    MIN's number of hits, ``block_tokens`` each. The least of the two bounds; the gap to the
    optimum is at most the partial hits' share of the tokens (0.0008 of the Mooncake trace's,
    0.016 of agents').

    ``references`` as :func:`infinite_cache` takes them; ``tick(n)`` is called as the passes
    over the references go, ``n`` at a time, twice the references in all (a progress bar)."""
    if capacity < 0:
        raise ValueError(f"capacity must not be negative, got {capacity}")
    blocks, tokens, reusable = references or block_references(requests, block_tokens)
    hits = _min_hits(blocks, [True] * len(blocks), capacity, tick)
    if any(0 < r < block_tokens for r in reusable):
        whole = _min_hits(blocks, [r == block_tokens for r in reusable], capacity, tick)
    else:  # every hit is of a whole block: the same pass
        whole = hits
        if tick is not None:
            tick(len(blocks))
    partial = sum(r for r in reusable if r < block_tokens)
    return _result(hits, min(whole * block_tokens + partial, hits * block_tokens), blocks, tokens)


def _min_hits(blocks: list[int], counted: list[bool], capacity: int, tick: Callable[[int], object] | None) -> int:
    """Hits of MIN with bypass on ``blocks`` where only references ``counted`` are worth
    holding a block for (an uncounted one is to MIN a block never used again, then a new one)."""
    n = len(blocks)
    nxt: list[float] = [_NEVER] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        b = blocks[i]
        j = last.get(b)
        nxt[i] = j if j is not None and counted[j] else _NEVER
        last[b] = i
    cached: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, block), lazy
    hits = 0
    for i in range(n):
        if tick is not None and i & TICK_MASK == TICK_MASK:
            tick(TICK_MASK + 1)
        b, when = blocks[i], nxt[i]
        if b in cached:
            hits += 1  # held only for a counted reference: this one
        elif capacity == 0 or when == _NEVER:
            continue  # bypass: never kept
        elif len(cached) >= capacity:
            while heap and cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)  # stale entry
            far, victim = -heap[0][0], heap[0][1]
            if far <= when:
                continue  # every cached block is needed sooner: bypass
            heapq.heappop(heap)
            del cached[victim]
        if when == _NEVER:
            cached.pop(b, None)
            continue
        cached[b] = when
        heapq.heappush(heap, (-when, b))
    if tick is not None:
        tick(n & TICK_MASK)
    return hits
