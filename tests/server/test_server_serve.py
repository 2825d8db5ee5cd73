"""``serve()`` as the CLI runs it: a real process that prints its URL, answers, and on SIGTERM
drains and exits cleanly."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp

from server_helpers import facade_available, small_config

SCRIPT = """
import json, sys
from hicache.config import HiCacheConfig
from hicache.server import serve
serve(HiCacheConfig.model_validate(json.loads(sys.argv[1])), mode=sys.argv[2])
"""


async def test_serve_answers_then_drains_on_sigterm(tmp_path: Path) -> None:
    # one process start is ~10 s of imports on a busy 2-core box: run the mode the CLI runs
    mode = "hicache" if facade_available() else "recompute"
    cfg = small_config(tmp_path / "store" if mode == "hicache" else None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRIPT, json.dumps(cfg.model_dump(mode="json")), mode,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "hicache server on http://" in line, line
        url = line.split(" on ", 1)[1].split()[0]
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/generate", json={"tokens": list(range(40)), "max_new_tokens": 3}) as resp:
                assert resp.status == 200 and len((await resp.json())["tokens"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


#: ``hicache`` (the CLI) with the engine's ``generate`` hanging for the request id ``hang``:
#: a request that outlasts any drain
CLI_WITH_A_HANG = """
import asyncio, sys
from hicache.engine.runner import Engine
generate = Engine.generate
async def hanging(self, rid, *args, **kwargs):
    if rid == "hang":
        await asyncio.Event().wait()
    return await generate(self, rid, *args, **kwargs)
Engine.generate = hanging
from hicache.cli import main
sys.exit(main(sys.argv[1:]))
"""


async def test_sigterm_drain_ends_within_the_configured_bound_and_says_what_it_cut(tmp_path: Path) -> None:
    """The drain on SIGTERM had a fixed bound: aiohttp waited 30 s for a running request and
    30 s more before it cut it, then the cache's close drained its writes for 30 s: past a
    container's grace (Kubernetes': 30 s by default), so the SIGKILL came mid-drain and the
    close report was never written. ``hicache serve --shutdown-timeout S`` bounds the whole
    drain: the request still running is answered 503, the log names it and what the cache's
    close left, and the process exits 0 within the bound."""
    mode = "hicache" if facade_available() else "recompute"
    cfg = small_config(tmp_path / "store" if mode == "hicache" else None)
    config_file = tmp_path / "server.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLI_WITH_A_HANG, "--log-level", "INFO", "serve", "-c", str(config_file),
        "--shutdown-timeout", "2", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "hicache server on http://" in line, line + (await proc.stderr.read()).decode()
        url = line.split(" on ", 1)[1].split()[0]
        async with aiohttp.ClientSession() as http:
            async def hung() -> tuple[int, dict]:  # type: ignore[type-arg]
                async with http.post(f"{url}/v1/generate", json={"tokens": [1, 2, 3], "rid": "hang"}) as resp:
                    return resp.status, await resp.json()

            request = asyncio.create_task(hung())
            for _ in range(200):
                async with http.get(f"{url}/health") as resp:
                    if (await resp.json())["active"] == 1:
                        break
                await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            proc.send_signal(signal.SIGTERM)
            status, body = await asyncio.wait_for(request, 30)
            assert status == 503 and "did not finish" in body["error"]
            # answered before half the bound (aiohttp's cut): it was 60 s in
            assert asyncio.get_running_loop().time() - started < 3.0
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        # the bound, and the interpreter's exit (torch's teardown: seconds on a busy machine)
        assert asyncio.get_running_loop().time() - started < 15.0
        log = (await proc.stderr.read()).decode()
        assert "draining 0 queued and 1 running request(s)" in log, log
        assert "did not finish were stopped and answered 503: 'hang'" in log, log
        if mode == "hicache":
            assert "cache closed: close: drained=True" in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_the_drain_bound_is_a_config_key_a_flag_and_an_env_variable(monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``server.shutdown_timeout_s``: by default inside Kubernetes' default grace (30 s);
    ``HICACHE__SERVER__SHUTDOWN_TIMEOUT_S`` sets it; no time, a negative one, inf or more than
    an hour is refused, as a flag or a key."""
    import pytest

    from hicache.cli import build_parser
    from hicache.config import HiCacheConfig, load_config
    from hicache.errors import ConfigError

    assert HiCacheConfig().server.shutdown_timeout_s < 30
    monkeypatch.setenv("HICACHE__SERVER__SHUTDOWN_TIMEOUT_S", "7.5")
    assert load_config(None).server.shutdown_timeout_s == 7.5
    for bad in ("0", "-1", "inf", "nan", "3601"):
        monkeypatch.setenv("HICACHE__SERVER__SHUTDOWN_TIMEOUT_S", bad)
        with pytest.raises((ConfigError, ValueError)):
            load_config(None)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--shutdown-timeout", bad])
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "12"]).shutdown_timeout == 12.0
