"""``Engine``: cached prefixes give the no-cache answers; errors and cancellation free slots;
``RecomputeCache`` (the baseline) never reuses and never leaks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine_helpers import DevicePrefixCache, prompt_of, small_config, small_spec
from hicache.engine import Engine, OutOfKVSlotsError, RecomputeCache, TinyTransformer, reference_generate, reference_logits


async def test_cached_prefix_gives_the_recompute_answer(model: TinyTransformer) -> None:
    cache = DevicePrefixCache(model.spec)
    engine = Engine(cache, model)
    try:
        system = prompt_of(100, seed=1)
        first = await engine.generate("a", system + prompt_of(20, seed=2), 6)
        assert first.cached_tokens == 0 and first.prefill_tokens == 120
        prompt = system + prompt_of(30, seed=3)
        second = await engine.generate("b", prompt, 6, return_logits=True)
        assert second.cached_tokens == 96  # whole pages of the shared system prompt
        assert second.prefill_tokens == len(prompt) - 96
        assert second.tokens == reference_generate(model, prompt, 6)
        want = reference_logits(model, prompt)[-1]
        assert torch.allclose(second.first_logits, want, atol=1e-4, rtol=1e-5)
    finally:
        await engine.aclose()


async def test_multi_turn_history_is_reused_and_correct(model: TinyTransformer) -> None:
    cache = DevicePrefixCache(model.spec)
    engine = Engine(cache, model)
    history = prompt_of(70, seed=10)
    try:
        for turn in range(3):
            history = history + prompt_of(20, seed=20 + turn)
            res = await engine.generate(f"t{turn}", history, 5)
            assert res.tokens == reference_generate(model, history, 5)
            if turn:
                assert res.cached_tokens > 0
            history = history + res.tokens
    finally:
        await engine.aclose()


async def test_fully_cached_prompt_recomputes_only_the_last_token(model: TinyTransformer) -> None:
    cache = DevicePrefixCache(model.spec)
    engine = Engine(cache, model)
    prompt = prompt_of(64, seed=4)
    try:
        await engine.generate("warm", prompt + [1, 2, 3], 2)
        before = cache.device_pool.kv_data.clone()
        res = await engine.generate("hit", prompt, 1)
        assert res.cached_tokens == 64 and res.prefill_tokens == 0
        assert torch.equal(cache.device_pool.kv_data, before)  # shared slots untouched
        assert res.tokens == reference_generate(model, prompt, 1)
    finally:
        await engine.aclose()


async def test_concurrent_requests_are_correct_and_forwards_never_overlap(model: TinyTransformer) -> None:
    cache = DevicePrefixCache(model.spec, size=8192)
    engine = Engine(cache, model)
    active, peak = 0, 0
    lock = threading.Lock()
    real = model.forward

    def tracked(*args, **kwargs):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active -= 1

    model.forward = tracked  # type: ignore[method-assign]
    system = prompt_of(48, seed=9)
    prompts = [system + prompt_of(10 + i, seed=100 + i) for i in range(6)]
    try:
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, 4) for i, p in enumerate(prompts)))
    finally:
        model.forward = real  # type: ignore[method-assign]
        await engine.aclose()
    assert peak == 1
    for p, r in zip(prompts, results):
        assert r.tokens == reference_generate(model, p, 4)


async def test_streaming_callback_sees_every_token_in_order(model: TinyTransformer) -> None:
    async with RecomputeCache(small_config()) as cache:
        engine = Engine(cache, model)
        seen: list[int] = []
        res = await engine.generate("s", prompt_of(30, seed=5), 5, on_token=seen.append)
        await engine.aclose()
    assert seen == res.tokens and len(seen) == 5
    assert res.ttft_s <= res.latency_s


async def test_recompute_cache_never_reuses_and_frees_every_slot(model: TinyTransformer) -> None:
    cfg = small_config()
    async with RecomputeCache(cfg) as cache:
        engine = Engine(cache, model)
        prompt = prompt_of(50, seed=6)
        a = await engine.generate("a", prompt, 20)  # decode crosses a page boundary
        b = await engine.generate("b", prompt, 20)
        assert a.tokens == b.tokens == reference_generate(model, prompt, 20)
        assert a.cached_tokens == b.cached_tokens == 0 and b.prefill_tokens == 50
        assert cache.metrics()["device_free_tokens"] == cfg.device.size_tokens
        await engine.aclose()


async def test_out_of_slots_is_an_error_and_leaks_nothing(model: TinyTransformer) -> None:
    async with RecomputeCache(small_config(size_tokens=64)) as cache:
        engine = Engine(cache, model)
        with pytest.raises(OutOfKVSlotsError):
            await engine.generate("big", prompt_of(100, seed=7), 2)
        with pytest.raises(OutOfKVSlotsError):  # decode runs out mid-way: aborted, slots back
            await engine.generate("long", prompt_of(60, seed=7), 10)
        assert cache.metrics()["device_free_tokens"] == 64
        await engine.aclose()


async def test_a_prompt_of_non_integer_or_out_of_vocabulary_ids_is_refused_before_the_cache(
        model: TinyTransformer) -> None:
    """``generate`` checks its prompt as ``HiCache.begin`` does: float ids were truncated by
    ``int()`` (``[1.7, 2.2, 3.9]`` answered as the prompt ``[1, 2, 3]``), and an id past the
    model's vocabulary failed only in the embedding lookup, after the cache had allocated."""
    cfg = small_config()
    async with RecomputeCache(cfg) as cache:
        engine = Engine(cache, model)
        vocab = model.spec.vocab_size
        for bad, error, match in (([1.7, 2.2, 3.9], TypeError, "integers"),
                                  (torch.tensor([1.0, 2.0]), TypeError, "integers"),
                                  ("123", TypeError, "sequence"),
                                  ([1, -2, 3], ValueError, "outside"),
                                  ([1, vocab, 3], ValueError, "vocab_size"),
                                  ([], ValueError, "at least one")):
            with pytest.raises(error, match=match):
                await engine.generate("bad", bad, 2)  # type: ignore[arg-type]
        assert engine.forwards == 0 and cache.metrics()["device_free_tokens"] == cfg.device.size_tokens
        # integer ids of any integer type are the prompt they say
        res = await engine.generate("ok", torch.tensor([1, 2, vocab - 1]), 2)
        assert res.tokens == reference_generate(model, [1, 2, vocab - 1], 2)
        await engine.aclose()


async def test_cancelled_request_waits_for_its_forward_then_aborts(spec) -> None:
    model = TinyTransformer(spec)
    cache = DevicePrefixCache(spec)
    engine = Engine(cache, model)
    started, finished = threading.Event(), threading.Event()
    real = model.forward

    def slow(*args, **kwargs):
        started.set()
        time.sleep(0.2)
        out = real(*args, **kwargs)
        finished.set()
        return out

    model.forward = slow  # type: ignore[method-assign]
    task = asyncio.create_task(engine.generate("c", prompt_of(40, seed=8), 3))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.02)
    task.cancel()  # twice (a shutdown cancels every task): it still waits for the forward
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()  # the forward completed before the slots were given back
    assert cache.aborted == 1 and cache.live == 0
    model.forward = real  # type: ignore[method-assign]
    await engine.aclose()


async def test_a_request_cancelled_while_its_forward_waits_in_the_queue_never_runs_it(spec) -> None:
    """A client gone while its prefill still waits behind another forward: the queued
    forward was run anyway once its turn came (nothing had started writing its slots, yet the
    cancellation waited for it), so every abandoned request cost the worker a whole prefill
    and delayed the requests queued behind it. It is dropped from the queue instead."""
    model = TinyTransformer(spec)
    cache = DevicePrefixCache(spec)
    engine = Engine(cache, model)
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(5)

    blocker = asyncio.create_task(engine.run(hold))
    while not held.is_set():
        await asyncio.sleep(0.01)
    calls = 0
    real = model.forward

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    model.forward = counted  # type: ignore[method-assign]
    task = asyncio.create_task(engine.generate("gone", prompt_of(40, seed=8), 3))
    while not engine._worker._queue.qsize():  # its prefill is queued behind the held forward
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 1)  # at once: nothing of it is running
    gate.set()
    await blocker
    await engine.run(lambda: None)  # everything queued before has been run (or skipped)
    assert calls == 0
    assert cache.aborted == 1 and cache.live == 0
    model.forward = real  # type: ignore[method-assign]
    await engine.aclose()


def test_engine_rejects_a_pool_of_another_geometry(model: TinyTransformer) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Engine(DevicePrefixCache(small_spec(num_layers=2)), model)


async def test_recompute_cache_refuses_to_extend_a_finished_request(model: TinyTransformer) -> None:
    """Slots grabbed for a committed or aborted handle would be tracked by nothing, not even
    ``aclose``: extending one is an error, as on the real cache, and nothing leaks."""
    cfg = small_config()
    async with RecomputeCache(cfg) as cache:
        for end in (cache.commit, cache.abort):
            handle = await cache.begin("r", prompt_of(20, seed=8))
            await end(handle)
            with pytest.raises(ValueError, match="already committed or aborted"):
                await cache.extend(handle, [1] * 40)
        assert cache.metrics()["device_free_tokens"] == cfg.device.size_tokens


async def test_the_baseline_keeps_a_request_whose_chunk_is_committed() -> None:
    """``commit(finished=False)`` is a prefill chunk (``CacheLike``): the request goes on. The
    baseline freed its slots, so the next request was given them while this one still wrote
    its KV there, and its next extend failed."""
    async with RecomputeCache(small_config()) as cache:
        h = await cache.begin("r", list(range(20)))
        free = cache.metrics()["device_free_tokens"]
        await cache.commit(h, finished=False)
        assert cache.metrics()["device_free_tokens"] == free
        assert (await cache.extend(h, [5])).numel() == 1
        await cache.commit(h, finished=True)
        assert cache.metrics()["device_free_tokens"] > free
