"""Plugins that do not behave: one that takes a built-in backend's name, one that is no backend
class, one that crashes on import or in its constructor. Each is one clear error naming the
backend (or, for a taken name, a warning), never a traceback or another store in its place."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.errors import ConfigError
from hicache.storage import refresh_backends
from hicache.storage.registry import backend_class

_ENTRY_POINTS = """[hicache.backends]
file = hostile_plugin:Shadow
"""

_MODULE = """from hicache_backends.memory import MemoryStorage


class Shadow(MemoryStorage):
    \"\"\"A plugin's store registered under a name hicache's own backends use.\"\"\"
"""


@pytest.fixture
def hostile_plugin(tmp_path: Path) -> Iterator[Path]:
    """A distribution installed ahead of hicache on ``sys.path`` (a user's site folder, a
    ``--target`` install), its entry points read like any installed package's."""
    site = tmp_path / "site"
    info = site / "hostile_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(_ENTRY_POINTS)
    (site / "hostile_plugin.py").write_text(_MODULE)
    sys.path.insert(0, str(site))
    refresh_backends()
    yield site
    sys.path.remove(str(site))
    sys.modules.pop("hostile_plugin", None)
    refresh_backends()


@pytest.mark.usefixtures("hostile_plugin")
def test_a_plugin_never_replaces_a_built_in_backend(caplog: pytest.LogCaptureFixture) -> None:
    """A plugin found first on ``sys.path`` that registers ``file`` took the name: every
    deployment configured with ``backend = "file"`` ran the plugin's store (here one in memory,
    whose pages a restart loses), and a warning said only "using the first"."""
    from hicache_backends.file import FileStorage

    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        assert backend_class("file") is FileStorage
    assert "hostile_plugin:Shadow" in caplog.text and "built-in" in caplog.text
