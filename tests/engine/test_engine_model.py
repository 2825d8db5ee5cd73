"""The model's forward pass: KV written by one forward and read by another gives the logits of a
full recompute, whatever the split, position scheme or KV dtype."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import pool_for, prompt_of, small_spec
from hicache.config import ModelConfig
from hicache.engine import ModelSpec, TinyTransformer, reference_generate, reference_logits
from hicache.memory import PagedTokenAllocator

ATOL, RTOL = 1e-4, 1e-5


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("split", [16, 37, 128])
def test_prefix_written_by_one_forward_serves_the_next(positions: str, split: int) -> None:
    spec = small_spec(positions=positions)
    model = TinyTransformer(spec)
    prompt = prompt_of(200, seed=split)
    pool = pool_for(spec)
    slots = PagedTokenAllocator(pool.size, pool.page_size).alloc(208)
    # scatter the sequence over non-contiguous slots: reversed pages
    slots = slots.view(-1, 16).flip(0).reshape(-1)
    model.forward(prompt[:split], 0, pool, slots)
    got = model.forward(prompt[split:], split, pool, slots, last_only=False)
    want = reference_logits(model, prompt)[split:]
    assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_layer_waits_are_called_in_order_before_the_prefix_is_read(model: TinyTransformer, spec: ModelSpec) -> None:
    pool = pool_for(spec)
    slots = torch.arange(64)
    prompt = prompt_of(40, seed=3)
    model.forward(prompt[:32], 0, pool, slots)
    seen: list[int] = []
    model.forward(prompt[32:], 32, pool, slots, wait_layer=seen.append)
    assert seen == list(range(spec.num_layers))
    seen.clear()
    model.forward(prompt, 0, pool, slots, wait_layer=seen.append)  # no prefix: nothing to wait for
    assert seen == []


def test_write_kv_false_leaves_the_pool_untouched(model: TinyTransformer, spec: ModelSpec) -> None:
    pool = pool_for(spec)
    slots = torch.arange(64)
    prompt = prompt_of(48, seed=4)
    model.forward(prompt, 0, pool, slots)
    before = pool.kv_data.clone()
    last = model.forward(prompt[-1:], 47, pool, slots, write_kv=False)
    assert torch.equal(pool.kv_data, before)
    assert torch.allclose(last, reference_logits(model, prompt)[-1:], atol=ATOL, rtol=RTOL)


def test_bfloat16_kv_matches_a_bfloat16_recompute() -> None:
    spec = small_spec(kv_dtype="bfloat16")
    model = TinyTransformer(spec)
    pool = pool_for(spec)
    assert pool.dtype == torch.bfloat16
    prompt = prompt_of(96, seed=5)
    slots = torch.arange(96)
    model.forward(prompt[:64], 0, pool, slots)
    got = model.forward(prompt[64:], 64, pool, slots, last_only=False)
    want = reference_logits(model, prompt)[64:]
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)


def test_same_spec_same_weights_and_answers() -> None:
    a, b = TinyTransformer(small_spec()), TinyTransformer(small_spec())
    other = TinyTransformer(small_spec(seed=8))
    prompt = prompt_of(50, seed=6)
    assert reference_generate(a, prompt, 6) == reference_generate(b, prompt, 6)
    assert not torch.equal(a.lm_head, other.lm_head)


def test_spec_from_model_config_follows_the_kv_geometry() -> None:
    mc = ModelConfig(num_layers=2, num_kv_heads=4, head_dim=8, kv_dtype="float16")
    spec = ModelSpec.from_model_config(mc, query_groups=2)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads, spec.kv_dtype) == (2, 4, 8, 8, "float16")
    assert spec.hidden_size == 64 and ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="MHA/GQA"):
        ModelSpec.from_model_config(ModelConfig(attention="mla"))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        small_spec(num_heads=3)


def test_pool_geometry_is_checked(model: TinyTransformer) -> None:
    wrong = pool_for(small_spec(head_dim=8))
    with pytest.raises(ValueError, match="does not fit"):
        model.check_pool(wrong)
