#!/usr/bin/env python3
"""Time to first token of storage hits against recomputing, with and without the recompute bound.

A storage hit that is slower than recomputing is a bug (SGLang users report a file-backend hit
at 2,450 ms TTFT against 1,725 ms recomputed). The ``timeout`` prefetch policy waits a fixed
``2 s + 0.1 s`` per 1Ki tokens; with the engine's prefill rate known, hicache also stops the
wait once the missing pages would be recomputed sooner than fetched
(:mod:`hicache.controller.recompute`). This benchmark measures both on the real engine (the demo
model, :class:`hicache.engine.Engine`) and the real ``file`` backend in a temporary folder:

1. ``recompute``: every prompt prefilled from token 0 (:class:`RecomputeCache`), the baseline;
2. each store speed (``fast``: the file store as it is; ``slow``: the same store with
   ``--latency-ms`` added to every call and reads throttled to ``--mbps``, a remote store's
   shape), each with the ``timeout`` policy as SGLang has it (``fixed``) and with the rate the
   engine reports (``bounded``).

Per variant: a writer cache stores the ``--prompts`` target prompts, then a fresh cache on the
same folder (a restart: storage holds them, device and host do not) first serves
``--warmup`` unrelated prompts (the engine reports their prefills, so the bounded variants know
the rate, as a server that has run a while does), then each target prompt plus a new question,
one at a time. TTFT is the engine's (``begin`` with its prefetch wait, then the prefill).

Prints one JSON document (also written to ``--out``): per variant the median TTFT of the asks,
its ratio to ``recompute`` in the same run and to ``miss``, hicache's TTFT for a prompt of the
same length that storage does not hold (the warm-up prompts on the fast store: what a request
that gives up on storage at once costs; a bounded variant should be at most about 1.0x of it,
and a fixed one on a slowed store is not), tokens served from storage, and the asks' waits the
bound cut. Example::

    .venv/bin/python scripts/bench_prefetch_stop.py --prompts 6 --tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hicache.bench_args import output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402
from hicache.config import HiCacheConfig  # noqa: E402
from hicache.engine import Engine, ModelSpec, TinyTransformer  # noqa: E402
from hicache.engine.recompute import RecomputeCache  # noqa: E402
from hicache.facade import HiCache  # noqa: E402
from hicache.testing.slow_store import register_slow_file  # noqa: E402

def parse_stores(text: str) -> dict[str, tuple[float, float]]:
    """``name=latency_ms:mbps,...`` -> ``{name: (latency_ms, mbps)}``."""
    out: dict[str, tuple[float, float]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            name, shape = item.split("=")
            latency, mbps = (float(v) for v in shape.split(":"))
        except ValueError:
            raise SystemExit(f"--stores: {item!r} is not name=latency_ms:mbps") from None
        if not name or name == "fast" or latency < 0 or mbps <= 0:
            raise SystemExit(f"--stores: {item!r}: a new name, latency >= 0 and mbps > 0")
        out[name] = (latency, mbps)
    return out


def config_for(root: Path, backend: str, rate: float | None, shape: tuple[float, float] | None = None) -> HiCacheConfig:
    """The cache's config; ``shape`` (latency ms, MB/s) slows the store's reads
    (:class:`hicache.testing.slow_store.SlowFileStorage`, registered as ``slow-file``)."""
    options: dict[str, Any] = {"root": str(root), "max_bytes": 1 << 32, "min_free_bytes": 0}
    if shape is not None:
        backend = "slow-file"
        options.update(latency_ms=shape[0], read_mbps=shape[1])
    return HiCacheConfig.model_validate({
        "model": {"name": "bench/prefetch-stop", "num_layers": 4, "num_kv_heads": 2, "head_dim": 32},
        "device": {"device": "cpu", "size_tokens": 16384, "page_size": 16, "max_context_len": 8192},
        "host": {"ratio": 2.0},
        "storage": {"backend": backend, "options": options},
        "cache": {"write_policy": "write_through",
                  "prefetch": {"policy": "timeout", "threshold_tokens": 0, "recompute_tokens_per_s": rate}},
        "session": {"enabled": False},
    })


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


async def serve(cache: Any, model: TinyTransformer, prompts: Sequence[list[int]], tag: str) -> list[Any]:
    engine = Engine(cache, model)
    try:
        return [await engine.generate(f"{tag}-{i}", p, 1) for i, p in enumerate(prompts)]
    finally:
        await engine.aclose()


async def run_variant(name: str, store: str, shape: tuple[float, float] | None, bounded: bool, model: TinyTransformer,
                      targets: list[list[int]], asks: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hicache-bench-stop-") as tmp:
        root = Path(tmp)
        async with HiCache.from_config(config_for(root, "file", None)) as writer:
            await serve(writer, model, targets, "write")
            await writer.drain()
        async with HiCache.from_config(config_for(root, "file", None, shape)) as cache:
            controller = cache._require_stack().controller
            if not bounded:  # SGLang's timeout policy: no rate, whatever the engine reports
                controller._prefetcher.prefill.observe = lambda *a: None  # type: ignore[method-assign]
            cold = await serve(cache, model, warmup, "warm")  # the engine reports these prefills
            counters = controller.metrics.counters
            cut_before = counters["prefetch_cut_recompute"]
            results = await serve(cache, model, asks, name)
            rate = controller._prefetcher.prefill.tokens_per_s
            pace = controller._prefetcher.pace.seconds_per_page
            cut = int(counters["prefetch_cut_recompute"] - cut_before)
    ttfts = [r.ttft_s for r in results]
    full = len(asks[0])
    return {
        "store": store,
        "bound": bounded,
        "ttft_ms_p50": statistics.median(ttfts) * 1e3,
        # the same cache recomputing prompts of the asks' length that storage does not have (on a
        # slowed store the fixed policy also waits for its exists answer)
        "cold_ttft_ms_p50": statistics.median(r.ttft_s for r in cold if r.prompt_tokens >= full) * 1e3,
        "ttft_ms": [round(t * 1e3, 2) for t in ttfts],
        "storage_tokens": sum(r.hits.get("storage", 0) for r in results),
        "prefill_tokens": sum(r.prefill_tokens for r in results),
        "waits_cut_by_bound": cut,
        "learned_tokens_per_s": rate,
        "store_ms_per_page": None if pace is None else pace * 1e3,
    }


async def run_recompute(model: TinyTransformer, asks: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hicache-bench-stop-") as tmp:
        cache = RecomputeCache(config_for(Path(tmp), "file", None))
        await serve(cache, model, warmup, "warm")
        results = await serve(cache, model, asks, "recompute")
    ttfts = [r.ttft_s for r in results]
    return {"ttft_ms_p50": statistics.median(ttfts) * 1e3, "ttft_ms": [round(t * 1e3, 2) for t in ttfts],
            "prefill_tokens": sum(r.prefill_tokens for r in results)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    register_slow_file()
    shapes: dict[str, tuple[float, float] | None] = {"fast": None, **parse_stores(args.stores)}
    torch.set_num_threads(args.torch_threads)
    spec = ModelSpec.from_model_config(config_for(Path("."), "file", None).model, max_positions=8192)
    model = TinyTransformer(spec)
    targets = [prompt(args.tokens, seed=100 + i) for i in range(args.prompts)]
    asks = [t + prompt(args.question_tokens, seed=500 + i) for i, t in enumerate(targets)]
    # mixed lengths (the rate's fit needs them); every third as long as an ask (the cold TTFT)
    warmup = [prompt((len(asks[0]) if i % 3 == 0 else args.tokens // (1 + i % 3)), seed=900 + i)
              for i in range(args.warmup)]
    report: dict[str, Any] = {
        "what": "TTFT of storage hits after a restart vs recomputing, timeout policy with a fixed wait and with the recompute bound",
        "prompts": args.prompts, "tokens": args.tokens, "question_tokens": args.question_tokens,
        "stores": {name: None if shape is None else {"latency_ms": shape[0], "mbps": shape[1]}
                   for name, shape in shapes.items()},
        "variants": {},
    }
    order = [(f"{store}_{kind}", store, kind == "bounded") for store in shapes for kind in ("fixed", "bounded")]
    recompute = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in order}
    for rep in range(args.repeats):
        recompute.append(await run_recompute(model, asks, warmup))
        for name, store, bounded in order:
            runs[name].append(await run_variant(name, store, shapes[store], bounded, model, targets, asks, warmup))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    base = statistics.median(r["ttft_ms_p50"] for r in recompute)
    report["recompute"] = {"ttft_ms_p50": base, "runs": recompute}
    # what a request that finds nothing in storage costs through hicache (the fast store answers
    # its lookup at once): where a request that gives up on a slow store should land
    miss = statistics.median(r["cold_ttft_ms_p50"] for r in runs["fast_fixed"] + runs["fast_bounded"])
    report["miss"] = {"ttft_ms_p50": miss, "vs_recompute": miss / base if base else None}
    for name, rs in runs.items():
        p50 = statistics.median(r["ttft_ms_p50"] for r in rs)
        report["variants"][name] = {
            "ttft_ms_p50": p50,
            "ttft_vs_recompute": p50 / base if base else None,
            "ttft_vs_miss": p50 / miss if miss else None,
            "per_repeat_vs_recompute": [r["ttft_ms_p50"] / rc["ttft_ms_p50"] for r, rc in zip(rs, recompute)],
            "runs": rs,
        }
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=positive_int, default=6, help="target prompts stored, then asked again")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens of each stored prompt")
    p.add_argument("--question-tokens", type=positive_int, default=32, help="new tokens after the stored prompt")
    p.add_argument("--warmup", type=positive_int, default=9, help="unrelated prompts served first (their prefills set the rate)")
    p.add_argument("--stores", default="par=30:50,slow=50:15",
                   help="slowed stores besides the plain file store ('fast'), as name=latency_ms:mbps,... "
                        "(latency added to every call, reads throttled to mbps)")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--torch-threads", type=positive_int, default=2)
    p.add_argument("--out", type=output_file, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = asyncio.run(main_async(args))
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
