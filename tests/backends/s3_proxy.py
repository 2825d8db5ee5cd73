"""A fault-injecting HTTP proxy in front of a moto S3 server, for the s3 backend's hostile tests.

It runs on the test's own event loop (aiohttp server on port 0, aiohttp client upstream) and
forwards every request unchanged, so the store talks real S3 over real HTTP. Faults happen at
the HTTP level, where a flaky link or a failing service would put them:

* ``flip_bits`` - flip one bit in the body of every successful GET of a page object (a link
  that corrupts data in transit; the object in the bucket stays intact);
* ``outage`` - answer every request with 503 SlowDown (the service is unreachable);
* ``answer`` - a coroutine that may answer a request itself (an odd or failing service: any
  status, headers or body, a connection cut mid-body); ``None`` forwards it.

``seen`` lists ``(method, path, headers)`` of every request, as it arrived; ``served`` lists
``(method, path, body bytes)`` of every answer it forwarded from upstream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["FaultProxy"]

# headers that describe one hop's connection or framing, never forwarded
_HOP = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length", "Content-Encoding", "Host", "TE",
              "Trailer", "Upgrade", "Proxy-Authorization", "Proxy-Authenticate")
)


class FaultProxy:
    """``async with FaultProxy(upstream) as proxy``: ``proxy.endpoint`` forwards to ``upstream``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.flip_bits = False
        self.outage = False
        self.flipped = 0
        self.answer: Callable[[web.Request], Awaitable[web.StreamResponse | None]] | None = None
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.served: list[tuple[str, str, int]] = []
        self.endpoint = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path, dict(request.headers)))
        if self.answer is not None:
            answered = await self.answer(request)
            if answered is not None:
                return answered
        if self.outage:
            return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
        assert self._session is not None
        body = await request.read()
        # a request's Content-Encoding (botocore's aws-chunked uploads) describes its body, not the hop
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP or k.lower() == "content-encoding"}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as upstream:
            data = await upstream.read()
            status = upstream.status
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        if self.flip_bits and request.method == "GET" and status in (200, 206) and "/pages/" in request.path and data:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x10
            data = bytes(flipped)
            self.flipped += 1
        self.served.append((request.method, request.path, len(data)))
        if request.method == "HEAD" and "Content-Length" in upstream.headers:  # the object's size, no body
            return web.Response(status=status, headers={**out, "Content-Length": upstream.headers["Content-Length"]})
        return web.Response(status=status, body=data, headers=out)
