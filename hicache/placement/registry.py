"""Placement policies by name (the ``cache.placement`` config value)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

from hicache.errors import ConfigError
from hicache.options import type_mismatch
from hicache.placement.base import PlacementPolicy
from hicache.placement.lru import LruPlacement
from hicache.placement.tiered import ReusePlacement, TieredPlacement

__all__ = ["PLACEMENT_POLICIES", "make_placement"]

PLACEMENT_POLICIES: dict[str, type[PlacementPolicy]] = {
    "lru": LruPlacement,
    "reuse": ReusePlacement,
    "tiered": TieredPlacement,
}


def make_placement(
    name: str | PlacementPolicy, options: dict[str, Any] | None = None, *, defaults: dict[str, Any] | None = None
) -> PlacementPolicy:
    """The policy ``name`` built with ``options``; unknown names and options are a
    :class:`ConfigError` that names the allowed ones. ``defaults`` (sizes the stack knows, such
    as ``ghost_pages``) apply only to policies that take them. A policy object is returned as is."""
    if isinstance(name, PlacementPolicy):
        return name
    cls = PLACEMENT_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown placement policy {name!r}; allowed: {sorted(PLACEMENT_POLICIES)}")
    accepted = set(inspect.signature(cls).parameters)
    options = {**{k: v for k, v in (defaults or {}).items() if k in accepted}, **(options or {})}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(f"placement {name!r}: unknown option(s) {unknown}; allowed: {sorted(accepted)}")
    _check_types(name, cls, options)
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"placement {name!r}: {exc}") from None


def _check_types(name: str, cls: type[PlacementPolicy], options: dict[str, Any]) -> None:
    """A :class:`ConfigError` for an option of the wrong type, by the policy's signature
    (pydantic, strict: no ``true`` or ``1.5`` taken as an integer): a string reached a
    comparison as ``'<' not supported between instances of 'str' and 'int'``, a float or
    ``true`` became a ghost list's size."""
    hints = typing.get_type_hints(cls.__init__)
    for key, value in options.items():
        if key not in hints:
            continue
        must = type_mismatch(hints[key], value)
        if must is not None:
            raise ConfigError(f"placement {name!r}: option {key!r} must be {must}, got {value!r:.40}")
