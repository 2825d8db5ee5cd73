"""The radix tree's results, pinned: optimising the hot path must not change one of them.

A seeded workload of matches, inserts (with splits, revivals and namespaces), locks, unlocks
and evictions runs against :class:`RadixCache` under every eviction policy, and everything
observable is folded into one digest: the device slots each match returns, each insert's
``prefix_len``, the tokens each evict frees, the sizes after each step, and at the end the
whole tree (keys, slots, locks). Evictions feed back into the allocator, so an eviction that
picks another victim changes every slot handed out after it.

The digests were recorded with the implementation before the hot-path work (the one that
compared token lists and cloned a tensor per node); any change of behaviour fails here.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from hicache.memory import PagedTokenAllocator
from hicache.prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
)

PS = 4

GOLDEN = {
    "lru": "1fa3294d233c768dbaa9ac8b3ad86a55cfa1b45991d1e217e53d3e4321bdcb12",
    "lfu": "fa202e6ed9526447459dafbd9cba22dd12f2035956e1c1bc9f6048ee71fdcd2c",
    "slru": "1fa3294d233c768dbaa9ac8b3ad86a55cfa1b45991d1e217e53d3e4321bdcb12",
    "priority": "98a7ce3944f41b7a974aa75fd8b3e6c735698fe3cf51a8934fdf7bdd0fa1212b",
}


def _tree_dump(cache: RadixCache) -> list[str]:
    out: list[str] = []
    stack = [(cache.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        children = sorted(node.children.values(), key=lambda c: (str(c.extra_key), list(c.key)))
        for child in children:
            value = child.value.tolist() if child.value is not None else None
            out.append(f"{depth}|{child.extra_key}|{list(child.key)}|{value}|{child.lock_ref}|{child.hit_count}")
            stack.append((child, depth + 1))
    return out


def run_workload(policy: str, seed: int = 7, steps: int = 1500) -> str:
    """Run the seeded workload; returns the digest of everything observed."""
    rng = random.Random(seed)
    alloc = PagedTokenAllocator(160 * PS, PS)
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS, eviction_policy=policy)
    h = hashlib.sha256()

    def note(*parts: object) -> None:
        h.update(repr(parts).encode())

    stems = [[rng.randrange(1000) for _ in range(PS * rng.randrange(1, 6))] for _ in range(12)]
    locked: list = []
    for step in range(steps):
        op = rng.random()
        extra = rng.choice([None, None, None, "lora-a"])
        if op < 0.55:
            stem = rng.choice(stems)
            cut = rng.randrange(0, len(stem) + 1)
            tail = [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * PS + 3))]
            tokens = stem[:cut] + tail
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
            note("match", m.device_indices.tolist(), m.host_hit_length)
            n = len(tokens) // PS * PS
            if n == 0:
                continue
            value = alloc.alloc(n)
            if value is None:
                got = cache.evict(EvictParams(num_tokens=n))
                note("evict-for-insert", got.num_tokens_evicted)
                value = alloc.alloc(n)
                if value is None:
                    note("full")
                    continue
            res = cache.insert(InsertParams(key=RadixKey(tokens[:n], extra), value=value, priority=rng.randrange(3)))
            note("insert", res.prefix_len, res.total_len)
            tree = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:n], extra))).device_indices
            dup = value[: tree.numel()][value[: tree.numel()] != tree]
            if dup.numel():
                alloc.free(dup)
            if rng.random() < 0.25:
                node = res.last_device_node
                cache.inc_lock_ref(node)
                locked.append(node)
        elif op < 0.7 and locked:
            node = locked.pop(rng.randrange(len(locked)))
            note("unlock", cache.dec_lock_ref(node).delta)
        elif op < 0.85:
            want = PS * rng.randrange(1, 12)
            note("evict", cache.evict(EvictParams(num_tokens=want)).num_tokens_evicted)
        else:
            stem = rng.choice(stems)
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(stem, extra)), count_hit=rng.random() < 0.5)
            note("rematch", m.device_indices.tolist())
        note("sizes", cache.evictable_size(), cache.protected_size())
        if step % 100 == 0:
            cache.sanity_check()
    cache.sanity_check()
    note("tree", _tree_dump(cache))
    return h.hexdigest()


@pytest.mark.parametrize("policy", sorted(GOLDEN))
def test_results_match_the_recorded_ones(policy: str) -> None:
    assert run_workload(policy) == GOLDEN[policy]


def test_keys_from_tensors_lists_and_tuples_match_alike() -> None:
    alloc = PagedTokenAllocator(64 * PS, PS)
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS)
    tokens = list(range(100, 116))
    value = alloc.alloc(16)
    cache.insert(InsertParams(key=RadixKey(tokens), value=value))
    for key in (tokens, tuple(tokens), torch.tensor(tokens)):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))
        assert torch.equal(m.device_indices, value)


if __name__ == "__main__":  # prints the digests to record
    for p in sorted(GOLDEN):
        print(p, run_workload(p))
