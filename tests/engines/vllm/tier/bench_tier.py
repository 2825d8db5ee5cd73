"""Store and load throughput of hicache's tier against vLLM's own ``fs`` tier, both behind
vLLM's ``TieringOffloadingManager`` in the same process, interleaved and repeated.

    .venv-vllm/bin/python tests/engines/vllm/tier/bench_tier.py [--chunks 64] [--mib 2] [--repeats 5]

Per repeat and tier: a fresh engine stores ``chunks`` chunks of ``mib`` MiB (cascade from the
primary tier to the secondary tier, timed until every job is finished), then another fresh
engine looks the prompt up and promotes every chunk back (timed until all are primary hits,
bytes checked). Each repeat uses a new root; the page cache is warm for both tiers alike.
Prints one JSON object: medians and the hicache/fs ratio (higher is faster for hicache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiering import BLOCK, Engine, block_keys, nvidia_gpu, payload, tier_config  # noqa: E402

from hicache.integrations.vllm import block_format  # noqa: E402


def tiers(root: str) -> dict[str, dict]:
    return {
        "hicache": tier_config(options={"root": root + "/hicache", "min_free_bytes": 0}),
        "fs": {"type": "fs", "root_dir": root + "/fs"},
    }


def one(tier: dict, keys: list[bytes], block_bytes: int) -> tuple[float, float]:
    with Engine([tier], chunks=len(keys) + 8, block_bytes=block_bytes) as first:
        t0 = time.perf_counter()
        first.store(keys)
        store_s = time.perf_counter() - t0
    with Engine([tier], chunks=len(keys) + 8, block_bytes=block_bytes) as second:
        t0 = time.perf_counter()
        got = second.load(keys)
        load_s = time.perf_counter() - t0
        assert got == [payload(k, second.chunk_bytes) for k in keys], "a tier returned wrong bytes"
    return store_s, load_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    block_format._platform = nvidia_gpu  # a GPU engine's scheduler side, as the tests play it
    block_bytes = args.mib << 20
    keys = block_keys(list(range(args.chunks * BLOCK)))
    for key in keys:  # made once, outside the timed stores
        payload(key, block_bytes)
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as root:
            order = list(tiers(root).items())
            for name, tier in order if r % 2 == 0 else order[::-1]:  # interleave
                s, ld = one(tier, keys, block_bytes)
                times.setdefault(name, {"store": [], "load": []})
                times[name]["store"].append(s)
                times[name]["load"].append(ld)
    mib = args.chunks * args.mib
    out = {"chunks": args.chunks, "chunk_mib": args.mib, "repeats": args.repeats}
    for name, t in times.items():
        out[name] = {op: {"median_s": round(statistics.median(v), 4),
                          "mib_per_s": round(mib / statistics.median(v), 1)} for op, v in t.items()}
    for op in ("store", "load"):
        out[f"{op}_ratio_hicache_over_fs"] = round(
            statistics.median(times["fs"][op]) / statistics.median(times["hicache"][op]), 2
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
