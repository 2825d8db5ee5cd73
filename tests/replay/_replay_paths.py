"""Paths the replay tests share: the repository, the 20% replay config, the Mooncake trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.replay import find_trace

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "replay-20pct.toml"


def shared_trace() -> Path:
    """The shared Mooncake trace; the test is skipped where it is not available."""
    try:
        return find_trace()
    except FileNotFoundError:
        pytest.skip("the shared Mooncake trace is not available")
