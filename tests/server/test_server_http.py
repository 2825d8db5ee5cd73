"""The demo server over real HTTP: concurrent multi-turn chats get the no-cache answers, the
endpoints behave, shutdown drains, and a restart serves an old conversation from storage."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from server_helpers import requires_facade, small_config
from hicache.server import running_server
from hicache.server.loadgen import Workload, run_load
from hicache.observability.scrape import Scrape

CHAT = Workload(clients=4, turns=3, system_tokens=96, user_tokens=24, max_new_tokens=4, vocab_size=256)


async def test_concurrent_multi_turn_clients_get_correct_answers(mode: str, tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store" if mode == "hicache" else None)
    async with running_server(cfg, mode=mode, port=0) as srv:
        report = await run_load(srv.url, CHAT, verify="client", run_tag="chat")
    s = report["summary"]
    assert s["requests"] == 12 and s["errors"] == 0
    assert s["verified"] is True and s["mismatches"] == 0
    if mode == "hicache":
        assert s["hit_tokens"]["device"] > 0 and s["cached_tokens"] > 0
        later = [r for r in report["records"] if r["turn"] > 0]
        assert all(r["cached_tokens"] > 0 for r in later)  # each turn reuses its history
    else:
        assert s["cached_tokens"] == 0 and s["prefill_tokens"] == s["prompt_tokens"]


async def test_server_side_reference_check_and_text_prompts(mode: str, tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store" if mode == "hicache" else None)
    async with running_server(cfg, mode=mode, port=0) as srv, aiohttp.ClientSession() as http:
        body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_new_tokens": 5,
                "debug_reference": True}
        for _ in range(2):  # the second one hits the cache (hicache mode)
            async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert out["reference_match"] is True and len(out["tokens"]) == 5
            assert isinstance(out["text"], str) and out["prompt_tokens"] == 180
            if mode == "hicache":  # every prompt token is a hit on a tier or a miss with its reason
                assert sum(out["hits"].values()) + sum(out["misses"].values()) == 180, out
        async with http.get(f"{srv.url}/metrics") as resp:
            text = await resp.text()
        mine = {"cache": srv.state.metrics.label}
        assert Scrape(text).value("hicache_server_reference_checks_total", result="match", **mine) == 2


async def test_streaming_sends_tokens_then_a_summary(tmp_path: Path) -> None:
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        body = {"tokens": list(range(40)), "max_new_tokens": 6, "stream": True}
        async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
            assert resp.status == 200 and resp.content_type == "application/x-ndjson"
            lines = [json.loads(line) async for line in resp.content if line.strip()]
    tokens = [line["token"] for line in lines if "token" in line]
    assert [line["index"] for line in lines[:-1]] == list(range(6))
    assert lines[-1]["done"] is True and lines[-1]["tokens"] == tokens


async def test_bad_requests_are_400_with_the_field_named() -> None:
    cases = [
        ({"tokens": [1, 2], "prompt": "x"}, "exactly one"),
        ({"tokens": [1, 999]}, "outside the vocabulary"),
        ({"tokens": []}, "empty"),
        ({"tokens": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"tokens": [1] * 2040, "max_new_tokens": 16}, "context limit"),
        ({"tokens": [1], "temperature": 0.5}, "unknown field"),
        ({"tokens": [1], "stream": "yes"}, "stream"),
    ]
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        for body, words in cases:
            async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
                assert resp.status == 400, body
                assert words in (await resp.json())["error"]
        async with http.post(f"{srv.url}/v1/generate", data=b"{not json") as resp:
            assert resp.status == 400


async def test_a_request_longer_than_the_device_pool_is_refused_up_front() -> None:
    """max_context_len above the device's size: a sequence that can never be on the device at
    once is a 400 naming the limit, not a wait for memory that will never be enough."""
    cfg = small_config(device={"size_tokens": 512, "max_context_len": 2048})
    async with running_server(cfg, mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1] * 600, "max_new_tokens": 4}) as resp:
            assert resp.status == 400
            assert "context limit 512" in (await resp.json())["error"]
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1] * 100, "max_new_tokens": 4}) as resp:
            assert resp.status == 200


async def test_health_metrics_model_and_session_release(mode: str, tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store" if mode == "hicache" else None)
    async with running_server(cfg, mode=mode, port=0) as srv, aiohttp.ClientSession() as http:
        async with http.get(f"{srv.url}/health") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        body = {"tokens": list(range(50)), "max_new_tokens": 3, "session_id": "s1"}
        async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["session_id"] == "s1"
        async with http.post(f"{srv.url}/v1/sessions/s1/release") as resp:
            assert resp.status == 200 and (await resp.json()) == {"released": "s1"}
        async with http.get(f"{srv.url}/v1/model") as resp:
            spec = (await resp.json())["spec"]
        assert spec["num_layers"] == 3 and spec["head_dim"] == 16
        async with http.get(f"{srv.url}/metrics") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            text = await resp.text()
        scrape, mine = Scrape(text), {"cache": srv.state.metrics.label}
        assert scrape.value("hicache_server_requests_total", outcome="ok", **mine) == 1
        assert scrape.value("hicache_server_ttft_seconds_count", **mine) == 1
        assert scrape.value("hicache_server_prompt_tokens_total", **mine) == 50
        gauge = "hicache_recompute_device_free_tokens" if mode == "recompute" else "hicache_device_free_tokens"
        assert scrape.value(gauge, **mine) is not None  # the cache's families share the server's label
        assert "# TYPE hicache_server_hit_tokens_total counter" in text


async def test_every_request_outcome_is_in_the_scrape_as_zero_before_its_first_request() -> None:
    """Only ``outcome="ok"`` was published from the start: the series of the first 500 (or 503,
    400, hang-up) appeared already at 1, and Prometheus' ``rate``/``increase`` take a series'
    first sample as its start, so an alert on ``rate(...{outcome="error"}[5m]) > 0`` never saw
    the first error of a server's life (nor a lone one). Every outcome is a zero from start."""
    async with running_server(small_config(None), port=0) as srv, aiohttp.ClientSession() as http:
        async with http.get(f"{srv.url}/metrics") as resp:
            scrape, mine = Scrape(await resp.text()), {"cache": srv.state.metrics.label}
        for outcome in ("ok", "bad_request", "rejected", "error", "abandoned"):
            assert scrape.value("hicache_server_requests_total", outcome=outcome, **mine) == 0, outcome
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [], "max_new_tokens": 1}) as resp:
            assert resp.status == 400
        async with http.get(f"{srv.url}/metrics") as resp:
            scrape = Scrape(await resp.text())
        assert scrape.value("hicache_server_requests_total", outcome="bad_request", **mine) == 1


async def test_shutdown_finishes_requests_in_flight() -> None:
    """Leaving ``running_server`` while requests run: they complete, later ones are refused."""
    cfg = small_config()
    async with aiohttp.ClientSession() as http:
        async with running_server(cfg, mode="recompute", port=0) as srv:
            url = srv.url
            body = {"tokens": list(range(200)), "max_new_tokens": 24}
            pending = [asyncio.create_task(http.post(f"{url}/v1/generate", json=body)) for _ in range(3)]
            while srv.state.metrics.active == 0:
                await asyncio.sleep(0.005)
        responses = await asyncio.gather(*pending)
        for resp in responses:
            assert resp.status == 200 and len((await resp.json())["tokens"]) == 24
        assert srv.state.scheduler.closing
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{url}/health")


@requires_facade
async def test_restart_serves_an_earlier_conversation_from_storage(tmp_path: Path) -> None:
    """A conversation served, the server stopped (cache drained to the file backend), a new
    server on the same root: the first turn's prompt comes back from storage, and correct."""
    cfg = small_config(tmp_path / "store")
    w = Workload(clients=2, turns=2, system_tokens=128, user_tokens=32, max_new_tokens=4, warmup=False)
    async with running_server(cfg, port=0) as srv:
        first = await run_load(srv.url, w, run_tag="before")
    assert first["summary"]["errors"] == 0
    async with running_server(cfg, port=0) as srv:
        again = await run_load(srv.url, Workload(**{**w.__dict__, "first_turn_only": True}), verify="client",
                               run_tag="after")
    s = again["summary"]
    assert s["errors"] == 0 and s["verified"] is True
    assert s["hit_tokens"]["storage"] > 0, s


async def test_a_text_answer_shows_tokens_that_are_no_byte_as_the_replacement_character() -> None:
    """A model whose vocabulary is wider than a byte answers tokens a text prompt's byte
    "tokenizer" has no byte for; they read as U+FFFD, as documented, not as a ``?`` that
    looked like real text."""
    from hicache.engine.model import ModelSpec

    cfg = small_config()
    spec = ModelSpec.from_model_config(cfg.model, vocab_size=1024, max_positions=cfg.device.max_context_len)
    async with running_server(cfg, mode="recompute", port=0, spec=spec) as srv, aiohttp.ClientSession() as http:
        async with http.post(f"{srv.url}/v1/generate", json={"prompt": "hello", "max_new_tokens": 16}) as resp:
            assert resp.status == 200
            out = await resp.json()
    wide = [t for t in out["tokens"] if t > 255]
    assert wide, out["tokens"]  # (the seeded model answers some)
    assert out["text"].count("?") == out["tokens"].count(ord("?")), out  # only a real "?" reads as one
    assert out["text"].count("\ufffd") >= len(wide), out


async def test_loadgen_names_a_refused_warmup_instead_of_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/loadgen.py`` against a server that refuses its warm-up (a system prompt past
    the server's context, a vocabulary the server's model lacks) ended in a RuntimeError
    traceback, though the same refusal of a later request is a record in the report. It is a
    one-line JSON error naming the refusal, exit status 2, as an unreachable server is."""
    from hicache.server.loadgen import main as loadgen_main

    async with running_server(small_config(), mode="recompute", port=0) as srv:
        rc = await asyncio.to_thread(loadgen_main, ["--url", srv.url, "--system-tokens", "3000",
                                                    "--clients", "1", "--turns", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error = json.loads(err)["error"]
    assert "warm-up" in error and "HTTP 400" in error and "context limit" in error
