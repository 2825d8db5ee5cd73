"""What an attention backend writes into a vLLM KV block, for the tests of the block format
(the connector's and the offloading tier's namespaces name it)."""

from __future__ import annotations

import torch


def backend_cache(isa: str | None, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A 2-block KV cache of vLLM's logical [blocks, H, N, 2 * D] shape whose block 1 holds the
    tokens' ``key``/``value`` ([N, H, D]) as an attention backend writes them: vLLM's CPU backend
    (``cpu_attn_reshape_and_cache`` of ISA ``isa`` on the [blocks, H, 2N, D] view it takes) or,
    for ``isa=None``, FlashAttention's (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``:
    cell (h, n) is token n's K then V)."""
    from vllm import _custom_ops as ops

    n, h, d = key.shape
    cache = torch.zeros(2, h, n, 2 * d, dtype=key.dtype)
    if isa is None:
        k_cache, v_cache = cache.transpose(1, 2).split(d, dim=-1)
        k_cache[1], v_cache[1] = key, value
    else:
        k_cache, v_cache = cache.view(2, h, 2 * n, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(n, 2 * n), isa)
    return cache
