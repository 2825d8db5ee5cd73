"""Diagnostic: which lever is left for `tiered`, on a block-level model of its two lower tiers.

A fast model (seconds, not the real cache): host is an LRU of whole blocks that evicts
storage-backed blocks first; a block host drops is written to storage when `tiered`'s rule admits
it (hit again while on host, back after host dropped it, or the body of a prompt of at least
32k tokens), and storage evicts LRU. Swapping one part for its offline optimum shows what each
could still gain: admission that knows the future (written only if referenced again), and
storage eviction that knows it (Belady: the block used farthest in the future goes first); and
storage eviction as `tiered` does it now (leaves of the stored prefix tree first, least recently
used in any tier), alone or ranked by uses first (a segmented LRU: blocks used once go before
blocks used more) or by conversation (blocks of a prompt chain asked about once go before those
of chains asked about again). The model hits a little more than the real cache (no device tier, no partial pages, no write bound),
so read differences between rows, not the absolute figures. Not a policy: it reads the future.

    .venv/bin/python scripts/placement_model.py [--trace T] [--host 2196] [--storage 8784]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
from collections import OrderedDict, defaultdict

from hicache.replay.trace import BLOCK_TOKENS, find_trace, load_trace


def replay(reqs: list[tuple[list[int], int]], host_cap: int, store_cap: int, *, oracle_admit: bool = False,
           belady_store: bool = False, leaf_store: bool = False, uses_first: bool = False,
           long_prompt_tokens: int = 32768, tail_blocks: int = 4, tinylfu: int = 0,
           conversations_first: bool = False) -> tuple[float, int]:
    """(token hit ratio, blocks written to storage) of the model. ``leaf_store``: storage
    evicts only blocks none of whose children it holds (the parent of a block is the block
    before it in a request), least recently used in any tier first; ``uses_first`` ranks
    those by uses (1, 2+) before recency, ``conversations_first`` by the requests seen so far
    that began with the block's first block (a conversation or document asked about once
    before one asked about again). ``tinylfu``: TinyLFU's admission test at storage (a
    block is written only if referenced more often than the LRU victim it would displace; counts
    halved every ``tinylfu`` storage capacities of references)."""
    refs: dict[int, list[int]] = defaultdict(list)
    for i, (blocks, _) in enumerate(reqs):
        for b in blocks:
            refs[b].append(i)

    def next_use(b: int, i: int) -> int:
        t = refs[b]
        k = bisect.bisect_right(t, i)
        return t[k] if k < len(t) else 1 << 40

    store: OrderedDict[int, None] = OrderedDict()
    backed: OrderedDict[int, int] = OrderedDict()   # host blocks storage holds (evicted first)
    private: OrderedDict[int, int] = OrderedDict()  # host blocks storage lacks: block -> uses
    ghost: OrderedDict[int, None] = OrderedDict()
    wanted: set[int] = set()
    heap: list[tuple[int, int]] = []
    due: dict[int, int] = {}
    parent: dict[int, int] = {}
    kids: dict[int, int] = defaultdict(int)
    used: dict[int, int] = defaultdict(int)  # hits in any tier
    leaves: list[tuple[tuple[int, int], int]] = []  # (rank, block), stale entries skipped
    rank: dict[int, tuple[int, int]] = {}
    tick = 0
    freq: dict[int, int] = defaultdict(int)  # references, aged (tinylfu)
    since_aging = 0

    asked: dict[int, int] = defaultdict(int)  # requests per first block (conversation)
    first_of: dict[int, int] = {}

    def ranked(b: int) -> None:
        if uses_first:
            cls = min(used[b], 2)
        else:
            cls = min(asked[first_of[b]], 2) if conversations_first else 0
        rank[b] = (cls, tick)
        heapq.heappush(leaves, (rank[b], b))
    hit = total = writes = 0
    for i, (blocks, length) in enumerate(reqs):
        total += length
        matched = 0
        if blocks:
            asked[blocks[0]] += 1
        for j, b in enumerate(blocks):
            first_of.setdefault(b, blocks[0])
            if j:
                parent[b] = blocks[j - 1]
            if tinylfu:
                freq[b] += 1
                since_aging += 1
                if since_aging >= tinylfu * store_cap:
                    since_aging = 0
                    freq = defaultdict(int, {k: c // 2 for k, c in freq.items() if c > 1})
        for b in blocks:
            if b in backed or b in private or b in store:
                matched += 1
                tick += 1
                used[b] += 1
                if b in store:
                    store.move_to_end(b)
                    if leaf_store:
                        ranked(b)
            else:
                break
        hit += matched * BLOCK_TOKENS
        for b in blocks:
            if belady_store and b in store:
                due[b] = next_use(b, i)
                heapq.heappush(heap, (-due[b], b))
        for j, b in enumerate(blocks):
            for tier in (backed, private):
                if b in tier:
                    tier.move_to_end(b)
                    tier[b] += 1
                    break
            else:
                if b in store:
                    backed[b] = 1
                    continue
                private[b] = 1
                if ghost.pop(b, 0) is None:
                    wanted.add(b)
                elif long_prompt_tokens and length >= long_prompt_tokens and j < len(blocks) - tail_blocks:
                    wanted.add(b)
        while len(backed) + len(private) > host_cap:
            if backed:
                backed.popitem(last=False)
                continue
            b, uses = private.popitem(last=False)
            admit = next_use(b, i) < 1 << 40 if oracle_admit else (uses >= 2 or b in wanted)
            wanted.discard(b)
            if not admit:
                ghost[b] = None
                while len(ghost) > 2 * (host_cap + store_cap):
                    ghost.popitem(last=False)
                continue
            if tinylfu and len(store) >= store_cap and freq[b] <= freq[next(iter(store))]:
                ghost[b] = None  # not worth its victim: dropped as an unadmitted block
                continue
            writes += 1
            store[b] = None
            if leaf_store:
                tick += 1
                ranked(b)
                if parent.get(b) in store:
                    kids[parent[b]] += 1
            if belady_store:
                due[b] = next_use(b, i)
                heapq.heappush(heap, (-due[b], b))
            while len(store) > store_cap:
                if leaf_store:
                    while True:
                        r, v = heapq.heappop(leaves)
                        if v in store and rank[v] == r and not kids[v]:
                            break
                    del store[v]
                    p = parent.get(v)
                    if p in store:
                        kids[p] -= 1
                        if not kids[p]:
                            heapq.heappush(leaves, (rank[p], p))
                    continue
                if not belady_store:
                    store.popitem(last=False)
                    continue
                while True:
                    neg, v = heapq.heappop(heap)
                    if v in store and due.get(v) == -neg:
                        break
                del store[v], due[v]
    return hit / max(1, total), writes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--host", type=int, default=2196, help="host blocks (default: 5%% of the Mooncake trace)")
    ap.add_argument("--storage", type=int, default=8784, help="storage blocks (default: 20%%)")
    args = ap.parse_args()
    reqs = [(list(r.hash_ids[: r.input_length // BLOCK_TOKENS]), r.input_length) for r in load_trace(find_trace(args.trace))]
    print(f"{'model of tiered':<48}{'token hit':>10}{'writes':>10}")
    for name, kw in (("as built (LRU storage)", {}), ("admission knows the future", {"oracle_admit": True}),
                     ("storage eviction knows the future (Belady)", {"belady_store": True}),
                     ("storage evicts leaves first, LRU (tiered)", {"leaf_store": True}),
                     ("leaves first, used once before used more", {"leaf_store": True, "uses_first": True}),
                     ("leaves first, conversations asked once first", {"leaf_store": True, "conversations_first": True}),
                     ("TinyLFU admission test at storage", {"tinylfu": 10})):
        ratio, writes = replay(reqs, args.host, args.storage, **kw)
        print(f"{name:<48}{ratio:>10.4f}{writes:>10}")


if __name__ == "__main__":
    main()
