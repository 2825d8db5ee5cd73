"""The engine on the real facade: a prompt whose prefix is served from device, from host and from
storage gets exactly the answer (and first-token logits) of a full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import prompt_of, small_spec
from hicache.config import HiCacheConfig
from hicache.engine import Engine, ModelSpec, TinyTransformer, reference_generate, reference_logits


def _facade():
    try:
        from hicache.facade import HiCache
    except ImportError:
        return None
    return HiCache if hasattr(HiCache, "begin") else None


HiCache = _facade()
pytestmark = pytest.mark.skipif(HiCache is None, reason="hicache.facade.HiCache is not implemented yet")

N_NEW = 4


def tier_config(root: Path, device_tokens: int = 512) -> HiCacheConfig:
    """A device pool of a few pages (so other traffic evicts a prefix to host), a large host
    pool, and the file backend under ``root`` with prefetch of any length, waited for."""
    return HiCacheConfig.model_validate({
        "model": {"name": "tests/engine-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
        "device": {"device": "cpu", "size_tokens": device_tokens, "page_size": 16, "max_context_len": 1024},
        "host": {"ratio": 8.0},
        "storage": {"backend": "file", "options": {"root": str(root), "max_bytes": 1 << 30, "min_free_bytes": 0}},
        "cache": {"write_policy": "write_through", "prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "session": {"enabled": True},
    })


def spec_for(cfg: HiCacheConfig) -> ModelSpec:
    m = cfg.model
    return small_spec(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


async def _check(engine: Engine, model: TinyTransformer, rid: str, prompt: list[int]):
    res = await engine.generate(rid, prompt, N_NEW, return_logits=True)
    assert res.tokens == reference_generate(model, prompt, N_NEW), rid
    want = reference_logits(model, prompt)[-1]
    assert torch.allclose(res.first_logits, want, atol=1e-4, rtol=1e-5), (res.first_logits - want).abs().max()
    return res


async def test_device_hit_equals_recompute(tmp_path: Path) -> None:
    cfg = tier_config(tmp_path, device_tokens=2048)
    model = TinyTransformer(spec_for(cfg))
    shared = prompt_of(160, seed=1)
    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        await _check(engine, model, "a", shared + prompt_of(20, seed=2))
        res = await _check(engine, model, "b", shared + prompt_of(30, seed=3))
        await engine.aclose()
    assert res.hits.get("device", 0) >= 160 and res.cached_tokens >= 160


async def test_host_hit_equals_recompute(tmp_path: Path) -> None:
    cfg = tier_config(tmp_path, device_tokens=512)
    model = TinyTransformer(spec_for(cfg))
    target = prompt_of(200, seed=4)
    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        await _check(engine, model, "first", target + [1])
        for i in range(4):  # unrelated prompts push the target's pages off the device
            await engine.generate(f"evict{i}", prompt_of(220, seed=50 + i), 2)
        res = await _check(engine, model, "again", target + [2, 3])
        await engine.aclose()
    assert res.hits.get("host", 0) > 0, res.hits


async def test_storage_hit_after_restart_equals_recompute(tmp_path: Path) -> None:
    cfg = tier_config(tmp_path, device_tokens=1024)
    model = TinyTransformer(spec_for(cfg))
    target = prompt_of(256, seed=6)
    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        await _check(engine, model, "before", target + [7])
        await engine.aclose()
    async with HiCache.from_config(cfg) as cache:  # a new process, as far as the cache knows
        engine = Engine(cache, model)
        res = await _check(engine, model, "after", target + [8, 9])
        await engine.aclose()
    assert res.hits.get("storage", 0) > 0, res.hits


async def test_a_one_token_prompt_loaded_from_host_waits_for_its_load(tmp_path: Path, monkeypatch) -> None:
    """Page size 1 (SGLang's default): a one-token prompt wholly on host recomputes its token
    without reading the prefix, so its prefill waits for no layer; the first decode step reads
    the loaded slot and must not run before the load landed (a slow load gave other tokens)."""
    import time

    from hicache.memory.copy_engine import CopyEngine

    cfg = HiCacheConfig.model_validate({
        "model": {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
        "device": {"device": "cpu", "size_tokens": 256, "page_size": 1, "max_context_len": 1024},
        "host": {"ratio": 8.0},
        "storage": {"backend": None},
        "cache": {"write_policy": "write_through"},
    })
    model = TinyTransformer(spec_for(cfg))
    real = CopyEngine._load_layer

    def slow_load_layer(self, plan, layer):
        time.sleep(0.1)
        return real(self, plan, layer)

    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        target = [5]
        await engine.generate("first", target, N_NEW)
        for i in range(4):  # push the one page off the device
            await engine.generate(f"evict{i}", prompt_of(200, seed=50 + i), 2)
        monkeypatch.setattr(CopyEngine, "_load_layer", slow_load_layer)
        res = await engine.generate("again", target, N_NEW)
        await engine.aclose()
    assert res.hits.get("host", 0) == 1 and res.cached_tokens == 1, res.hits
    assert res.tokens == reference_generate(model, target, N_NEW)


async def test_the_engine_reports_prefills_that_waited_for_no_load(tmp_path: Path) -> None:
    """Prefills computed from scratch (or after a device hit) tell the cache what a recompute
    costs; one that waited for a load-back from host would overstate it and is not reported."""
    cfg = tier_config(tmp_path, device_tokens=512)
    model = TinyTransformer(spec_for(cfg))
    target = prompt_of(200, seed=4)
    async with HiCache.from_config(cfg) as cache:
        prefill = cache._require_stack().controller._prefetcher.prefill
        engine = Engine(cache, model)
        await _check(engine, model, "first", target + [1])
        assert prefill.observations == 1
        for i in range(4):
            await engine.generate(f"evict{i}", prompt_of(220, seed=50 + i), 2)
        assert prefill.observations == 5
        res = await _check(engine, model, "again", target + [2, 3])
        assert res.hits.get("host", 0) > 0 and prefill.observations == 5
        await engine.aclose()
        assert prefill.seconds_per_token is not None and prefill.seconds_per_token > 0


class _OnCuda:
    """A CPU model that says it runs on CUDA: its kernels, as a GPU's are, finish at the
    device's synchronize (here a stand-in that takes ``finish_s``), not when forward returns."""

    def __init__(self, model: TinyTransformer) -> None:
        self._model = model
        self.device = torch.device("cuda")

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._model, name)


async def test_a_gpu_prefill_is_timed_to_its_end_not_to_its_launch(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA ``forward`` returns once its kernels are queued: the time the engine reported
    was the launch (near flat in the tokens), so the learned rate overstated the GPU by far and
    every prefetch wait was cut; the work itself was then waited for by ``.item()`` on the
    server's loop. The worker now waits for the device before it stops the clock."""
    finish_s, synced = 0.05, []

    def synchronize(device=None):  # type: ignore[no-untyped-def]
        synced.append(device)
        import time

        time.sleep(finish_s)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    cfg = tier_config(tmp_path, device_tokens=512)
    model = TinyTransformer(spec_for(cfg))
    async with HiCache.from_config(cfg) as cache:
        reported: list[tuple[int, float]] = []
        cache.note_prefill = lambda tokens, seconds: reported.append((tokens, seconds))  # type: ignore[method-assign]
        engine = Engine(cache, _OnCuda(model))  # type: ignore[arg-type]
        res = await engine.generate("r", prompt_of(100, seed=7), 1)
        await engine.aclose()
    assert res.tokens == reference_generate(model, prompt_of(100, seed=7), 1)
    assert synced and reported and reported[0][0] == 100 and reported[0][1] >= finish_s
