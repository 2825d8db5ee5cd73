"""The server against hostile clients: bodies built to break a JSON decoder get a 400 and one
log line, clients that hang up (queued or mid-stream) have their work dropped, and a huge body
is decoded off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from server_helpers import small_config
from hicache.server import running_server
from hicache.testing import eventually


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _post_and_hang_up(port: int, body: dict) -> None:  # type: ignore[type-arg]
    """A client that sends a whole request and closes the connection without reading."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request("/v1/generate", json.dumps(body).encode()))
    await writer.drain()
    writer.close()
    await writer.wait_closed()


class _Gate:
    """Wraps the engine's ``generate``: counts the requests generated, holds them until open."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.calls = 0
        self.open = asyncio.Event()
        self._generate = engine.generate
        engine.generate = self

    async def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        await self.open.wait()
        return await self._generate(*args, **kwargs)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"tokens": [' + b"9" * 5000 + b"]}", "refused"),
        (b"[" * 100_000 + b"]" * 100_000, "deep"),
        (b'{"prompt": "abc\\ud800def"}', "Unicode"),
        (b'{"tokens": [1], "session_id": "\\udfff"}', "Unicode"),
        (b"\xff\xfe{}", "JSON"),
    ],
    ids=["5000-digit-int", "100k-deep", "lone-surrogate-prompt", "lone-surrogate-session", "not-utf8"],
)
async def test_hostile_bodies_are_400_with_one_log_line(raw: bytes, words: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        async with http.post(f"{srv.url}/v1/generate", data=raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert words in (await resp.json())["error"]
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "bad request" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tokens": [1], **{f"k{i}": 1 for i in range(100_000)}}, "unknown field"),
        ({"tokens": [1], "x" * 1_000_000: 1}, "unknown field"),
        ({"tokens": [1], "max_new_tokens": "9" * 1_000_000}, "max_new_tokens"),
        ({"tokens": [1], "stream": "y" * 1_000_000}, "stream"),
    ],
    ids=["100k-unknown-fields", "megabyte-field-name", "megabyte-max-new-tokens", "megabyte-flag"],
)
async def test_an_error_quotes_a_bounded_part_of_what_the_client_sent(
        body: dict, field: str, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[type-arg]
    """A 400 quoted the offending value or field names whole: a body of 100k unknown fields or a
    megabyte string was echoed into a megabyte answer and a megabyte log line per request (any
    client could flood the log it is meant to keep to one line). The quote is cut short, and
    the message still names the field."""
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        async with http.post(f"{srv.url}/v1/generate", data=json.dumps(body),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert field in error and len(error) < 1024, error[:2000]
        lines = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
        assert len(lines) == 1 and len(lines[0]) < 1024


async def test_clients_that_hang_up_while_queued_are_not_generated_for() -> None:
    cfg = small_config(server={"max_batch": 1})
    async with running_server(cfg, mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        gate = _Gate(srv.state.engine)
        try:
            first = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}))
            await eventually(lambda: gate.calls > 0)
            assert gate.calls == 1  # the first request runs (held), the rest queue behind it
            await asyncio.gather(*(_post_and_hang_up(srv.port, {"tokens": [4, 5, i]}) for i in range(10)))
            await eventually(lambda: srv.state.metrics.requests["abandoned"] >= 10)
            assert srv.state.metrics.requests["abandoned"] == 10
            gate.open.set()
            async with await first as resp:
                assert resp.status == 200
            async with http.post(f"{srv.url}/v1/generate", json={"tokens": [7, 8]}) as resp:
                assert resp.status == 200
        finally:
            gate.open.set()  # never leave the server draining requests held here
        assert gate.calls == 2  # nothing was generated for the ten that left


async def test_a_streaming_client_that_hangs_up_is_dropped_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    cfg = small_config(server={"max_batch": 1, "max_new_tokens": 1500})
    async with running_server(cfg, mode="recompute", port=0) as srv:
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        body = json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 1500, "stream": True}).encode()
        writer.write(_request("/v1/generate", body))
        await writer.drain()
        await reader.readuntil(b'"index": 0')  # the stream has started
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: srv.state.metrics.requests["abandoned"] and not srv.state.metrics.active)
        assert srv.state.metrics.requests["abandoned"] == 1
        assert srv.state.metrics.active == 0  # the generation was cancelled, not run to the end
        assert srv.state.metrics.generated_tokens == 0  # it never finished
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_huge_body_is_decoded_off_the_event_loop() -> None:
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        big = b'{"tokens": [' + b",".join([b"1"] * 3_000_000) + b"]}"  # 6 MiB
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(_request("/v1/generate", big))
        await writer.drain()
        order: list[str] = []

        async def big_answer() -> None:
            await reader.readuntil(b"\r\n\r\n")
            order.append("big")

        waiter = asyncio.ensure_future(big_answer())
        await asyncio.sleep(0.05)  # the server is decoding the big body now
        async with http.get(f"{srv.url}/health") as resp:
            assert resp.status == 200
            order.append("health")
        await asyncio.wait_for(waiter, 30)
        writer.close()
        assert order == ["health", "big"]  # /health did not wait for the decode


async def test_a_closed_cache_answers_503_once_counted_and_release_too() -> None:
    """The cache closed under a running server: a generate is one 503 counted once, and a
    session release is a 503 with Retry-After, not a 500 with a traceback. A streaming generate
    is a 503 too: its status line went out before the job ran, a 200 that hid the failure from
    every client and balancer that retries by status."""
    from hicache.facade import HiCache

    cfg = small_config()
    async with HiCache.from_config(cfg) as cache:
        async with running_server(cfg, cache=cache) as srv:
            await cache.aclose()
            async with aiohttp.ClientSession() as http:
                async with http.post(srv.url + "/v1/generate", json={"tokens": [1, 2, 3]}) as r:
                    assert r.status == 503
                async with http.post(srv.url + "/v1/sessions/a/release") as r:
                    assert r.status == 503 and r.headers.get("Retry-After") == "1"
                counted = {k: v for k, v in srv.state.metrics.requests.items() if v}
                assert sum(counted.values()) == 1, counted
                async with http.post(srv.url + "/v1/generate", json={"tokens": [1, 2, 3], "stream": True}) as r:
                    assert r.status == 503 and r.headers.get("Retry-After") == "1", await r.text()


async def test_a_job_that_fails_is_counted_by_the_status_it_is_answered_with() -> None:
    """A job that failed once it ran was counted ``error`` whatever it was answered: a 503 for
    device memory (after its retries) or a closed cache, and a 400 for a bad value, so
    ``outcome="error"`` (and alerts on it) held capacity refusals and bad requests, while the
    same failures refused at submit were ``rejected``/``bad_request``. Each is now counted by
    its status; every request counted once."""
    from hicache.errors import OutOfKVSlotsError
    from hicache.facade import HiCache
    from hicache.observability.scrape import Scrape

    failures: dict[str, Exception] = {"full": OutOfKVSlotsError("injected: device full"),
                                      "full-stream": OutOfKVSlotsError("injected: device full"),
                                      "bad": ValueError("injected: bad value"),
                                      "bug": RuntimeError("injected: bug")}
    cfg = small_config()
    async with HiCache.from_config(cfg) as cache:
        async with running_server(cfg, cache=cache) as srv, aiohttp.ClientSession() as http:
            srv.state.scheduler.max_memory_retries = 0  # give up on device memory at once
            real = srv.state.engine.generate

            async def failing(rid: str, *args: Any, **kwargs: Any) -> Any:
                if rid in failures:
                    raise failures[rid]
                return await real(rid, *args, **kwargs)

            srv.state.engine.generate = failing  # type: ignore[method-assign]
            answered = {}
            for rid in ("ok", "full", "full-stream", "bad", "bug"):
                body = {"tokens": [1, 2, 3], "max_new_tokens": 2, "rid": rid, "stream": rid.endswith("stream")}
                async with http.post(srv.url + "/v1/generate", json=body) as r:
                    answered[rid] = (r.status, r.headers.get("Retry-After"))
            await cache.aclose()
            async with http.post(srv.url + "/v1/generate", json={"tokens": [1, 2, 3], "rid": "closed"}) as r:
                answered["closed"] = (r.status, r.headers.get("Retry-After"))
            assert answered == {"ok": (200, None), "full": (503, "1"), "full-stream": (503, "1"),
                                "bad": (400, None), "bug": (500, None), "closed": (503, "1")}
            counted = {k: v for k, v in srv.state.metrics.requests.items() if v}
            assert counted == {"ok": 1, "rejected": 3, "bad_request": 1, "error": 1}, counted
            async with http.get(srv.url + "/metrics") as r:
                scrape = Scrape(await r.text())
            mine = {"cache": srv.state.metrics.label}
            assert scrape.value("hicache_server_requests_total", outcome="error", **mine) == 1
            assert scrape.value("hicache_server_requests_total", outcome="rejected", **mine) == 3


@pytest.mark.parametrize(
    "method, path, body, status, words",
    [
        ("POST", "/v1/generate", b'{"tokens": [' + b"1," * (4 * 1024 * 1024 + 1) + b"1]}", 413, "Maximum request body size"),
        ("GET", "/v1/generate", b"", 405, "Method Not Allowed"),
        ("POST", "/v1/nowhere", b"{}", 404, "Not Found"),
    ],
    ids=["body-over-8MiB", "wrong-method", "unknown-path"],
)
async def test_what_aiohttp_refuses_is_a_json_error_counted_and_logged_once(
        method: str, path: str, body: bytes, status: int, words: str, caplog: pytest.LogCaptureFixture) -> None:
    """A body over ``client_max_size`` (and a wrong method, an unknown path) got aiohttp's
    plain-text page: no JSON error for the client to read, not counted as ``bad_request``, not
    logged. It is answered like the server's other bad input."""
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        async with http.request(method, srv.url + path, data=body or None,
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status and resp.content_type == "application/json"
            assert words in (await resp.json())["error"]
            if status == 405:
                assert resp.headers["Allow"] == "POST"
        assert srv.state.metrics.requests["bad_request"] == 1
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "bad request" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_400(
        encoding: str, caplog: pytest.LogCaptureFixture) -> None:
    """A body sent with ``Content-Encoding: gzip`` (or deflate) that is no such stream made
    ``request.read`` raise aiohttp's payload error out of the handler: a plain-text 500
    ("Server got itself in trouble") and two ERROR tracebacks per request. It is the client's
    bad input: a JSON 400 that says so, counted and logged once like the others."""
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        async with http.post(f"{srv.url}/v1/generate", data=b'{"tokens": [1, 2, 3]}',
                             headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
            assert resp.status == 400 and resp.content_type == "application/json"
            assert encoding in (await resp.json())["error"]
        await asyncio.sleep(0.1)  # (aiohttp's own read of what is left of the body comes after the answer)
        assert srv.state.metrics.requests["bad_request"] == 1
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "bad request" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving


async def test_a_client_that_hangs_up_while_sending_its_body_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """A client that went away before its whole body arrived (a timeout while uploading a long
    prompt) made ``request.read`` raise ``ConnectionResetError`` out of the handler: an ERROR
    traceback from aiohttp per client, and the request in no outcome. Like any client that
    hangs up, it is one log line and counted ``abandoned``."""
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"tokens": [1, 2, 3')
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler is reading the body
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: srv.state.metrics.requests["abandoned"] > 0)
        await asyncio.sleep(0.1)
        assert dict(srv.state.metrics.requests) == {"abandoned": 1}
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "hung up" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nCookie: " + b"a" * 20_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nX-Bad\x01: 1\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["header-over-8KiB", "bad-content-length", "bad-header-name"],
)
async def test_a_request_aiohttp_cannot_parse_is_a_400_counted_and_logged_once(
        head: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A request whose head aiohttp's parser refuses (a header line over 8 KiB - a big cookie -,
    a Content-Length that is no number, a control byte in a header name) is answered 400 by aiohttp before any handler or
    middleware runs, and aiohttp logged each as an ERROR with a traceback: any client could
    fill the log and page whoever alerts on ERROR. It is the client's bad input: one INFO line
    and counted ``bad_request``, like the server's other bad input."""
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # aiohttp closes after its 400
        writer.close()
        await writer.wait_closed()
        assert b"HTTP/1.0 400 " in answer or b"HTTP/1.1 400 " in answer
        assert srv.state.metrics.requests["bad_request"] == 1
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "bad request" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving


async def test_requests_still_queued_when_the_drain_times_out_get_a_503() -> None:
    """A drain (SIGTERM) gives the requests in flight ``shutdown_timeout`` to finish; aiohttp
    then cancels its handlers and, a second ``shutdown_timeout`` later, cuts their connections.
    A request still queued behind a long one was served nothing and cut there, with no status
    (a balancer cannot tell it safe to retry) and logged as a client that hung up. Once the
    drain's time is up, a request that has not started is answered 503 with Retry-After."""
    cfg = small_config(server={"max_batch": 1})
    async with aiohttp.ClientSession() as http:
        server = running_server(cfg, mode="recompute", port=0, shutdown_timeout=1.0)
        srv = await server.__aenter__()
        gate = _Gate(srv.state.engine)  # the running request never finishes
        closing: asyncio.Task[Any] | None = None

        async def post(body: dict[str, Any]) -> tuple[int, str | None, Any]:
            async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        try:
            running = asyncio.create_task(post({"tokens": [1, 2, 3]}))
            await eventually(lambda: gate.calls == 1)
            queued = [asyncio.create_task(post({"tokens": [4, 5, 6], "stream": stream})) for stream in (False, True)]
            await eventually(lambda: srv.state.metrics.queue_depth == 2)
            closing = asyncio.create_task(server.__aexit__(None, None, None))
            for task in queued:
                status, retry_after, body = await asyncio.wait_for(task, 10)
                assert (status, retry_after) == (503, "1") and "shutting down" in body["error"]
            assert srv.state.metrics.requests["rejected"] == 2
            # the running one is answered too before aiohttp cuts it (see the next test)
            status, retry_after, body = await asyncio.wait_for(running, 10)
            assert (status, retry_after) == (503, "1") and "did not finish" in body["error"]
        finally:
            if closing is None:
                gate.open.set()
                await server.__aexit__(None, None, None)
            else:
                await closing


class _Hang:
    """Wraps the engine's ``generate``: each request streams ``tokens`` tokens, then hangs
    (until cancelled): a request that outlasts the drain."""

    def __init__(self, engine, tokens: int) -> None:  # type: ignore[no-untyped-def]
        self.calls = 0
        self.tokens = tokens
        engine.generate = self

    async def __call__(self, rid, token_ids, max_new_tokens, session_id=None, *, on_token=None, **kw):  # type: ignore[no-untyped-def]
        self.calls += 1
        for i in range(self.tokens):
            if on_token is not None:
                on_token(100 + i)
        await asyncio.Event().wait()


async def test_a_request_still_running_when_the_drain_ends_is_answered_not_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A drain (SIGTERM) gives the requests in flight ``shutdown_timeout``; aiohttp then
    cancels their bodies and, a second ``shutdown_timeout`` later, cancels their handlers and
    cuts their connections. A request still running then was cut with no status: its client
    (and a balancer) could not tell the server went away from a network fault, and nothing was
    logged or counted but ``abandoned``. It is now answered before the cut: a plain request
    503 with Retry-After, a stream already under way its tokens so far and a last line with
    the error; each counted ``rejected`` and logged."""
    cfg = small_config(server={"max_batch": 2})
    async with aiohttp.ClientSession() as http:
        server = running_server(cfg, mode="recompute", port=0, shutdown_timeout=1.0)
        srv = await server.__aenter__()
        hang = _Hang(srv.state.engine, tokens=2)

        async def post(body: dict[str, Any]) -> tuple[int, str | None, bytes]:
            async with http.post(f"{srv.url}/v1/generate", json=body) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.read()

        plain = asyncio.create_task(post({"tokens": [1, 2, 3]}))
        stream = asyncio.create_task(post({"tokens": [4, 5, 6], "stream": True}))
        await eventually(lambda: hang.calls == 2)
        caplog.clear()
        await asyncio.wait_for(server.__aexit__(None, None, None), 30)
        status, retry_after, raw = await asyncio.wait_for(plain, 10)
        assert (status, retry_after) == (503, "1") and "did not finish" in json.loads(raw)["error"]
        status, _, raw = await asyncio.wait_for(stream, 10)
        lines = [json.loads(line) for line in raw.splitlines()]
        assert status == 200 and [line.get("token") for line in lines[:2]] == [100, 101]
        assert lines[-1]["done"] is True and "did not finish" in lines[-1]["error"]
    assert srv.state.metrics.requests["rejected"] == 2
    assert srv.state.metrics.requests["abandoned"] == 0
    assert any("did not finish" in r.getMessage() for r in caplog.records)


async def test_an_app_under_another_runner_logs_a_request_its_drain_cuts(caplog: pytest.LogCaptureFixture) -> None:
    """An embedder serving ``create_app`` under its own ``AppRunner`` has no
    ``running_server`` to answer its running requests before aiohttp's cut: such a cut is
    logged (a WARNING naming the request), never silent."""
    from aiohttp import web

    from hicache.engine.recompute import RecomputeCache
    from hicache.server.app import STATE, create_app

    cfg = small_config()
    async with RecomputeCache(cfg) as cache:
        app = create_app(cache, cfg)
        runner = web.AppRunner(app, shutdown_timeout=0.3)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        hang = _Hang(app[STATE].engine, tokens=0)
        async with aiohttp.ClientSession() as http:
            post = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/generate", json={"tokens": [1, 2]}))
            await eventually(lambda: hang.calls == 1)
            caplog.clear()
            await asyncio.wait_for(runner.cleanup(), 30)
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(post, 10)
    assert any("cut by the server's shutdown" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


#: a request id built to forge log lines: a newline, a NUL, an ANSI colour escape, a CR
EVIL_ID = "x\nERROR hicache forged line\x00\x1b[31m\r"


def _control_characters_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if any(ord(c) < 32 or ord(c) == 127 for c in r.getMessage())]


async def test_client_supplied_ids_and_paths_are_quoted_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A request id, a session id or a path is the client's text, and was written raw into log
    lines: a newline in it forged a line of its own, an ANSI escape recoloured a terminal, a NUL
    cut a line in some collectors. Every line that carries one quotes it (``quoted``)."""
    cfg = small_config(server={"max_batch": 1})
    caplog.set_level(logging.INFO)
    async with running_server(cfg, mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        gate = _Gate(srv.state.engine)
        failing = gate._generate

        async def fail_the_failing(rid, *args, **kwargs):  # type: ignore[no-untyped-def]
            if rid.startswith("fail"):
                raise RuntimeError("engine broke")
            return await failing(rid, *args, **kwargs)

        gate._generate = fail_the_failing
        try:
            first = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}))
            await eventually(lambda: gate.calls == 1)
            caplog.clear()
            # hangs up while queued: "request ...: the client hung up"
            await _post_and_hang_up(srv.port, {"tokens": [4, 5], "rid": EVIL_ID, "session_id": EVIL_ID})
            await eventually(lambda: srv.state.metrics.requests["abandoned"] == 1)
            gate.open.set()
            async with await first as resp:
                assert resp.status == 200
            # fails while served (500): "request ... failed", from the scheduler and the handler
            async with http.post(f"{srv.url}/v1/generate", json={"tokens": [6], "rid": "fail" + EVIL_ID}) as resp:
                assert resp.status == 500
            # a path of no route (404), percent-encoded control characters
            async with http.post(f"{srv.url}/v1/x%0AERROR%20forged%1B[31m%00") as resp:
                assert resp.status == 404
        finally:
            gate.open.set()
        logged = [r.getMessage() for r in caplog.records]
        assert any("hung up" in m for m in logged) and any("failed" in m for m in logged), logged
        assert any("bad request" in m and "404" in m for m in logged), logged
        assert _control_characters_in(caplog) == []


async def test_a_body_that_stops_arriving_is_a_408_not_a_handler_held_for_good(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A client that sent its head and part of its body, then nothing (its machine died, a
    network partition: no FIN, no RST), held its handler in ``request.read`` for good: a
    coroutine and a socket per such client, never freed (the server enables no TCP keepalive),
    and a slow-body client could hold any number. The body has ``BODY_READ_TIMEOUT_S`` to
    arrive: then a 408, the connection closed, counted ``bad_request`` and logged once."""
    from hicache.server import app as server_app

    monkeypatch.setattr(server_app, "BODY_READ_TIMEOUT_S", 0.5)
    caplog.set_level(logging.INFO)
    async with running_server(small_config(), mode="recompute", port=0) as srv, aiohttp.ClientSession() as http:
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        try:
            writer.write(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"tokens": [1')
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)  # answered, and closed
        finally:
            writer.close()
            await writer.wait_closed()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"the body did not arrive" in answer
        await asyncio.sleep(0.1)
        assert dict(srv.state.metrics.requests) == {"bad_request": 1}
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "did not arrive" in r.getMessage()]) == 1
        async with http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2, 3]}) as resp:
            assert resp.status == 200  # and the server goes on serving
