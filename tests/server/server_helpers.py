"""Server test helpers: a small deployment config and a check for the real facade."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache.config import HiCacheConfig

PAGE = 16


def small_config(storage_root: Path | None = None, **sections: Any) -> HiCacheConfig:
    """A fast deployment: 3 layers, 2 KV heads of 16, a CPU device pool, loopback port 0; the
    file backend under ``storage_root`` when given, else no storage tier."""
    data: dict[str, Any] = {
        "model": {"name": "tests/server-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
        "device": {"device": "cpu", "size_tokens": 4096, "page_size": PAGE, "max_context_len": 2048},
        "host": {"ratio": 2.0},
        "storage": {"backend": None} if storage_root is None else
                   {"backend": "file", "options": {"root": str(storage_root), "max_bytes": 1 << 30, "min_free_bytes": 0}},
        "cache": {"prefetch": {"threshold_tokens": 0}},
        "server": {"host": "127.0.0.1", "port": 0, "max_batch": 4, "max_new_tokens": 4},
    }
    for name, value in sections.items():
        data.setdefault(name, {}).update(value)
    return HiCacheConfig.model_validate(data)


def facade_available() -> bool:
    """Whether ``hicache.facade.HiCache`` is implemented (it lands after the engine)."""
    try:
        from hicache.facade import HiCache
    except ImportError:
        return False
    return hasattr(HiCache, "from_config") and hasattr(HiCache, "begin")


requires_facade = pytest.mark.skipif(not facade_available(), reason="hicache.facade.HiCache is not implemented yet")
