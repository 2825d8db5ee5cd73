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
each in its own process, alternated ``--repeats`` times (baseline first); the report gives
medians over repeats of the TTFT percentiles and the throughput, and how many answers are equal in both configurations (greedy decoding; see the report's
comment on ``answers_equal``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hicache.bench_output import emit_report  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside the engine process: play the workload, return per-request figures."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              block_size=spec["block_size"], enforce_eager=True, seed=0, max_num_seqs=4,
              num_gpu_blocks_override=spec["gpu_blocks"], disable_log_stats=False,
              distributed_executor_backend="uni", **kwargs)
    sp = SamplingParams(max_tokens=spec["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    vocab, u = spec["vocab"], spec["user_tokens"]
    history = [[(c * 7919 + i * 31 + 17) % (vocab - 3) + 3 for i in range(spec["system_tokens"])]
               for c in range(spec["chats"])]
    # warm-up request (not measured): kernels, allocator
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], sp, use_tqdm=False)
    rows = []
    t_start = time.perf_counter()
    for turn in range(spec["turns"]):
        for c in range(spec["chats"]):
            user = [(c * 104729 + turn * 613 + i * 7) % (vocab - 3) + 3 for i in range(u)]
            prompt = history[c] + user
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            answer = list(out.outputs[0].token_ids)
            m = out.metrics
            ttft = float(m.first_token_latency) if m is not None and m.first_token_latency else wall
            rows.append({"chat": c, "turn": turn, "prompt_tokens": len(prompt), "cached_tokens": int(out.num_cached_tokens or 0),
                         "ttft_s": ttft, "wall_s": wall, "answer": answer})
            history[c] = prompt + answer
    total = time.perf_counter() - t_start
    return {"rows": rows, "total_s": total}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    later = [r for r in rows if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "ttft_p50_ms": 1000 * _percentile([r["ttft_s"] for r in rows], 0.5),
        "ttft_p90_ms": 1000 * _percentile([r["ttft_s"] for r in rows], 0.9),
        "ttft_p50_later_turns_ms": 1000 * _percentile([r["ttft_s"] for r in later], 0.5) if later else None,
        "requests_per_s": len(rows) / result["total_s"],
        "output_tokens_per_s": sum(len(r["answer"]) for r in rows) / result["total_s"],
        "prompt_tokens": prompt,
        "cached_fraction": sum(r["cached_tokens"] for r in rows) / prompt,
        "total_s": result["total_s"],
    }


def spawn(spec: dict[str, Any], tmp: Path, name: str, timeout: float) -> dict[str, Any]:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(dict(spec, out=str(out_path))))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with log_path.open("wb") as log:
        rc = subprocess.run([sys.executable, __file__, "--engine", str(spec_path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise SystemExit(f"engine run {name} failed (rc {rc}):\n{tail}")
    return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="4 chats x 3 turns, one repeat")
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=768)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=96, help="vLLM's KV cache, in blocks")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per engine run")
    ap.add_argument("--out", help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.engine:
        spec = json.loads(Path(args.engine).read_text())
        Path(spec["out"]).write_text(json.dumps(run_engine(spec)))
        return 0
    if args.quick:
        args.chats, args.turns, args.repeats = 4, 3, 1
    from hicache.integrations.vllm.tiny_model import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as d:
        tmp = Path(d)
        shape = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=512)
        model = make_tiny_llama(tmp / "model", **shape)
        base = {"model": str(model), "block_size": args.block_size, "gpu_blocks": args.gpu_blocks,
                "chats": args.chats, "turns": args.turns, "system_tokens": args.system_tokens,
                "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens, "vocab": shape["vocab"]}
        runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "vllm+hicache": []}
        answers: dict[str, list[Any]] = {}
        for rep in range(args.repeats):
            for name in runs:
                connector = None
                if name != "vllm":
                    connector = {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.integrations.vllm",
                                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                 "kv_connector_extra_config": {"backend": "file", "host_pages": 1024,
                                                               "backend_options": {"root": str(tmp / f"store-{rep}")}}}
                t = time.perf_counter()
                result = spawn(dict(base, connector=connector), tmp, f"{name}-{rep}", args.timeout)
                print(f"# {name} repeat {rep}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
                summary = summarize(result)
                summary["requests"] = [{k: r[k] for k in ("chat", "turn", "prompt_tokens", "cached_tokens", "ttft_s")}
                                       for r in result["rows"]]
                runs[name].append(summary)
                answers.setdefault(name, [r["answer"] for r in result["rows"]])
        med = {name: {k: statistics.median(s[k] for s in sums) for k in sums[0]
                      if k != "requests" and sums[0][k] is not None}
               for name, sums in runs.items()}
        pairs = list(zip(answers["vllm"], answers["vllm+hicache"]))
        report = {
            "workload": {k: v for k, v in base.items() if k != "model"} | {"model": shape, "repeats": args.repeats},
            "median": med,
            "runs": runs,
            "ttft_p50_speedup": med["vllm"]["ttft_p50_ms"] / med["vllm+hicache"]["ttft_p50_ms"],
            "throughput_speedup": med["vllm+hicache"]["requests_per_s"] / med["vllm"]["requests_per_s"],
            # greedy answers of the two configurations, request by request. The first token of
            # every answer depends only on the prompt's KV; later turns also attend to KV of
            # generated tokens, which decode computed (with hicache restored, as vLLM's own
            # prefix cache would) while the baseline recomputes it in a prefill: bf16 rounds the
            # two differently, and a random-weight model's near-flat logits can flip.
            "first_answer_tokens_equal": sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
            "answers_equal": sum(a == b for a, b in pairs) / len(pairs),
        }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
