"""Plugins that do not behave: one that takes a built-in backend's name, one that is no backend
class, one that crashes on import or in its constructor. Each is one clear error naming the
backend (or, for a taken name, a warning), never a traceback or another store in its place."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hicache_backends.memory import MemoryStorage

from hicache.errors import BackendLoadError
from hicache.storage import available_backends, create_async_storage, refresh_backends, register_backend
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


class _Exploding(MemoryStorage):
    """A plugin whose constructor fails on something of its own (a client library's bug)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("plugin constructor exploded")


def test_a_plugin_that_raises_in_its_constructor_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A ``RuntimeError`` from a plugin's ``__init__`` went through the command line as a
    traceback (only ``TypeError`` and ``ValueError`` were reported, as bad options); it is a
    :class:`BackendLoadError` naming the backend and the cause, and the command exits 2."""
    from hicache.cli import main

    register_backend("exploding", _Exploding)
    with pytest.raises(BackendLoadError, match=r"'exploding'.*RuntimeError: plugin constructor exploded"):
        create_async_storage("exploding", None)
    config = tmp_path / "replay.toml"
    config.write_text('[storage]\nbackend = "exploding"\noptions = { max_bytes = 1000000 }\n')
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["replay", "-c", str(config), "--trace", str(trace), "--no-progress", "--policies", "lru"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "plugin constructor exploded" in err and "'exploding'" in err


@pytest.mark.parametrize("metadata", [None, "Metadata-Version: 2.1\nVersion: 0.1\n"], ids=["no-METADATA", "no-Name"])
def test_a_distribution_without_a_name_sharing_a_backend_name_is_no_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, metadata: str | None
) -> None:
    """A ``.dist-info`` whose metadata names no distribution (no ``METADATA`` file, as a
    half-removed package or a hand-made plugin folder leaves it, or one without ``Name``)
    that registered a backend name another distribution registers made every backend lookup
    an ``AttributeError`` (``None.lower()``), ``file`` included: no cache could start. The
    built-in keeps its name, with the usual warning."""
    from hicache_backends.file import FileStorage

    site = tmp_path / "site"
    info = site / "nameless-0.1.dist-info"
    info.mkdir(parents=True)
    if metadata is not None:
        (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text("[hicache.backends]\nfile = hostile_plugin:Shadow\n")
    (site / "hostile_plugin.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(site))
    refresh_backends()
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.storage"):
            assert "memory" in available_backends()
            assert backend_class("file") is FileStorage
        assert "hostile_plugin:Shadow" in caplog.text and "built-in" in caplog.text
    finally:
        monkeypatch.undo()
        sys.modules.pop("hostile_plugin", None)
        refresh_backends()


class _OpenExploding(MemoryStorage):
    """A plugin whose open fails on something of its own (its client library's exception)."""

    async def _open(self) -> None:
        raise RuntimeError("plugin open exploded")


async def test_a_plugin_that_raises_in_its_open_is_one_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A ``RuntimeError`` from a plugin's ``_open`` came out of ``HiCache.start()`` as it was,
    no hicache error for an embedding server to catch, and ended ``hicache demo`` in a
    traceback with exit 1; it is a :class:`BackendLoadError` naming the backend and the cause,
    and the command is one line, exit 2. A later open tries again, as after any failed open."""
    from hicache.cli import main
    from hicache.facade import HiCache

    register_backend("open-exploding", _OpenExploding)
    store = create_async_storage("open-exploding", None)
    for _ in range(2):
        with pytest.raises(BackendLoadError, match=r"could not be opened: RuntimeError: plugin open exploded") as raised:
            await store.open()
        assert isinstance(raised.value.__cause__, RuntimeError)
    await store.aclose()

    config = {"model": {"name": "plugin-test"}, "storage": {"backend": "open-exploding"}}
    with pytest.raises(BackendLoadError, match="plugin open exploded"):
        await HiCache.from_config(config).start()

    path = tmp_path / "demo.toml"
    path.write_text('[model]\nname = "plugin-test"\n[storage]\nbackend = "open-exploding"\n')
    assert await asyncio.to_thread(main, ["demo", "--quick", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "plugin open exploded" in err and "could not be opened" in err


class _OpenWaiting(MemoryStorage):
    """A plugin whose open waits for a service that does not answer (until ``answer`` is set)."""

    backend_name = "open-waiting"
    answer = threading.Event()

    async def _open(self) -> None:
        while not self.answer.is_set():
            await asyncio.sleep(0.05)


async def test_an_open_that_does_not_answer_is_said_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend whose open does not answer held ``HiCache.start()`` with nothing in the log
    (a server that never came up, and no line saying why); a warning now names the backend
    while the open goes on, and the start completes once the backend answers."""
    import hicache.storage.base as base
    from hicache.facade import HiCache

    monkeypatch.setattr(base, "OPEN_WARN_S", 0.2, raising=False)
    register_backend("open-waiting", _OpenWaiting)
    _OpenWaiting.answer.clear()
    cache = HiCache.from_config({"model": {"name": "plugin-test"}, "storage": {"backend": "open-waiting"},
                                 "device": {"device": "cpu"}})
    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        start = asyncio.create_task(cache.start())
        try:
            for _ in range(600):  # up to 60 s on a loaded machine
                if "'open-waiting' has not opened" in caplog.text or start.done():
                    break
                await asyncio.sleep(0.1)
            assert not start.done()
            assert "'open-waiting' has not opened" in caplog.text
        finally:
            _OpenWaiting.answer.set()
            await asyncio.wait_for(start, 60)
            await cache.aclose()
