"""The reference the replay is judged against: a nested, inclusive, block-level LRU.

Three LRU lists of blocks with capacities ``device <= host <= storage``; every reference
touches all three (inclusive), and a block is served by the smallest tier that holds it. With
the trace's README capacities (1%, 5%, 20% of 43,924 unique blocks) the whole trace gives
4,184 device, 14,677 host and 28,736 storage hits and 74,280 misses (hit ratio 0.3905).

Hits are also counted in tokens (what earlier requests had of the block, at most this
reference's length: :func:`~hicache.replay.trace.block_references`, the rule of the bounds),
which is what the cache's hit tokens are compared with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hicache.replay.trace import BLOCK_TOKENS, TraceRequest, block_references

__all__ = ["reference_lru", "unique_blocks"]

TIERS = ("device", "host", "storage")


def unique_blocks(requests: Sequence[TraceRequest]) -> int:
    return len({h for r in requests for h in r.hash_ids})


def reference_lru(
    requests: Sequence[TraceRequest], capacities: Sequence[int], block_tokens: int = BLOCK_TOKENS
) -> dict[str, float]:
    """Serve ``requests`` (in order) from nested inclusive LRUs of ``capacities`` blocks. A tier
    of capacity 0 is absent (a deployment without storage): it never hits. Capacities that do
    not grow from tier to tier (a host smaller than the device: a valid deployment) are served
    the same way, each tier an LRU of its own size, so a lower tier adds no hits the one above
    could hold; a negative capacity is a ``ValueError``."""
    if any(c < 0 for c in capacities):
        raise ValueError(f"tier capacities must be >= 0 blocks, got {list(capacities)}")
    lists: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities]
    blocks = [0] * (len(capacities) + 1)
    tokens = [0] * (len(capacities) + 1)
    for h, length, reusable in zip(*block_references(requests, block_tokens)):
        tier = len(capacities)
        for i, lru in enumerate(lists):
            if h in lru:
                tier = i
                break
        blocks[tier] += 1
        hit = reusable if tier < len(capacities) else 0
        tokens[tier] += hit
        tokens[-1] += length - hit  # a miss, or the part of a hit block no earlier request had
        for lru, cap in zip(lists, capacities):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > cap:
                    lru.popitem(last=False)
    out: dict[str, float] = {}
    names = TIERS[: len(capacities)]
    for name, b, t in zip(names, blocks, tokens):
        out[f"{name}_hit_blocks"] = b
        out[f"{name}_hit_tokens"] = t
    out["miss_blocks"] = blocks[-1]
    out["miss_tokens"] = tokens[-1]
    total = sum(blocks)
    out["block_references"] = total
    out["hit_blocks"] = total - blocks[-1]
    out["hit_tokens"] = sum(tokens[:-1])
    out["hit_ratio"] = (total - blocks[-1]) / total if total else 0.0
    return out
