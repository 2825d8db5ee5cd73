"""Keyword-only option dataclasses built from plain dicts, with unknown keys as clear errors."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from hicache.errors import ConfigError

__all__ = ["options_from_dict"]

T = TypeVar("T")


def options_from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """``cls(**data)``, refusing keys ``cls`` does not have (a typo must not fall back to a
    default): the error names them and the allowed ones."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known, key=str)  # a YAML key may be a number: 1 and "a" do not sort
    if unknown:
        raise ConfigError(f"unknown {what} option(s) {unknown}; allowed: {sorted(known)}")
    return cls(**data)
