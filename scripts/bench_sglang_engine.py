"""What a SGLang user sees after a restart, through SGLang's own engine (``sglang.Engine``,
0.5.23, on the CPU): SGLang alone, SGLang's hierarchical cache on SGLang's own ``file`` storage
backend, and the same on hicache's file store (SGLang's ``dynamic`` backend loading
``hicache.integrations.sglang.HiCacheSGLangStorage``), in one run, on the same workload and model.

Run with the SGLang environment (``bash scripts/test_sglang.sh`` makes it)::

    .venv-sglang/bin/python scripts/bench_sglang_engine.py            # JSON on stdout
    .venv-sglang/bin/python scripts/bench_sglang_engine.py --quick    # smaller, one policy

Workload: ``--docs`` shared documents of ``--doc-tokens`` tokens (a long system prompt or a
retrieved document), each asked ``--questions`` questions of ``--question-tokens`` tokens;
answers are ``--answer-tokens`` greedy tokens. Run 1, a fresh engine, asks every question
(question-major: every document's first question, then every second question...) and fills
the store; its engine is shut down once every full page of KV is in the store (SGLang writes
to storage in the background). Run 2, a NEW engine on the same store (the restart: nothing on
the device or in the host pool, only L3 can help), asks a follow-up to each: the run-1 prompt,
its answer and ``--question-tokens`` new tokens, in the same order. The first follow-up on a
document finds that document only in the store; the later ones find it on the device (SGLang's
own radix cache, as without the hierarchical cache).

Per configuration and run 2: TTFT per request (streaming: the time from the call to the first
streamed chunk, in the engine's process), p50/p90 over all follow-ups and over the first
follow-up on each document, the total time of run 2, cached tokens with their breakdown by
source (SGLang's ``meta_info['cached_tokens_details']``: device / host / storage) and SGLang's
``storage_prefetch_wait`` where it reports one, the pages stored after run 1, and whether every
answer equals SGLang-alone's (greedy). Ratios: each store's TTFT against SGLang alone, and
hicache's against SGLang's ``file`` backend.

Each hierarchical configuration runs under every ``--policies`` prefetch policy (SGLang's
default ``timeout``, and ``wait_complete``); run 2 of each starts on its own copy of its run-1
store. Every engine is a subprocess (SGLang's scheduler and detokenizer are processes it spawns,
``sleep_on_idle`` so that a waiting engine leaves the CPU alone). The engines of a run are
started side by side and take turns request by request, in an order rotated every request, so
that load from elsewhere on the machine falls on all alike; after each answer, an engine with a
store is left (untimed, reported as ``store_settle_s``) until its store holds every full page
of KV so far, so that no engine's background backups run during another's request.
``--repeats`` passes of run 2 (new engines each time) give medians over passes. Every engine
first serves a warm-up prompt that shares nothing with the workload (SGLang's page hasher is
JIT-built and loaded on first use; in run 2 it is a storage hit, so the read path is warm too).

Reading the figures: SGLang's CPU attention (``torch_native``, the only one without Intel AMX
kernels) computes an extend's attention over the whole sequence, cached prefix included (its
query is padded to the sequence length), so on this backend a cache hit saves the projections
and the MLP of the cached tokens but not their attention: recomputing a 2k-token document costs
only about twice a hit here, where on a GPU's attention kernels the gap is far wider. The
storage read itself is in ``storage_hit_prefetch_wait_p50_ms`` (SGLang's own clock, from a
prefetch's start to its request's admission, over the requests with a storage hit): the part of
TTFT where the two stores differ. ``engines[...][pass]["storage_calls"]`` splits it further:
every call the engine made after its warm-up to SGLang's controller (``_storage_hit_query``,
``_page_transfer``: a hit's read into the host pool, ``_page_backup``) and to the store
(``batch_exists``, ``batch_get``/``batch_get_v1``, ``batch_set``/``batch_set_v1``), with its
count, total and median milliseconds (timed in the scheduler process by wrappers this script
puts around those methods).

On the CPU, SGLang reaches a few GPU-only kernels; they are replaced by the tests' doubles
(``tests/engines/sglang/sgl_doubles.py``: the ``sgl_kernel`` module, the device <-> host page
copy ``transfer_kv_direct``, host-memory pinning), as in the engine's end-to-end test. Both
hierarchical configurations use the host layout and I/O path those doubles cover
(``layer_first``, ``direct``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOUBLES = REPO / "tests" / "engines" / "sglang"
ENGINE_ENV = "HICACHE_BENCH_SGLANG_ENGINE"
CALL_TAG = "@@storage-call "
WARM_TAG = "@@warm\n"

if os.environ.get(ENGINE_ENV):
    # An engine process, or one of the processes SGLang spawns from it (``spawn`` imports this
    # script again in each child, as ``__mp_main__``): SGLang's CPU engine and the doubles of
    # its GPU-only kernels, before anything imports SGLang.
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, str(DOUBLES))
    import sgl_doubles  # noqa: E402

    sgl_doubles.install_engine_doubles()

    def _timed(cls: Any, names: tuple[str, ...]) -> None:
        """Where a hit's time goes: each call of these methods writes its duration to stderr
        (the engine's log), tagged, for the report's ``storage_calls``."""
        for name in names:
            inner = getattr(cls, name, None)
            if inner is None:
                continue

            def timed(self: Any, *a: Any, _inner: Any = inner, _name: str = f"{cls.__name__}.{name}", **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _inner(self, *a, **kw)
                finally:
                    sys.stderr.write(f"{CALL_TAG}{_name} {1000 * (time.perf_counter() - t):.3f}\n")

            setattr(cls, name, timed)

    # where a hit's time goes, through the doubles' import hook (the unpinned page SGLang's
    # ``file`` backend needs on the CPU is one of the doubles)
    sgl_doubles.after_import("sglang.srt.managers.cache_controller", lambda m: _timed(
        m.HiCacheController, ("_storage_hit_query", "_page_transfer", "_page_backup")))
    sgl_doubles.after_import("sglang.srt.mem_cache.hicache_storage", lambda m: _timed(
        m.HiCacheFile, ("batch_exists", "batch_get", "batch_set")))
    sgl_doubles.after_import("hicache.integrations.sglang.storage", lambda m: _timed(
        m.HiCacheSGLangStorage, ("batch_exists", "batch_get_v1", "batch_set_v1")))

sys.path.insert(0, str(REPO))

from hicache.bench_args import non_negative_int, output_file, positive_int  # noqa: E402
from hicache.bench_engine import EngineProcess, say  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402

CONFIGS = ("sglang", "sglang+file", "sglang+hicache")
POLICIES = ("timeout", "wait_complete")


# --------------------------------------------------------------------------- engine process


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model_path=spec["model"], device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
        skip_tokenizer_init=True, dtype="bfloat16", page_size=spec["page_size"],
        max_total_tokens=spec["max_total_tokens"], disable_cuda_graph=True, random_seed=0, log_level="warning",
        enable_metrics=True,  # meta_info's timings (first_token_latency, storage_prefetch_wait)
        sleep_on_idle=True,  # engines wait side by side: an idle scheduler polls its sockets, not the CPU
    )
    config, root = spec["config"], spec.get("root")
    if config == "sglang":
        return kwargs
    kwargs.update(
        enable_hierarchical_cache=True, hicache_mem_layout="layer_first", hicache_io_backend="direct",
        hicache_storage_prefetch_policy=spec["policy"],
    )
    if config == "sglang+file":
        kwargs.update(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config=json.dumps({"file_storage_path": root}))
    else:
        extra = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                 "class_name": "HiCacheSGLangStorage", "hicache_backend": "file", "hicache_options": {"root": root}}
        kwargs.update(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra))
    return kwargs


def _ask(engine: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One request, streamed: TTFT is the time from the call to the first chunk."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t = time.perf_counter()
    ttft = None
    ids: list[int] = []
    last: dict[str, Any] = {}
    for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - t
        out = list(chunk.get("output_ids") or [])
        # SGLang streams either the whole output so far or only the new ids
        ids = out if len(out) >= len(ids) and out[: len(ids)] == ids else ids + out
        last = chunk
    wall = time.perf_counter() - t
    meta = last.get("meta_info", {})
    return {"answer": ids, "ttft_s": ttft if ttft is not None else wall, "wall_s": wall,
            "cached": int(meta.get("cached_tokens") or 0), "details": meta.get("cached_tokens_details"),
            "prefetch_wait_s": meta.get("storage_prefetch_wait"),
            "first_token_latency_s": meta.get("first_token_latency")}


def serve_engine(spec: dict[str, Any]) -> None:
    """Inside an engine process: start the engine, serve the warm-up prompt, then answer one
    request per stdin line (``{"prompt": ids, "new_tokens": n}``) with one tagged stdout line;
    ``{"wait_pages": n}`` waits until the store holds n page files (or 120 s)."""
    import sglang

    t = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(spec))
    started = time.perf_counter() - t
    try:
        t = time.perf_counter()
        _ask(engine, spec["warmup"], 1)
        time.sleep(0.5)  # the warm-up's backups land before the mark
        sys.stderr.write(WARM_TAG)
        sys.stderr.flush()
        say({"ready": True, "startup_s": started, "warmup_s": time.perf_counter() - t})
        for line in sys.stdin:
            cmd = json.loads(line)
            if "wait_pages" in cmd:
                deadline = time.monotonic() + 120
                while store_pages(spec.get("root")) < cmd["wait_pages"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                say({"pages": store_pages(spec.get("root"))})
            else:
                say(_ask(engine, cmd["prompt"], cmd["new_tokens"]))
    finally:
        engine.shutdown()


def store_pages(root: str | None) -> int:
    """Page files in a store: hicache's ``*.page``, SGLang's ``file`` backend's ``*.bin``."""
    if root is None or not os.path.isdir(root):
        return 0
    return sum(1 for p in Path(root).rglob("*") if p.suffix in (".page", ".bin"))


# --------------------------------------------------------------------------- orchestrator


class Engine(EngineProcess):
    """One engine process and its request pipe, with the store it writes to and its ready
    message (startup and warm-up times)."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        paths = [str(REPO), str(REPO / "backends"), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **{ENGINE_ENV: "1"})
        # SGLang JIT-builds its C++ page hasher (torch's cpp_extension): once per venv
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
        super().__init__(__file__, spec, log, env, cwd=log.parent)
        self.root = spec.get("root")
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        self.ready = self.reply()


def storage_calls(log: Path) -> dict[str, dict[str, float]]:
    """The timed storage calls an engine's processes logged after its warm-up: count, total
    and median milliseconds per method."""
    calls: dict[str, list[float]] = {}
    warm = False
    for line in log.read_text(errors="replace").splitlines():
        if line == WARM_TAG.strip():
            warm = True
        elif warm and line.startswith(CALL_TAG):
            name, ms = line[len(CALL_TAG):].rsplit(" ", 1)
            calls.setdefault(name, []).append(float(ms))
    return {n: {"calls": len(v), "total_ms": round(sum(v), 3), "median_ms": round(statistics.median(v), 3)}
            for n, v in sorted(calls.items())}


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def full_pages(seqs: list[list[int]], page: int) -> int:
    """Distinct full pages of KV the sequences leave in a radix tree (prefix-deduplicated)."""
    seen: set[tuple[int, int]] = set()
    for s in seqs:
        h = 0
        for k in range(len(s) // page):
            h = hash((h, tuple(s[k * page:(k + 1) * page])))
            seen.add((k, h))
    return len(seen)


def summarize(rows: list[dict[str, Any]], n_docs: int) -> dict[str, Any]:
    first = rows[:n_docs]  # question-major order: the first follow-up on each document
    prompt = sum(r["prompt_tokens"] for r in rows)
    by_source = {k: sum(int((r["details"] or {}).get(k) or 0) for r in rows) for k in ("device", "host", "storage")}
    waits = [r["prefetch_wait_s"] for r in rows if r["prefetch_wait_s"] is not None]
    # SGLang's own clock of a storage hit: from the prefetch's start to the request's admission
    hit_waits = [r["prefetch_wait_s"] for r in rows if r["prefetch_wait_s"] and int((r["details"] or {}).get("storage") or 0)]
    return {
        "ttft_p50_ms": 1000 * _percentile([r["ttft_s"] for r in rows], 0.5),
        "ttft_p90_ms": 1000 * _percentile([r["ttft_s"] for r in rows], 0.9),
        "ttft_p50_first_on_doc_ms": 1000 * _percentile([r["ttft_s"] for r in first], 0.5),
        "ttft_p50_later_ms": 1000 * _percentile([r["ttft_s"] for r in rows[n_docs:]], 0.5) if rows[n_docs:] else None,
        "run2_s": sum(r["wall_s"] for r in rows),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r["cached"] for r in rows),
        "cached_by_source": by_source,
        "storage_prefetch_wait_ms_sum": 1000 * sum(waits) if waits else None,
        "storage_hit_prefetch_wait_p50_ms": 1000 * _percentile(hit_waits, 0.5) if hit_waits else None,
        "store_settle_s": sum(r["store_settle_s"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="3 documents of 1,024 tokens, 2 questions, 2 layers, "
                                                         "the timeout policy only, one pass")
    ap.add_argument("--docs", type=positive_int, default=4, help="shared documents (default 4)")
    ap.add_argument("--doc-tokens", type=positive_int, default=2048, help="tokens of each document (default 2048)")
    ap.add_argument("--questions", type=positive_int, default=2, help="questions per document (default 2)")
    ap.add_argument("--question-tokens", type=positive_int, default=64, help="tokens of each question (default 64)")
    ap.add_argument("--answer-tokens", type=positive_int, default=8, help="greedy tokens of each answer (default 8)")
    ap.add_argument("--page-size", type=positive_int, default=32, help="SGLang's page size in tokens (default 32)")
    ap.add_argument("--layers", type=positive_int, default=8, help="model layers (hidden 512, 8 heads, 2 KV heads)")
    ap.add_argument("--max-total-tokens", type=positive_int, default=0,
                    help="SGLang's device KV pool in tokens (default: room for the whole workload)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"SGLang prefetch policies, comma-separated, of {list(POLICIES)} (default both)")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="passes of run 2 over every configuration, rotated order (default 1)")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="token seed of the workload (default 0)")
    ap.add_argument("--keep", help="keep the model, stores and engine logs in this folder")
    ap.add_argument("--out", type=output_file, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.engine:
        serve_engine(json.loads(args.engine))
        return 0
    if args.quick:
        args.docs, args.doc_tokens, args.questions, args.layers, args.policies, args.repeats = (
            3, 1024, 2, 2, "timeout", 1)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        ap.error(f"--policies: {bad or 'none given'}; choose from {list(POLICIES)}")
    if args.doc_tokens < args.page_size:
        ap.error("--doc-tokens must be at least one page (--page-size)")

    from hicache.testing.tiny_model import make_tiny_llama

    vocab = 512
    shape = dict(hidden=512, layers=args.layers, heads=8, kv_heads=2, intermediate=1536, vocab=vocab)

    def toks(n: int, *salt: int) -> list[int]:
        a, b = 7919 + 104729 * sum((i + 1) * s for i, s in enumerate(salt)) + args.seed * 31, 613 + 17 * len(salt)
        return [(i * a + b + (i * i) % 97) % (vocab - 3) + 3 for i in range(n)]

    docs = [toks(args.doc_tokens, 1, d) for d in range(args.docs)]
    order = [(q, d) for q in range(args.questions) for d in range(args.docs)]  # question-major
    prompts1 = {(q, d): docs[d] + toks(args.question_tokens, 2, d, q) for q, d in order}
    warmup = toks(512, 9)  # shares nothing with the workload; long enough for a storage lookup
    longest = args.doc_tokens + 2 * args.question_tokens + 2 * args.answer_tokens
    max_total = args.max_total_tokens or max(4096, 2 * (len(order) * (longest - args.doc_tokens) + args.docs * args.doc_tokens
                                                         + 1024))
    names = [("sglang", None)] + [(c, p) for p in policies for c in CONFIGS[1:]]
    label = {n: n[0] if n[1] is None else f"{n[0]}/{n[1]}" for n in names}

    tmpctx = tempfile.TemporaryDirectory(prefix="hicache-bench-sglang-engine-") if not args.keep else None
    tmp = Path(tmpctx.name if tmpctx else args.keep)
    tmp.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    try:
        model = make_tiny_llama(tmp / "model", **shape)
        base = {"model": str(model), "page_size": args.page_size, "max_total_tokens": max_total, "warmup": warmup}

        def start(name: tuple[str, str | None], root: Path | None, tag: str) -> Engine:
            config, policy = name
            spec = dict(base, config=config, policy=policy or "timeout", root=None if root is None else str(root))
            return Engine(spec, tmp / f"{label[name].replace('/', '-')}-{tag}.log")

        def ask_all(engines: dict[Any, Engine], prompts: dict[tuple[int, int], list[int]],
                    seqs: dict[Any, list[list[int]]]) -> dict[Any, list[dict[str, Any]]]:
            """Every prompt, in ``order``, to every engine: side by side, taking turns request by
            request in a rotated order. After each answer an engine with a store is left until
            its store holds every full page of KV so far (SGLang backs pages up to the host pool
            and the store in the background; untimed, reported as ``store_settle_s``), so no
            engine's background writes fall on another's request."""
            got: dict[Any, list[dict[str, Any]]] = {n: [] for n in engines}
            keys = list(engines)
            for i, k in enumerate(order):
                j = i % len(keys)
                for n in keys[j:] + keys[:j]:
                    r = engines[n].send({"prompt": prompts[k], "new_tokens": args.answer_tokens})
                    settle = 0.0
                    if engines[n].root is not None:
                        seqs[n].append(prompts[k] + r["answer"][:-1])
                        t = time.perf_counter()
                        r["pages"] = engines[n].send({"wait_pages": full_pages(seqs[n], args.page_size)})["pages"]
                        settle = time.perf_counter() - t
                    got[n].append({"doc": k[1], "question": k[0], "prompt_tokens": len(prompts[k]),
                                   "store_settle_s": settle, **r})
            return got

        def close_all(engines: dict[Any, Engine]) -> None:
            for e in engines.values():
                e.close()

        # ---- run 1: a fresh engine per store backend fills its store
        stores = {c: tmp / f"{c}-store1" for c in CONFIGS[1:]}
        for root in stores.values():  # a --keep folder used before: run 1 starts on empty stores
            shutil.rmtree(root, ignore_errors=True)
        eng1: dict[Any, Engine] = {}
        try:
            for c in CONFIGS[1:]:
                eng1[c] = start((c, policies[0]), stores[c], "run1")
            for e in eng1.values():
                e.wait_ready()  # started side by side; startup_s is not a figure to compare
            seqs1: dict[Any, list[list[int]]] = {c: [warmup] for c in CONFIGS[1:]}
            got1 = ask_all(eng1, prompts1, seqs1)
        finally:
            close_all(eng1)
        run1: dict[str, Any] = {}
        for c in CONFIGS[1:]:
            want, pages = full_pages(seqs1[c], args.page_size), store_pages(str(stores[c]))
            run1[c] = {"startup_s": eng1[c].ready["startup_s"], "warmup_s": eng1[c].ready["warmup_s"],
                       "run1_s": sum(r["wall_s"] for r in got1[c]),
                       "store_settle_s": sum(r["store_settle_s"] for r in got1[c]),
                       "pages_stored": pages, "pages_expected": want}
            if pages < want:
                raise SystemExit(f"{c}: {pages} of {want} pages stored after run 1 (see {eng1[c].log})")
            print(f"# run 1 {c}: {pages} pages stored, {run1[c]['run1_s']:.1f} s", file=sys.stderr)
        answers1 = {k: r["answer"] for k, r in zip(order, got1[CONFIGS[1]])}
        if [r["answer"] for r in got1[CONFIGS[2]]] != [answers1[k] for k in order]:
            print("# warning: the two stores' run-1 engines answered differently", file=sys.stderr)

        # ---- run 2: a new engine per configuration, each on its own copy of its run-1 store
        prompts2 = {k: prompts1[k] + answers1[k] + toks(args.question_tokens, 3, k[1], k[0]) for k in order}
        rows: dict[tuple[str, str | None], list[list[dict[str, Any]]]] = {n: [] for n in names}
        engines_info: dict[str, list[dict[str, Any]]] = {label[n]: [] for n in names}
        for rep in range(args.repeats):
            k0 = rep % len(names)
            rotated = names[k0:] + names[:k0]
            eng2: dict[Any, Engine] = {}
            seqs2: dict[Any, list[list[int]]] = {}
            try:
                for name in rotated:
                    root = None
                    if name[0] != "sglang":
                        root = tmp / f"{label[name].replace('/', '-')}-store2"
                        shutil.rmtree(root, ignore_errors=True)
                        shutil.copytree(stores[name[0]], root)
                        seqs2[name] = list(seqs1[name[0]])
                    eng2[name] = start(name, root, f"run2-{rep}")
                for e in eng2.values():
                    e.wait_ready()
                os.sync()
                got2 = ask_all(eng2, prompts2, seqs2)
            finally:
                close_all(eng2)
            for name in names:
                rows[name].append(got2[name])
                engines_info[label[name]].append({"startup_s": eng2[name].ready["startup_s"],
                                                  "warmup_s": eng2[name].ready["warmup_s"],
                                                  "storage_calls": storage_calls(eng2[name].log)})
                s = summarize(got2[name], args.docs)
                print(f"# run 2 pass {rep} {label[name]}: TTFT p50 {s['ttft_p50_ms']:.1f} ms, first on doc "
                      f"{s['ttft_p50_first_on_doc_ms']:.1f} ms, {s['cached_by_source']}", file=sys.stderr)
    finally:
        if tmpctx:
            tmpctx.cleanup()

    runs = {n: [summarize(rs, args.docs) for rs in rows[n]] for n in names}

    def med(n: tuple[str, str | None], key: str) -> Any:
        vals = [s[key] for s in runs[n] if s[key] is not None]
        return statistics.median(vals) if vals else None

    keys = list(runs[names[0]][0])
    median = {label[n]: {k: (runs[n][0][k] if k == "cached_by_source" else med(n, k)) for k in keys} for n in names}
    base_answers = [r["answer"] for r in rows[names[0]][0]]
    for n in names:
        median[label[n]]["answers_equal_baseline"] = sum(
            r["answer"] == a for rs in rows[n] for r, a in zip(rs, base_answers)) / (len(order) * args.repeats)
        median[label[n]]["first_tokens_equal_baseline"] = sum(
            r["answer"][:1] == a[:1] for rs in rows[n] for r, a in zip(rs, base_answers)) / (len(order) * args.repeats)

    ratios: dict[str, Any] = {}
    b = median["sglang"]
    for p in policies:
        f, h = median[f"sglang+file/{p}"], median[f"sglang+hicache/{p}"]
        ratios[p] = {
            # above 1.0: faster than the other
            "file_ttft_p50_speedup_vs_sglang": b["ttft_p50_ms"] / f["ttft_p50_ms"],
            "hicache_ttft_p50_speedup_vs_sglang": b["ttft_p50_ms"] / h["ttft_p50_ms"],
            "file_ttft_first_on_doc_speedup_vs_sglang": b["ttft_p50_first_on_doc_ms"] / f["ttft_p50_first_on_doc_ms"],
            "hicache_ttft_first_on_doc_speedup_vs_sglang": b["ttft_p50_first_on_doc_ms"] / h["ttft_p50_first_on_doc_ms"],
            "hicache_vs_file_ttft_p50": f["ttft_p50_ms"] / h["ttft_p50_ms"],
            "hicache_vs_file_ttft_p90": f["ttft_p90_ms"] / h["ttft_p90_ms"],
            "hicache_vs_file_ttft_first_on_doc": f["ttft_p50_first_on_doc_ms"] / h["ttft_p50_first_on_doc_ms"],
            "hicache_vs_file_run2_time": f["run2_s"] / h["run2_s"],
            "hicache_vs_file_storage_hit_prefetch_wait_p50": (
                f["storage_hit_prefetch_wait_p50_ms"] / h["storage_hit_prefetch_wait_p50_ms"]
                if f["storage_hit_prefetch_wait_p50_ms"] and h["storage_hit_prefetch_wait_p50_ms"] else None),
        }
    report = {
        "workload": {"docs": args.docs, "doc_tokens": args.doc_tokens, "questions": args.questions,
                     "question_tokens": args.question_tokens, "answer_tokens": args.answer_tokens,
                     "page_size": args.page_size, "max_total_tokens": max_total, "requests_per_run": len(order),
                     "repeats": args.repeats, "model": shape, "policies": policies, "seed": args.seed},
        "ttft": "streamed: call to first chunk, in the engine's process (meta_info first_token_latency "
                "kept per request in 'requests')",
        "run1": run1,
        "run1_requests": {c: [{k: r[k] for k in ("doc", "question", "prompt_tokens", "ttft_s", "wall_s", "cached",
                                                 "prefetch_wait_s", "store_settle_s")} for r in got1[c]]
                          for c in CONFIGS[1:]},
        "median": median,
        "ratios": ratios,
        "engines": engines_info,
        "runs": {label[n]: runs[n] for n in names},
        "requests": {label[n]: [[{k: r[k] for k in ("doc", "question", "prompt_tokens", "ttft_s", "first_token_latency_s",
                                                     "wall_s", "cached", "details", "prefetch_wait_s",
                                                     "store_settle_s")} for r in rs]
                                for rs in rows[n]] for n in names},
        "wall_s": time.perf_counter() - t_all,
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
