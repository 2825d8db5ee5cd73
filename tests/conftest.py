"""Shared test configuration: make CUDA-only tests skip cleanly on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Engine adapters are tested in their own virtual environments (scripts/test_<engine>.sh), which
# set HICACHE_ENGINE_TESTS to the engine's name; the main suite never collects tests/engines.
_engine = os.environ.get("HICACHE_ENGINE_TESTS", "")
collect_ignore = [] if _engine else ["engines"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
