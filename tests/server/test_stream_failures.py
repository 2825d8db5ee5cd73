"""Streaming answers: sent with their first token (a failure before it is answered as a plain
request's, see test_server_hostile), and streamed as ever once tokens come."""

from __future__ import annotations

import aiohttp

from hicache.facade import HiCache
from hicache.server import running_server
from server_helpers import small_config


async def test_a_stream_that_produces_tokens_still_streams_them() -> None:
    cfg = small_config()
    async with HiCache.from_config(cfg) as cache:
        async with running_server(cfg, cache=cache) as srv:
            async with aiohttp.ClientSession() as http:
                async with http.post(srv.url + "/v1/generate",
                                     json={"tokens": [1, 2, 3], "stream": True, "max_new_tokens": 3}) as r:
                    assert r.status == 200
                    lines = [line for line in (await r.text()).splitlines() if line]
    assert len(lines) == 4 and '"done": true' in lines[-1]
