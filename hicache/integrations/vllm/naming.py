"""Page keys and the storage namespace of a vLLM deployment.

Keys must be equal in every process that serves the same model the same way, across restarts,
and different whenever the KV would differ. So:

- a page key is hicache's chained SHA-256 of the block's token ids (never Python's ``hash()``,
  which ``PYTHONHASHSEED`` changes per process), chained from a root that is the request's
  ``cache_salt`` when it has one: salted requests never share pages with unsalted ones;
- the namespace (kept apart by every backend) holds the model and revision, the weights'
  quantization, the KV dtype, the block size, the KV geometry, the block's byte format (the
  attention backend's), the tensor/pipeline ranks and an optional deployment salt.

Nothing here imports vLLM: the connector reads these facts from vLLM's config objects and
passes them in as plain values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.keys import Namespace
from hicache.prefix_cache.hashing import fast_page_hashes

__all__ = ["KVGeometry", "PAGE_LAYOUT", "PageKeyChain", "deployment_namespace", "salt_root"]

#: How a page's bytes are ordered: every layer's block, layer after layer, each block the
#: [H, N, C] cells of vLLM's logical per-layer view ``[blocks, H, N, C]`` (vLLM 0.32 registers
#: that view whatever the physical layout, ``VLLM_KV_CACHE_LAYOUT``, and the worker copies it
#: in logical order). What a block's bytes hold is not fixed by that: each attention backend
#: reads the cells its own way (FlashAttention's cell (h, n) is token n's K then V, vLLM's CPU
#: backend keeps per head the block's K, packed by its ISA, then its V), so the namespace also
#: names that ``block_format`` (see :func:`deployment_namespace`). Part of the namespace.
PAGE_LAYOUT = "vllm-block-L.HNC"


@dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """The shape of one page: ``num_layers`` blocks of ``block_nbytes`` bytes each."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_nbytes: int

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "block_nbytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVGeometry.{name} must be a positive integer, got {value!r}")

    @property
    def page_nbytes(self) -> int:
        return self.num_layers * self.block_nbytes


def deployment_namespace(
    *,
    model: str,
    revision: str | None,
    geometry: KVGeometry,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    block_format: str,
    salt: str | None = None,
    quantization: str | None = None,
) -> Namespace:
    """The namespace pages of one (tp, pp) rank of this deployment live in.

    ``block_format`` names what a block's bytes hold (the attention backend's format, which
    the connector derives from vLLM's platform and KV cache spec the same way in the scheduler
    and in every worker): engines whose backends write the same KV as other bytes never read
    each other's pages. ``quantization`` is the weights' (vLLM's ``--quantization``): the same
    model name with quantized weights computes other KV for the same tokens. Named only when
    set, so the namespaces of unquantized engines stay what they were."""
    if not isinstance(block_format, str) or not block_format:
        raise ValueError(f"block_format must be a non-empty string, got {block_format!r}")
    extra = [("block_format", block_format), ("block_nbytes", str(geometry.block_nbytes)), ("engine", "vllm")]
    if quantization:
        extra.append(("quantization", str(quantization)))
    return Namespace(
        model=model,
        revision=revision,
        kv_dtype=geometry.dtype,
        layout=PAGE_LAYOUT,
        page_size=geometry.block_size,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        salt=salt,
        extra=tuple(extra),
    )


def salt_root(cache_salt: str | None, epoch: str | None = None) -> str | None:
    """The hash the key chain of a request starts from (``None``: unsalted, first epoch).

    ``epoch`` is the scheduler's cache epoch (``None`` until the first ``reset_cache``): a
    reset, e.g. after the weights changed, rotates it, so every page stored before the reset
    has keys no lookup computes any more (storage cannot be emptied at once, nor safely: other
    engines may share it)."""
    if epoch is not None:
        return hashlib.sha256(
            b"hicache-vllm-epoch\x00" + epoch.encode("utf-8") + b"\x00" + (cache_salt or "").encode("utf-8")
        ).hexdigest()
    if cache_salt is None or cache_salt == "":
        return None
    return hashlib.sha256(b"hicache-vllm-cache-salt\x00" + cache_salt.encode("utf-8")).hexdigest()


class PageKeyChain:
    """The keys of one request's full blocks, extended as its tokens grow (prompt, then the
    generated tokens), each key computed once."""

    __slots__ = ("block_size", "keys", "_root")

    def __init__(self, block_size: int, cache_salt: str | None = None, epoch: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.keys: list[str] = []
        self._root = salt_root(cache_salt, epoch)

    def extend(self, token_ids: Sequence[int], num_pages: int) -> list[str]:
        """Keys of the first ``num_pages`` full blocks of ``token_ids`` (fewer if the tokens
        do not fill that many)."""
        bs = self.block_size
        num_pages = min(num_pages, len(token_ids) // bs)
        have = len(self.keys)
        if have < num_pages:
            prior = self.keys[-1] if self.keys else self._root
            # the core's hashing (one C call for the chain where built): the same keys as
            # hicache.keys.page_hashes, without its conversion of each token in Python
            self.keys.extend(fast_page_hashes(list(token_ids[have * bs : num_pages * bs]), bs, prior))
        return self.keys[:num_pages]
