"""Multi-process mode: several real worker processes, one scrape from yet another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.observability.scrape import Scrape

HERE = Path(__file__).resolve().parent
SCRAPE = "import sys; from hicache.observability.metrics import exposition_text; sys.stdout.write(exposition_text())"


def _env(mp_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(mp_dir)
    return env


def _worker(mp_dir: Path, root: Path, seed: int, requests: int) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_metrics_mp_worker.py"), str(root), str(seed), str(requests)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(mp_dir),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"worker exited with {proc.returncode} before reporting")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def _scrape(mp_dir: Path) -> Scrape:
    out = subprocess.run([sys.executable, "-c", SCRAPE], env=_env(mp_dir), capture_output=True, text=True,
                         timeout=120, check=True)
    return Scrape(out.stdout)


def test_one_scrape_sees_every_worker_and_only_live_gauges(tmp_path: Path) -> None:
    mp_dir, root = tmp_path / "prom", tmp_path / "store"
    mp_dir.mkdir()
    first, a = _worker(mp_dir, root, seed=1, requests=3)
    second = None
    try:
        second, b = _worker(mp_dir, root, seed=1, requests=3)  # the same prompts: its hits come from storage
        assert a["label"] == b["label"] == "0"  # each process's first cache
        assert b["storage_hits"] > 0
        scrape = _scrape(mp_dir)
        # counters and histograms: the sum over the workers
        assert scrape.value("hicache_requests_total", cache="0") == a["requests"] + b["requests"] == 6
        assert scrape.value("hicache_hit_tokens_total", cache="0", tier="storage") == b["storage_hits"]
        assert scrape.value("hicache_backend_write_ok_total", cache="0", backend="file") > 0
        assert scrape.value("hicache_operation_seconds_count", cache="0", op="set", tier="storage") >= 1
        assert scrape.value("hicache_operation_seconds_count", cache="0", op="prefetch", tier="storage") >= 1
        # live gauges: summed over live workers (livesum), the store's state the worst of them
        assert scrape.value("hicache_host_size_tokens", cache="0") == a["host_size"] + b["host_size"]
        assert scrape.value("hicache_storage_up", cache="0") == 1
        _stop(first)
        scrape = _scrape(mp_dir)
        assert scrape.value("hicache_requests_total", cache="0") == 6  # a dead worker's counts stay
        assert scrape.value("hicache_host_size_tokens", cache="0") == b["host_size"]  # its gauges leave
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_missing_multiprocess_dir_is_one_clear_error(tmp_path: Path) -> None:
    code = ("from hicache.errors import ConfigError\n"
            "from hicache.controller.metrics import ControllerMetrics\n"
            "try:\n    ControllerMetrics()\nexcept ConfigError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path / "absent"), capture_output=True,
                         text=True, timeout=120, check=True)
    assert "is not a directory" in out.stdout, out


REFRESH_OFF_LOOP = r"""
import asyncio, json, threading
from hicache.observability import metrics as obs
from hicache.controller.metrics import ControllerMetrics

release = threading.Event()
seen = {}

def slow_gauge():
    seen.setdefault("threads", []).append(threading.get_ident())
    release.wait(10)  # a stalled store's figures: the loop must not wait for them
    return 7.0

async def main():
    m = ControllerMetrics()
    m.gauge("probe_depth", slow_gauge)
    m.incr("requests")  # an update on the loop asks for a refresh
    on_loop = threading.get_ident() in seen.get("threads", [])
    release.set()
    while not obs._refresher.idle():
        await asyncio.sleep(0.01)
    text = await asyncio.to_thread(obs.exposition_text)  # as /metrics does
    await m.aclose()  # the last refresh runs on a thread too
    print(json.dumps({"on_loop": on_loop, "refreshed": len(seen["threads"]),
                      "loop_thread": threading.get_ident(), "threads": seen["threads"],
                      "value": 'hicache_probe_depth{cache="0"} 7.0' in text}))

asyncio.run(main())
"""


def test_gauges_are_refreshed_off_the_updating_thread(tmp_path: Path) -> None:
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    out = subprocess.run([sys.executable, "-c", REFRESH_OFF_LOOP], env=_env(mp_dir), capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["on_loop"], got
    assert got["loop_thread"] not in got["threads"], got
    assert got["refreshed"] >= 2  # the one the update asked for, and the last one at close
    assert got["value"], out.stdout


_RECOVERY = r'''
import asyncio, sys
from hicache.observability import metrics as obs
from hicache.controller.metrics import ControllerMetrics
state = {"up": 1.0}
async def main():
    m = ControllerMetrics()
    m.gauge("storage_up", lambda: state["up"])
    state["up"] = 0.0; m.incr("storage_trips")        # marked down: published
    while not obs._refresher.idle(): await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    state["up"] = 1.0; m.incr("storage_recoveries")   # recovered within the refresh window
    await asyncio.sleep(2.0)                          # then idle: no update publishes it
    print("ready", flush=True); sys.stdin.readline()
asyncio.run(main())
'''


def test_the_last_change_before_a_worker_goes_idle_is_published(tmp_path: Path) -> None:
    """A refresh asked for within the throttle window was dropped: a store that recovered
    0.2 s after it went down read DOWN in every other process's scrape for as long as the
    worker stayed idle."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _RECOVERY], env=_env(mp_dir), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        scrape = _scrape(mp_dir)
        assert scrape.value("hicache_storage_up") == 1.0
        assert scrape.value("hicache_storage_recoveries_total") == 1.0
    finally:
        _stop(proc)


_REPLACED = r'''
import asyncio, json, math, sys
from hicache.facade import HiCache
from hicache.observability.metrics import exposition_text
from hicache.observability.scrape import Scrape
from hicache.observability.stats_view import render_scrape
def config():
    return {"model": {"name": "test/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "device": {"device": "cpu", "size_tokens": 1024, "page_size": 16, "max_context_len": 2048},
            "host": {"ratio": 4.0}, "storage": {"backend": "memory"}, "session": {"reap_interval_s": None}}
async def main():
    a = await HiCache.from_config(config()).start()
    a._stack.controller.health.trip("store hung")  # why it is being replaced
    await a.aclose()
    b = await HiCache.from_config(config()).start()  # its replacement, same process
    s = Scrape(exposition_text())
    line = [l for l in render_scrape(s, "x").splitlines() if l.startswith("storage:")][0]
    print(json.dumps({"device": s.value("hicache_device_size_tokens"), "line": line,
                      "up": [x.value for x in s.select("hicache_storage_up") if math.isfinite(x.value)]}))
    await b.aclose()
asyncio.run(main())
'''


def test_a_closed_cache_leaves_neutral_gauges(tmp_path: Path) -> None:
    """Multi-process mode cannot remove a closed cache's series: its gauges are neutral (0
    where summed, +inf/-inf where min/max), so a replaced cache's sizes are not added in and its
    last ``storage_up = 0`` does not read as DOWN."""
    import warnings

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", _REPLACED], env=_env(mp_dir),
                             capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["device"] == 1024.0  # the live cache's only
    assert got["up"] == [1.0] and "storage: up" in got["line"]


_SHARED_LABEL = r'''
import sys
from hicache.observability.metrics import InstanceMetrics
old, new = InstanceMetrics("prod"), InstanceMetrics("prod")
for owner in (old, new):
    owner.gauge("pages_in_use", lambda: 5)
    owner.refresh()
old.close()  # its final refresh, then its gauges neutral; the series is the live owner's too
print("ready", flush=True)
sys.stdin.readline()
new.close()
'''


def test_a_closed_owner_leaves_a_gauge_it_shares_with_a_live_one(tmp_path: Path) -> None:
    """Two owners of one ``cache`` label write one gauge series; the first to close set it to
    its neutral 0 though the other still ran: a scrape from another process read 0 until the
    live owner's next update."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SHARED_LABEL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env(mp_dir))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert _scrape(mp_dir).value("hicache_pages_in_use", cache="prod") == 5.0
    finally:
        _stop(proc)


def test_store_wide_figures_are_not_summed_over_workers(tmp_path: Path) -> None:
    """Two workers on one file store each report the whole store's pages and bytes: the scrape
    shows the store once (the largest report), not twice."""
    mp_dir, root = tmp_path / "prom", tmp_path / "store"
    mp_dir.mkdir()
    first, _ = _worker(mp_dir, root, seed=1, requests=3)
    second = None
    try:
        second, _ = _worker(mp_dir, root, seed=2, requests=3)
        scrape = _scrape(mp_dir)
        files = [p for p in root.rglob("*") if p.is_file() and p.parent.parent.name == "pages"]
        stored = scrape.value("hicache_backend_stored_pages")
        assert stored is not None and 0 < stored <= len(files)
    finally:
        if second is not None:
            _stop(second)
        _stop(first)


def test_a_killed_workers_gauges_leave_the_scrape(tmp_path: Path) -> None:
    """A worker killed by a signal (the OOM killer, SIGKILL from a supervisor) runs no atexit:
    its live gauge files stayed in the directory, and every scrape kept adding its host size
    (and would keep its last ``storage_up = 0``) for as long as the deployment ran."""
    mp_dir, root = tmp_path / "prom", tmp_path / "store"
    mp_dir.mkdir()
    first, a = _worker(mp_dir, root, seed=1, requests=2)
    second = None
    try:
        second, b = _worker(mp_dir, root, seed=2, requests=2)
        assert _scrape(mp_dir).value("hicache_host_size_tokens", cache="0") == a["host_size"] + b["host_size"]
        first.kill()
        first.wait(timeout=60)
        scrape = _scrape(mp_dir)
        assert scrape.value("hicache_requests_total", cache="0") == a["requests"] + b["requests"]  # counts stay
        assert scrape.value("hicache_host_size_tokens", cache="0") == b["host_size"]  # the live one only
        assert scrape.value("hicache_storage_up", cache="0") == 1
        _stop(second)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
