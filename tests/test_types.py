"""``mypy`` passes on ``hicache`` and the bundled backends (``backends/hicache_backends``) with
the repository's configuration (``[tool.mypy]`` in pyproject.toml). Skipped only where mypy is
not installed (the ``dev`` extra installs it)."""

from __future__ import annotations

import os
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


def test_an_installed_hicache_gives_its_types_to_a_users_mypy(tmp_path: Path) -> None:
    """A server that embeds hicache and runs mypy gets hicache's annotations (PEP 561): the
    packages as setuptools installs them carry a ``py.typed`` marker. Without it mypy refused
    to read them ("module is installed, but missing library stubs or py.typed marker") and
    every hicache name was ``Any``: a wrong call went unchecked."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[dev]')")
    lib = tmp_path / "lib"
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
         "build_py", "--build-lib", str(lib)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert (lib / "hicache" / "facade.py").is_file()
    user = tmp_path / "server"
    user.mkdir()
    (user / "server.py").write_text(
        "from hicache.facade import HiCache\n"
        "from hicache_backends.memory import MemoryStorage\n"
        "cache: int = HiCache.from_config('hicache.toml')\n"
        "store: int = MemoryStorage()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "server.py"],
        cwd=user, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(lib), "MYPYPATH": ""},
    )
    out = proc.stdout + proc.stderr
    assert "py.typed" not in out and "import-untyped" not in out, out
    # hicache's annotations reached the user's check: both wrong assignments are caught
    assert 'expression has type "HiCache", variable has type "int"' in out, out
    assert 'expression has type "MemoryStorage", variable has type "int"' in out, out
