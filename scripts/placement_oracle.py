"""Diagnostic: how far `tiered`'s admission is from perfect knowledge, on the real cache.

Replays the trace through the real stack with `tiered`, except that write-back at host eviction
admits a page exactly when the trace references it again later (known only offline). Everything
else (tiers, host order, ancestors first, the memory backend's LRU) is the cache's own, so the
difference to `hicache replay`'s `tiered` row is what a better admission rule could still gain.
Not a policy: it reads the future.

    .venv/bin/python scripts/placement_oracle.py [-c configs/replay-20pct.toml] [--trace T]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import dataclasses
import json

from hicache.placement.tiered import TieredPlacement
from hicache.prefix_cache.hashing import fast_page_hashes
from hicache.replay import runner
from hicache.replay.trace import request_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default="configs/replay-20pct.toml")
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    cfg, requests, basis, _ = runner.replay_inputs(args.config, args.trace)
    refs: dict[str, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(requests):
        for key in fast_page_hashes(request_tokens(r), cfg.page_size, None):
            refs[key].append(i)
    now = [0]
    serve = runner.serve_request

    async def serve_counted(stack, tokens, *, rid, **kw):  # type: ignore[no-untyped-def]
        now[0] = int(rid[1:])  # the replay names request i "r{i}"
        return await serve(stack, tokens, rid=rid, **kw)

    def reused_later(key: str) -> bool:
        times = refs.get(key, [])
        return bisect.bisect_right(times, now[0]) < len(times)

    def oracle_pages(self: TieredPlacement, node) -> int:  # type: ignore[no-untyped-def]
        n = 0
        while n < len(node.hash_value) and reused_later(node.hash_value[n]):
            n += 1
        return n

    runner.serve_request = serve_counted  # type: ignore[assignment]
    TieredPlacement.victim_pages = oracle_pages  # type: ignore[method-assign]
    cfg = dataclasses.replace(cfg, placement="tiered")
    res = asyncio.run(runner.replay_requests(cfg, requests, basis_unique_blocks=basis))
    print(json.dumps({"hit_ratio_tokens": res["hit_ratio_tokens"], "storage_written_bytes": res["bytes"]["h2s"],
                      "verification_failures": res["verification_failures"], **res["placement"]}, indent=1))


if __name__ == "__main__":
    main()
