"""A small decoder-only transformer whose attention reads K/V from hicache's device pool.

Why a real model at all: the cache's whole promise is that KV loaded back from host or storage is
*exactly* the KV a recompute would produce. Comparing bytes of pages proves the copy path; only a
model that attends over restored K/V proves the pages land in the right slots, layers and order.
The model is tiny (random, seeded weights; no checkpoint to download) but structurally the real
thing: token embedding, RMSNorm, GQA attention with rotary or learned positions, SwiGLU MLP, an
LM head and greedy decoding. Its sizes are chosen so a 1k-token prefill costs tens of
milliseconds on a CPU: enough for prefix reuse to show in time-to-first-token.

K/V geometry (layers, KV heads, head dim, KV dtype) comes from the deployment's
:class:`~hicache.config.ModelConfig`, because that is what sizes the pools and the storage
namespace; everything else (vocab, hidden size, query heads, MLP width, seed) is a
:class:`ModelSpec` option that only the model needs.

Thread model: :meth:`TinyTransformer.forward` is plain blocking torch code meant for one worker
thread (see :mod:`hicache.engine.runner`); it never touches an event loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hicache.config.schema import ModelConfig
from hicache.errors import ConfigError

__all__ = ["KVPoolLike", "ModelSpec", "TinyTransformer", "kv_dtype_of"]

_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")


class KVPoolLike(Protocol):
    """What the model needs from a device KV pool (``MHATokenToKVPool`` satisfies it)."""

    dtype: torch.dtype

    def get_key_buffer(self, layer: Any) -> torch.Tensor: ...

    def get_value_buffer(self, layer: Any) -> torch.Tensor: ...

    def set_kv_buffer(self, layer: Any, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None: ...


def kv_dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a ``ModelConfig.kv_dtype`` name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown kv dtype {name!r}")
    return dtype


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything that determines the model's weights and outputs.

    Two processes that build a :class:`TinyTransformer` from equal specs get bit-identical
    weights (a CPU generator seeded with ``seed``), which is how a load generator can verify a
    server's answers without talking to it.
    """

    vocab_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    hidden_size: int = 128
    intermediate_size: int = 384
    positions: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    max_positions: int = 8192
    norm_eps: float = 1e-5
    kv_dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                     "intermediate_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"ModelSpec.positions must be 'rope' or 'learned', got {self.positions!r}")
        kv_dtype_of(self.kv_dtype)

    @classmethod
    def from_model_config(
        cls,
        model: ModelConfig,
        *,
        vocab_size: int = 256,
        hidden_size: int | None = None,
        query_groups: int = 2,
        intermediate_size: int | None = None,
        positions: Literal["rope", "learned"] = "rope",
        max_positions: int = 8192,
        seed: int = 0,
    ) -> ModelSpec:
        """The spec for a deployment's :class:`ModelConfig` (which fixes the KV geometry).

        ``query_groups`` query heads share each KV head (GQA); the hidden size defaults to the
        query width and the MLP to three times the hidden size. With the default geometry (4
        layers, 2 KV heads of 32) that is a 128-wide model whose 1k-token prefill takes a few
        tens of milliseconds on two CPU cores: prefix reuse shows in TTFT, a minute-long demo
        still fits. Only MHA/GQA is modelled: an MLA
        deployment is rejected because its pool has no separate K and V.
        """
        # ConfigErrors naming the [model] field: a config the cache takes but this model cannot
        # run ended ``hicache serve`` and ``hicache demo`` in a ValueError traceback
        if model.attention != "mha":
            raise ConfigError(f"model.attention = {model.attention!r}: the demo's reference model implements "
                              "MHA/GQA only ('mha')")
        if positions == "rope" and model.head_dim % 2:
            raise ConfigError(f"model.head_dim = {model.head_dim}: the demo's reference model uses rotary "
                              "positions, which need an even head dim")
        num_heads = model.num_kv_heads * query_groups
        hidden = hidden_size if hidden_size is not None else num_heads * model.head_dim
        return cls(
            vocab_size=vocab_size,
            num_layers=model.num_layers,
            num_heads=num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            hidden_size=hidden,
            intermediate_size=intermediate_size if intermediate_size is not None else 3 * hidden,
            positions=positions,
            max_positions=max_positions,
            kv_dtype=model.kv_dtype,
            seed=seed,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**data)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (NeoX half-split form) of ``x`` ``[n, heads, dim]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a pool buffer; fp8 buffers are gathered as bytes (CPU torch builds
    may lack fp8 indexing kernels) and viewed back."""
    if buffer.dtype.is_floating_point and buffer.element_size() == 1:
        return buffer.view(torch.uint8).index_select(0, index).view(buffer.dtype)
    return buffer.index_select(0, index)


class TinyTransformer:
    """A seeded random decoder-only transformer over a paged KV pool.

    Not an ``nn.Module``: there is nothing to train, and plain tensors keep the forward pass
    explicit about where K/V come from and go to.
    """

    def __init__(self, spec: ModelSpec, device: str | torch.device = "cpu") -> None:
        self.spec: ModelSpec = spec
        self.device: torch.device = torch.device(device)
        self.kv_dtype: torch.dtype = kv_dtype_of(spec.kv_dtype)
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        h, d = spec.hidden_size, spec.head_dim

        def w(fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
            t = torch.randn(fan_in, fan_out, generator=gen) * (gain / math.sqrt(fan_in))
            return t.to(self.device)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(self.device)

        self.embed: torch.Tensor = torch.randn(spec.vocab_size, h, generator=gen).to(self.device)
        self.pos_embed: torch.Tensor | None = None
        if spec.positions == "learned":
            self.pos_embed = (0.5 * torch.randn(spec.max_positions, h, generator=gen)).to(self.device)
        self.layers: list[_Layer] = [
            _Layer(
                attn_norm=norm(),
                wq=w(h, spec.num_heads * d),
                wk=w(h, spec.num_kv_heads * d),
                wv=w(h, spec.num_kv_heads * d),
                wo=w(spec.num_heads * d, h, 0.5),
                mlp_norm=norm(),
                w_gate=w(h, spec.intermediate_size),
                w_up=w(h, spec.intermediate_size),
                w_down=w(spec.intermediate_size, h, 0.5),
            )
            for _ in range(spec.num_layers)
        ]
        self.final_norm: torch.Tensor = norm()
        # a large logit scale keeps greedy choices far from ties, so float rounding differences
        # between a cached and a recomputed prefix (~1e-6) can never flip a token
        self.lm_head: torch.Tensor = w(h, spec.vocab_size, 4.0)
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq: torch.Tensor = inv_freq.to(self.device)

    # -- helpers
    def _rope_tables(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float64, device=self.device)
        ang = torch.outer(pos, self._inv_freq)
        return ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]

    def check_pool(self, pool: KVPoolLike) -> None:
        """Raise ``ValueError`` unless ``pool`` has this model's KV geometry and dtype."""
        s = self.spec
        key = pool.get_key_buffer(0)
        want = (s.num_kv_heads, s.head_dim)
        layers = getattr(pool, "layer_num", s.num_layers)
        if tuple(key.shape[1:]) != want or layers != s.num_layers or pool.dtype != self.kv_dtype:
            raise ValueError(
                f"KV pool {pool!r} does not fit the model: need {s.num_layers} layers of {want} "
                f"{self.kv_dtype}, pool has {layers} layers of {tuple(key.shape[1:])} {pool.dtype}"
            )

    # -- the forward pass
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor | list[int],
        start_pos: int,
        pool: KVPoolLike,
        kv_indices: torch.Tensor,
        *,
        wait_layer: Callable[[int], None] | None = None,
        write_kv: bool = True,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Logits (float32) for ``token_ids`` at positions ``start_pos, start_pos+1, ...``.

        ``kv_indices[:start_pos]`` are the pool slots of the already-computed prefix (read, never
        written); ``kv_indices[start_pos:start_pos+n]`` receive the new tokens' K/V unless
        ``write_kv`` is false (used when a fully cached prompt must recompute its last token's
        logits without touching a slot shared with other requests). ``wait_layer(i)`` is called
        before layer ``i`` reads the prefix, so a load-back from host overlaps earlier layers'
        compute. Returns ``[1, vocab]`` with ``last_only`` (generation), else ``[n, vocab]``.

        New K/V are rounded through the pool dtype before attention, so a token's attention sees
        the same values whether its neighbours' K/V were just computed or read back from a tier.
        """
        s = self.spec
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("forward needs at least one token")
        total = start_pos + n
        if kv_indices.numel() < total:
            raise ValueError(f"kv_indices has {kv_indices.numel()} slots, the sequence needs {total}")
        if total > s.max_positions:
            raise ValueError(f"sequence of {total} tokens exceeds max_positions={s.max_positions}")
        kv_indices = kv_indices.to(self.device, torch.int64)
        prefix_idx = kv_indices[:start_pos]
        new_idx = kv_indices[start_pos:total]

        x = self.embed.index_select(0, ids)
        cos = sin = None
        if self.pos_embed is not None:
            x = x + self.pos_embed[start_pos:total]
        else:
            cos, sin = self._rope_tables(start_pos, n)
        # query i (position start_pos+i) sees keys 0..start_pos+i: a causal mask aligned to the
        # bottom-right corner, which torch's fused CPU/GPU attention kernels take natively
        mask = causal_lower_right(n, total) if n > 1 else None
        groups = s.num_heads // s.num_kv_heads

        for layer_id, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, s.norm_eps)
            q = (h @ layer.wq).view(n, s.num_heads, s.head_dim)
            k = (h @ layer.wk).view(n, s.num_kv_heads, s.head_dim)
            v = (h @ layer.wv).view(n, s.num_kv_heads, s.head_dim)
            if cos is not None and sin is not None:
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k_kv, v_kv = k.to(self.kv_dtype), v.to(self.kv_dtype)
            if write_kv:
                pool.set_kv_buffer(layer_id, new_idx, k_kv, v_kv)
            if start_pos:
                if wait_layer is not None:
                    wait_layer(layer_id)
                keys = torch.cat([_gather(pool.get_key_buffer(layer_id), prefix_idx).float(), k_kv.float()])
                values = torch.cat([_gather(pool.get_value_buffer(layer_id), prefix_idx).float(), v_kv.float()])
            else:
                keys, values = k_kv.float(), v_kv.float()
            # [1, heads, seq, dim]; KV heads repeated for their query group (GQA)
            keys = keys.repeat_interleave(groups, dim=1).transpose(0, 1)[None]
            values = values.repeat_interleave(groups, dim=1).transpose(0, 1)[None]
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask)
            x = x + attn[0].transpose(0, 1).reshape(n, -1) @ layer.wo
            h = _rms_norm(x, layer.mlp_norm, s.norm_eps)
            x = x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

        if last_only:
            x = x[-1:]
        return _rms_norm(x, self.final_norm, s.norm_eps) @ self.lm_head

    def __repr__(self) -> str:
        return f"TinyTransformer({self.spec}, device={self.device})"
