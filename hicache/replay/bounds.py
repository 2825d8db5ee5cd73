"""Bounds computed from the trace alone: what any cache of a given size could hit.

Why: a policy's hit rate means little without the ceiling. ``infinite`` hits every block seen
before (no capacity limit: only the first reference of a block misses). ``belady`` is the
offline optimum of one cache of ``capacity`` blocks (Belady's MIN with bypass: on a miss, keep
the new block only if it is used again sooner than the cached block used farthest in the
future). A block id fixes its whole prefix, so a block-level hit is also a prefix hit.

Both count blocks and tokens, in one pass each: a hit's tokens are what earlier requests had of
the block, at most this reference's length (:func:`~hicache.replay.trace.block_references`: a
partial last block counts its own length, and a block first seen short only that part).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hicache.replay.trace import BLOCK_TOKENS, TraceRequest, block_references

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


def infinite_cache(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> dict[str, float]:
    """Hits of a cache that never evicts."""
    blocks, tokens, reusable = block_references(requests, block_tokens)
    return _result(len(blocks) - len(set(blocks)), sum(reusable), blocks, tokens)  # all but first sights hit


def belady(requests: Sequence[TraceRequest], capacity: int, block_tokens: int = BLOCK_TOKENS) -> dict[str, float]:
    """Hits of the offline-optimal cache of ``capacity`` blocks (MIN with bypass)."""
    if capacity < 0:
        raise ValueError(f"capacity must not be negative, got {capacity}")
    blocks, tokens, reusable = block_references(requests, block_tokens)
    n = len(blocks)
    nxt: list[float] = [_NEVER] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        b = blocks[i]
        nxt[i] = last.get(b, _NEVER)
        last[b] = i
    cached: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, block), lazy
    hb = ht = 0
    for i in range(n):
        b, when = blocks[i], nxt[i]
        if b in cached:
            hb += 1
            ht += reusable[i]
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
    return _result(hb, ht, blocks, tokens)
