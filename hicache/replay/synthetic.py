"""Deterministic synthetic KV derived from token ids, so every restored page can be verified.

Replay and tests never run a model: the "KV" of token ``t`` in layer ``l``, head ``h``, channel
``j`` is a small integer hashed from ``(t, l, h, j)``, stored exactly in the pool dtype (below
2^8 for bfloat16, 2^11 for float16, 2^23 for float32). Any page that comes back from host or
storage with a wrong byte compares unequal, and so does the page of any other block: the value
was once linear in ``t`` modulo a power of two, so the pages of blocks ``h`` and ``h + 4``
(float16, bfloat16) or ``h + 16384`` (float32) were identical and a page served under the wrong
key passed verification; bfloat16 rounded values above 2^8.

In the trace every token id is distinct per block (``hash_id * 512 + j``) and a block id fixes
the whole prefix, so a value derived from the token id alone is a faithful stand-in for KV
that depends on the prefix.
"""

from __future__ import annotations

import torch

__all__ = ["synthetic_kv", "write_synthetic_kv", "verify_kv"]


def _modulus(dtype: torch.dtype) -> int:
    """A power of two every smaller non-negative integer (and its negation) is exact in."""
    if dtype in (torch.float32, torch.float64):
        return 1 << 23
    return 1 << 8 if dtype == torch.bfloat16 else 1 << 11


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer hash (splitmix64's finaliser; int64 products wrap), so that no shift
    of the token id maps a page onto another page's values."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94D049BB133111EB as int64
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def synthetic_kv(
    tokens: torch.Tensor, layer: int, head_num: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of shape ``(len(tokens), head_num, head_dim)`` for ``layer``."""
    t = tokens.to(torch.int64).reshape(-1, 1, 1)
    h = torch.arange(head_num, dtype=torch.int64).reshape(1, -1, 1)
    j = torch.arange(head_dim, dtype=torch.int64).reshape(1, 1, -1)
    mod = _modulus(dtype)
    x = _mix(t * 1_000_003 + layer * 7919 + h * 104_729 + j * 31)
    k = x & (mod - 1)
    v = (x >> 32) & (mod - 1)
    return k.to(dtype), (-v - 1).to(dtype)


def write_synthetic_kv(device_pool: object, loc: torch.Tensor, tokens: torch.Tensor) -> None:
    """"Compute" the KV of ``tokens`` into device slots ``loc`` of an MHA pool."""
    for layer in range(device_pool.layer_num):  # type: ignore[attr-defined]
        k, v = synthetic_kv(tokens, layer, device_pool.head_num, device_pool.head_dim, device_pool.dtype)  # type: ignore[attr-defined]
        device_pool.set_kv_buffer(layer, loc, k, v)  # type: ignore[attr-defined]


def verify_kv(device_pool: object, loc: torch.Tensor, tokens: torch.Tensor) -> int:
    """Number of tokens whose KV at ``loc`` differs from the synthetic KV of ``tokens``."""
    if loc.numel() == 0:
        return 0
    bad = torch.zeros(loc.numel(), dtype=torch.bool)
    idx = loc.to(torch.int64)
    for layer in range(device_pool.layer_num):  # type: ignore[attr-defined]
        k, v = synthetic_kv(tokens, layer, device_pool.head_num, device_pool.head_dim, device_pool.dtype)  # type: ignore[attr-defined]
        kb, vb = device_pool.get_kv_buffer(layer)  # type: ignore[attr-defined]
        got_k = kb[idx.to(kb.device)].cpu()
        got_v = vb[idx.to(vb.device)].cpu()
        bad |= (got_k != k).reshape(len(idx), -1).any(dim=1)
        bad |= (got_v != v).reshape(len(idx), -1).any(dim=1)
    return int(bad.sum())
