"""Checks shared by the storage backends' options (a backend's keyword arguments, from a config
file, the ``HICACHE__STORAGE__OPTIONS__*`` environment or a caller)."""

from __future__ import annotations

import inspect
from typing import Any

from hicache.errors import ConfigError

__all__ = ["bool_option", "takes_bool"]


def bool_option(backend: str, name: str, value: Any) -> bool:
    """``value`` if it is a real boolean, else a :class:`ConfigError` naming the option.

    ``bool(value)`` read every non-empty string as true: ``fsync = "false"`` in TOML, or
    ``..__OPTIONS__SHARED=False`` from the environment, turned the option on."""
    if not isinstance(value, bool):
        raise ConfigError(f"{backend} backend: option {name} must be true or false, got {value!r}")
    return value


def takes_bool(param: inspect.Parameter) -> bool:
    """Whether a backend's constructor parameter is annotated ``bool`` (as a type, or as the
    string a module with postponed annotations leaves in the signature)."""
    return param.annotation in (bool, "bool")
