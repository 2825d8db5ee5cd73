"""Host KV pools (the L2 tier) with SGLang's three layouts and the canonical page protocol.

A host pool is what storage reads pages into and writes pages from (the page protocol in
``docs/architecture.md``) and what the copy engine backs device pages up to. The byte order of a
page as storage sees it is fixed (:mod:`hicache.memory.layouts`), whatever the layout, so the
layout is a local performance choice that never changes what is on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache.memory.allocator import AllocatorBacked, PagedTokenAllocator
from hicache.memory.device import as_index, as_index_array
from hicache.memory.device_pool import KVPool
from hicache.memory.host_alloc import alloc_host_bytes, resolve_host_units, want_pinned
from hicache.memory.layouts import (
    PAGE_FIRST,
    PAGE_FORMAT,
    check_layout,
    host_buffer_shape,
    host_typed_view,
    host_unit_view,
)

__all__ = ["HostKVPool", "MHATokenToKVPoolHost", "MLATokenToKVPoolHost"]


class HostKVPool(AllocatorBacked):
    """A host KV pool shadowing ``device_pool``: same geometry and dtype, its own size/layout."""

    def __init__(
        self,
        device_pool: KVPool,
        *,
        host_size_bytes: int | None = None,
        host_to_device_ratio: float | None = None,
        page_size: int,
        layout: str = PAGE_FIRST,
        pin_memory: bool | None = None,
    ) -> None:
        mla = getattr(type(self), "_mla", None)
        if mla is not None and bool(device_pool.is_mla) != mla:
            want, other = ("MLA", "MHATokenToKVPoolHost") if mla else ("MHA", "MLATokenToKVPoolHost")
            raise TypeError(f"{type(self).__name__} needs an {want} device pool; use {other}")
        if page_size != device_pool.page_size:
            raise ValueError(
                f"host page_size ({page_size}) must equal the device pool's ({device_pool.page_size}): "
                "the copy engine moves whole pages"
            )
        self.device_pool: KVPool = device_pool
        self.layout: str = check_layout(layout)
        self.page_size: int = page_size
        self.geometry = device_pool.geometry
        self.dtype: torch.dtype = device_pool.dtype
        self.layer_num: int = device_pool.layer_num
        self.page_nbytes: int = self.geometry.page_nbytes(page_size)
        self.pin_memory: bool = want_pinned(pin_memory)
        self.num_pages: int = resolve_host_units(
            device_units=device_pool.size // device_pool.page_size,
            unit_nbytes=self.page_nbytes,
            host_size_bytes=host_size_bytes,
            host_to_device_ratio=host_to_device_ratio,
            what=type(self).__name__,
            pinned=self.pin_memory,
        )
        self.size: int = self.num_pages * page_size
        self.device: torch.device = torch.device("cpu")
        self._buf: torch.Tensor = alloc_host_bytes(
            host_buffer_shape(self.layout, self.geometry, self.num_pages, page_size), self.pin_memory
        )
        self._units: torch.Tensor = host_unit_view(self.layout, self._buf, self.geometry, self.num_pages, page_size)
        self._byte_rows: memoryview | None = None  # the buffer's bytes, made on first page_views
        self.allocator: PagedTokenAllocator = PagedTokenAllocator(self.size, page_size, "cpu")
        self._init_geometry(device_pool)

    def _init_geometry(self, device_pool: KVPool) -> None:
        """Copy the attention-specific geometry of ``device_pool`` (subclasses)."""

    # -- memory
    @property
    def kv_buffer(self) -> torch.Tensor:
        """The whole buffer in the pool dtype, shaped by layout (see ``host_typed_view``)."""
        return host_typed_view(self.layout, self._buf, self.geometry, self.num_pages, self.page_size)

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    # -- allocation: alloc/free/available_size/clear come from AllocatorBacked

    # -- copy-engine interface
    @property
    def transfer_unit(self) -> int:
        return self.page_size

    @property
    def transfer_layer_num(self) -> int:
        return self.layer_num

    def transfer_views(self) -> list[torch.Tensor]:
        return [self._units]

    # -- page protocol
    def _page(self, index: int) -> int:
        index = as_index(index, what="page index")
        if index < 0 or index >= self.size or index % self.page_size:
            raise IndexError(
                f"page index {index} is not the first token of a page in a host pool of "
                f"{self.size} tokens (page_size={self.page_size})"
            )
        return index // self.page_size

    def page_view(self, index: int) -> torch.Tensor | None:
        """A live, contiguous 1-D uint8 view of the page's flat bytes (``page_first`` only)."""
        p = self._page(index)
        if self.layout != PAGE_FIRST:
            return None
        return self._buf[p].view(-1)

    def page_views(self, starts: Sequence[int]) -> list[memoryview] | None:
        """Live writable byte views of the pages at token indices ``starts`` (``page_first``
        only, else ``None``); ``IndexError`` when any index is not a page start, ``TypeError``
        when one is not an integer.

        What :meth:`page_view` gives one page at a time, for a whole storage batch: asking for
        each view through torch cost ~10 us a page, more than moving a small page's bytes, and
        the storage thread held the GIL the server's loop waits for."""
        if self.layout != PAGE_FIRST:
            return None
        first = as_index_array(starts, what="page indices")
        ps = self.page_size
        if first.size and (int(first.min()) < 0 or int(first.max()) >= self.size or (first % ps).any()):
            raise IndexError(f"page indices must be first tokens of pages in [0, {self.size}) (page_size={ps})")
        rows = self._byte_rows
        if rows is None:
            rows = self._byte_rows = self._buf.view(torch.uint8).reshape(-1).numpy().data.cast("B")
        nb = self.page_nbytes
        return [rows[p * nb : p * nb + nb] for p in (first // ps).tolist()]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """A snapshot (copy) of the page in canonical order, in the pool dtype.

        Flat: 1-D. Not flat: ``(C, L, page_size, *token_shape)``. A copy rather than a view so
        that a write still queued when the page is reused cannot pick up foreign bytes; the
        zero-copy path is :meth:`page_view`.
        """
        live = self._units[self._page(index)]
        page = live.clone() if live.is_contiguous() else live.contiguous()
        typed = page.view(self.dtype)
        if flat:
            return typed.view(-1)
        g = self.geometry
        return typed.view(g.components, g.layer_num, self.page_size, *g.token_shape)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A scratch flat page (pool dtype) that storage reads into before committing."""
        return torch.empty(self.page_nbytes // self.geometry.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Store a canonical flat page (any dtype with exactly ``page_nbytes`` bytes)."""
        dst = self._units[self._page(index)]
        src = data_page.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        src = src.reshape(-1)
        if not src.is_contiguous():
            src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        if nbytes != self.page_nbytes:
            raise ValueError(f"flat page has {nbytes} bytes, expected {self.page_nbytes}")
        src_bytes = src.view(torch.uint8)
        if src_bytes.data_ptr() == dst.data_ptr() and dst.is_contiguous():
            return  # storage read straight into page_view(): already in place
        dst.copy_(src_bytes.view(dst.shape))

    def storage_signature(self) -> dict[str, Any]:
        """Facts that make pages incompatible. The layout is deliberately absent: every layout
        writes the same canonical bytes."""
        g = self.geometry
        sig: dict[str, Any] = {
            "page_format": PAGE_FORMAT,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_num": g.layer_num,
            "head_num": self.device_pool.head_num,
            "head_dim": self.device_pool.head_dim,
            "page_size": self.page_size,
            "is_mla": self.device_pool.is_mla,
            "page_nbytes": self.page_nbytes,
        }
        return sig

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, layout={self.layout!r}, "
            f"dtype={self.dtype}, pinned={self.pin_memory}, available={self.available_size()})"
        )


class MHATokenToKVPoolHost(HostKVPool):
    """Host counterpart of :class:`~hicache.memory.device_pool.MHATokenToKVPool`."""

    _mla = False

    def _init_geometry(self, device_pool: KVPool) -> None:
        self.head_num: int = device_pool.head_num
        self.head_dim: int = device_pool.head_dim


class MLATokenToKVPoolHost(HostKVPool):
    """Host counterpart of :class:`~hicache.memory.device_pool.MLATokenToKVPool`."""

    _mla = True

    def _init_geometry(self, device_pool: KVPool) -> None:
        self.kv_lora_rank: int = device_pool.kv_lora_rank  # type: ignore[attr-defined]
        self.qk_rope_head_dim: int = device_pool.qk_rope_head_dim  # type: ignore[attr-defined]

    def storage_signature(self) -> dict[str, Any]:
        sig = super().storage_signature()
        sig["kv_lora_rank"] = self.kv_lora_rank
        sig["qk_rope_head_dim"] = self.qk_rope_head_dim
        return sig
