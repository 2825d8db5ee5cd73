"""Host memory layouts and the one canonical flat page format.

Geometry: ``C`` components (2 for MHA/GQA: K and V; 1 for MLA: the latent), ``L`` layers, pages
of ``ps`` tokens, and ``E`` bytes per token per component per layer (``head_num * head_dim *
itemsize``; MLA: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``).

Canonical flat page (what storage sees, whatever the layout)::

    [component][layer][token in page][head][dim]      i.e. a C-order array (C, L, ps, E bytes)

This is the order SGLang's ``layer_first`` and ``page_first_direct`` pools write, so pages stay
byte-compatible with theirs; unlike SGLang, *every* layout here produces and consumes it, so a
store filled under one layout is never read back scrambled under another (SGLang #33268).

Physical layouts of the host buffer (all in bytes; ``P`` pages)::

    layer_first        (C, L, P*ps, E)   mirrors the device pool; a page is C*L separate pieces
    page_first         (P, C, L, ps, E)  a page is ONE contiguous region equal to its flat bytes,
                                         so storage reads into / writes from it directly
    page_first_direct  (C, P, L, ps, E)  each layer's slice of a page is contiguous (per-layer
                                         copies), K and V live in two separate halves

``page_first`` differs from SGLang's ``(2, tokens, L, H, D)``: there K and V of one page are two
regions and layers interleave per token, which forces a staging copy for every storage I/O. Ours
keeps "all layers of a page together" and makes the page exactly its flat bytes.

Every layout is exposed to the copy engine through one *unit view*: a byte tensor of logical
shape ``(P, C, L, ps*E)`` (a permuted view of the buffer, no copy). Page ``p``'s canonical flat
bytes are ``unit_view[p]`` in C order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "LAYER_FIRST",
    "LAYOUTS",
    "PAGE_FIRST",
    "PAGE_FIRST_DIRECT",
    "KVGeometry",
    "check_layout",
    "host_buffer_shape",
    "host_unit_view",
    "host_typed_view",
    "PAGE_FORMAT",
]

LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
LAYOUTS: tuple[str, ...] = (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT)

#: Name and version of the canonical flat page byte order, carried in ``storage_signature()``.
PAGE_FORMAT = "hicache-canonical-v1"


def check_layout(layout: str) -> str:
    """``layout`` if known, else ``ValueError`` listing the allowed ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; allowed: {list(LAYOUTS)}")
    return layout


@dataclass(frozen=True)
class KVGeometry:
    """Shape facts shared by a device pool and its host pool."""

    components: int
    layer_num: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_nbytes(self) -> int:
        """``E``: bytes of one token of one component in one layer."""
        return math.prod(self.token_shape) * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token across all components and layers."""
        return self.components * self.layer_num * self.token_nbytes

    def page_nbytes(self, page_size: int) -> int:
        return page_size * self.bytes_per_token


def host_buffer_shape(layout: str, geom: KVGeometry, num_pages: int, page_size: int) -> tuple[int, ...]:
    """Physical byte shape of a host buffer of ``num_pages`` pages under ``layout``."""
    c, lyr, e = geom.components, geom.layer_num, geom.token_nbytes
    if layout == LAYER_FIRST:
        return (c, lyr, num_pages * page_size, e)
    if layout == PAGE_FIRST:
        return (num_pages, c, lyr, page_size, e)
    if layout == PAGE_FIRST_DIRECT:
        return (c, num_pages, lyr, page_size, e)
    raise ValueError(check_layout(layout))


def host_unit_view(layout: str, buf: torch.Tensor, geom: KVGeometry, num_pages: int, page_size: int) -> torch.Tensor:
    """The ``(P, C, L, ps*E)`` byte view of a host buffer (see module docstring)."""
    c, lyr, x = geom.components, geom.layer_num, page_size * geom.token_nbytes
    if layout == LAYER_FIRST:
        return buf.view(c, lyr, num_pages, x).permute(2, 0, 1, 3)
    if layout == PAGE_FIRST:
        return buf.view(num_pages, c, lyr, x)
    if layout == PAGE_FIRST_DIRECT:
        return buf.view(c, num_pages, lyr, x).permute(1, 0, 2, 3)
    raise ValueError(check_layout(layout))


def host_typed_view(layout: str, buf: torch.Tensor, geom: KVGeometry, num_pages: int, page_size: int) -> torch.Tensor:
    """The host buffer in the pool dtype, shaped like the layout's SGLang counterpart:
    ``layer_first (C, L, tokens, *token_shape)``, ``page_first (P, C, L, ps, *token_shape)``,
    ``page_first_direct (C, P, L, ps, *token_shape)``."""
    shape = host_buffer_shape(layout, geom, num_pages, page_size)
    return buf.view(geom.dtype).view(*shape[:-1], *geom.token_shape)
