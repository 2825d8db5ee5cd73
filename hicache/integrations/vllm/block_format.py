"""What a KV block's bytes hold in vLLM 0.32: the attention backend's format.

vLLM hands every attention backend the logical per-layer view ``[blocks, H, N, C]`` whatever
the physical layout, and both of hicache's routes copy blocks in it (the connector layer by
layer, the offloading tier through vLLM's offloading worker, raw or as vLLM's canonical page,
which moves whole (token, head) cells and never reads them). What a cell holds is the
backend's choice: ``kv-cells`` (NVIDIA GPUs' FlashAttention, FlashInfer, Triton,
FlexAttention: cell (h, n) is token n's K then V), ``mla-concat`` (MLA latents written by
``concat_and_cache_mla`` on NVIDIA GPUs), ``cpu_attn-<isa>`` (vLLM's CPU backend: per head the
block's K, packed by the ISA its kernels use, then its V); ROCm's, XPU's and other backends
pack their own ways. The same tokens' KV are then other bytes, so both routes name the format
in their namespaces, derived from facts the scheduler side has (vLLM's platform, the KV cache
spec), and refuse at start a format they cannot name.

This module imports vLLM only inside its functions.
"""

from __future__ import annotations

from typing import Any

from hicache.errors import ConfigError

__all__ = [
    "CPU_BACKEND",
    "KV_CELLS",
    "KV_CELL_BACKENDS",
    "MLA_CONCAT",
    "PLATFORM_CHECKS",
    "block_format",
    "check_block_format",
    "layer_block_format",
    "offload_block_format",
]

#: Attention backends (by class, as ``module.QualName``) whose block is ``kv-cells``: the logical
#: [H, N, C] cell (h, n) is token n's K then V of head h (each writes and reads the cache as
#: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), in vLLM 0.32.
KV_CELL_BACKENDS = frozenset({
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
    "vllm.v1.attention.backends.flashinfer.FlashInferBackend",
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
    "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend",
})
CPU_BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
KV_CELLS = "kv-cells"
MLA_CONCAT = "mla-concat"

#: The platform checks the format is derived from (what a test's stand-in platform answers).
PLATFORM_CHECKS = ("is_cuda", "is_rocm", "is_xpu", "is_cpu", "is_cuda_alike")


def _platform() -> Any:
    """vLLM's current platform (one place to look it up, for tests that play another)."""
    from vllm.platforms import current_platform

    return current_platform


def _platform_name(platform: Any) -> str:
    names = {"is_rocm": "ROCm", "is_xpu": "XPU", "is_cpu": "CPU", "is_cuda": "CUDA"}
    for check, name in names.items():
        if getattr(platform, check)():
            return f"{name} ({getattr(platform, '__name__', type(platform).__name__)})"
    return getattr(platform, "__name__", type(platform).__name__)


def block_format(spec: Any, cache_dtype: str, model_dtype: Any, owner: str = "HiCacheConnector") -> str:
    """What a block of KV cache spec ``spec`` holds, for the namespace: the format of the
    attention backend vLLM runs on this platform, from facts the scheduler and the workers
    share (the platform, the spec, the model's dtype); the workers check their backends write
    it (:func:`check_block_format`). Anything but ``kv-cells``, ``mla-concat`` (NVIDIA GPUs) and
    ``cpu_attn-<isa>`` (vLLM's CPU backend, whose ISA follows the machine) is a
    :class:`ConfigError`: its bytes could be another engine's format under the same namespace.

    The CPU ISA is chosen as vLLM's ``CPUAttentionMetadataBuilder`` chooses it, from the
    *model's* dtype (``model_config.dtype``), not the cache spec's: with an fp8 cache the spec
    says ``uint8``, and a bf16 model on an AMX machine was named ``vec`` here while its layers
    wrote ``amx``, so a working engine was refused at start."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    platform = _platform()
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
        raise ConfigError(
            f"{owner} cannot name the block format of this KV cache: its attention backend packs "
            f"the block its own way ({type(spec).__name__} with num_head_slots={spec.num_head_slots}, "
            f"state_content_bytes={spec.state_content_bytes}), and pages of another backend's format would "
            f"share its namespace. Use an attention backend that stores plain K/V cells"
        )
    if isinstance(spec, MLAAttentionSpec):
        if platform.is_cuda():
            return MLA_CONCAT
    elif platform.is_cuda():
        return KV_CELLS
    elif platform.is_cpu():
        from vllm.v1.attention.backends import cpu_attn

        isa = cpu_attn._get_attn_isa(model_dtype, int(spec.block_size), int(spec.head_size), cache_dtype)
        return f"cpu_attn-{isa}"
    raise ConfigError(
        f"{owner} cannot name the block format of {type(spec).__name__} KV caches on "
        f"{_platform_name(platform)}: only NVIDIA GPUs (FlashAttention, FlashInfer, Triton, "
        f"FlexAttention; MLA) and vLLM's CPU backend are known, and another backend's pages of the same "
        f"tokens are other bytes under the same namespace"
    )


def offload_block_format(config: Any, owner: str = "HiCacheTier") -> str:
    """The block format of the chunks an engine with vLLM ``OffloadingConfig`` ``config``
    stores through vLLM's offloading worker (direct and canonical mode alike: both keep each
    cell's bytes), from what a secondary tier has: vLLM's platform and ``config``, which
    carries no KV cache spec (nor the attention backend, nor the head size).

    On NVIDIA GPUs that is ``kv-cells|mla-concat``: the formats of :func:`block_format` for
    an attention and an MLA spec there; which one a chunk holds is the model's (its name is in
    the namespace; an MLA model run without MLA, ``VLLM_MLA_DISABLE``, has other chunk sizes).
    Every other platform is a :class:`ConfigError`: ROCm's and XPU's backends pack blocks their
    own ways, and on vLLM's CPU platform the offloading worker does not run at all
    (``CPUOffloadingSpec.get_worker``), while the CPU backend's format depends on a head size
    the scheduler side does not see."""
    platform = _platform()
    if platform.is_cuda():
        return f"{KV_CELLS}|{MLA_CONCAT}"
    why = (
        "vLLM's offloading worker refuses this platform (only CUDA-alike and XPU GPUs), and its CPU "
        "attention backend packs each head's K by an ISA chosen from a head size the scheduler side does "
        "not see" if platform.is_cpu() else
        "its attention backends pack a block their own ways (ROCm's split K with 16-byte lanes, XPU's "
        "kernels), not as NVIDIA GPUs' FlashAttention cells"
    )
    raise ConfigError(
        f"{owner} cannot name the block format of vLLM offloading chunks of {config.model.name} on "
        f"{_platform_name(platform)}: {why}; chunks of the same tokens in another format would share "
        f"the namespace of an NVIDIA GPU engine's. Only NVIDIA GPUs are known"
    )


def layer_block_format(layer: Any) -> str | None:
    """The block format the attention layer's backend writes (``None``: one hicache does not
    know)."""
    get_backend = getattr(layer, "get_attn_backend", None)
    if get_backend is None:
        return None
    names = {f"{c.__module__}.{c.__qualname__}" for c in get_backend().__mro__}
    impl = getattr(layer, "impl", None)
    if CPU_BACKEND in names:
        isa = getattr(impl, "isa", None) or getattr(layer, "isa", None)
        return f"cpu_attn-{isa}" if isa else None
    if names & KV_CELL_BACKENDS:
        return KV_CELLS
    if impl is not None:
        from vllm.v1.attention.backend import MLAAttentionImpl

        if isinstance(impl, MLAAttentionImpl) and type(impl).do_kv_cache_update is MLAAttentionImpl.do_kv_cache_update:
            return MLA_CONCAT
    return None


def check_block_format(vllm_config: Any, layers: list[str], want: str, owner: str = "HiCacheConnector") -> None:
    """Refuse a worker whose attention layers write another block format than the namespace
    says (the scheduler's, derived from the platform): a ``ConfigError`` at start, never pages
    of one format stored or loaded as another's."""
    context = vllm_config.compilation_config.static_forward_context
    for name in layers:
        layer = context.get(name)
        have = None if layer is None else layer_block_format(layer)
        if have != want:
            backend = "no attention layer" if layer is None else getattr(
                getattr(layer, "get_attn_backend", lambda: None)(), "__name__", type(layer).__name__)
            raise ConfigError(
                f"{owner}: layer {name} ({backend}) writes KV blocks in format {have or 'unknown'}, "
                f"the namespace says {want} (vLLM's default backend on this platform): another backend's "
                f"pages of the same tokens are other bytes. Run the default attention backend, or one that "
                f"writes {want}"
            )
