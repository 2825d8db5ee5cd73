#!/usr/bin/env python
"""Repeat the demo's cached and restart phases many times, to catch outcomes that depend on
how requests interleave.

    .venv/bin/python scripts/demo_stress.py --runs 20 [--device-tokens 1440] [--quick] [-c CONFIG]

Why: ``hicache demo`` runs each phase once, so an outcome that needs a rare interleaving (a
request that gives up waiting for device room, KV read from a page being reused) shows up once
in many runs and cannot be told apart afterwards. This computes the no-cache answers once (the
reference recompute, which the demo's baseline equals by construction), then runs the cached
phase and the restart phase ``--runs`` times, each in a fresh storage namespace, and prints one
JSON line per run: requests that failed and answers that differ, counted apart (only the latter
can mean wrong KV), memory waits, hits per tier and the load average. ``HICACHE__*`` variables
override the config as usual (``HICACHE__HOST__RATIO=1.0``: a host pool the size of the device,
so history comes back from storage). Exit status 1 when any request failed or answer differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from hicache.bench_args import positive_int
from hicache.config import load_config
from hicache.config.schema import HiCacheConfig
from hicache.demo import FULL_WORKLOAD, QUICK_WORKLOAD, demo_config, run_cached_phases
from hicache.engine.model import ModelSpec, TinyTransformer
from hicache.engine.runner import reference_generate
from hicache.server.loadgen import Workload, conversation_turn_tokens, system_prompt

#: the repository (the default config is found from any working directory)
REPO = Path(__file__).resolve().parents[1]

Answers = dict[tuple[int, int], list[int]]


def reference_answers(config: HiCacheConfig, w: Workload) -> Answers:
    """Every conversation's answers by full recompute, turn by turn (a turn's prompt holds
    the earlier answers)."""
    spec = ModelSpec.from_model_config(config.model, max_positions=config.device.max_context_len)
    model = TinyTransformer(spec)
    out: Answers = {}
    for client in range(w.clients):
        history = list(system_prompt(w))
        for turn in range(w.turns):
            history += conversation_turn_tokens(w, client, turn)
            out[client, turn] = reference_generate(model, history, w.max_new_tokens)
            history += out[client, turn]
    return out


async def one_run(config: HiCacheConfig, w: Workload, ref: Answers, device_tokens: int | None) -> dict[str, Any]:
    salt = f"stress-{uuid.uuid4().hex[:12]}"
    cfg = demo_config(config, w, salt=salt)
    if device_tokens:
        cfg = cfg.model_copy(update={"device": cfg.device.model_copy(update={"size_tokens": device_tokens})})
    runs = await run_cached_phases(cfg, w, salt)
    cached = runs.cached
    check = runs.check(ref)
    failed = runs.failures()
    waits = cached["memory_retries"]
    return {
        "device_tokens": cfg.device.size_tokens,
        "answers_compared": check.compared,
        "answers_differing": check.differing,
        "answers_missing": check.missing,
        "failed_requests": failed,
        "memory_waits": waits,
        "prompt_tokens": cached["summary"]["prompt_tokens"],
        "hit_tokens": cached["summary"]["hit_tokens"],
        "wall_s": round(cached["wall_s"], 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


async def main_async(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    w = QUICK_WORKLOAD if args.quick else FULL_WORKLOAD
    ref = await asyncio.to_thread(reference_answers, config, w)
    bad_runs = 0
    for i in range(args.runs):
        row = await one_run(config, w, ref, args.device_tokens)
        bad_runs += bool(row["answers_differing"] or row["answers_missing"] or row["failed_requests"])
        print(json.dumps({"run": i, **row}), flush=True)
    print(json.dumps({"runs": args.runs, "runs_with_a_failure_or_difference": bad_runs}), flush=True)
    return 1 if bad_runs else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", default=str(REPO / "configs" / "default.toml"))
    p.add_argument("--runs", type=positive_int, default=10)
    p.add_argument("--device-tokens", type=positive_int, default=None, help="device pool (default: the demo's)")
    p.add_argument("--quick", action="store_true", help="the demo's quick workload")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
