#!/usr/bin/env python3
"""Copy-engine throughput: backup (device -> host) and layer-wise load (host -> device).

Each measurement is compared with a plain torch copy of the same number of bytes measured in
the same run, before and after every rep of ours, so that noise from other processes (on a
shared VM, mostly other tenants' memory traffic) hits both alike:

* CPU: a contiguous ``dst.copy_(src)``;
* CUDA: a contiguous device -> pinned host copy (backup) and pinned host -> device (load).

Two index patterns: ``runs`` (pages as a fresh allocator hands them out: consecutive) and
``scattered`` (random pages on both sides: the worst case after long churn). A scattered
layer-wise load is made of ``page_size * head_num * head_dim * itemsize``-byte pieces (128 KiB
by default), so scattered rows also report ``torch_chunked_gbps``: torch copying the same bytes
in pieces of that size in random order, what a loop of ``Tensor.copy_`` per piece reaches.

``ratio`` is median(torch) / median(ours); ``ratio_paired`` the median of the per-rep ratios
against the same baseline (more robust when other processes share the machine).

On CPU each row is measured for every copy path in ``--paths``: ``native`` (the compiled span
copier with streaming stores, the engine's default where it is built) and ``numpy`` (the
numpy/torch fallback). ``min_ratio*`` are over the default path only.

Prints one JSON document (also written to ``--out``). Example::

    .venv/bin/python scripts/bench_copy.py --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.memory import (  # noqa: E402
    LAYOUTS,
    CopyEngine,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    device_for,
)
from hicache.memory.spans import NATIVE_AVAILABLE, STREAM_KIND  # noqa: E402
from hicache.bench_args import name_list, non_negative_int, output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["fp8"] = torch.float8_e4m3fn



def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: tiny test sizes must not round a real rate to 0."""
    return float(f"{x:.{digits}g}")

#: the index patterns and CPU copy paths a run can measure (see the module docstring)
PATTERNS = ("runs", "scattered")
PATHS = ("native", "numpy")


def _device_arg(text: str) -> str:
    """An argparse type: a torch device name (``cpu``, ``cuda``, ``cuda:1``); another was a
    ``RuntimeError`` traceback from torch."""
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu or cuda)") from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--pages", type=positive_int, default=32, help="pages moved per operation")
    p.add_argument("--reps", type=positive_int, default=7)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--patterns", type=name_list(PATTERNS), default=",".join(PATTERNS))
    p.add_argument("--device", type=_device_arg, default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--paths", type=name_list(PATHS), default=None,
                   help="CPU copy paths, comma-separated: native, numpy (default: both where native is built)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--quick", action="store_true", help="small run for a few seconds")
    p.add_argument("--out", type=output_file, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.pages = min(args.pages, 8)
        args.reps = min(args.reps, 3)
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def token_indices(pages: np.ndarray, page_size: int) -> torch.Tensor:
    return torch.from_numpy((pages[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int64))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = device_for(args.device)
    dtype = DTYPES[args.dtype]
    ps, n = args.page_size, args.pages
    pool_pages = n + max(2, n // 2)  # room for scattered picks
    dev = MHATokenToKVPool(pool_pages * ps, ps, dtype, args.heads, args.head_dim, args.layers, device)
    dev.kv_data.view(torch.uint8).fill_(7)
    nbytes = n * ps * dev.bytes_per_token
    rng = np.random.default_rng(args.seed)
    patterns = {
        "runs": (np.arange(n), np.arange(n)),
        "scattered": (rng.permutation(pool_pages)[:n], rng.permutation(pool_pages)[:n]),
    }

    # plain-torch references of the same bytes
    if device.type == "cuda":
        ref_dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        ref_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(2)
        ref_backup = lambda: ref_host.copy_(ref_dev, non_blocking=True)  # noqa: E731
        ref_load = lambda: ref_dev.copy_(ref_host, non_blocking=True)  # noqa: E731
    else:
        ref_a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        ref_b = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
        ref_backup = ref_load = lambda: ref_b.copy_(ref_a)  # noqa: E731

    # a torch copy of the same bytes in the engine's smallest piece (one layer of one page of K
    # or V, in random order): the bound for scattered layer-wise loads
    chunk = ps * dev.geometry.token_nbytes
    order = torch.from_numpy(rng.permutation(nbytes // chunk))
    if device.type == "cuda":
        chunk_src, chunk_dst = ref_host, ref_dev
    else:
        chunk_src, chunk_dst = ref_a, ref_b
    wide = torch.int64 if chunk % 8 == 0 else torch.uint8  # as the engine copies
    chunk_src = chunk_src.view(wide).view(len(order), -1)
    chunk_dst = chunk_dst.view(wide).view(len(order), -1)
    order_list = order.tolist()

    def ref_chunked() -> None:
        for i, j in enumerate(order_list):
            chunk_dst[i].copy_(chunk_src[j], non_blocking=True)

    results: list[dict[str, Any]] = []
    ref_times: dict[str, list[float]] = {"backup": [], "load": []}
    t_start = time.perf_counter()
    if device.type == "cuda":
        paths = ["cuda"]
    else:
        paths = args.paths or (list(PATHS) if NATIVE_AVAILABLE else ["numpy"])
    default_path = paths[0]
    for layout, path in [(lo, pa) for lo in args.layouts for pa in paths]:
        host = MHATokenToKVPoolHost(dev, host_size_bytes=pool_pages * ps * dev.bytes_per_token,
                                    page_size=ps, layout=layout)
        native = None if path == "cuda" else path == "native"
        with CopyEngine(dev, host, native=native) as eng:
            for pattern in args.patterns:
                d_pages, h_pages = patterns[pattern]
                d_idx, h_idx = token_indices(d_pages, ps), token_indices(h_pages, ps)
                ops = {
                    "backup": (lambda: eng.backup_sync(d_idx, h_idx), ref_backup),
                    "load": (lambda: eng.load(h_idx, d_idx).wait_sync(), ref_load),
                }
                for op, (fn, ref) in ops.items():
                    fn()  # warm-up: first touch of host pages, thread start-up
                    ref()
                    mine, theirs, chunked = [], [], []
                    for _ in range(args.reps):
                        # the baseline brackets each rep of ours (before and after, averaged), so
                        # a slow drift of the machine's memory bandwidth hits both alike
                        before = timed(ref, device)
                        mine.append(timed(fn, device))
                        theirs.append((before + timed(ref, device)) / 2)
                        if pattern == "scattered":
                            chunked.append(timed(ref_chunked, device))
                    if path == default_path:
                        ref_times[op].extend(theirs)
                    t_mine, t_ref = statistics.median(mine), statistics.median(theirs)
                    row = {
                        "layout": layout, "pattern": pattern, "op": op, "path": path,
                        "gbps": _sig(nbytes / t_mine / 1e9),
                        "torch_copy_gbps": _sig(nbytes / t_ref / 1e9),
                        "ratio": _sig(t_ref / t_mine),
                        # the same baseline, paired rep by rep (median of per-rep ratios): less
                        # sensitive to another process stealing a core for part of the row
                        "ratio_paired": _sig(statistics.median(r / m for r, m in zip(theirs, mine))),
                    }
                    if chunked:
                        t_chunk = statistics.median(chunked)
                        row["torch_chunked_gbps"] = _sig(nbytes / t_chunk / 1e9)
                        row["ratio_vs_chunked"] = _sig(t_chunk / t_mine)
                    results.append(row)
        del host
    default_rows = [r for r in results if r["path"] == default_path]
    report = {
        "benchmark": "hicache.memory copy engine",
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "config": {
            "layers": args.layers, "kv_heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
            "page_size": ps, "pages_per_op": n, "bytes_per_op": nbytes,
            "page_bytes": ps * dev.bytes_per_token, "chunk_bytes": chunk, "reps": args.reps,
            "quick": args.quick,
        },
        "torch_copy_gbps": {op: _sig(nbytes / statistics.median(t) / 1e9) for op, t in ref_times.items() if t},
        "results": results,
        "default_path": default_path,
        "stream_kind": STREAM_KIND if default_path == "native" else None,
        "min_ratio": min((r["ratio"] for r in default_rows), default=None),
        "min_ratio_runs": min((r["ratio"] for r in default_rows if r["pattern"] == "runs"), default=None),
        "min_ratio_paired": min((r["ratio_paired"] for r in default_rows), default=None),
        "target_ratio": 0.8,
        "elapsed_s": round(time.perf_counter() - t_start, 2),
    }
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
