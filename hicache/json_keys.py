"""JSON objects that refuse a key given twice.

Why a module of its own: ``json`` keeps the last of two equal keys, silently, so a config
section pasted twice, or a trace record with two ``hash_ids`` lists, was read as something the
user did not write. The config loader and the trace reader both refuse them; this is the one
hook they pass to ``json.loads`` (dependency-free, so reading a trace imports no config stack).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DuplicateKeyError", "unique_keys"]


class DuplicateKeyError(ValueError):
    """A key given twice in one JSON object (or YAML mapping)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: one object, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} is given twice in one object")
        out[key] = value
    return out
