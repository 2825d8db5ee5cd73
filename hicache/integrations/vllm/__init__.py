"""hicache inside vLLM, as a KV connector (``KVConnectorBase_V1``).

Turn it on with one config line (the module path is this package)::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
                           "kv_connector_module_path": "hicache.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"backend": "file",
                                                         "backend_options": {"root": "/data/kv"}}}'

Importing this package never imports vLLM: the connector class is resolved on first attribute
access (vLLM's factory does ``getattr(module, "HiCacheConnector")``), so the core and its tests
stay engine-free. The engine-independent halves (:mod:`.scheduler_side` with its host tier
tree :mod:`.host_tree`, :mod:`.worker_side` with its host pool :mod:`.host_pool`, the step
plan :mod:`.transfers`, :mod:`.naming`, :mod:`.options`) import no vLLM at all.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HiCacheConnector", "HiCacheConnectorMetadata"]

_LAZY = {
    "HiCacheConnector": "hicache.integrations.vllm.connector",
    "HiCacheConnectorMetadata": "hicache.integrations.vllm.connector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
