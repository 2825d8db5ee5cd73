"""A small Llama checkpoint made on the spot, for the engines' end-to-end tests (vLLM and
SGLang) and the vLLM benchmark: a local config.json and seeded safetensors weights, so nothing
is downloaded. The weights are random but scaled so that the output depends on every token's
KV (the negative-control tests rely on it). Needs ``safetensors`` (both engines install it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["make_tiny_llama"]


def make_tiny_llama(
    path: Path, *, hidden: int = 128, layers: int = 2, heads: int = 2, kv_heads: int = 1,
    intermediate: int = 256, vocab: int = 512, seed: int = 0,
) -> Path:
    """Write the model into ``path`` (head size hidden/heads must be one the CPU backend has,
    e.g. 64) and return it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "model.norm.weight": ones.clone(),
         "lm_head.weight": w(vocab, hidden, std=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones.clone()
        t[p + "post_attention_layernorm.weight"] = ones.clone()
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden, std=0.2)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden, std=0.2)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden, std=0.1)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim, std=0.1)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden, std=0.1)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden, std=0.1)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate, std=0.1)
    save_file(t, str(path / "model.safetensors"))
    return path
