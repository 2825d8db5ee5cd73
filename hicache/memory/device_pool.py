"""Device KV pools (the L1 tier): MHA/GQA (K and V per layer) and MLA (one latent per layer).

Why one tensor per pool instead of SGLang's list of per-layer tensors: the copy engine can then
move all layers of a run of pages with a single strided copy (backup), and per-layer views are
still free (``get_key_buffer(layer)`` is a contiguous slice). The pool holds exactly ``size``
token slots (no hidden padding page; see :mod:`hicache.memory.allocator` for the reserved-page
option).

fp8 KV (``torch.float8_e4m3fn`` / ``float8_e5m2``) is stored in its own dtype, but every write
and copy goes through ``uint8`` views, so pools work with torch builds that lack fp8 kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.memory.device import IndexLike, as_index, as_index_array, has_integer_dtype
from hicache.memory.layouts import KVGeometry

__all__ = ["KVPool", "MHATokenToKVPool", "MLATokenToKVPool", "layer_id_of"]

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}


def layer_id_of(layer: Any) -> int:
    """Accept an int or an attention module with ``layer_id`` (SGLang passes the module); a
    float or a bool is a ``TypeError`` (``int()`` made 1.7 and True layer 1)."""
    return as_index(getattr(layer, "layer_id", layer), what="layer")


def _byte_store(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``t`` for fp8 writes (other dtypes are written as they are)."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


class KVPool:
    """Shared machinery of the KV pools: one tensor ``(C, L, size, *token_shape)``."""

    # set by each concrete pool (MLA: one head of the latent's width); storage signatures name them
    head_num: int
    head_dim: int

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str | torch.device,
        components: int,
        token_shape: tuple[int, ...],
    ) -> None:
        if page_size <= 0 or size <= 0 or size % page_size:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        if layer_num <= 0 or any(d <= 0 for d in token_shape):
            raise ValueError(f"bad geometry: layer_num={layer_num}, token shape {token_shape}")
        self.size: int = size
        self.page_size: int = page_size
        self.dtype: torch.dtype = dtype
        self.layer_num: int = layer_num
        self.device: torch.device = torch.device(device)
        self.geometry: KVGeometry = KVGeometry(components, layer_num, tuple(token_shape), dtype)
        data = torch.empty((components, layer_num, size, *token_shape), dtype=dtype, device=self.device)
        data.view(torch.uint8).zero_()
        self.kv_data: torch.Tensor = data

    # -- geometry
    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot across all layers (K+V, or the latent)."""
        return self.geometry.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.size * self.bytes_per_token

    @property
    def is_mla(self) -> bool:
        return self.geometry.components == 1

    # -- copy-engine interface
    @property
    def transfer_unit(self) -> int:
        """Tokens per unit the copy engine moves (a page)."""
        return self.page_size

    @property
    def transfer_layer_num(self) -> int:
        """Layers the copy engine reports completion for."""
        return self.layer_num

    def transfer_views(self) -> list[torch.Tensor]:
        """One ``(pages, C, L, page_size*E)`` byte view of the whole pool (no copy)."""
        g = self.geometry
        x = self.page_size * g.token_nbytes
        flat = self.kv_data.view(g.components, g.layer_num, self.size, -1).view(torch.uint8)
        return [flat.view(g.components, g.layer_num, self.size // self.page_size, x).permute(2, 0, 1, 3)]

    def _lid(self, layer: Any) -> int:
        """The layer index of ``layer`` (an int or a module with ``layer_id``), checked: a
        negative one would wrap to the last layers, as torch indexing does."""
        lid = layer_id_of(layer)
        if not 0 <= lid < self.layer_num:
            raise IndexError(f"layer {lid} is outside this pool's layers [0, {self.layer_num})")
        return lid

    def _write(self, comp: int, layer: int, loc: IndexLike, value: torch.Tensor) -> None:
        dst = self.kv_data[comp, layer]
        src = value.to(device=self.device, dtype=self.dtype).reshape(-1, *self.geometry.token_shape)
        # slots are integers: a list of floats was cast to int64 (1.7 wrote slot 1), and torch
        # takes a uint8 or bool tensor for a mask (uint8 slots [2, 1, 3, 1] wrote slots 0 to 3)
        if not isinstance(loc, torch.Tensor):
            loc = torch.from_numpy(as_index_array(loc, what="loc"))
        elif not has_integer_dtype(loc):
            raise TypeError(f"loc must hold integer slots, got a {loc.dtype} tensor")
        elif loc.dtype not in (torch.int64, torch.int32):
            loc = loc.to(torch.int64)
        # a negative slot would wrap to the pool's last slots (past the end torch refuses);
        # checked where it costs no device sync: on CUDA a kernel's indices come from the allocator
        if loc.device.type == "cpu" and loc.numel() and int(loc.min()) < 0:
            raise IndexError(f"slot {int(loc.min())} is negative: slots are 0 .. {self.size - 1}")
        _byte_store(dst)[loc.to(self.device)] = _byte_store(src)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, dtype={self.dtype}, "
            f"layer_num={self.layer_num}, token_shape={self.geometry.token_shape}, device={self.device})"
        )


class MHATokenToKVPool(KVPool):
    """K and V per layer, each ``(size, head_num, head_dim)``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, 2, (head_num, head_dim))
        self.head_num: int = head_num
        self.head_dim: int = head_dim

    def get_key_buffer(self, layer: Any) -> torch.Tensor:
        return self.kv_data[0, self._lid(layer)]

    def get_value_buffer(self, layer: Any) -> torch.Tensor:
        return self.kv_data[1, self._lid(layer)]

    def get_kv_buffer(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lid = self._lid(layer)
        return self.kv_data[0, lid], self.kv_data[1, lid]

    def set_kv_buffer(
        self, layer: Any, loc: IndexLike, cache_k: torch.Tensor, cache_v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Store K and V of tokens at slots ``loc`` (cast to the pool dtype). Extra SGLang
        arguments (scales) are accepted and ignored."""
        lid = self._lid(layer)
        self._write(0, lid, loc, cache_k)
        self._write(1, lid, loc, cache_v)


class MLATokenToKVPool(KVPool):
    """One latent per layer, ``(size, 1, kv_lora_rank + qk_rope_head_dim)``; the "value" is the
    first ``kv_lora_rank`` channels of it, as in SGLang."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, 1, (1, kv_lora_rank + qk_rope_head_dim))
        self.kv_lora_rank: int = kv_lora_rank
        self.qk_rope_head_dim: int = qk_rope_head_dim
        self.head_num: int = 1
        self.head_dim: int = kv_lora_rank + qk_rope_head_dim

    def get_key_buffer(self, layer: Any) -> torch.Tensor:
        return self.kv_data[0, self._lid(layer)]

    def get_value_buffer(self, layer: Any) -> torch.Tensor:
        return self.kv_data[0, self._lid(layer)][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer), self.get_value_buffer(layer)

    def set_kv_buffer(
        self, layer: Any, loc: IndexLike, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> None:
        """Store the latent ``cache_k`` (``[n, 1, kv_lora_rank + rope]``); ``cache_v`` is ignored
        because in MLA the value is part of the latent."""
        self._write(0, self._lid(layer), loc, cache_k)

    def set_mla_kv_buffer(self, layer: Any, loc: IndexLike, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """Store the latent from its two parts (SGLang's helper)."""
        n = cache_k_nope.shape[0]
        latent = torch.cat(
            [cache_k_nope.reshape(n, 1, -1), cache_k_rope.reshape(n, 1, -1).to(cache_k_nope.dtype)], dim=-1
        )
        self._write(0, self._lid(layer), loc, latent)
