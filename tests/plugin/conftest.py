"""Installs the sample plugin package into a temporary folder once per test session and puts it
on ``sys.path``, the way a user's ``pip install`` would make it visible."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.storage import refresh_backends

PLUGIN_SRC = Path(__file__).parent / "sample_plugin"


@pytest.fixture(scope="session")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory):
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources, which
    # would litter the repository (and race between concurrent test runs).
    src = build / "sample_plugin"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-index", "--target", str(target), str(src)],
        check=True, cwd=build,
    )
    sys.path.insert(0, str(target))
    refresh_backends()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.startswith("hicache_sample_plugin")]:
        del sys.modules[name]
    refresh_backends()
