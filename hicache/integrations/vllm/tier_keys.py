"""Page keys and the namespace of hicache's vLLM secondary tier.

vLLM names an offloaded chunk by an ``OffloadKey``: the raw bytes of its block hash (a chained
hash of every token up to the chunk, plus the request's LoRA, multimodal inputs and
``cache_salt``) followed by the KV-cache group index as 4 big-endian bytes. With vLLM's default
``sha256`` hashes the chain starts from a fixed seed, so the same prompt gives the same key in
every process and after a restart (a non-cryptographic hash needs ``PYTHONHASHSEED``; vLLM warns
then). The page key is that key in hex: stable, and reversible for inspection.

What the key does not carry is what makes two chunks of the same tokens incompatible: the
model, KV dtype, block and chunk size, the layers of each group, the parallel layout, the byte
format of a chunk (its layout, and the attention backend's block format: what each cell holds). :func:`tier_namespace` puts all of that into hicache's
:class:`~hicache.keys.Namespace`, so two engines that differ in any of them never read each
other's pages. The scheduler-side chunk holds every worker's slice side by side, so the world
layout (TP/PP/PCP/DCP sizes) is part of the namespace, not one rank.

The byte format is decided on the workers, which this tier never sees (it runs in vLLM's
scheduler): in vLLM's default *direct* mode a chunk is each layer's block copied raw from the
GPU, so its bytes follow the engine's physical KV cache layout, and, when the attention backend
takes only smaller blocks, the kernel blocks vLLM split each block into
(``prepare_kernel_block_sizes``; the worker regroups them by bytes, ``group_kernel_blocks``).
The scheduler knows the layout (vLLM resolves it before building the scheduler) but not the
split. :func:`chunk_format` names the layout, and refuses the configurations whose bytes a split
can change unseen (see there): a mismatch is then a miss or an error at start, never KV read in
another engine's byte order.

Nothing here imports vLLM: the functions read the attributes of vLLM's ``OffloadingConfig``.
"""

from __future__ import annotations

import json
from typing import Any

from hicache.errors import ConfigError
from hicache.keys import Namespace

__all__ = ["GROUP_BYTES", "NEVER_SPLIT_BLOCK_TOKENS", "SPLIT_SAFE_LAYOUTS", "chunk_format", "offload_key_group", "page_key", "tier_namespace"]

#: Bytes of the KV-cache group index at the end of an ``OffloadKey``.
GROUP_BYTES = 4


def page_key(offload_key: bytes) -> str:
    """The storage key of a vLLM ``OffloadKey``: its bytes in lower-case hex."""
    if not isinstance(offload_key, (bytes, bytearray)) or len(offload_key) <= GROUP_BYTES:
        raise ConfigError(
            f"a vLLM offload key is a block hash plus {GROUP_BYTES} group bytes, got {offload_key!r:.80}"
        )
    return bytes(offload_key).hex()


def offload_key_group(offload_key: bytes) -> int:
    """The KV-cache group index packed at the end of an ``OffloadKey``."""
    return int.from_bytes(offload_key[-GROUP_BYTES:], "big", signed=False)


#: vLLM ``KVCacheLayout`` names whose direct-mode chunks do not depend on a kernel-block split:
#: tokens are the outermost axis of a layer's page (``[N, H, C]``), so a block split into kernel
#: blocks is the same bytes as the whole block. In the head-major ones (``LBHNC``, vLLM's choice
#: for ``OffloadingConnector``) a split block is ``[H, N/r, C]`` r times, not ``[H, N, C]``.
SPLIT_SAFE_LAYOUTS = ("LBNHC", "BLNHC")

#: The largest block (tokens one worker's block holds) vLLM never splits into kernel blocks: it
#: splits only a block size some attention backend does not take (``select_common_block_size``),
#: and every backend of vLLM 0.32 takes 16 (``MultipleOf(16)``, ``MultipleOf(1)``, or 16 among
#: its sizes) or takes no size dividing 16 at all (an engine that cannot start). vLLM's default
#: block size on GPUs is 16, so a default engine in any layout stores unsplit blocks.
NEVER_SPLIT_BLOCK_TOKENS = 16


def _never_split(config: Any) -> bool:
    """Whether this engine's direct-mode chunks are the same bytes whatever kernel blocks its
    attention backend takes: blocks of at most :data:`NEVER_SPLIT_BLOCK_TOKENS` tokens, or a
    pure-MLA model (``replicated_layout``: one latent vector a token, no head axis a split could
    move tokens across)."""
    if getattr(config, "replicated_layout", False):
        return True
    parallel = config.parallel
    cp = max(1, int(parallel.pcp_size)) * max(1, int(parallel.dcp_size))  # tokens_per_block spans the CP ranks
    return all(int(g.tokens_per_block) // cp <= NEVER_SPLIT_BLOCK_TOKENS for g in config.groups)


def chunk_format(config: Any) -> str:
    """The byte format of the chunks an engine with vLLM ``OffloadingConfig`` ``config`` stores,
    for its namespace; :class:`ConfigError` for a configuration whose chunks it cannot name.

    Direct mode: ``direct-<layout>``, for the split-safe layouts (:data:`SPLIT_SAFE_LAYOUTS`), and
    for any layout where no split can happen (:func:`_never_split`: blocks of 16 tokens, vLLM's
    default, or a pure-MLA model); otherwise a split block's bytes differ from a whole block's
    and nothing on the scheduler side tells them apart. Canonical mode (``canonical_layout``): the layout, when vLLM declares
    the chunks parallelism-agnostic, because it then refuses at worker start any layer it cannot
    map to the canonical page (a split one included); otherwise it stores such a layer's raw bytes
    under the same canonical format, so that is refused too. A layout vLLM has not resolved yet
    (``None``) is refused: the bytes depend on it.
    """
    layout = getattr(config, "kv_cache_layout", None)
    canonical = bool(getattr(config, "canonical_layout", False))
    if layout is None:
        raise ConfigError(
            "HiCacheTier: vLLM has not resolved the KV cache layout (OffloadingConfig.kv_cache_layout "
            "is None); a stored chunk's bytes depend on it, so the tier cannot name them safely"
        )
    layout = str(layout)
    if canonical:
        if not config.parallel.is_parallelism_agnostic:
            raise ConfigError(
                f"HiCacheTier cannot key canonical_layout chunks of this engine: vLLM does not declare "
                f"them parallelism-agnostic, so it stores a layer it cannot map to the canonical page "
                f"(one whose blocks the attention backend split into kernel blocks, say) as raw bytes "
                f"under the same canonical format, and the scheduler cannot see which. Remove "
                f"canonical_layout and start vLLM with VLLM_KV_CACHE_LAYOUT=NHD (layout now {layout})"
            )
        return layout
    if layout not in SPLIT_SAFE_LAYOUTS and not _never_split(config):
        raise ConfigError(
            f"HiCacheTier cannot key direct-mode chunks of KV cache layout {layout}: a layer's block "
            f"is head-major there, so when the attention backend splits blocks into smaller kernel "
            f"blocks (vLLM's prepare_kernel_block_sizes: FlashInfer under --block-size 128, say) a "
            f"chunk holds the same tokens in another byte order, and the scheduler, which names the "
            f"chunks, cannot see the split. Set \"canonical_layout\": true in kv_connector_extra_config "
            f"(vLLM then certifies every layer's bytes at worker start and refuses a split block), or "
            f"start vLLM with VLLM_KV_CACHE_LAYOUT=NHD (token-major: a split block is the same bytes), "
            f"or with --block-size 16 (no attention backend splits a 16-token block)"
        )
    return f"direct-{layout}"


def tier_namespace(
    config: Any,
    chunk_bytes: int,
    *,
    block_format: str,
    salt: str | None = None,
    model_revision: str | None = None,
) -> Namespace:
    """The namespace of the chunks an engine with vLLM ``OffloadingConfig`` ``config`` stores.

    ``chunk_bytes`` is the stride of one chunk in the primary tier (padding included: a chunk
    is stored whole). ``block_format`` names what a layer's block holds, the attention backend's
    format (:func:`~hicache.integrations.vllm.block_format.offload_block_format`, from vLLM's
    platform): vLLM's offloading worker keeps each cell's bytes in both modes, so chunks of the
    same tokens and layout written by backends of other formats are other bytes. ``salt`` separates tenants that must never share KV even for equal keys;
    ``model_revision`` separates weights published under one model name. Raises
    :class:`ConfigError` where :func:`chunk_format` does.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    if not isinstance(block_format, str) or not block_format:
        raise ConfigError(f"block_format must be a non-empty string, got {block_format!r}")
    for name, value in (("namespace_salt", salt), ("model_revision", model_revision)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{name} must be a non-empty string or null, got {value!r}")
    parallel = config.parallel
    # vLLM's own claim: concatenated worker slices (or the canonical layout) are the same bytes
    # under any topology, so engines of different TP sizes may share pages.
    agnostic = bool(parallel.is_parallelism_agnostic or getattr(config, "replicated_layout", False))
    groups = [
        {"tokens_per_block": int(g.tokens_per_block), "layers": list(g.layer_names)}
        for g in config.groups
    ]
    extra = {
        "engine": "vllm",
        "route": "offloading-tier",
        "tokens_per_hash": str(int(config.cache.tokens_per_hash)),
        "blocks_per_chunk": str(int(config.cache.blocks_per_chunk)),
        "chunk_bytes": str(chunk_bytes),
        "groups": json.dumps(groups, sort_keys=True, separators=(",", ":")),
        "parallel": "agnostic" if agnostic else (
            f"tp{parallel.tp_size}-pp{parallel.pp_size}-pcp{parallel.pcp_size}-dcp{parallel.dcp_size}"
        ),
        "replicated_layout": str(bool(getattr(config, "replicated_layout", False))),
        # the byte format (key kept from when direct mode recorded only "direct", so canonical
        # namespaces are unchanged; direct ones now carry their layout)
        "canonical_layout": chunk_format(config),
        # what a block's bytes hold: the attention backend's format (the layout orders them)
        "block_format": block_format,
    }
    return Namespace(
        model=str(config.model.name),
        revision=model_revision,
        kv_dtype=str(config.model.dtype),
        layout="vllm-offload-chunk",
        page_size=int(config.cache.tokens_per_hash) * int(config.cache.blocks_per_chunk),
        tp_size=1 if agnostic else int(parallel.tp_size),
        pp_size=1 if agnostic else int(parallel.pp_size),
        salt=salt,
        extra=tuple(sorted(extra.items())),
    )
