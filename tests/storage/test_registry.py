"""Backends are found by entry-point name; unknown names and bad options are clear errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.errors import BackendLoadError, BackendNotFoundError, ConfigError
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorage,
    available_backends,
    backend_class,
    create_async_storage,
    create_storage,
    refresh_backends,
    register_backend,
)


def test_our_backends_are_entry_points() -> None:
    names = available_backends()
    for name in ("memory", "file", "s3", "fsspec"):
        assert name in names
    assert issubclass(backend_class("memory"), AsyncHiCacheStorage)


def test_create_storage_memory() -> None:
    store = create_storage("memory")
    try:
        assert isinstance(store, HiCacheStorage)
        assert store.batch_exists(["x"]) == 0
    finally:
        store.close()


def test_unknown_backend_lists_what_exists() -> None:
    with pytest.raises(BackendNotFoundError, match="memory"):
        create_async_storage("no-such-backend")


def test_bad_option_lists_allowed() -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        create_async_storage("memory", None, max_byte=1)
    with pytest.raises(ConfigError, match="max_bytes"):
        create_async_storage("memory", None, max_bytes=-1)


def test_runtime_registration_and_type_check() -> None:
    register_backend("not-a-backend", "builtins:dict")
    with pytest.raises(BackendLoadError, match="not an AsyncHiCacheStorage"):
        backend_class("not-a-backend")
    register_backend("broken", "no_such_module_xyz:Thing")
    with pytest.raises(BackendLoadError, match="could not be imported"):
        backend_class("broken")


def _install_plugin(root: Any, entry_points_txt: str) -> None:
    """A real installed distribution (a package and its ``.dist-info``) under ``root``."""
    (root / "hicache_demo_plugin").mkdir()
    (root / "hicache_demo_plugin" / "__init__.py").write_text(
        "from hicache_backends.memory import MemoryStorage\n\n"
        "class DemoStorage(MemoryStorage):\n    backend_name = 'demo'\n"
    )
    info = root / "hicache_demo_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-demo-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points_txt)


@pytest.fixture
def plugin_site(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    refresh_backends()
    yield tmp_path
    sys.modules.pop("hicache_demo_plugin", None)
    monkeypatch.undo()
    refresh_backends()


def test_entry_points_with_extras_or_spaces_load(plugin_site: Any) -> None:
    """Entry-point values may name extras (``mod:Class [extra]``) and put spaces around the
    colon; the registry took the raw text apart itself and refused both valid plugins."""
    _install_plugin(plugin_site, "[hicache.backends]\n"
                                 "demo-extras = hicache_demo_plugin:DemoStorage [fast]\n"
                                 "demo-spaces = hicache_demo_plugin : DemoStorage\n")
    refresh_backends()
    assert {"demo-extras", "demo-spaces"} <= set(available_backends())
    for name in ("demo-extras", "demo-spaces"):
        assert backend_class(name).__name__ == "DemoStorage"
        store = create_storage(name)
        try:
            assert store.batch_exists(["x"]) == 0
        finally:
            store.close()


def test_a_plugin_missing_primitives_is_a_load_error_naming_them() -> None:
    """A backend class that leaves primitives abstract can never be built: it was accepted
    (listed, its options shown, a config naming it passed the check at start) and failed only
    when built, as a ConfigError that blamed the options."""

    class HalfStorage(AsyncHiCacheStorage):
        async def _exists(self, pages: Any) -> list[bool]:
            return [False] * len(pages)

    register_backend("half-done", HalfStorage)
    with pytest.raises(BackendLoadError, match=r"half-done.*_clear.*_read.*_read_bytes.*_write"):
        backend_class("half-done")
    with pytest.raises(BackendLoadError, match="half-done"):
        create_async_storage("half-done")


@pytest.mark.parametrize("option", ["name", "storage_config"])
@pytest.mark.parametrize("backend", ["memory", "file", "slow-file"])
def test_an_option_named_like_the_factorys_own_arguments_is_a_config_error(tmp_path, option: str, backend: str) -> None:
    """An option called ``name`` or ``storage_config`` (from a user's config) collided with the
    factory's own arguments: a raw TypeError ("got multiple values") instead of an option the
    backend does not have, also for a backend taking **kwargs (hicache's slow-file)."""
    from hicache.errors import ConfigError
    from hicache.testing.slow_store import register_slow_file

    register_slow_file()
    roots = {} if backend == "memory" else {"root": str(tmp_path)}
    with pytest.raises(ConfigError):
        create_async_storage(backend, None, **roots, **{option: "x"})
