#!/usr/bin/env python3
"""What metrics cost the request path: one ``ControllerMetrics`` update of each kind against the
dict-only update it replaced, and one scrape, all in the same process.

Medians over ``--rounds`` rounds of best-of-3 timings of ``--calls`` calls each (rounds
interleave the kinds, so machine load hits them alike). Prints one JSON document. Example::

    .venv/bin/python scripts/bench_metrics.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

from hicache.bench_args import positive_int
from hicache.controller.metrics import ControllerMetrics
from hicache.observability.metrics import exposition


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=positive_int, default=20_000)
    ap.add_argument("--rounds", type=positive_int, default=5)
    args = ap.parse_args()
    m = ControllerMetrics()
    plain: dict[str, float] = {"requests": 0}

    def dict_only() -> None:  # what ControllerMetrics.incr did before prometheus_client
        plain["requests"] = plain.get("requests", 0) + 1

    kinds = {
        "dict_only_incr": dict_only,
        "incr": lambda: m.incr("requests"),
        "transfer": lambda: m.transfer("h2s", 4, 4096, 0.001),
        "observe": lambda: m.observe("get", "storage", 0.002),
    }
    us: dict[str, list[float]] = {k: [] for k in kinds}
    scrape_ms: list[float] = []
    for _ in range(args.rounds):
        for name, fn in kinds.items():
            us[name].append(min(timeit.repeat(fn, number=args.calls, repeat=3)) / args.calls * 1e6)
        scrape_ms.append(min(timeit.repeat(exposition, number=20, repeat=3)) / 20 * 1e3)
    out = {f"{k}_us": round(statistics.median(v), 3) for k, v in us.items()}
    out["scrape_ms"] = round(statistics.median(scrape_ms), 3)
    out["scrape_bytes"] = len(exposition())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
