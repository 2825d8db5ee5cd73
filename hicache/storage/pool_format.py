"""The byte format of a host pool whose pages are stored as the pool gives them.

hicache's own pools (and SGLang's, through the SGLang integration's canonical adapter) write
pages in one canonical byte order and describe their geometry with ``storage_signature()``,
which goes into the namespace. An engine's host pool registered directly, with no signature,
writes its own bytes: their order depends on its class, layout, element types and shapes, and
a reader whose pool differs in any of them would restore the bytes reinterpreted, as valid KV.
:func:`pool_format_tag` names that format, so that it goes into the namespace and two formats
never share pages.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["pool_format_tag", "signature_tag", "states_its_format"]

#: counts that shape a pass-through pool's page, besides its ``*dtype`` and ``*_shape(s)``.
#: ``size_per_token``: a slot's bytes, which state kept beside the named buffers adds to
#: (SGLang's Mamba pool with ``extra_checkpoint_buffers``): without it two servers of one model,
#: one with that state, shared the pool's pages and overwrote each other's. (Named since stop
#: 45: every pass-through pool that has it, SGLang's Mamba pools included, got a new namespace,
#: so their pages stored before are misses once.)
_FORMAT_COUNTS = ("num_mamba_layers", "layer_num", "head_num", "head_dim", "page_size", "size_per_token")


def states_its_format(pool: Any) -> bool:
    """Whether a pool without ``storage_signature()`` says how its pages are laid out (an
    engine's host pool: SGLang's have a ``layout``), so that its format can be named. A bare
    page-protocol pool (a test double, a plugin's) is taken as it always was."""
    return not callable(getattr(pool, "storage_signature", None)) and isinstance(getattr(pool, "layout", None), str)


def pool_format_tag(pool: Any) -> str:
    """Its class and layout, and a digest of its element types, state shapes and layer counts.
    Without the latter, two servers of one model whose state dtypes differ in meaning but not
    in size (``bfloat16`` and ``float16``) shared pages: one restored the other's state,
    reinterpreted, as valid. Sizes that only count slots are left out (host pools of different
    sizes share pages)."""
    parts: list[str] = []
    try:
        attrs = sorted(vars(pool).items())
    except TypeError:  # a class with __slots__ only: what its class says
        attrs = []
    for name, value in attrs:
        if isinstance(value, torch.dtype) and name.endswith("dtype"):
            parts.append(f"{name}={value}")
        elif name.endswith(("_shape", "_shapes")) and _is_shape_like(value):
            parts.append(f"{name}={_shape_text(value)}")
        elif name in _FORMAT_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{name}={value}")
    tag = f"{type(pool).__name__}/{getattr(pool, 'layout', None)}"
    if parts:
        tag += "/" + hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]
    return tag


def signature_tag(signature: Any) -> str:
    """The format of a pool that describes itself with ``storage_signature()`` (a digest of
    the signature, whose keys and values are plain data)."""
    text = json.dumps(signature, sort_keys=True, default=str)
    return "signature/" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_shape_like(value: Any) -> bool:
    if isinstance(value, (torch.Size, tuple)):
        return all(isinstance(d, int) for d in value)
    if isinstance(value, list):
        return all(_is_shape_like(v) for v in value)
    return False


def _shape_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_shape_text(v) for v in value) + "]"
    return "(" + ",".join(str(int(d)) for d in value) + ")"
