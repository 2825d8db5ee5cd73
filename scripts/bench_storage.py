#!/usr/bin/env python3
"""Storage backend benchmark: v2 batch set/get/exists against the raw limit of the same disk.

Every number that is compared is measured in the same run (FIELD-NOTES: page-cache throughput
is noisy between runs). One run measures, for any registered backend:

* ``v2``: ``batch_set_v2`` / ``batch_get_v2`` / ``batch_exists_v2`` of N realistic pages through a
  host pool that offers ``page_view`` (so the backend may read into / write from pool memory);
* baselines on the same bytes (a dict of functions, extend ``BASELINES``): ``raw_loop``, a plain
  single-thread Python loop of open/write/close and open/readinto/close per page (the raw
  limit), and ``seed_replica``, SGLang HiCacheFile's per-page behaviour (``tofile``; read into a
  fresh staging page, then copy into the pool);
* ``exists`` latency of 64 stored keys (p50/p99 over many calls) with 1k, 10k and 100k pages
  stored (small pages), plus 64 absent keys, and the time a reopened store needs to index them.

Examples::

    python scripts/bench_storage.py                          # file backend, 128 x 4 MiB pages
    python scripts/bench_storage.py --quick --out bench.json
    python scripts/bench_storage.py --backend file --option io_threads=8 --option fsync=true

Output: one JSON document on stdout (and in ``--out``); ``ratios`` holds set_vs_raw and
get_vs_raw (throughput of the backend over the raw loop; >= 1.0 means at least as fast).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache.keys import Namespace, page_hashes
from hicache.storage import AsyncHiCacheStorage, PoolTransfer, create_async_storage
from hicache.testing import ArrayHostPool
from hicache.bench_output import emit_report  # noqa: E402

TOKENS_PER_PAGE = 64
# A 64-token page of 32 layers x 8 KV heads x 128 dims x (K, V) is 4 MiB with an 8-bit KV cache
# (8 MiB in bf16); 4 MiB is the default, --page-kib changes it.
DEFAULT_PAGE_KIB = 4096


# ---------------------------------------------------------------------- set-up helpers


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value parsed as JSON where possible (``true``, ``8``, ``null``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option wants key=value, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def make_pool(pages: int, page_bytes: int, seed: int | None) -> ArrayHostPool:
    """A page_first-like host pool whose pages are contiguous (it offers ``page_view``)."""
    token_bytes = page_bytes // TOKENS_PER_PAGE
    if token_bytes * TOKENS_PER_PAGE != page_bytes or token_bytes % 2:
        raise SystemExit(f"page size {page_bytes} must split into {TOKENS_PER_PAGE} tokens of bf16")
    pool = ArrayHostPool(pages, TOKENS_PER_PAGE, token_elems=token_bytes // 2, dtype=torch.bfloat16, direct=True)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, pool.buffer.shape, generator=g, dtype=torch.int16))
    return pool


class SeedProtocolPool:
    """A host pool as SGLang's storage code sees one: ``page_size`` and the three page-protocol
    methods, no ``page_view``. ``get_data_page`` returns a copy and ``get_dummy_flat_data_page``
    a fresh zeroed page, as SGLang's MHA host pools do for flat pages."""

    def __init__(self, pool: ArrayHostPool) -> None:
        self._pool = pool
        self.page_size = pool.page_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._pool.buffer[index : index + self.page_size]
        return page.reshape(-1).clone() if flat else page.clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self._pool.token_elems, dtype=self._pool.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._pool.buffer[index : index + self.page_size].copy_(data_page.reshape(self.page_size, -1))


def page_views(pool: ArrayHostPool, pages: int) -> list[memoryview]:
    out = []
    for i in range(pages):
        view = pool.page_view(i * TOKENS_PER_PAGE)
        assert view is not None
        out.append(memoryview(view.view(torch.uint8).numpy()))
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def ms_stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1e3, 4),
        "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 4),
        "mean_ms": round(statistics.fmean(s) * 1e3, 4),
    }


def drop_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class BackendFactory:
    """Builds stores of one backend with the user's options (a fresh root per store for ``file``)."""

    def __init__(self, name: str, options: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.options = options
        self.workdir = workdir
        self._n = 0

    def __call__(self, tag: str, root: Path | None = None) -> AsyncHiCacheStorage:
        opts = dict(self.options)
        if self.name == "file" and "root" not in opts:
            self._n += 1
            opts["root"] = str(root or self.workdir / f"{tag}-{self._n}")
        ns = Namespace(model=f"bench/{tag}", kv_dtype="bfloat16", layout="page_first")
        return create_async_storage(self.name, None, namespace=ns, **opts)


# ---------------------------------------------------------------------- measurements


async def v2_once(
    make: BackendFactory, src: ArrayHostPool, dst: ArrayHostPool, keys: list[str], protocol: str = "view"
) -> dict[str, Any]:
    """One batch_set_v2, batch_exists_v2 and two batch_get_v2 of every page, on a fresh store
    (``protocol="seed"``: through :class:`SeedProtocolPool` wrappers, no ``page_view``)."""
    idx = src.indices(0, len(keys))
    store = make("v2")
    src_pool: Any = SeedProtocolPool(src) if protocol == "seed" else src
    dst_pool: Any = SeedProtocolPool(dst) if protocol == "seed" else dst
    async with store:
        store.register_mem_host_pool_v2(src_pool, "kv")
        settle = getattr(store, "wait_background", None)
        if settle is not None:  # measure the steady state, not the start-up scan and set-up
            await settle()
        t0, c0 = time.perf_counter(), time.process_time()
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=keys)])
        set_s, set_cpu = time.perf_counter() - t0, time.process_time() - c0
        if not all(res["kv"]):
            raise SystemExit(f"batch_set_v2 stored {sum(res['kv'])}/{len(keys)} pages")
        t0 = time.perf_counter()
        hit = await store.batch_exists_v2(keys)
        exists_s = time.perf_counter() - t0
        assert hit.kv_hit_pages == len(keys)
        store.register_mem_host_pool_v2(dst_pool, "kv")
        get_s = get_cpu = float("inf")
        for _ in range(2):  # page cache warm either way; keep the better
            t0, c0 = time.perf_counter(), time.process_time()
            got = await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=keys)])
            get_s = min(get_s, time.perf_counter() - t0)
            get_cpu = min(get_cpu, time.process_time() - c0)
            assert all(got["kv"])
        stats = {k: v for k, v in store.get_stats().items() if isinstance(v, (int, float, bool, str, type(None)))}
        await store.clear()
    if make.name == "file" and "root" not in make.options:
        drop_dir(Path(store.root))  # type: ignore[attr-defined]
    return {"set_s": set_s, "get_s": get_s, "set_cpu": set_cpu, "get_cpu": get_cpu, "exists_s": exists_s, "stats": stats}


async def measure_throughput(
    make: BackendFactory, workdir: Path, pages: int, page_bytes: int, repeats: int, baselines: list[str],
    protocol: str = "view",
) -> dict[str, Any]:
    """The backend's v2 set/get against each baseline on the same bytes, interleaved per repeat
    (so that background writeback and neighbours' load hit every method alike); best of
    ``repeats`` is kept for each."""
    src = make_pool(pages, page_bytes, seed=1)
    dst = make_pool(pages, page_bytes, seed=None)
    keys = page_hashes(list(range(pages * TOKENS_PER_PAGE)), TOKENS_PER_PAGE)
    views, into = page_views(src, pages), page_views(dst, pages)
    runs: dict[str, dict[str, list[float]]] = {
        m: {"set": [], "get": [], "set_cpu": [], "get_cpu": []} for m in ["v2", *baselines]
    }
    exists_s: list[float] = []
    stats: dict[str, Any] = {}
    methods = ["v2", *baselines]
    for rep in range(repeats):
        # rotate the order so no method always runs right after another one's writes
        for name in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            if name == "v2":
                one = await v2_once(make, src, dst, keys, protocol)
                for k in ("set", "get"):
                    runs["v2"][k].append(one[f"{k}_s"])
                    runs["v2"][f"{k}_cpu"].append(one[f"{k}_cpu"])
                exists_s.append(one["exists_s"])
                stats = one["stats"]
            else:
                c0 = time.process_time()
                w, r = BASELINES[name](workdir, views, into)
                runs[name]["set"].append(w)
                runs[name]["get"].append(r)
                runs[name]["set_cpu"].append(float("nan"))  # one figure for both; see below
                runs[name]["get_cpu"].append(time.process_time() - c0)
            if not torch.equal(dst.buffer.view(torch.int16), src.buffer.view(torch.int16)):
                raise SystemExit(f"{name} read different bytes")
            dst.buffer.zero_()
    nbytes = pages * page_bytes
    out: dict[str, Any] = {}
    for name, r in runs.items():
        out[name] = {
            "set_s": round(min(r["set"]), 4),
            "get_s": round(min(r["get"]), 4),
            "set_gbps": gbps(nbytes, min(r["set"])),
            "get_gbps": gbps(nbytes, min(r["get"])),
            "set_runs_s": [round(x, 4) for x in r["set"]],
            "get_runs_s": [round(x, 4) for x in r["get"]],
        }
        if name == "v2":
            out[name]["set_cpu_s"] = round(min(r["set_cpu"]), 4)
            out[name]["get_cpu_s"] = round(min(r["get_cpu"]), 4)
        else:  # the baselines are single-threaded: wall time includes their CPU time
            out[name]["set_and_get_cpu_s"] = round(min(r["get_cpu"]), 4)
    out["v2"]["exists_all_pages_ms"] = round(min(exists_s) * 1e3, 4)
    out["v2"]["backend_stats"] = stats
    return out


def raw_loop(workdir: Path, views: list[memoryview], into: list[memoryview]) -> tuple[float, float]:
    """The raw limit: one thread, open/write/close then open/readinto/close per page."""
    d = workdir / "raw"
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, v in enumerate(views):
        with open(d / f"{i}.bin", "wb", buffering=0) as f:
            f.write(v)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, v in enumerate(into):
        with open(d / f"{i}.bin", "rb", buffering=0) as f:
            if f.readinto(v) != len(v):
                raise SystemExit("short raw read")
    r = time.perf_counter() - t0
    drop_dir(d)
    return w, r


def seed_replica(workdir: Path, views: list[memoryview], into: list[memoryview]) -> tuple[float, float]:
    """SGLang HiCacheFile's per-page path: ``tofile``; readinto a fresh staging page, then copy."""
    import numpy as np

    d = workdir / "seed"
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, v in enumerate(views):
        path = d / f"{i}.bin"
        if not path.exists():
            np.frombuffer(v, dtype=np.uint8).tofile(path)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, v in enumerate(into):
        staging = torch.empty(len(v), dtype=torch.uint8)  # get_dummy_flat_data_page()
        with open(d / f"{i}.bin", "rb", buffering=0) as f:
            if f.readinto(memoryview(staging.numpy())) != len(v):
                raise SystemExit("short seed read")
        torch.frombuffer(v, dtype=torch.uint8).copy_(staging)  # set_from_flat_data_page
    r = time.perf_counter() - t0
    drop_dir(d)
    return w, r


#: name -> function(workdir, source views, destination views) -> (write s, read s)
BASELINES: dict[str, Callable[[Path, list[memoryview], list[memoryview]], tuple[float, float]]] = {
    "raw_loop": raw_loop,
    "seed_replica": seed_replica,
}


async def fill_small_pages(store: AsyncHiCacheStorage, start: int, stop: int, payload_bytes: int) -> list[str]:
    """Store small pages ``start..stop`` quickly; returns their keys.

    Two v2 batches of 2048 pages are kept in flight, so the event loop prepares one while the
    I/O threads write the other.
    """
    tokens, per_batch = 4, 2048
    pool = ArrayHostPool(2 * per_batch, tokens, token_elems=max(1, payload_bytes // (tokens * 2)), dtype=torch.float16)
    pool.fill_random(3)
    store.register_mem_host_pool_v2(pool, "kv")
    keys = [f"exists-{i:08d}" for i in range(start, stop)]

    async def put(batch: list[str], region: int) -> None:
        idx = pool.indices(region * per_batch, len(batch))
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=batch)])
        if not all(res["kv"]):
            raise SystemExit(f"could not store {len(batch) - sum(res['kv'])} small pages")

    for at in range(0, len(keys), 2 * per_batch):
        pair = [keys[i : i + per_batch] for i in (at, at + per_batch) if i < len(keys)]
        await asyncio.gather(*(put(b, r) for r, b in enumerate(pair)))
    return keys


async def time_exists(store: AsyncHiCacheStorage, keys: list[str], calls: int, batch: int, rng: random.Random) -> dict[str, float]:
    """batch_exists_v2 latency of ``batch`` keys drawn from ``keys``, over ``calls`` calls."""
    gc.collect()  # start from a settled heap: a fill leaves garbage a collection would bill here
    samples = []
    for _ in range(calls):
        asked = rng.sample(keys, batch) if len(keys) >= batch else keys
        t0 = time.perf_counter()
        await store.batch_exists_v2(asked)
        samples.append(time.perf_counter() - t0)
    return ms_stats(samples)


async def measure_exists_scaling(make: BackendFactory, scales: list[int], calls: int, payload_bytes: int) -> dict[str, Any]:
    """exists latency of 64 stored keys (and of 64 absent ones) as one store grows through
    ``scales`` pages (small pages, so the run stays short); then, for the file backend, how
    long a reopened store takes to answer and to finish indexing the largest scale."""
    rng = random.Random(0)
    out: dict[str, Any] = {}
    absent = [f"absent-{i}" for i in range(64)]
    keys: list[str] = []
    store = make("exists")
    async with store:
        for n in sorted(scales):
            t0 = time.perf_counter()
            keys += await fill_small_pages(store, len(keys), n, payload_bytes)
            row: dict[str, Any] = {"fill_s": round(time.perf_counter() - t0, 3)}
            row["hit"] = await time_exists(store, keys, calls, 64, rng)
            row["miss"] = await time_exists(store, absent, max(10, calls // 4), 64, rng)
            out[str(n)] = row
    root = getattr(store, "root", None)
    if root and keys:
        reopened = make("exists", root=Path(root))
        t0 = time.perf_counter()
        async with reopened:
            first = await time_exists(reopened, keys, 1, 64, rng)
            wait = getattr(reopened, "wait_index_ready", None)
            if wait is not None:
                await wait(None)
                out[str(max(scales))]["reopen_index_s"] = round(time.perf_counter() - t0, 3)
            out[str(max(scales))]["reopen_first_exists_ms"] = first["p50_ms"]
            out[str(max(scales))]["reopen_indexed_hit"] = await time_exists(reopened, keys, calls, 64, rng)
            t0 = time.perf_counter()
            await reopened.clear()
            out[str(max(scales))]["clear_s"] = round(time.perf_counter() - t0, 3)
            finish = getattr(reopened, "wait_background", None)
            if finish is not None:  # the file backend deletes cleared pages in the background
                await finish()
                out[str(max(scales))]["clear_done_s"] = round(time.perf_counter() - t0, 3)
    else:
        async with make("exists") as again:
            await again.clear()
    if root and make.name == "file" and "root" not in make.options:
        drop_dir(Path(root))
    return out


# ---------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(args.option or [])
    workdir = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir=args.workdir))
    make = BackendFactory(args.backend, options, workdir)
    page_bytes = args.page_kib * 1024
    result: dict[str, Any] = {
        "backend": args.backend,
        "options": options,
        "pages": args.pages,
        "page_bytes": page_bytes,
        "repeats": args.repeats,
        "protocol": args.protocol,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "workdir": str(workdir),
    }
    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    result["phase_s"] = phases
    try:
        t0 = time.perf_counter()
        tp = await measure_throughput(make, workdir, args.pages, page_bytes, args.repeats, args.baselines, args.protocol)
        phases["throughput"] = round(time.perf_counter() - t0, 2)
        result["v2"] = tp.pop("v2")
        result["baselines"] = tp
        ratios: dict[str, float] = {}
        for name, short in (("raw_loop", "raw"), ("seed_replica", "seed")):
            b = tp.get(name)
            if b:
                ratios[f"set_vs_{short}"] = round(b["set_s"] / result["v2"]["set_s"], 3)
                ratios[f"get_vs_{short}"] = round(b["get_s"] / result["v2"]["get_s"], 3)
        result["ratios"] = ratios
        # medians of the interleaved runs: on a shared machine the best run is a lottery
        med = {n: {k: statistics.median(v[f"{k}_runs_s"]) for k in ("set", "get")}
               for n, v in [("v2", result["v2"]), *tp.items()]}
        result["ratios_median"] = {
            f"{k}_vs_{short}": round(med[name][k] / med["v2"][k], 3)
            for name, short in (("raw_loop", "raw"), ("seed_replica", "seed")) if name in med for k in ("set", "get")
        }
        if not args.exists_off:
            t0 = time.perf_counter()
            exists = await measure_exists_scaling(make, args.exists_scales, args.exists_calls, args.exists_payload)
            phases["exists"] = round(time.perf_counter() - t0, 2)
            result["exists"] = exists
            result["exists_ms"] = {n: row["hit"]["p50_ms"] for n, row in exists.items()}
            result["exists_p99_ms"] = {n: row["hit"]["p99_ms"] for n, row in exists.items()}
    finally:
        if not args.keep:
            drop_dir(workdir)
    result["total_s"] = round(time.perf_counter() - t_start, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="file", help="registered backend name (default: file)")
    p.add_argument("--option", action="append", type=parse_option, metavar="KEY=VALUE",
                   help="backend option, value parsed as JSON where possible (repeatable)")
    p.add_argument("--pages", type=int, default=128, help="pages per batch (default 128: 512 MiB of 4 MiB pages)")
    p.add_argument("--page-kib", type=int, default=DEFAULT_PAGE_KIB, help="page size in KiB (default 4096)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each throughput measurement; best is kept")
    p.add_argument("--exists-scales", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                   help="stored-page counts for the exists latency (default 1000,10000,100000)")
    p.add_argument("--exists-calls", type=int, default=200, help="exists calls per scale (default 200)")
    p.add_argument("--exists-payload", type=int, default=1024, help="payload bytes of the small pages (default 1024)")
    p.add_argument("--baselines", type=lambda s: [x for x in s.split(",") if x], default=list(BASELINES),
                   help=f"comma-separated baselines to run (default {','.join(BASELINES)})")
    p.add_argument("--protocol", choices=["view", "seed"], default="view",
                   help="host pools with page_view (default), or the seed page protocol alone")
    p.add_argument("--exists-off", action="store_true", help="skip the exists-latency phase")
    p.add_argument("--quick", action="store_true", help="small sizes: finishes in a few seconds")
    p.add_argument("--workdir", default=None, help="where scratch roots go (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.pages = min(args.pages, 32)
        args.page_kib = min(args.page_kib, 1024)
        args.repeats = max(args.repeats, 5)  # tiny runs are noisy: more of them, best kept
        args.exists_scales = args.exists_scales or [1000, 5000]
        args.exists_calls = min(args.exists_calls, 100)
    args.exists_scales = args.exists_scales or [1000, 10000, 100000]
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown:
        p.error(f"unknown baseline(s) {unknown}; known: {sorted(BASELINES)}")
    result = asyncio.run(run(args))
    emit_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
