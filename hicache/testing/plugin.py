"""pytest plugin registered by hicache (``pytest11`` entry point): markers used by the suite."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hicache_conformance: the storage conformance suite")
    config.addinivalue_line("markers", "slow: long-running test (crash loops, soak)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
