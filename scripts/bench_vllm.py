"""Multi-turn chat on a real vLLM (the CPU build), with and without hicache, in one run.

Run with the vLLM environment (scripts/test_vllm.sh makes it):

    .venv-vllm/bin/python scripts/bench_vllm.py            # JSON on stdout
    .venv-vllm/bin/python scripts/bench_vllm.py --quick    # fewer chats and turns

Workload: ``--chats`` conversations of ``--turns`` turns, served one request at a time, chats
interleaved (turn 1 of every chat, then turn 2, ...). Every turn's prompt is the whole
conversation so far plus ``--user-tokens`` new tokens; the answer is ``--answer-tokens``
greedy tokens. vLLM's own KV cache is limited to ``--gpu-blocks`` blocks (fewer than the
chats need together), as on a busy server where a conversation's KV is evicted before its
next turn: without hicache that turn recomputes the whole history, with hicache its blocks come
back from hicache's host pool or file store.

Both configurations run the same engine (a local Llama made on the spot, seeded weights),
each in its own process, side by side: they take turns request by request, so load from
elsewhere on the machine falls on both alike. ``--repeats`` passes over the workload (new chats
each pass); the report gives medians over passes of the TTFT percentiles and the throughput
(requests per second of engine time), and how many answers are equal in both configurations (greedy decoding; see the report's
comment on ``answers_equal``).

A slow store (``--store-latency-ms``, ``--store-mbps``: the file store behind a remote store's
latency and bandwidth, :mod:`hicache.testing.slow_store`) adds a third engine,
``vllm+hicache-unbounded``: the connector claiming every storage hit as before, against
``vllm+hicache`` claiming them only while a read is no slower than recomputing (the pace both
are learned on the spot; ``recompute_bound``). Give the host tier few pages (``--host-pages``)
so that hits come from storage::

    .venv-vllm/bin/python scripts/bench_vllm.py --store-latency-ms 20 --store-mbps 5 --host-pages 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hicache.bench_args import output_file, positive_int  # noqa: E402
from hicache.bench_engine import EngineProcess, say  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402


def _percentile(values: list[float], q: float) -> float | None:
    """``None`` for no values (a one-turn workload has no later turns)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b




def serve_engine(spec: dict[str, Any]) -> None:
    """Inside an engine process: start the engine, then answer one request per stdin line
    (token ids as JSON) with one tagged stdout line (answer, cached tokens, TTFT)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
        if spec["connector"]["kv_connector_extra_config"]["backend"] == "slow-file":
            from hicache.testing.slow_store import register_slow_file

            register_slow_file()  # scheduler and worker share this process ("uni" executor)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              block_size=spec["block_size"], enforce_eager=True, seed=0, max_num_seqs=4,
              num_gpu_blocks_override=spec["gpu_blocks"], disable_log_stats=False,
              distributed_executor_backend="uni", **kwargs)
    sp = SamplingParams(max_tokens=spec["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], sp, use_tqdm=False)  # warm-up, not measured
    say({"ready": True})
    for line in sys.stdin:
        prompt = json.loads(line)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        m = out.metrics
        ttft = float(m.first_token_latency) if m is not None and m.first_token_latency else wall
        say({"answer": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0),
             "ttft_s": ttft, "wall_s": wall})


def start_engine(spec: dict[str, Any], log: Path) -> EngineProcess:
    """One engine process and its request pipe."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return EngineProcess(__file__, spec, log, env, log_tail=4000)


def summarize(rows: list[dict[str, Any]], total_s: float) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "ttft_p50_ms": _ms(_percentile([r["ttft_s"] for r in rows], 0.5)),
        "ttft_p90_ms": _ms(_percentile([r["ttft_s"] for r in rows], 0.9)),
        "ttft_p50_later_turns_ms": _ms(_percentile([r["ttft_s"] for r in later], 0.5)),
        "requests_per_s": len(rows) / total_s,
        "prompt_tokens": prompt,
        "cached_fraction": sum(r["cached"] for r in rows) / prompt,
        "busy_s": total_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="4 chats x 3 turns, one repeat")
    ap.add_argument("--chats", type=positive_int, default=6)
    ap.add_argument("--turns", type=positive_int, default=4)
    ap.add_argument("--system-tokens", type=positive_int, default=768)
    ap.add_argument("--user-tokens", type=positive_int, default=96)
    ap.add_argument("--answer-tokens", type=positive_int, default=8)
    ap.add_argument("--gpu-blocks", type=positive_int, default=96, help="vLLM's KV cache, in blocks")
    ap.add_argument("--block-size", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=3, help="passes over the workload (new chats each time)")
    ap.add_argument("--host-pages", type=positive_int, default=1024, help="hicache's host tier, in pages")
    ap.add_argument("--store-latency-ms", type=float, default=0.0,
                    help="slow the store: every lookup and read call waits this long (adds the unbounded engine)")
    ap.add_argument("--store-mbps", type=float, default=0.0, help="slow the store: reads at this many MB/s")
    ap.add_argument("--out", type=output_file, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.engine:
        serve_engine(json.loads(args.engine))
        return 0
    if args.quick:
        args.chats, args.turns, args.repeats = 4, 3, 1
    from hicache.testing.tiny_model import make_tiny_llama

    slow = args.store_latency_ms > 0 or args.store_mbps > 0
    names: tuple[str, ...] = ("vllm", "vllm+hicache") + (("vllm+hicache-unbounded",) if slow else ())
    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as d:
        tmp = Path(d)
        shape = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=512)
        model = make_tiny_llama(tmp / "model", **shape)
        base = {"model": str(model), "block_size": args.block_size, "gpu_blocks": args.gpu_blocks,
                "answer_tokens": args.answer_tokens}
        def hicache(name: str) -> dict[str, Any] | None:
            if name == "vllm":
                return None
            store: dict[str, Any] = {"root": str(tmp / name / "store")}
            extra: dict[str, Any] = {"backend": "file", "host_pages": args.host_pages, "backend_options": store}
            if slow:
                store.update(latency_ms=args.store_latency_ms, read_mbps=args.store_mbps)
                extra.update(backend="slow-file", recompute_bound=name == "vllm+hicache")
            return {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}

        # the engines run side by side and take turns request by request, so that load from
        # elsewhere on the machine falls on all alike
        engines = {n: start_engine(dict(base, connector=hicache(n)), tmp / f"{n}.log") for n in names}
        try:
            for e in engines.values():
                e.reply()  # ready
            vocab, u = shape["vocab"], args.user_tokens
            rows: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
            for rep in range(args.repeats):
                hist = {n: [[(rep * 7 + c * 7919 + i * 31 + 17) % (vocab - 3) + 3 for i in range(args.system_tokens)]
                            for c in range(args.chats)] for n in names}
                for n in names:
                    rows[n].append([])
                for turn in range(args.turns):
                    for c in range(args.chats):
                        user = [(rep * 13 + c * 104729 + turn * 613 + i * 7) % (vocab - 3) + 3 for i in range(u)]
                        k = (turn + c) % len(names)
                        order = names[k:] + names[:k]
                        for n in order:
                            prompt = hist[n][c] + user
                            r = engines[n].send(prompt)
                            rows[n][rep].append({"chat": c, "turn": turn, "prompt_tokens": len(prompt),
                                                 "prompt": hash(tuple(prompt)), **r})
                            hist[n][c] = prompt + r["answer"]
                print(f"# repeat {rep} done", file=sys.stderr)
        finally:
            for e in engines.values():
                e.close()
    runs = {n: [summarize(rs, sum(r["wall_s"] for r in rs)) for rs in rows[n]] for n in names}
    med = {n: {k: _median([s[k] for s in runs[n]]) for k in runs[n][0]} for n in names}
    # each engine continues its own conversations: once an answer differs, the two prompts of
    # that chat differ from then on, and their answers say nothing of the cache. Pairs are
    # compared while the prompts are the same
    pairs = [(a["answer"], b["answer"]) for ra, rb in zip(rows["vllm"], rows["vllm+hicache"])
             for a, b in zip(ra, rb) if a["prompt"] == b["prompt"]]
    report = {
        "workload": {"chats": args.chats, "turns": args.turns, "system_tokens": args.system_tokens,
                     "user_tokens": u, "answer_tokens": args.answer_tokens, "gpu_blocks": args.gpu_blocks,
                     "block_size": args.block_size, "repeats": args.repeats, "model": shape},
        "median": med,
        "runs": runs,
        "ttft_p50_speedup": _ratio(med["vllm"]["ttft_p50_ms"], med["vllm+hicache"]["ttft_p50_ms"]),
        "ttft_p50_later_turns_speedup": _ratio(med["vllm"]["ttft_p50_later_turns_ms"],
                                               med["vllm+hicache"]["ttft_p50_later_turns_ms"]),
        "throughput_speedup": _ratio(med["vllm+hicache"]["requests_per_s"], med["vllm"]["requests_per_s"]),
        # greedy answers of the two configurations, request by request. The first token of
        # every answer depends only on the prompt's KV; later turns also attend to KV of
        # generated tokens, which decode computed (with hicache restored, as vLLM's own
        # prefix cache would) while the baseline recomputes it in a prefill: bf16 rounds the
        # two differently, and a random-weight model's near-flat logits can flip.
        "first_answer_tokens_equal": sum(a[:1] == b[:1] for a, b in pairs) / max(1, len(pairs)),
        "answers_equal": sum(a == b for a, b in pairs) / max(1, len(pairs)),
        "answers_compared": len(pairs),
    }
    if slow:
        report["store"] = {"latency_ms": args.store_latency_ms, "read_mbps": args.store_mbps,
                           "host_pages": args.host_pages}
        for n in names[1:]:  # TTFT against vLLM alone: above 1.0 the cache made it slower
            report[f"{n}_ttft_p50_vs_vllm"] = _ratio(med[n]["ttft_p50_ms"], med["vllm"]["ttft_p50_ms"])
            report[f"{n}_ttft_p50_later_turns_vs_vllm"] = _ratio(med[n]["ttft_p50_later_turns_ms"],
                                                                 med["vllm"]["ttft_p50_later_turns_ms"])
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
