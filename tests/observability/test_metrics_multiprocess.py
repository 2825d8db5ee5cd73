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
