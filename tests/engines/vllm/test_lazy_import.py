"""The package is importable without pulling vLLM in; vLLM's factory finds the connector."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_does_not_import_vllm() -> None:
    code = (
        "import sys, hicache, hicache.integrations.vllm as m;"
        "import hicache.integrations.vllm.naming, hicache.integrations.vllm.worker_side,"
        " hicache.integrations.vllm.scheduler_side;"
        "assert 'vllm' not in sys.modules, sorted(k for k in sys.modules if k.startswith('vllm'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_vllm_factory_resolves_the_connector() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cfg = KVTransferConfig(
        kv_connector="HiCacheConnector",
        kv_connector_module_path="hicache.integrations.vllm",
        kv_role="kv_both",
    )
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert issubclass(cls, KVConnectorBase_V1)
