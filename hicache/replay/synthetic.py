"""Deterministic synthetic KV derived from token ids, so every restored page can be verified.

Replay and tests never run a model: the "KV" of token ``t`` in layer ``l``, head ``h``, channel
``j`` is a small integer computed from ``(t, l, h, j)``, stored exactly in the pool dtype
(below 2^11 for float16/bfloat16-safe values, 2^23 for float32). Any page that comes back from
host or storage with a wrong byte compares unequal.

In the trace every token id is distinct per block (``hash_id * 512 + j``) and a block id fixes
the whole prefix, so a value derived from the token id alone is a faithful stand-in for KV
that depends on the prefix.
"""

from __future__ import annotations

import torch

__all__ = ["synthetic_kv", "write_synthetic_kv", "verify_kv"]


def _modulus(dtype: torch.dtype) -> int:
    return 1 << 23 if dtype in (torch.float32, torch.float64) else 1 << 11


def synthetic_kv(
    tokens: torch.Tensor, layer: int, head_num: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of shape ``(len(tokens), head_num, head_dim)`` for ``layer``."""
    t = tokens.to(torch.int64).reshape(-1, 1, 1)
    h = torch.arange(head_num, dtype=torch.int64).reshape(1, -1, 1)
    j = torch.arange(head_dim, dtype=torch.int64).reshape(1, 1, -1)
    mod = _modulus(dtype)
    k = (t * (2 * j + 1) + 7919 * layer + 104729 * h + 31 * j) % mod
    v = (k * 3 + 17) % mod
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
