"""What the reference engine guarantees about KV made in different ways, and why the demo may
compare answers token for token.

A cache serves KV that was made differently from a recompute's: a conversation's earlier
answers were decoded one token at a time, and a page-aligned prefix leaves the tail of the last
page to a prefill that starts mid-history. Matmuls of other shapes round differently, so that
KV is not bit-equal to a full prefill's. What the demo needs is that the difference stays at
float rounding and that no greedy choice of its workloads is close enough to a tie for it to
matter. Both are checked here, on the demo's own model and quick workload, with the split
points the cache produces (no server, no timing: the same numbers on every run).
"""

from __future__ import annotations

import torch

from hicache.config.schema import HiCacheConfig
from hicache.demo import QUICK_WORKLOAD
from hicache.engine import ModelSpec, TinyTransformer
from hicache.engine.runner import _scratch_pool
from hicache.server.loadgen import conversation_turn_tokens, system_prompt

#: KV made by decode or by a prefill of another length differs from a full prefill's by at
#: most this (float32 rounding of 128-wide dot products; measured ~2e-6)
KV_ROUNDING = 1e-5
#: the smallest greedy margin of a workload must exceed the largest logit difference between
#: the cached and the recomputed path by this factor (measured: 71x on the quick demo workload, 147x on the full one)
SAFETY = 20.0


def _demo_model() -> TinyTransformer:
    """The model the demo server builds from the default config."""
    cfg = HiCacheConfig()
    return TinyTransformer(ModelSpec.from_model_config(cfg.model, max_positions=cfg.device.max_context_len))


def _kv(pool, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.get_key_buffer(layer)[:n].clone(), pool.get_value_buffer(layer)[:n].clone()


def test_decode_made_kv_equals_prefill_made_kv_up_to_float_rounding() -> None:
    model = _demo_model()
    tokens = system_prompt(QUICK_WORKLOAD)[:96]
    full, idx_full = _scratch_pool(model, len(tokens))
    model.forward(tokens, 0, full, idx_full)
    stepwise, idx_step = _scratch_pool(model, len(tokens))
    model.forward(tokens[:64], 0, stepwise, idx_step)
    for pos in range(64, len(tokens)):
        model.forward([tokens[pos]], pos, stepwise, idx_step)
    for layer in range(model.spec.num_layers):
        (k_full, v_full), (k_step, v_step) = _kv(full, layer, len(tokens)), _kv(stepwise, layer, len(tokens))
        assert (k_full - k_step).abs().max() <= KV_ROUNDING
        assert (v_full - v_step).abs().max() <= KV_ROUNDING


def test_every_greedy_choice_of_the_quick_demo_is_far_from_a_tie_whatever_made_the_history_kv() -> None:
    """Per conversation, the cached path keeps one pool: the history's KV as the previous turns
    left it (their answers decoded token by token), the new part prefilled from the split the
    cache hands over - the committed length (a session slot) or the page boundary below it (a
    tree hit). The recompute prefills the whole prompt. Tokens must agree, and the smallest
    greedy margin must dwarf the largest logit difference."""
    w = QUICK_WORKLOAD
    page = HiCacheConfig().device.page_size
    model = _demo_model()
    worst_diff, smallest_margin = 0.0, float("inf")
    for client in range(w.clients):
        history = list(system_prompt(w))
        cached, idx = _scratch_pool(model, len(history) + w.turns * (w.user_tokens + w.max_new_tokens))
        model.forward(history, 0, cached, idx)  # the warm-up request's prefill
        committed = len(history)
        for turn in range(w.turns):
            history += conversation_turn_tokens(w, client, turn)
            split = committed if turn % 2 == 0 else committed // page * page
            ref_pool, ref_idx = _scratch_pool(model, len(history) + w.max_new_tokens)
            ref_logits = model.forward(history, 0, ref_pool, ref_idx)
            cached_logits = model.forward(history[split:], split, cached, idx)
            answer: list[int] = []
            for step in range(w.max_new_tokens):
                ref_last, cached_last = ref_logits[-1], cached_logits[-1]
                top2 = ref_last.topk(2).values
                smallest_margin = min(smallest_margin, float(top2[0] - top2[1]))
                worst_diff = max(worst_diff, float((ref_last - cached_last).abs().max()))
                token = int(ref_last.argmax())
                assert int(cached_last.argmax()) == token, (client, turn, step)
                answer.append(token)
                if step < w.max_new_tokens - 1:
                    pos = len(history) + step
                    ref_logits = model.forward([token], pos, ref_pool, ref_idx)
                    cached_logits = model.forward([token], pos, cached, idx)
            committed = len(history) + w.max_new_tokens - 1  # the last answer token has no KV yet
            history += answer
    assert worst_diff < 1e-3  # rounding-sized logit differences
    assert smallest_margin > SAFETY * worst_diff, (smallest_margin, worst_diff)
