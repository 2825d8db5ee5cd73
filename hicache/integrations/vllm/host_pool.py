"""A worker's host tier: hicache's :class:`~hicache.memory.host_pool.HostKVPool` shaped for
vLLM blocks.

A page is one block of every layer, back to back (the page layout of :mod:`.naming`). vLLM's
block is opaque bytes to us (its attention backend decides the order inside), so the pool is
built over a one-component geometry whose "token" is ``block_nbytes / block_size`` bytes: in
the ``page_first`` layout a page is then ``num_layers`` blocks in a row, exactly the stored page,
and storage reads into and writes from the pool's pages directly (``page_view``). Pinned when
CUDA is there (what lets copies to and from a GPU run asynchronously), plain memory otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.integrations.vllm.naming import KVGeometry
from hicache.memory.host_pool import HostKVPool
from hicache.memory.layouts import PAGE_FIRST
from hicache.memory.layouts import KVGeometry as PoolGeometry

__all__ = ["block_host_pool", "page_slots", "slot_indices"]


def slot_indices(slots: Sequence[int], page_size: int) -> torch.Tensor:
    """Host token indices of page slots ``slots`` (each page's consecutive tokens), as host
    pools, allocators and storage take them."""
    if not slots:
        return torch.empty(0, dtype=torch.int64)
    base = torch.tensor(list(slots), dtype=torch.int64).unsqueeze(1) * page_size
    return (base + torch.arange(page_size, dtype=torch.int64)).reshape(-1)


def page_slots(indices: torch.Tensor, page_size: int) -> list[int]:
    """The page slots of host token ``indices`` that cover whole pages (the inverse of
    :func:`slot_indices`): one index a page, in tensor arithmetic (an eviction frees tens of
    thousands of pages; a Python int per token was the cost)."""
    return (indices.reshape(-1)[::page_size] // page_size).tolist()


class _BlockLayout:
    """The facts :class:`HostKVPool` reads from the device pool it shadows, for vLLM's blocks
    (vLLM owns the device memory; nothing here allocates any)."""

    is_mla = False

    def __init__(self, geometry: KVGeometry) -> None:
        bs, nb = geometry.block_size, geometry.block_nbytes
        if nb % bs:
            raise ValueError(f"a block of {nb} bytes does not split into {bs} tokens")
        self.page_size = bs
        self.size = bs
        self.dtype = torch.uint8
        self.layer_num = geometry.num_layers
        self.head_num = geometry.num_kv_heads
        self.head_dim = geometry.head_size
        self.geometry = PoolGeometry(1, geometry.num_layers, (nb // bs,), torch.uint8)


def block_host_pool(geometry: KVGeometry, num_pages: int, *, pin_memory: bool | None = None) -> HostKVPool:
    """``num_pages`` host pages for blocks of ``geometry`` (``page_first``: a page is contiguous)."""
    pool = HostKVPool(
        _BlockLayout(geometry),  # type: ignore[arg-type]
        host_size_bytes=num_pages * geometry.page_nbytes,
        page_size=geometry.block_size,
        layout=PAGE_FIRST,
        pin_memory=pin_memory,
    )
    if pool.page_nbytes != geometry.page_nbytes:  # cannot happen: the geometry above is exact
        raise AssertionError(f"host page of {pool.page_nbytes} bytes, a stored page has {geometry.page_nbytes}")
    return pool
