#!/usr/bin/env python3
"""Page keys on the event loop: hicache's native chain against its hashlib fallback and SGLang's.

Every page a server writes to storage, and every page of a prompt it looks up there, needs its
chained sha256 key first, computed on the event loop (``hicache.prefix_cache.fast_page_hashes``).
One run hashes the page-aligned prompts of the first ``--requests`` requests of the Mooncake
trace (``--trace``, ``$HICACHE_TRACE`` or ``../shared/traces/``), packed as ``array('I')`` as
the tree keeps them, through:

* ``native``: ``fast_page_hashes`` with the C extension (``hicache.prefix_cache._pagehash``: the
  chain in one call, OpenSSL's sha256);
* ``hashlib``: the same function without it (the fallback where the extension is not built:
  one ``hashlib.sha256`` per page), the baseline of the ratios;
* ``sglang``: SGLang's own ``get_hash_str(tokens, prior, page_size)`` (its C++ extension,
  compiled on first use by torch), when SGLang is importable; its keys are compared too.

Methods alternate per repeat; the report gives each one's median microseconds per page, the
ratio to ``hashlib`` per repeat, and the loop time of one 16k-token prompt's keys (p50 of
``--long-reps``). Every method must give the same keys for every prompt (the script fails
otherwise). Example::

    .venv/bin/python scripts/bench_hash.py --requests 500 --repeats 5
    .venv-sglang/bin/python scripts/bench_hash.py   # with SGLang's column
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.bench_args import output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402
from hicache.prefix_cache import hashing  # noqa: E402
from hicache.replay.trace import find_trace, load_trace, request_tokens  # noqa: E402

Hasher = Callable[[array, int], list[str]]


def hicache_native(tokens: array, page_size: int) -> list[str]:
    return hashing.fast_page_hashes(tokens, page_size)


def hicache_hashlib(tokens: array, page_size: int) -> list[str]:
    """The fallback path, as ``fast_page_hashes`` takes it without the extension."""
    n = len(tokens) // page_size
    if n == 0:
        return []
    return hashing._python_chain(hashing._uint32_le(tokens, n * page_size), 4 * page_size, b"")


def sglang_hasher() -> tuple[Hasher | None, str | None]:
    """SGLang's ``get_hash_str`` with its native extension, or ``(None, why)``."""
    if importlib.util.find_spec("sglang") is None:
        return None, "sglang is not installed"
    try:
        from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash

        def run(tokens: array, page_size: int) -> list[str]:
            out = get_native_hash(tokens, None, page_size)
            return out if isinstance(out, list) else [out]

        run(array("I", range(64)), 16)  # compiles it (once per machine) outside the timing
    except Exception as exc:  # noqa: BLE001 - any failure means: no SGLang column
        return None, f"{type(exc).__name__}: {exc}"
    return run, None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None)
    p.add_argument("--requests", type=positive_int, default=500)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--long-tokens", type=positive_int, default=16384)
    p.add_argument("--long-reps", type=positive_int, default=200)
    p.add_argument("--no-sglang", action="store_true")
    p.add_argument("--out", type=output_file, default=None)
    args = p.parse_args(argv)
    ps = args.page_size
    reqs = load_trace(find_trace(args.trace), limit=args.requests)
    prompts = [array("I", t[: len(t) // ps * ps]) for t in (request_tokens(r) for r in reqs)]
    pages = sum(len(t) // ps for t in prompts)

    methods: dict[str, Hasher] = {"hashlib": hicache_hashlib}
    skipped: dict[str, str] = {}
    if hashing.NATIVE_HASHING:
        methods["native"] = hicache_native
    else:
        skipped["native"] = "hicache.prefix_cache._pagehash is not built"
    sgl, why = (None, "--no-sglang") if args.no_sglang else sglang_hasher()
    if sgl is not None:
        methods["sglang"] = sgl
    else:
        skipped["sglang"] = str(why)

    want = [hicache_hashlib(t, ps) for t in prompts]
    for name, fn in methods.items():
        got = [fn(t, ps) for t in prompts]
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise SystemExit(f"{name}: keys differ from hashlib's on prompt {bad}")

    per_page: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(args.repeats):
        order = list(methods)[r % len(methods):] + list(methods)[: r % len(methods)]
        for name in order:
            fn = methods[name]
            t0 = time.perf_counter()
            for t in prompts:
                fn(t, ps)
            per_page[name].append((time.perf_counter() - t0) / pages * 1e6)

    long = array("I", (i * 7919 % (1 << 31) for i in range(args.long_tokens)))
    long_ms: dict[str, float] = {}
    for name, fn in methods.items():
        samples = []
        for _ in range(args.long_reps):
            t0 = time.perf_counter()
            fn(long, ps)
            samples.append((time.perf_counter() - t0) * 1e3)
        long_ms[name] = round(statistics.median(samples), 4)

    base = per_page["hashlib"]
    report: dict[str, Any] = {
        "benchmark": "chained sha256 page keys",
        "requests": len(prompts),
        "page_size": ps,
        "pages": pages,
        "repeats": args.repeats,
        "skipped": skipped,
        "keys_equal": True,
        "us_per_page": {name: round(statistics.median(v), 4) for name, v in per_page.items()},
        "us_per_page_runs": {name: [round(x, 4) for x in v] for name, v in per_page.items()},
        "speedup_vs_hashlib": {
            name: {
                "median_per_run": round(statistics.median(b / x for b, x in zip(base, v)), 3),
                "per_run": [round(b / x, 3) for b, x in zip(base, v)],
            }
            for name, v in per_page.items() if name != "hashlib"
        },
        f"prompt_{args.long_tokens}_ms_p50": long_ms,
    }
    if "native" in per_page and "sglang" in per_page:
        report["native_vs_sglang"] = round(
            statistics.median(s / n for s, n in zip(per_page["sglang"], per_page["native"])), 3
        )
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
