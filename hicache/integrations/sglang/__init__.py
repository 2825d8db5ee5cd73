"""hicache as SGLang's L3 storage (SGLang 0.5.23), loaded by SGLang's own factory::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheSGLangStorage",
        "hicache_backend": "file", "hicache_options": {"root": "/data/kv"}}'

``HiCacheSGLangStorage`` subclasses SGLang's ``HiCacheStorage``, so importing it imports SGLang;
it is resolved on first access, and the other modules here (page adapter, settings, hit query,
transfer) import no SGLang at all.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HiCacheSGLangStorage", "SUPPORTED_SGLANG"]

#: SGLang releases this adapter is tested against (tests/engines/sglang).
SUPPORTED_SGLANG = ("0.5.23",)


def __getattr__(name: str) -> Any:
    if name in ("HiCacheSGLangStorage", "SGLangAttachError"):
        try:
            from hicache.integrations.sglang import storage
        except ImportError as exc:
            raise ImportError(
                f"hicache.integrations.sglang.{name} needs SGLang ({' or '.join(SUPPORTED_SGLANG)}) "
                f"installed: {exc}"
            ) from exc
        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
