"""hicache's connector, with the ``slow-file`` backend registered in the process that imports
it (vLLM imports the connector's module in the scheduler's and the workers' processes): a file
store whose calls answer ``latency_ms`` late (:mod:`hicache.testing.slow_store`)."""

from __future__ import annotations

from hicache.integrations.vllm.connector import HiCacheConnector
from hicache.testing.slow_store import register_slow_file

__all__ = ["HiCacheConnector"]

register_slow_file()
