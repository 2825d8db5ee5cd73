"""Fixtures of the server tests (helpers live in ``server_helpers``)."""

from __future__ import annotations

import pytest

from server_helpers import requires_facade


@pytest.fixture(params=["recompute", pytest.param("hicache", marks=requires_facade)])
def mode(request: pytest.FixtureRequest) -> str:
    """Serve with no cache (the baseline) and with the real hicache facade."""
    return request.param
