"""Factories shared by the memory-tier tests (fixtures, so no test helper module is imported)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache.memory import (
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
)

HOST_SENTINEL = 0xAB  # every fresh host pool is filled with it; untouched pages must keep it


def fill_random_bytes(t: torch.Tensor, seed: int) -> None:
    """Random bytes into any tensor (any dtype, fp8 included): byte compares stay exact."""
    g = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8).to(b.device))


def make_device_pool(kind: str, *, size: int, page_size: int, dtype: torch.dtype = torch.float16,
                     layers: int = 3, device: str = "cpu") -> Any:
    if kind == "mha":
        return MHATokenToKVPool(size, page_size, dtype, head_num=2, head_dim=4, layer_num=layers, device=device)
    return MLATokenToKVPool(size, page_size, dtype, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=layers, device=device)


def make_host_pool(device_pool: Any, *, layout: str, pages: int) -> Any:
    cls = MLATokenToKVPoolHost if device_pool.is_mla else MHATokenToKVPoolHost
    nbytes = pages * device_pool.page_size * device_pool.bytes_per_token
    pool = cls(device_pool, host_size_bytes=nbytes, page_size=device_pool.page_size, layout=layout)
    pool._buf.fill_(HOST_SENTINEL)
    return pool


@pytest.fixture
def device_pool_factory() -> Callable[..., Any]:
    return make_device_pool


@pytest.fixture
def host_pool_factory() -> Callable[..., Any]:
    return make_host_pool


@pytest.fixture
def fill_bytes() -> Callable[[torch.Tensor, int], None]:
    return fill_random_bytes
