"""The radix benchmark's SGLang columns still build against the pinned SGLang: its plain
``RadixCache`` and its hierarchical cache (``UnifiedRadixCache`` with a host pool and the
``memory`` store through its ``dynamic`` backend) match the same tokens as hicache's trees on a
few requests (a generated agents trace), and the report carries every ratio. Run as the benchmark runs: its own
process (it publishes SGLang server arguments for its whole process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def bench(tmp_path: Path, requests: int, *options: str) -> dict:
    """The benchmark's report on a generated agents trace, run as its own process."""
    out, trace = tmp_path / "radix.json", tmp_path / "agents.jsonl"
    made = subprocess.run([sys.executable, "-m", "hicache.cli", "workload", "agents", str(trace)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert made.returncode == 0, made.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_radix.py"), "--trace", str(trace), "--requests", str(requests),
         "--repeats", "1", "--long-tokens", "2048", "--long-reps", "1", *options, "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_radix_benchmark_compares_both_sglang_trees(tmp_path: Path) -> None:
    report = bench(tmp_path, 60)
    assert report["sglang_skipped"] is None and report["sglang_tiers_skipped"] is None
    results = report["results"]
    for name in ("hicache_prebuilt", "hicache_tiers_prebuilt", "sglang_prebuilt", "sglang_tiers_prebuilt"):
        assert results[name]["total_s"] > 0, name
    assert results["sglang_tiers_prebuilt"]["loop_cpu_ms_per_request"] > 0
    assert "hicache_tiers_prebuilt_vs_sglang_tiers_prebuilt" in report["ratios"]
    assert report["matched_tokens"] > 0  # the same for every method (the script fails otherwise)


def test_the_radix_benchmark_runs_with_cache_pressure_and_write_back(tmp_path: Path) -> None:
    """``--sweep-kib`` (memory read between requests, in every method),
    ``--tiers-write-policy write_back`` and ``--one-cpu`` leave the results identical (same
    matched tokens) and are recorded in the report."""
    report = bench(tmp_path, 40, "--no-sglang-tiers", "--tiers-write-policy", "write_back", "--sweep-kib", "64",
                   "--one-cpu")
    assert report["tiers_write_policy"] == "write_back" and report["sweep_kib_between_requests"] == 64
    assert report["one_cpu"] is True
    assert report["matched_tokens"] > 0
    assert report["results"]["hicache_tiers_prebuilt"]["total_s"] > 0
    assert report["results"]["sglang_prebuilt"]["total_s"] > 0
