"""``mypy`` passes on ``hicache`` and the bundled backends (``backends/hicache_backends``) with
the repository's configuration (``[tool.mypy]`` in pyproject.toml). Skipped only where mypy is
not installed (the ``dev`` extra installs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_passes(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[dev]')")
    cmd = [
        sys.executable, "-m", "mypy",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(tmp_path / "mypy-cache"),  # never a .mypy_cache in the repository
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        print(proc.stdout)
        print(proc.stderr, file=sys.stderr)
    assert proc.returncode == 0, f"mypy found errors (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
