"""Storage keys of tree pages: :func:`hicache.keys.page_hashes`, computed fast.

``hicache.keys`` converts tokens one by one in Python; a tree hashes every page it inserts, so
here the tokens of all pages are packed to uint32 little-endian with numpy in one call and only
the sha256 chain runs per page. The bytes hashed, and so the keys, are identical (a test checks).

A namespace (``extra_key``) seeds the chain: its first page is chained to a digest of the
namespace instead of to nothing, so the same tokens under two namespaces get disjoint keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["namespace_seed", "fast_page_hashes"]

_UINT32_MAX = 0xFFFFFFFF


def namespace_seed(extra_key: str | None) -> str | None:
    """The prior hash a namespace's chains start from (``None``: no namespace, SGLang's keys)."""
    if extra_key is None:
        return None
    return hashlib.sha256(b"hicache-namespace\x00" + extra_key.encode("utf-8")).hexdigest()


def fast_page_hashes(tokens: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Chained keys of every full page of ``tokens`` (same values as ``hicache.keys.page_hashes``)."""
    n = len(tokens) // page_size
    if n == 0:
        return []
    arr = np.asarray(tokens[: n * page_size], dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > _UINT32_MAX):
        raise ValueError("token ids must fit in uint32")
    raw = arr.astype("<u4").tobytes()
    step = 4 * page_size
    out: list[str] = []
    prev = bytes.fromhex(prior_hash) if prior_hash is not None else None
    for i in range(n):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev.hex())
    return out
