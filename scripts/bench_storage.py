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

    python scripts/bench_storage.py --protocol seed --exists-off --repeats 7   # no page_view
    python scripts/bench_storage.py --protocol seed-copies --exists-off --repeats 7  # copies only

How it stays sound on a shared machine: every method writes and reads files of the same size
(the raw loop pads to the backend's header and footer), fsync is off on both sides (on on both
with ``--option fsync=true``), the dirty pages of the file system are written back (untimed)
before every timed phase, gets read warm (each method the files it has just written), methods
alternate within each repeat in a rotating order, and CPU seconds (all threads) are reported
per phase next to wall time: they do not grow with the neighbours' load.

Output: one JSON document on stdout (and in ``--out``). ``ratios`` holds set_vs_raw and
get_vs_raw: the median over repeats of baseline seconds / backend seconds within the same
repeat (>= 1.0 means at least as fast); ``ratios_range`` their min and max, ``cpu_ratios`` the
same for CPU seconds, and every method's medians, ranges and per-repeat runs are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
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
from hicache.bench_args import int_list, output_file, positive_int  # noqa: E402
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
    methods, no ``page_view``. Laid out as SGLang's MHA ``page_first`` pool (``kv_buffer`` of
    shape (2, tokens, ...): a page's K half and V half lie apart), over the same memory as
    ``pool``, and answering as it does: ``get_data_page(flat=False)`` is a view of that memory,
    ``flat=True`` a copy (the page is not contiguous), ``get_dummy_flat_data_page`` a fresh
    zeroed page. ``copies=True``: a pool that hands out copies even for ``flat=False`` (reads
    then stage every page)."""

    #: hicache reads straight into SGLang's ``HostKVCache`` pools by class; a pool of another
    #: class says that its ``set_from_flat_data_page`` only places bytes (as SGLang's does)
    hicache_view_reads = True

    def __init__(self, pool: ArrayHostPool, *, copies: bool = False) -> None:
        if pool.token_elems % 2:
            raise SystemExit("a seed-protocol page splits each token into a K and a V half")
        self._pool = pool
        self._copies = copies
        self.page_size = pool.page_size
        self._kv = pool.buffer.view(-1).view(2, pool.size, pool.token_elems // 2)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._kv[:, index : index + self.page_size]
        if flat:
            return page.flatten()
        return page.clone() if self._copies else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self._pool.token_elems, dtype=self._pool.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._kv[:, index : index + self.page_size] = data_page.reshape(2, self.page_size, -1)


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


def settle_disk(path: Path) -> None:
    """Write back the dirty pages of the file system holding ``path`` (untimed, before every
    timed phase of every method), so no method pays for the previous one's writeback."""
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


class Timed:
    """Wall and CPU seconds (``process_time``: every thread of this process, so the figure a
    loaded machine does not inflate) of one ``with`` block."""

    wall = cpu = 0.0

    def __enter__(self) -> Timed:
        self._t, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu = time.process_time() - self._c


#: One method's timings of one repeat: set/get wall and CPU seconds.
Phases = dict[str, float]


def _phases(w: Timed, r: Timed) -> Phases:
    return {"set": w.wall, "get": r.wall, "set_cpu": w.cpu, "get_cpu": r.cpu}


async def v2_once(
    make: BackendFactory, src: ArrayHostPool, dst: ArrayHostPool, keys: list[str], protocol: str, settle: Path
) -> tuple[Phases, dict[str, Any]]:
    """One batch_set_v2 then one batch_get_v2 of every page on a fresh store, each after the disk
    was settled (``protocol="seed"``: through :class:`SeedProtocolPool` wrappers, no
    ``page_view``). Before the timed get, one untimed get of a few pages warms what a running
    server keeps warm (I/O threads, the staging arena)."""
    idx = src.indices(0, len(keys))
    store = make("v2")
    def as_protocol(pool: ArrayHostPool) -> Any:
        return pool if protocol == "view" else SeedProtocolPool(pool, copies=protocol == "seed-copies")

    src_pool, dst_pool = as_protocol(src), as_protocol(dst)
    async with store:
        store.register_mem_host_pool_v2(src_pool, "kv")
        settle_wait = getattr(store, "wait_background", None)
        if settle_wait is not None:  # measure the steady state, not the start-up scan and set-up
            await settle_wait()
        settle_disk(settle)
        with Timed() as w:
            res = await store.batch_set_v2([PoolTransfer("kv", host_indices=idx, keys=keys)])
        if not all(res["kv"]):
            raise SystemExit(f"batch_set_v2 stored {sum(res['kv'])}/{len(keys)} pages")
        t0 = time.perf_counter()
        hit = await store.batch_exists_v2(keys)
        exists_s = time.perf_counter() - t0
        assert hit.kv_hit_pages == len(keys)
        store.register_mem_host_pool_v2(dst_pool, "kv")
        warm = min(len(keys), WARMUP_PAGES)
        await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, warm), keys=keys[:warm])])
        dst.buffer.zero_()
        settle_disk(settle)
        with Timed() as r:
            got = await store.batch_get_v2([PoolTransfer("kv", host_indices=idx, keys=keys)])
        if not all(got["kv"]):
            raise SystemExit(f"batch_get_v2 found {sum(got['kv'])}/{len(keys)} pages")
        stats = {k: v for k, v in store.get_stats().items() if isinstance(v, (int, float, bool, str, type(None)))}
        await store.clear()
    if make.name == "file" and "root" not in make.options:
        drop_dir(Path(store.root))  # type: ignore[attr-defined]
    return _phases(w, r), {"exists_s": exists_s, "stats": stats}


#: Pages of the untimed warm-up get before each timed one (three staging chunks of 4 MiB pages).
WARMUP_PAGES = 12


def _spread(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 4), "min": round(min(samples), 4), "max": round(max(samples), 4)}


def summarize(runs: dict[str, list[Phases]], nbytes: int, pages: int) -> dict[str, Any]:
    """Per method: median and range of every phase, GB/s of the medians, CPU ms per page."""
    out: dict[str, Any] = {}
    for name, reps in runs.items():
        row: dict[str, Any] = {}
        for phase in ("set", "get"):
            wall = [r[phase] for r in reps]
            cpu = [r[f"{phase}_cpu"] for r in reps]
            row[f"{phase}_s"] = _spread(wall)
            row[f"{phase}_gbps"] = gbps(nbytes, statistics.median(wall))
            row[f"{phase}_cpu_s"] = _spread(cpu)
            row[f"{phase}_cpu_ms_per_page"] = round(statistics.median(cpu) / pages * 1e3, 4)
            row[f"{phase}_runs_s"] = [round(x, 4) for x in wall]
        out[name] = row
    return out


def paired_ratios(runs: dict[str, list[Phases]], baseline: str) -> dict[str, Any]:
    """Baseline time over the backend's time in the same repeat (>= 1.0: the backend is at least
    as fast), as median and range over the repeats; CPU the same way."""
    out: dict[str, Any] = {}
    for phase in ("set", "get", "set_cpu", "get_cpu"):
        per_rep = [b[phase] / v[phase] for b, v in zip(runs[baseline], runs["v2"]) if v[phase] > 0]
        if per_rep:
            out[phase] = _spread(per_rep)
    return out


async def measure_throughput(
    make: BackendFactory, workdir: Path, pages: int, page_bytes: int, repeats: int, baselines: list[str],
    protocol: str = "view",
) -> dict[str, Any]:
    """The backend's v2 set/get against each baseline on the same bytes and the same file sizes,
    interleaved per repeat (the order rotates, so background writeback and neighbours' load hit
    every method alike). Every timed phase starts with the disk settled (no dirty pages) and,
    for gets, the page cache warm: each method reads the files it has just written."""
    src = make_pool(pages, page_bytes, seed=1)
    dst = make_pool(pages, page_bytes, seed=None)
    keys = page_hashes(list(range(pages * TOKENS_PER_PAGE)), TOKENS_PER_PAGE)
    views, into = page_views(src, pages), page_views(dst, pages)
    overhead = file_overhead(make.name, keys[0], "kv")
    fsync = bool(make.options.get("fsync", False))  # the baselines fsync when the backend does
    methods = ["v2", *baselines]
    runs: dict[str, list[Phases]] = {m: [] for m in methods}
    exists_s: list[float] = []
    stats: dict[str, Any] = {}
    for rep in range(repeats):
        for name in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            if name == "v2":
                phases, extra = await v2_once(make, src, dst, keys, protocol, workdir)
                exists_s.append(extra["exists_s"])
                stats = extra["stats"]
            else:
                phases = BASELINES[name](workdir, views, into, overhead, fsync)
            runs[name].append(phases)
            if not torch.equal(dst.buffer.view(torch.int16), src.buffer.view(torch.int16)):
                raise SystemExit(f"{name} read different bytes")
            dst.buffer.zero_()
    out = summarize(runs, pages * page_bytes, pages)
    out["v2"]["exists_all_pages_ms"] = round(min(exists_s) * 1e3, 4)
    out["v2"]["backend_stats"] = stats
    out["paired"] = {b: paired_ratios(runs, b) for b in baselines}
    return out


def file_overhead(backend: str, key: str, pool: str) -> int:
    """Bytes a backend's page file holds beyond the payload (header and footer of ``file``),
    so that the baselines write and read files of the same size."""
    if backend != "file":
        return 0
    from hicache_backends.file.layout import NamespaceLayout

    return NamespaceLayout.file_size(key, pool, 0)


def raw_loop(workdir: Path, views: list[memoryview], into: list[memoryview], overhead: int, fsync: bool) -> Phases:
    """The raw limit: one thread, open/write/close then open/readinto/close per page (files of
    the backend's size: the payload and ``overhead`` bytes around it, as the backend stores)."""
    d = workdir / "raw"
    d.mkdir(parents=True, exist_ok=True)
    head, foot = bytearray(overhead // 2), bytearray(overhead - overhead // 2)
    paths = [str(d / f"{i}.bin") for i in range(len(views))]
    settle_disk(workdir)
    with Timed() as w:
        for path, v in zip(paths, views):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [head, v, foot])
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
    settle_disk(workdir)
    want = overhead + len(into[0]) if into else 0
    with Timed() as r:
        for path, v in zip(paths, into):
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.readv(fd, [head, v, foot]) != want:
                    raise SystemExit("short raw read")
            finally:
                os.close(fd)
    drop_dir(d)
    return _phases(w, r)


def seed_replica(workdir: Path, views: list[memoryview], into: list[memoryview], overhead: int, fsync: bool) -> Phases:
    """SGLang HiCacheFile's per-page path: ``tofile``; readinto a fresh staging page, then copy
    (its files hold the payload only: SGLang's format has no header)."""
    import numpy as np

    d = workdir / "seed"
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / f"{i}.bin" for i in range(len(views))]
    settle_disk(workdir)
    with Timed() as w:
        for path, v in zip(paths, views):
            if not path.exists():
                np.frombuffer(v, dtype=np.uint8).tofile(path)
                if fsync:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
    settle_disk(workdir)
    with Timed() as r:
        for path, v in zip(paths, into):
            staging = torch.empty(len(v), dtype=torch.uint8)  # get_dummy_flat_data_page()
            with open(path, "rb", buffering=0) as f:
                if f.readinto(memoryview(staging.numpy())) != len(v):
                    raise SystemExit("short seed read")
            torch.frombuffer(v, dtype=torch.uint8).copy_(staging)  # set_from_flat_data_page
    drop_dir(d)
    return _phases(w, r)


#: name -> function(workdir, source views, destination views, file overhead bytes, fsync) -> phases
BASELINES: dict[str, Callable[[Path, list[memoryview], list[memoryview], int, bool], Phases]] = {
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
        "method": {
            "page_cache": "warm for gets (each method reads the files it has just written)",
            "settled": "dirty pages written back (syncfs) before every timed phase of every method",
            "fsync": "on on both sides (per page)" if options.get("fsync") else "off on both sides",
            "file_sizes": "the baselines write the backend's file size (payload + header + footer)",
            "order": "interleaved, rotating per repeat",
            "warmup": f"one untimed get of {WARMUP_PAGES} pages per fresh store before the timed get",
            "ratios": "baseline s / backend s within each repeat; median (and range) over repeats",
            "cpu": "process_time (all threads) per phase",
        },
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
        paired = tp.pop("paired")
        result["v2"] = tp.pop("v2")
        result["baselines"] = tp
        # the headline: the median over the repeats of each repeat's own ratio (baseline and
        # backend measured back to back); "ranges" holds min/max, "cpu" the same for CPU time
        result["ratios"] = {
            f"{phase}_vs_{short}": paired[name][phase]["median"]
            for name, short in (("raw_loop", "raw"), ("seed_replica", "seed")) if name in paired
            for phase in ("set", "get") if phase in paired[name]
        }
        result["ratios_range"] = {
            f"{phase}_vs_{short}": [paired[name][phase]["min"], paired[name][phase]["max"]]
            for name, short in (("raw_loop", "raw"), ("seed_replica", "seed")) if name in paired
            for phase in ("set", "get") if phase in paired[name]
        }
        result["cpu_ratios"] = {
            f"{phase}_vs_{short}": paired[name][f"{phase}_cpu"]["median"]
            for name, short in (("raw_loop", "raw"), ("seed_replica", "seed")) if name in paired
            for phase in ("set", "get") if f"{phase}_cpu" in paired[name]
        }
        result["paired"] = paired
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
    p.add_argument("--pages", type=positive_int, default=128, help="pages per batch (default 128: 512 MiB of 4 MiB pages)")
    p.add_argument("--page-kib", type=positive_int, default=DEFAULT_PAGE_KIB, help="page size in KiB (default 4096)")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats of each throughput measurement (medians and ranges reported)")
    p.add_argument("--exists-scales", type=int_list, default=None,
                   help="stored-page counts for the exists latency (default 1000,10000,100000)")
    p.add_argument("--exists-calls", type=positive_int, default=200, help="exists calls per scale (default 200)")
    p.add_argument("--exists-payload", type=positive_int, default=1024, help="payload bytes of the small pages (default 1024)")
    p.add_argument("--baselines", type=lambda s: [x for x in s.split(",") if x], default=list(BASELINES),
                   help=f"comma-separated baselines to run (default {','.join(BASELINES)})")
    p.add_argument("--protocol", choices=["view", "seed", "seed-copies"], default="view",
                   help="host pools with page_view (default), or the seed page protocol alone: as SGLang's "
                        "pools answer it (seed), or by a pool that hands out copies only (seed-copies)")
    p.add_argument("--exists-off", action="store_true", help="skip the exists-latency phase")
    p.add_argument("--quick", action="store_true", help="small sizes: finishes in a few seconds")
    p.add_argument("--workdir", default=None, help="where scratch roots go (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--out", type=output_file, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.pages = min(args.pages, 32)
        args.page_kib = min(args.page_kib, 1024)
        args.repeats = max(args.repeats, 5)  # tiny runs are noisy: more of them (medians)
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
