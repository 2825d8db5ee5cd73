"""Checks shared by the storage backends' options (a backend's keyword arguments, from a config
file, the ``HICACHE__STORAGE__OPTIONS__*`` environment or a caller)."""

from __future__ import annotations

import inspect
import os
import pathlib
import types
import typing
from typing import Any

from hicache.errors import ConfigError

__all__ = ["bool_option", "takes_bool", "takes_str"]

# what a text option's annotation names: a string or a path (as types, or as postponed text)
_TEXT_TYPES = (str, os.PathLike, pathlib.PurePath)
_TEXT_NAMES = frozenset({"str", "os.PathLike[str]", "PathLike[str]", "os.PathLike", "PathLike", "Path", "pathlib.Path"})


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


def takes_str(param: inspect.Parameter) -> bool:
    """Whether a backend's constructor parameter takes text only: annotated ``str`` or a path
    (``os.PathLike[str]``, ``Path``), optionally ``| None`` - as types, or as the string a module
    with postponed annotations leaves in the signature. From the environment such an option keeps
    its variable's text: read as JSON, a root folder named ``2024`` became the number 2024 and
    was refused (``true``, ``1e3`` changed type too)."""
    ann = param.annotation
    if isinstance(ann, str):
        members = [m.strip() for m in ann.split("|")]
        return any(m in _TEXT_NAMES for m in members) and all(m in _TEXT_NAMES or m == "None" for m in members)
    union = typing.get_origin(ann) in (typing.Union, types.UnionType)
    members = list(typing.get_args(ann)) if union else [ann]
    def is_text(member: Any) -> bool:
        cls = typing.get_origin(member) or member  # os.PathLike[str] -> os.PathLike
        return isinstance(cls, type) and issubclass(cls, _TEXT_TYPES)

    return any(map(is_text, members)) and all(is_text(m) or m is type(None) for m in members)
