"""Backends are found by entry-point name; unknown names and bad options are clear errors."""

from __future__ import annotations

import pytest

from hicache.errors import BackendLoadError, BackendNotFoundError, ConfigError
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorage,
    available_backends,
    backend_class,
    create_async_storage,
    create_storage,
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
