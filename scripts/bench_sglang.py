"""hicache's file backend vs SGLang's own ``file`` backend, both driven by SGLang's controller.

Same pages, same process, interleaved repetitions: for every SGLang host layout, each backend
backs up the same host pages (``_page_backup``, set) and prefetches them back into fresh host
pages (``_storage_hit_query`` + ``_page_transfer``, get), from a warm page cache. Every get is
checked byte for byte against the source pages (hicache also verifies each page's checksum as
it reads). Reported: medians of GB/s per backend and of the per-repetition ratio hicache/SGLang.

Between runs each store is cleared, hicache's background deletion is waited for and dirty
pages are flushed (``os.sync``), so no run pays for the one before it (writeback of the other
backend's pages, or its deletion). ``--variants`` adds hicache configurations to the same
interleaved run, to price what they cost against SGLang's backend: ``unshared`` (no cross-process
usage ledger: ``shared=False``), ``fsync`` (each page and its folder synced before success), ``io2``/``io1`` (2 or 1 I/O threads instead of 4).

Needs SGLang: run in the engine venv (``bash scripts/test_sglang.sh`` creates it)::

    .venv-sglang/bin/python scripts/bench_sglang.py [--reps 7] [--pages 24] [--variants unshared,fsync] [--torch-threads 1] [--out FILE]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engines" / "sglang"))

import torch  # noqa: E402

import conftest  # noqa: E402,F401 - SGLang's CPU import setup (test doubles of CUDA-built modules)
import sgl_drive as drive  # noqa: E402
from hicache.bench_args import output_file, positive_int  # noqa: E402
import sgl_helpers as helpers  # noqa: E402


#: hicache configurations a run can add beside the default (options of the file backend)
VARIANTS: dict[str, dict] = {"hicache": {}, "unshared": {"shared": False}, "fsync": {"fsync": True}, "io2": {"io_threads": 2}, "io1": {"io_threads": 1}}


def _make(layout: str, backend: str, root: str, dev, host):
    if backend == "sglang":
        extra = {"file_storage_path": root}
        return helpers.controller(dev, host, extra, backend="file")
    return helpers.controller(dev, host, helpers.extra_config("file", root=root, **VARIANTS[backend]))


def _settle(ctl) -> None:
    """Nothing of this run may spill into the next: hicache's background deletion of the
    cleared pages is waited for, and every dirty page is written back."""
    store = ctl.storage_backend
    backend = getattr(store, "backend", None)
    if backend is not None and hasattr(backend, "wait_background"):
        store._ensure_open().run(backend.wait_background())
    os.sync()


def _cpu() -> float:
    """CPU seconds (user + system, every thread) this process has used; nanosecond clock
    (``os.times`` counts 10 ms ticks, too coarse for one operation)."""
    return time.process_time()


def _one(ctl, host, toks) -> tuple[float, float, float, float, bool]:
    src = ctl.mem_pool_host.alloc(len(toks))
    t0, c0 = time.perf_counter(), _cpu()
    written = drive.backup(ctl, toks, src)
    t_set, c_set = time.perf_counter() - t0, _cpu() - c0
    t0, c0 = time.perf_counter(), _cpu()
    done, dst = drive.prefetch(ctl, toks)
    t_get, c_get = time.perf_counter() - t0, _cpu() - c0
    ps = host.page_size
    ok = written == len(toks) and done == len(toks) and all(
        torch.equal(host.get_data_page(int(s)), host.get_data_page(int(d)))  # same layout: SGLang's own pages
        for s, d in zip(src[::ps].tolist(), dst[::ps].tolist())
    )
    ctl.mem_pool_host.free(src)
    if dst is not None:
        ctl.mem_pool_host.free(dst)
    ctl.storage_backend.clear()
    _settle(ctl)
    return t_set, t_get, c_set, c_get, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pages", type=int, default=24, help="pages per operation (96 MiB at the default geometry)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--layouts", default=",".join(helpers.MHA_LAYOUTS))
    ap.add_argument("--variants", default="", help=f"extra hicache configurations, comma-separated: {sorted(set(VARIANTS) - {'hicache'})}")
    ap.add_argument("--out", type=output_file, help="also write the JSON report here")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (SGLang's page copies); 1 prices the work without "
                         "the spin-waiting of idle OpenMP threads, which a loaded machine inflates")
    args = ap.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)

    tokens_per_op = args.pages * args.page_size
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    report: dict = {
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "what": "SGLang controller set (_page_backup) and get (_storage_hit_query + _page_transfer), "
        "hicache file backend vs SGLang's file backend, warm page cache",
        "geometry": {"layers": args.layers, "kv_heads": args.heads, "head_dim": args.head_dim,
                     "page_size": args.page_size, "dtype": "bfloat16", "page_bytes": page_bytes,
                     "pages_per_op": args.pages, "bytes_per_op": page_bytes * args.pages},
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "layouts": {},
    }
    for layout in args.layouts.split(","):
        dev = helpers.device_pool(size=tokens_per_op, page_size=args.page_size, layers=args.layers,
                                  heads=args.heads, head_dim=args.head_dim)
        host = helpers.host_pool(dev, layout, ratio=2.5)
        helpers.fill_random(host, 1)
        with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
            names = ["sglang", "hicache", *[v for v in args.variants.split(",") if v]]
            ctls = {name: _make(layout, name, f"{tmp}/{name}", dev, host) for name in names}
            times: dict[str, dict[str, list[float]]] = {n: {"set": [], "get": []} for n in ctls}
            cpu: dict[str, dict[str, list[float]]] = {n: {"set": [], "get": []} for n in ctls}
            verified = True
            try:
                for rep in range(args.reps + 1):  # rep 0 warms both paths up and is dropped
                    order = list(ctls)[rep % len(ctls) :] + list(ctls)[: rep % len(ctls)]  # each goes first in turn
                    toks = drive.tokens(tokens_per_op, seed=1000 + rep)
                    for name in order:
                        t_set, t_get, c_set, c_get, ok = _one(ctls[name], host, toks)
                        verified &= ok
                        if rep:
                            times[name]["set"].append(t_set)
                            times[name]["get"].append(t_get)
                            cpu[name]["set"].append(c_set)
                            cpu[name]["get"].append(c_get)
            finally:
                for ctl in ctls.values():
                    ctl.detach_storage_backend()
        nbytes = page_bytes * args.pages
        row: dict = {"verified": verified}
        for op in ("set", "get"):
            ratios = [s / h for s, h in zip(times["sglang"][op], times["hicache"][op])]
            row[op] = {
                "hicache_gbps": round(nbytes / statistics.median(times["hicache"][op]) / 1e9, 2),
                "sglang_gbps": round(nbytes / statistics.median(times["sglang"][op]) / 1e9, 2),
                "speedup_median": round(statistics.median(ratios), 2),
                "speedup_range": [round(min(ratios), 2), round(max(ratios), 2)],
                # CPU seconds per op, SGLang's over hicache's: the work each does, which a loaded
                # machine disturbs far less than wall time (hicache spreads it over threads)
                "cpu_ratio_median": round(statistics.median(cpu["sglang"][op]) / max(statistics.median(cpu["hicache"][op]), 1e-9), 2),
                "hicache_cpu_ms": round(statistics.median(cpu["hicache"][op]) * 1e3, 1),
                "sglang_cpu_ms": round(statistics.median(cpu["sglang"][op]) * 1e3, 1),
                "hicache_wall_ms": round(statistics.median(times["hicache"][op]) * 1e3, 1),
                "sglang_wall_ms": round(statistics.median(times["sglang"][op]) * 1e3, 1),
            }
            for name in names[2:]:
                vr = [s / h for s, h in zip(times["sglang"][op], times[name][op])]
                row[op][f"{name}_gbps"] = round(nbytes / statistics.median(times[name][op]) / 1e9, 2)
                row[op][f"{name}_speedup_median"] = round(statistics.median(vr), 2)
        row["load_average"] = [round(x, 2) for x in os.getloadavg()]
        report["layouts"][layout] = row
        print(f"{layout}: {json.dumps(row)}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(r["verified"] for r in report["layouts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
