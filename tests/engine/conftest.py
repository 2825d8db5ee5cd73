"""Fixtures of the engine tests (helpers live in ``engine_helpers``)."""

from __future__ import annotations

import pytest

from engine_helpers import small_spec
from hicache.engine import ModelSpec, TinyTransformer


@pytest.fixture
def spec() -> ModelSpec:
    return small_spec()


@pytest.fixture
def model(spec: ModelSpec) -> TinyTransformer:
    return TinyTransformer(spec)
