"""Keyword-only option dataclasses built from plain dicts, with unknown keys and values of the
wrong type as clear errors."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from hicache.errors import ConfigError

__all__ = ["check_option_types", "options_from_dict", "type_mismatch"]

T = TypeVar("T")

#: what a value of each pydantic error type must be, in the error an operator reads
_MUST_BE = {"int_type": "an integer", "string_type": "a string", "float_type": "a number", "bool_type": "true or false"}


@functools.lru_cache(maxsize=256)
def _adapter(hint: Any) -> TypeAdapter[Any]:
    """One validator per type, built once: building it is most of a check's cost."""
    return TypeAdapter(hint)


def type_mismatch(hint: Any, value: Any) -> str | None:
    """What ``value`` must be to be of type ``hint`` (``"an integer or null"``), or ``None``
    when it is one. Strict (pydantic's strict mode): ``true`` or ``1.5`` is no integer, ``"4"``
    no number and ``"false"`` no flag, where a lax reading took them silently."""
    try:
        try:
            adapter = _adapter(hint)
        except TypeError:  # a hint that cannot be hashed: built for this check alone
            adapter = TypeAdapter(hint)
        adapter.validate_python(value, strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        none = " or null" if type(None) in typing.get_args(hint) else ""
        return _MUST_BE.get(error["type"], f"valid ({error['msg']})") + none
    return None


def check_option_types(options: Any, what: str) -> None:
    """A :class:`ConfigError` naming the first field of the option dataclass ``options`` whose
    value is not of its annotated type (see :func:`type_mismatch`); run before range checks, a
    string reached them as a raw ``TypeError`` that named no field."""
    hints = typing.get_type_hints(type(options))
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        must = type_mismatch(hints[field.name], value)
        if must is not None:
            raise ConfigError(f"{what} option {field.name} must be {must}, got {value!r:.40}")


def options_from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """``cls(**data)``, refusing keys ``cls`` does not have (a typo must not fall back to a
    default): the error names them and the allowed ones."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known, key=str)  # a YAML key may be a number: 1 and "a" do not sort
    if unknown:
        raise ConfigError(f"unknown {what} option(s) {unknown}; allowed: {sorted(known)}")
    return cls(**data)
