#!/usr/bin/env python
"""Throughput of the ``s3`` backend against the best plain s3fs code for the same bytes.

Every way to move the same pages, measured in one run against one server, each repeat running
them all in a rotated order so drift hits each alike:

* ``hicache``     - ``batch_set_v2`` / ``batch_get_v2`` of the whole batch through our backend,
  with a host pool (pages written from and read straight into pool memory, header + checksum
  verified on every read; page requests signed with botocore's signer and sent on the s3fs
  client's own session, ``backends/hicache_backends/s3/direct.py``).
* ``s3fs_gather`` - plain s3fs: ``asyncio.gather`` of ``_pipe_file`` / ranged ``_cat_file``
  under a semaphore of the same concurrency, payloads ready as ``bytes``, no verification, no
  copy into a pool.
* ``s3fs_batch``  - plain s3fs's own batch calls: ``_pipe(dict)`` / ``_cat(paths, start, end)``
  with ``batch_size`` = the same concurrency.
* ``s3fs_tuned``  - ``s3fs_gather`` on a client with our backend's botocore tuning as well
  (unsigned payloads): what our tuning alone buys, shown beside the target.

Both s3fs clients get the connection settings our backend uses (pool size = concurrency,
timeouts, one attempt, checksums only when required), so the baseline is the best plain usage
rather than a strawman. The target baseline, ``s3fs_best``, is the faster (by median) of
``s3fs_gather`` and ``s3fs_batch``.

Starts its own moto server on loopback in a subprocess (or use ``--endpoint``). Moto on loopback
answers in microseconds and is CPU-bound, which would make a serial loop look as good as a
concurrent one; real object stores answer in tens to hundreds of milliseconds. So the server
delays every request by ``--latency-ms`` (default 50; ``0`` for raw loopback numbers). The delay
is a sleep in the server's per-request thread: it costs no CPU and overlaps across connections.
Moto's server (werkzeug) closes every connection after one request; every client pays that alike.

Prints one JSON object to stdout and writes it to ``--out`` if given. Ratios are paired repeat by
repeat (the runs being compared are seconds apart): median and range over repeats. Client CPU
seconds per page (this process, threads included: the work our code and s3fs add per page,
free of the server's and the neighbours' noise) are reported for every way. Targets: hicache >=
1.0x ``s3fs_best``, >= 5x a one-page-at-a-time loop.

    python scripts/bench_s3.py                # about a minute
    python scripts/bench_s3.py --quick        # under 15 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from hicache.keys import Namespace
from hicache.storage import PoolTransfer, create_async_storage
from hicache.testing import ArrayHostPool
from hicache.bench_args import non_negative_float, output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402

KEY, SECRET = "bench-key", "bench-secret"
TOKENS_PER_PAGE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MOTO_WITH_LATENCY = """
import sys, time
from moto.moto_server import werkzeug_app
latency = float(sys.argv[2])
_app_call = werkzeug_app.DomainDispatcherApplication.__call__
def delayed(self, environ, start_response):
    if latency and environ.get("PATH_INFO", "").startswith("/moto-api") is False:
        time.sleep(latency)  # each request has its own server thread: this is wait, not CPU
    return _app_call(self, environ, start_response)
werkzeug_app.DomainDispatcherApplication.__call__ = delayed
from moto.server import main
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"""


def start_moto(latency_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    """A moto server in its own process (its CPU does not compete with ours for the GIL) that
    answers every request ``latency_ms`` late, like a real object store over a network."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _MOTO_WITH_LATENCY, str(port), str(latency_ms / 1000.0)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
                break
        except urllib.error.HTTPError:
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.05)
    return proc, endpoint


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": "us-east-1"}}


def s3fs_config(concurrency: int, timeout: float) -> dict[str, Any]:
    """The botocore settings our backend uses; the baseline gets the same, so it is the best
    plain s3fs usage rather than a strawman (default pool of 10 connections, checksums...)."""
    return {
        "max_pool_connections": concurrency,
        "connect_timeout": timeout,
        "read_timeout": timeout,
        "retries": {"total_max_attempts": 1},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """Wall and this process's CPU seconds of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _s3fs(endpoint: str, concurrency: int, tuned: bool = False) -> Any:
    import s3fs

    cfg = s3fs_config(concurrency, 30.0)
    if tuned:
        cfg["s3"] = {"payload_signing_enabled": False}
    return s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **storage_options(endpoint), config_kwargs=cfg)


async def run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    page_bytes = args.page_kib * 1024
    c = args.concurrency
    bucket = args.bucket
    base = f"{bucket}/bench-{uuid.uuid4().hex[:8]}"

    fs, tuned = _s3fs(endpoint, c), _s3fs(endpoint, c, tuned=True)
    await fs.set_session()
    await tuned.set_session()
    try:  # plain CreateBucket: s3fs's _mkdir adds a LocationConstraint us-east-1 rejects
        await fs._call_s3("create_bucket", Bucket=bucket)
    except OSError:
        pass  # already there
    try:
        return await _measure(args, fs, tuned, base, page_bytes)
    finally:
        for f in (fs, tuned):
            if getattr(f, "_s3", None) is not None:
                await f._s3.close()


WAYS = ("hicache", "s3fs_gather", "s3fs_batch", "s3fs_tuned")


async def _measure(args: argparse.Namespace, fs: Any, tuned: Any, base: str, page_bytes: int) -> dict[str, Any]:
    n, c = args.pages, args.concurrency
    token_elems = page_bytes // (TOKENS_PER_PAGE * 2)  # float16

    src = ArrayHostPool(n, TOKENS_PER_PAGE, token_elems=token_elems)
    src.fill_random(7)
    dst = ArrayHostPool(n, TOKENS_PER_PAGE, token_elems=token_elems)
    assert src.page_nbytes == page_bytes
    keys = [f"bench-page-{i}" for i in range(n)]
    payloads = [src.page_bytes(i * TOKENS_PER_PAGE) for i in range(n)]

    store = create_async_storage(
        "s3", None, url=f"s3://{base}/hicache", storage_options=storage_options(args.endpoint_url),
        namespace=Namespace(model="bench", kv_dtype="float16", page_size=TOKENS_PER_PAGE),
        concurrency=c, request_timeout=30.0, call_timeout=300.0,
    )
    await store.open()
    raw_paths = [f"{base}/raw/{i}" for i in range(n)]

    async def hicache_set() -> None:
        store.register_mem_host_pool_v2(src, "kv")
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=keys)])
        assert all(res["kv"]), "hicache set failed"

    async def hicache_get() -> None:
        store.register_mem_host_pool_v2(dst, "kv")
        res = await store.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, n), keys=keys)])
        assert all(res["kv"]), "hicache get failed"

    def gather_ways(f: Any) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]:
        sem = asyncio.Semaphore(c)

        async def put(i: int) -> None:
            async with sem:
                await f._pipe_file(raw_paths[i], payloads[i])

        async def get(i: int) -> bytes:
            async with sem:  # ranged: s3fs would otherwise HEAD first to plan a multi-part read
                return await f._cat_file(raw_paths[i], start=0, end=page_bytes)

        async def set_all() -> None:
            await asyncio.gather(*(put(i) for i in range(n)))

        async def get_all() -> None:
            got = await asyncio.gather(*(get(i) for i in range(n)))
            assert got[-1] == payloads[-1]

        return set_all, get_all

    async def batch_set() -> None:
        await fs._pipe(dict(zip(raw_paths, payloads)), batch_size=c)

    async def batch_get() -> None:
        got = await fs._cat(raw_paths, batch_size=c, start=0, end=page_bytes)
        assert got[raw_paths[-1]] == payloads[-1]

    gather_set, gather_get = gather_ways(fs)
    tuned_set, tuned_get = gather_ways(tuned)
    calls: dict[str, tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]] = {
        "hicache": (hicache_set, hicache_get),
        "s3fs_gather": (gather_set, gather_get),
        "s3fs_batch": (batch_set, batch_get),
        "s3fs_tuned": (tuned_set, tuned_get),
    }
    serial_n = max(1, min(n, args.serial_pages))

    async def serial_set() -> None:
        for i in range(serial_n):
            await fs._pipe_file(raw_paths[i], payloads[i])

    async def serial_get() -> None:
        for i in range(serial_n):
            await fs._cat_file(raw_paths[i], start=0, end=page_bytes)

    for set_call, get_call in calls.values():  # warm-up: connections, sessions, first objects
        await set_call()
        await get_call()
    await store.wait_index_writes()
    assert torch.equal(dst.buffer, src.buffer), "hicache read wrong bytes"

    wall: dict[str, list[float]] = {f"{w}_{op}": [] for w in WAYS for op in ("set", "get")}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    wall["serial_set"], wall["serial_get"] = [], []
    for rep in range(args.repeats):
        # rotate who goes first, so drift on a shared machine favours none of them
        order = WAYS[rep % len(WAYS):] + WAYS[: rep % len(WAYS)]
        for op, idx in (("set", 0), ("get", 1)):
            for way in order:
                if way == "hicache" and op == "get":
                    dst.buffer.zero_()  # so the check below sees this read's bytes (not timed)
                t, spent = await timed(calls[way][idx])
                wall[f"{way}_{op}"].append(t)
                cpu[f"{way}_{op}"].append(spent)
                await store.wait_index_writes()  # our run index PUT: not inside the next timing
        assert torch.equal(dst.buffer, src.buffer), "hicache read wrong bytes"
        t, _ = await timed(serial_set)
        wall["serial_set"].append(t * n / serial_n)  # scaled to the batch size
        t, _ = await timed(serial_get)
        wall["serial_get"].append(t * n / serial_n)
    best: dict[str, str] = {}
    for op in ("set", "get"):
        # the best plain s3fs code: the faster way by median. (Not the faster of the two in each
        # repeat: the minimum of two noisy draws is biased low against our one draw.)
        best[op] = min(("s3fs_gather", "s3fs_batch"), key=lambda w: statistics.median(wall[f"{w}_{op}"]))
        wall[f"s3fs_best_{op}"] = list(wall[f"{best[op]}_{op}"])
        cpu[f"s3fs_best_{op}"] = list(cpu[f"{best[op]}_{op}"])

    lookup = await measure_lookup(store, args.lookup_pages, c)
    stats = store.get_stats()
    await store.clear()
    await store.aclose()
    await fs._rm(f"{base}/raw", recursive=True)

    total_mb = n * page_bytes / 1e6
    results: dict[str, Any] = {}
    for name, ts in wall.items():
        med = statistics.median(ts)
        results[name] = {
            "median_s": round(med, 4), "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
            "MB_per_s": round(total_mb / med, 1), "pages_per_s": round(n / med, 1),
        }
        if cpu.get(name):  # client CPU per page: our overhead, free of the server's and the load's noise
            results[name]["client_cpu_ms_per_page"] = round(1000 * statistics.median(cpu[name]) / n, 3)
    ratios: dict[str, Any] = {}
    for op in ("set", "get"):
        for other in ("s3fs_best", "s3fs_gather", "s3fs_batch", "s3fs_tuned", "serial"):
            # paired repeat by repeat (measured seconds apart): robust to a machine whose load drifts
            paired = [o / h for o, h in zip(wall[f"{other}_{op}"], wall[f"hicache_{op}"])]
            ratios[f"{op}_vs_{other}"] = {
                "median": round(statistics.median(paired), 3), "min": round(min(paired), 3), "max": round(max(paired), 3),
            }
        for other in ("s3fs_best", "s3fs_tuned"):  # client CPU per page: theirs / ours
            ratios[f"{op}_cpu_vs_{other}"] = round(
                statistics.median(cpu[f"{other}_{op}"]) / statistics.median(cpu[f"hicache_{op}"]), 3)
    ratios["s3fs_best_is"] = best
    met = all(ratios[f"{op}_vs_s3fs_best"]["median"] >= 1.0 and ratios[f"{op}_vs_serial"]["median"] >= 5.0
              for op in ("set", "get"))
    return {
        "benchmark": "bench_s3",
        "config": {
            "page_kib": args.page_kib, "pages": n, "batch_MB": round(total_mb, 2), "concurrency": c,
            "repeats": args.repeats, "serial_pages": serial_n,
            "endpoint": "given" if args.endpoint else f"moto subprocess, +{args.latency_ms:g} ms per request",
        },
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg": [round(x, 2) for x in os.getloadavg()]},
        "results": results,
        "ratios": ratios,
        "targets": {"vs_s3fs_best": 1.0, "vs_serial": 5.0},
        "targets_met": met,  # judged on the paired medians
        "backend_stats": {k: v for k, v in stats.items() if k in ("requests", "retries", "timeouts", "corrupt_pages", "breaker_open")},
        "prefix_lookup": lookup,
    }


async def measure_lookup(store: Any, pages: int, concurrency: int) -> dict[str, Any]:
    """A ``pages``-page prompt's existence check from a cold process (nothing known locally):
    ``batch_exists_v2`` (run index + HEADs per wave) against one HEAD per page
    (``exists_pages``, what every lookup cost before), the prompt stored as one batch of tiny
    pages. Wall time and requests sent, median of 5."""
    keys = [f"lookup-{i:06d}" for i in range(pages)]
    pool = ArrayHostPool(pages, TOKENS_PER_PAGE, token_elems=2)
    store.register_mem_host_pool_v2(pool, "kv")
    res = await store.batch_set_v2([PoolTransfer("kv", host_indices=pool.indices(0, pages), keys=keys)])
    assert all(res["kv"]), "lookup pages not stored"
    await store.wait_index_writes()
    asked = keys + ["lookup-absent"]  # the prompt goes on past what is stored, as usual
    out: dict[str, Any] = {"pages": pages, "concurrency": concurrency}
    for name, call in (("run_index", lambda: store.batch_exists_v2(asked)), ("head_per_page", lambda: store.exists_pages(asked))):
        times, reqs = [], []
        for _ in range(5):
            store.exists_cache.clear()
            before = store.get_stats()["requests"]
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)
            reqs.append(store.get_stats()["requests"] - before)
        out[name] = {"median_ms": round(statistics.median(times) * 1e3, 1), "requests": statistics.median(reqs)}
    out["speedup"] = round(out["head_per_page"]["median_ms"] / out["run_index"]["median_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="S3 endpoint URL (default: start a moto server on loopback)")
    parser.add_argument("--bucket", default="hicache-bench")
    parser.add_argument(
        "--lookup-pages", type=positive_int, default=512, help="pages of the prompt whose existence check is timed (default 512)")
    parser.add_argument(
        "--latency-ms", type=non_negative_float, default=50.0,
        help="delay moto adds to each request (default 50; AWS quotes 100-200 ms first-byte latency "
        "for S3; 0 = raw loopback, where a CPU-bound moto hides what concurrency buys)",
    )
    parser.add_argument("--page-kib", type=positive_int, default=256, help="page size in KiB (default 256)")
    parser.add_argument("--pages", type=positive_int, default=128, help="pages per batch (default 128)")
    parser.add_argument("--concurrency", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=8, help="repeats (default 8: every way leads twice)")
    parser.add_argument("--serial-pages", type=positive_int, default=8, help="pages timed in the one-at-a-time loop (scaled)")
    parser.add_argument("--quick", action="store_true", help="a few seconds: 16 pages, 4 repeats")
    parser.add_argument("--out", type=output_file, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.pages, args.repeats, args.serial_pages = 16, 4, 4
    proc = None
    endpoint = args.endpoint
    if endpoint is None:
        proc, endpoint = start_moto(args.latency_ms)
    try:
        t0 = time.perf_counter()
        args.endpoint_url = endpoint
        report = asyncio.run(run(args, endpoint))
        report["wall_s"] = round(time.perf_counter() - t0, 2)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
