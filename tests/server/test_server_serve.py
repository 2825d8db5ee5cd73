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
