"""A streaming request the server cannot serve is answered as a plain one's failure (503 with
Retry-After): the status line went out before the job ran, and its 200 hid the failure from
every client and balancer that retries by status."""

from __future__ import annotations

import aiohttp

from hicache.facade import HiCache
from hicache.server import running_server
from server_helpers import small_config


async def test_a_stream_that_fails_before_its_first_token_is_not_200() -> None:
    cfg = small_config()
    async with HiCache.from_config(cfg) as cache:
        async with running_server(cfg, cache=cache) as srv:
            await cache.aclose()
            async with aiohttp.ClientSession() as http:
                async with http.post(srv.url + "/v1/generate", json={"tokens": [1, 2, 3]}) as r:
                    plain = r.status
                async with http.post(srv.url + "/v1/generate", json={"tokens": [1, 2, 3], "stream": True}) as r:
                    streamed, retry, body = r.status, r.headers.get("Retry-After"), await r.text()
    assert plain == 503
    assert streamed == 503 and retry == "1", (streamed, body)


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
