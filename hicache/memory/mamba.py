"""Per-request recurrent state (Mamba-style) for hybrid models, device and host side.

Hybrid models keep, besides KV, one fixed-size state per request (SSM/conv states). It is
cached and stored as its own pool (``pool_name="mamba"``, hit policy ``TRAILING_PAGES``) so the
v2 multi-pool storage path has a real second pool. One state slot is one "page" of page size 1.

``state_shapes`` maps a state name to its per-slot shape; put a layer dimension inside the shape
if the model has per-layer states (``{"conv": (L, d, k), "ssm": (L, h, n)}``). Flat page byte
order: the states in ``state_shapes`` order, each C-order, concatenated.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hicache.memory.allocator import AllocatorBacked, PagedTokenAllocator
from hicache.memory.device import as_index
from hicache.memory.host_alloc import alloc_host_bytes, resolve_host_units, want_pinned

__all__ = ["MambaStatePool", "MambaHostPool"]


def _check_shapes(state_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    if not state_shapes:
        raise ValueError("state_shapes must name at least one state")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in state_shapes.items():
        shape = tuple(int(d) for d in shape)
        if any(d <= 0 for d in shape):
            raise ValueError(f"state {name!r} has a non-positive dimension: {shape}")
        out[str(name)] = shape
    return out


class MambaStatePool(AllocatorBacked):
    """``size`` state slots on the device; ``alloc``/``free`` hand out slot indices (int64)."""

    page_size: int = 1
    transfer_unit: int = 1
    transfer_layer_num: int = 1

    def __init__(
        self,
        size: int,
        state_shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size: int = size
        self.state_shapes: dict[str, tuple[int, ...]] = _check_shapes(state_shapes)
        self.dtype: torch.dtype = dtype
        self.device: torch.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        for name, shape in self.state_shapes.items():
            t = torch.empty((size, *shape), dtype=dtype, device=self.device)
            t.view(torch.uint8).zero_()
            self.states[name] = t
        self.itemsize: int = torch.empty((), dtype=dtype).element_size()
        self.slot_nbytes: int = sum(math.prod(s) for s in self.state_shapes.values()) * self.itemsize
        self.allocator: PagedTokenAllocator = PagedTokenAllocator(size, 1, self.device)

    def get_state(self, name: str) -> torch.Tensor:
        """The ``(size, *shape)`` tensor of one state."""
        return self.states[name]

    # -- copy-engine interface: each state is one segment of shape (slots, 1, 1, bytes)
    def transfer_views(self) -> list[torch.Tensor]:
        return [t.reshape(self.size, -1).view(torch.uint8).view(self.size, 1, 1, -1) for t in self.states.values()]

    def __repr__(self) -> str:
        return f"MambaStatePool(size={self.size}, states={self.state_shapes}, dtype={self.dtype}, device={self.device})"


class MambaHostPool(AllocatorBacked):
    """Host counterpart of :class:`MambaStatePool`; one slot's states are one contiguous row,
    so every page has a live ``page_view`` and storage I/O never stages."""

    page_size: int = 1
    transfer_unit: int = 1
    transfer_layer_num: int = 1

    def __init__(
        self,
        device_pool: MambaStatePool,
        *,
        host_size: int | None = None,
        host_size_bytes: int | None = None,
        host_to_device_ratio: float | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.device_pool: MambaStatePool = device_pool
        self.state_shapes: dict[str, tuple[int, ...]] = dict(device_pool.state_shapes)
        self.dtype: torch.dtype = device_pool.dtype
        self.page_nbytes: int = device_pool.slot_nbytes
        if host_size is not None:
            if host_size_bytes is not None or host_to_device_ratio is not None:
                raise ValueError("MambaHostPool: give one of host_size, host_size_bytes, host_to_device_ratio")
            host_size_bytes = int(host_size) * self.page_nbytes
        self.pin_memory: bool = want_pinned(pin_memory)
        self.size: int = resolve_host_units(
            device_units=device_pool.size,
            unit_nbytes=self.page_nbytes,
            host_size_bytes=host_size_bytes,
            host_to_device_ratio=host_to_device_ratio,
            what="MambaHostPool",
            pinned=self.pin_memory,
        )
        self._buf: torch.Tensor = alloc_host_bytes((self.size, self.page_nbytes), self.pin_memory)
        self._segments: list[torch.Tensor] = []
        self.states: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in self.state_shapes.items():
            nb = math.prod(shape) * device_pool.itemsize
            seg = self._buf[:, offset : offset + nb]
            self._segments.append(seg.view(self.size, 1, 1, nb))
            self.states[name] = seg.view(self.dtype).view(self.size, *shape)
            offset += nb
        self.allocator: PagedTokenAllocator = PagedTokenAllocator(self.size, 1, "cpu")

    def transfer_views(self) -> list[torch.Tensor]:
        return list(self._segments)

    # -- page protocol (page_size 1: a page is one slot)
    def _slot(self, index: int) -> int:
        index = as_index(index, what="state slot")
        if not 0 <= index < self.size:
            raise IndexError(f"state slot {index} outside a host pool of {self.size} slots")
        return index

    def page_view(self, index: int) -> torch.Tensor:
        return self._buf[self._slot(index)]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._buf[self._slot(index)].clone().view(self.dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_nbytes // self.device_pool.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        dst = self._buf[self._slot(index)]
        src = data_page.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        if src.numel() != self.page_nbytes:
            raise ValueError(f"flat state page has {src.numel()} bytes, expected {self.page_nbytes}")
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)

    def storage_signature(self) -> dict[str, Any]:
        return {
            "page_format": "hicache-mamba-v1",
            "dtype": str(self.dtype).removeprefix("torch."),
            "page_size": 1,
            "state_shapes": {k: list(v) for k, v in self.state_shapes.items()},
            "page_nbytes": self.page_nbytes,
        }

    def __repr__(self) -> str:
        return f"MambaHostPool(size={self.size}, states={self.state_shapes}, dtype={self.dtype})"
