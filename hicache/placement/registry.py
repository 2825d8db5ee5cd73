"""Placement policies by name (the ``cache.placement`` config value)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hicache.errors import ConfigError
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


#: what an option of each pydantic error type must be, in the error an operator reads
_MUST_BE = {"int_type": "an integer", "string_type": "a string", "float_type": "a number", "bool_type": "true or false"}


def _check_types(name: str, cls: type[PlacementPolicy], options: dict[str, Any]) -> None:
    """A :class:`ConfigError` for an option of the wrong type, by the policy's signature
    (pydantic, strict: no ``true`` or ``1.5`` taken as an integer): a string reached a
    comparison as ``'<' not supported between instances of 'str' and 'int'``, a float or
    ``true`` became a ghost list's size."""
    hints = typing.get_type_hints(cls.__init__)
    for key, value in options.items():
        if key not in hints:
            continue
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=True)
        except ValidationError as exc:
            error = exc.errors()[0]
            what = _MUST_BE.get(error["type"], f"valid ({error['msg']})")
            none = " or null" if type(None) in typing.get_args(hints[key]) else ""
            raise ConfigError(f"placement {name!r}: option {key!r} must be {what}{none}, got {value!r:.40}") from None
