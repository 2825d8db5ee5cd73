"""What per-request miss attribution costs: the trace replay with it on and off, same process.

Each round replays the first ``--requests`` requests of the Mooncake trace through a fresh
stack (the replay config's tiers, so device, host and storage evict), once with attribution and
once without, in alternating order; the report is the median wall and CPU time of each and their
ratio, plus the attribution's own time per request (measured around its hook) and the miss
breakdown. JSON on stdout.

    python scripts/bench_attribution.py --requests 600 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hicache.bench_args import positive_int  # noqa: E402
from hicache.observability.attribution_flow import TreeAttribution  # noqa: E402
from hicache.replay import load_replay_config, load_trace, unique_blocks  # noqa: E402
from hicache.replay import runner  # noqa: E402
from hicache.replay.trace import find_trace  # noqa: E402


def _timed_hook() -> list[float]:
    """Wrap the attribution hook to sum its own time (restored by the caller)."""
    spent: list[float] = []
    inner = TreeAttribution.after_admit

    def after_admit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    TreeAttribution.after_admit = after_admit  # type: ignore[method-assign]
    return spent


async def _one(cfg, requests, basis, attribution: bool) -> dict:  # type: ignore[no-untyped-def]
    original = runner.build_stack

    def build(stack_cfg, **kw):  # type: ignore[no-untyped-def]
        return original(dataclasses.replace(stack_cfg, attribution=attribution), **kw)

    runner.build_stack = build
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        result = await runner.replay_requests(cfg, requests, basis_unique_blocks=basis)
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "result": result}
    finally:
        runner.build_stack = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=600)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--config", default=str(REPO / "configs" / "replay-20pct.toml"))
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    everything = load_trace(find_trace(args.trace))
    requests = everything[: args.requests]
    cfg = load_replay_config(args.config)
    basis = unique_blocks(everything)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    inner = TreeAttribution.after_admit
    hook_s: list[float] = []
    try:
        for r in range(args.rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                spent = _timed_hook() if mode == "on" else None
                out = asyncio.run(_one(cfg, requests, basis, mode == "on"))
                TreeAttribution.after_admit = inner  # type: ignore[method-assign]
                if spent is not None:
                    hook_s.append(sum(spent) / max(1, len(spent)))
                runs[mode].append(out)
    finally:
        TreeAttribution.after_admit = inner  # type: ignore[method-assign]
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("wall_s", "cpu_s")} for m, v in runs.items()}
    same = runs["on"][0]["result"]
    off = runs["off"][0]["result"]
    print(json.dumps({
        "requests": len(requests),
        "rounds": args.rounds,
        "median": med,
        "ratio_on_over_off": {k: med["on"][k] / med["off"][k] for k in ("wall_s", "cpu_s")},
        "per_round_wall_ratio": [a["wall_s"] / b["wall_s"] for a, b in zip(runs["on"], runs["off"])],
        "attribution_us_per_request_median": statistics.median(hook_s) * 1e6,
        "same_hits": {t: same[f"{t}_hit_tokens"] == off[f"{t}_hit_tokens"] for t in ("device", "host", "storage")},
        "attribution": same["attribution"],
    }, indent=2))


if __name__ == "__main__":
    main()
