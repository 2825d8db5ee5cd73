#!/usr/bin/env python3
"""Device eviction cost on the event loop: the eviction index against a walk of the whole tree.

For trees of growing size (requests of 4 pages under 100 shared 2-page prefixes, so about one
node per request), it measures one ``evict`` of one page through the index, against the same
victim search done the way a tree walk does it (collect the unlocked device leaves, heapify,
pop), on the same tree in the same run. Both pick the same victim; the script checks that.

Prints one JSON document (also written to ``--out``). Example::

    .venv/bin/python scripts/bench_evict.py --sizes 1000,10000
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.memory import PagedTokenAllocator  # noqa: E402
from hicache.prefix_cache import EvictParams, InsertParams, RadixCache, RadixKey  # noqa: E402
from hicache.bench_args import int_list, non_negative_int, output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402


def build(n_requests: int, page_size: int, seed: int) -> tuple[RadixCache, PagedTokenAllocator]:
    rng = random.Random(seed)
    alloc = PagedTokenAllocator((n_requests * 2 + 200 + 64) * page_size, page_size)
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size)
    roots = [[rng.randrange(1 << 30) for _ in range(2 * page_size)] for _ in range(100)]
    for i in range(n_requests):
        tokens = roots[i % 100] + [rng.randrange(1 << 30) for _ in range(2 * page_size)]
        value = alloc.alloc(len(tokens))
        res = cache.insert(InsertParams(key=RadixKey(tokens), value=value))
        if res.prefix_len:
            alloc.free(value[: res.prefix_len])
    return cache, alloc


def walk_victim(cache: RadixCache) -> Any:
    """The victim as a walk of the whole tree finds it (what eviction cost before the index)."""
    heap = [(cache._evict_key(n), n.id, n) for n in cache._nodes() if cache._is_device_leaf(n)]
    heapq.heapify(heap)
    return heapq.heappop(heap)[2] if heap else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int_list, default=[1000, 10000, 50000],
                   help="requests inserted (about one node each), comma-separated; each at least --reps")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--reps", type=positive_int, default=20, help="evictions timed per size (each takes a leaf)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", type=output_file, default=None)
    args = p.parse_args(argv)
    small = [n for n in args.sizes if n < args.reps]
    if small:  # each repeat evicts a leaf: a smaller tree runs out of them before the last one
        p.error(f"--sizes {small}: each size must be at least --reps ({args.reps})")
    rows = []
    for n in args.sizes:
        cache, _ = build(n, args.page_size, args.seed)
        nodes = sum(1 for _ in cache._nodes())
        walk_s, index_s = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            want = walk_victim(cache)
            walk_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cache.evict(EvictParams(num_tokens=1))
            index_s.append(time.perf_counter() - t0)
            if want is None or want.value is not None:
                raise SystemExit(f"the index evicted another node than the tree walk picks ({want!r})")
        walk, index = statistics.median(walk_s), statistics.median(index_s)
        rows.append({
            "requests": n, "nodes": nodes,
            "tree_walk_ms": round(walk * 1e3, 3), "index_evict_ms": round(index * 1e3, 3),
            "speedup": round(walk / index, 1),
        })
    report = {"benchmark": "hicache.prefix_cache eviction", "page_size": args.page_size, "reps": args.reps,
              "results": rows}
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
