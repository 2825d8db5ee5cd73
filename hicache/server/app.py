"""The aiohttp application: HTTP handlers over a :class:`Scheduler` with hicache embedded.

Routes:

- ``POST /v1/generate`` - see :mod:`hicache.server.protocol`; JSON, or NDJSON with ``stream``
- ``POST /v1/sessions/{id}/release`` - end a session (its KV is written back and freed):
  ``{"released": id}``; with turns of it queued or running, the release applies after the last
  of them and the answer says ``"deferred": true``; 404 for an id with no session (never
  opened, released, or expired) and no turn pending
- ``GET /v1/model`` - the model spec, so a client can rebuild the same model and verify answers
- ``GET /metrics`` - the process's Prometheus scrape (the cache's, the server's and every other
  family on the default registry; every worker's in multi-process mode)
- ``GET /health`` - 200 while serving, 503 while draining

Hostile clients: a body is decoded and validated off the event loop when it is large (a 6 MiB
token list would hold the loop for a second), and anything it cannot be (bad JSON, too deep,
too-long integers, lone surrogates) is a 400 with one log line. What aiohttp refuses itself (a
body over 8 MiB: 413; a wrong method: 405; an unknown path: 404) is answered in the same JSON
shape, counted as ``bad_request`` and logged once too. A request whose head aiohttp cannot parse gets
aiohttp's plain 400, counted and logged once the same way (:class:`ProtocolLog`, which
``running_server`` gives the runner). A body that stops arriving part-way is a 408 once
:data:`BODY_READ_TIMEOUT_S` has passed. A client that hangs up, queued or mid-stream, has its request dropped (:meth:`Scheduler.abandon`): aiohttp does not cancel the
handler on disconnect, so the handler watches the connection itself while it waits.

The app does not own the cache: whoever created it (``serve``, ``running_server``, a test)
enters it before and closes it after the app, so the drain order is HTTP -> scheduler -> engine
-> cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hicache.config.schema import HiCacheConfig
from hicache.engine.model import ModelSpec, TinyTransformer
from hicache.engine.runner import CacheLike, Engine, GenerateResult
from hicache.errors import HiCacheError, quoted
from hicache.observability.metrics import CONTENT_TYPE, exposition
from hicache.server.metrics import ServerMetrics
from hicache.server.protocol import GenerateRequest, RequestError, decode_generate, text_of_tokens
from hicache.server.scheduler import Job, Scheduler, status_of

__all__ = ["ServerState", "STATE", "ProtocolLog", "create_app"]

logger = logging.getLogger("hicache.server")


@dataclass(eq=False)
class ServerState:
    """Everything the handlers share, stored on the app under :data:`STATE`."""

    config: HiCacheConfig
    cache: CacheLike
    engine: Engine
    scheduler: Scheduler
    metrics: ServerMetrics
    spec: ModelSpec
    draining: bool = False


STATE: web.AppKey[ServerState] = web.AppKey("hicache_state", ServerState)

#: bodies larger than this are decoded on a worker thread, not on the loop
OFFLOOP_BODY_BYTES = 64 * 1024
#: how often a waiting handler checks that its client is still connected
DISCONNECT_POLL_S = 0.05
#: how long a request's body may take to arrive (8 MiB, the largest, at ~150 KB/s); a client
#: that stops sending part-way is answered 408 then, not waited for as long as the socket lives
BODY_READ_TIMEOUT_S = 60.0


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _wait_for_client(request: web.Request, st: ServerState, job: Job,
                           waitable: asyncio.Future[Any]) -> bool:
    """Wait for ``waitable`` while the client stays connected; when it hangs up (or the
    handler is cancelled) the job is abandoned. Returns whether ``waitable`` is done."""
    try:
        while True:
            done, _ = await asyncio.wait({waitable}, timeout=DISCONNECT_POLL_S)
            if done:
                return True
            if _client_gone(request):
                logger.info("request %s: the client hung up; dropped", quoted(job.request.rid))
                st.scheduler.abandon(job)
                return False
    except asyncio.CancelledError:
        _cut(st, job)
        raise


def _cut(st: ServerState, job: Job) -> None:
    """The handler of ``job`` was cancelled: drop the job, and say so when the drain did it
    (aiohttp cuts a handler still running a second ``shutdown_timeout`` in, with no answer;
    ``running_server`` answers them before, an app run by another runner may not)."""
    if st.draining and not job.future.done():
        logger.warning("request %s: cut by the server's shutdown before it finished; no answer was sent",
                       quoted(job.request.rid))
    st.scheduler.abandon(job)


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _payload(req: GenerateRequest, result: GenerateResult, job: Job) -> dict[str, Any]:
    out = result.to_json()
    out["session_id"] = req.session_id
    if req.from_text:
        out["text"] = text_of_tokens(result.tokens)
    if job.reference is not None:
        out["reference_tokens"] = job.reference
        out["reference_match"] = job.reference == result.tokens
    return out


def _error_of(exc: BaseException) -> web.Response:
    """The answer to an exception raised while serving (:func:`status_of`, the mapping the
    requests are counted by too); a 503 says when to try again."""
    status, _ = status_of(exc)
    return _error(status, str(exc) or type(exc).__name__, **({"Retry-After": "1"} if status == 503 else {}))


def _failure(what: str, exc: BaseException) -> web.Response:
    """The answer to a request that failed while served: its status for an error of the cache
    or of the request (:func:`_error_of`), else a 500 whose traceback goes to the log. ``what``
    names the request in that log line, quoted (:func:`quoted`: a client chose its id)."""
    if isinstance(exc, (HiCacheError, MemoryError, ValueError)):
        return _error_of(exc)
    logger.error("request %s failed", what, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}")


@web.middleware
async def _json_http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (413 for a body over ``client_max_size``, raised by
    ``request.read``; 405 for a wrong method; 404 for an unknown path) in the server's JSON
    shape. They were aiohttp's plain-text pages, which a client parsing ``{"error": ...}``
    could not read, and a client's error among them was neither counted nor logged like other
    bad input; it now is (``bad_request``, one log line)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:  # a redirect is an answer, not an error
            raise
        if exc.status < 500:
            request.app[STATE].metrics.requests["bad_request"] += 1
            logger.info("bad request from %s: %s %s: %d %s", request.remote, request.method, quoted(request.path),
                        exc.status, exc.reason)
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}  # keeps Allow
        return _error(exc.status, exc.text or exc.reason, **headers)


class ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's connection logger for the app's server (``AppRunner(app, logger=...)``).

    Why: a request whose head aiohttp's parser refuses (a header line over 8 KiB, a Content-Length
    that is no number, a control byte in a header) is answered 400 by aiohttp itself, before any
    handler or middleware, and logged through this logger's ``exception`` as an ERROR with a
    traceback: any client could fill the log and page whoever alerts on ERROR. Such a refusal
    (an ``HttpProcessingError`` with a 4xx code) is the client's bad input: one INFO line and
    ``bad_request``, like the server's other bad input. Everything else passes through."""

    def __init__(self, metrics: ServerMetrics) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._metrics = metrics

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            self._metrics.requests["bad_request"] += 1
            reason = (str(exc.message).splitlines() or [type(exc).__name__])[0]
            logger.info("bad request: %s: aiohttp could not parse it: %d %s", str(msg) % args, exc.code, reason)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _draining() -> web.Response:
    return _error(503, "the server is shutting down", **{"Retry-After": "1"})


def _unread_body(request: web.Request, st: ServerState, status: int, why: str) -> web.Response:
    """The answer to a request whose body was not read whole (it stopped arriving, or could not
    be decoded): counted and logged once as a bad request, and the connection closed after it;
    aiohttp is told the body is over, or it would read the rest again after the answer."""
    request.content.feed_eof()
    st.metrics.requests["bad_request"] += 1
    logger.info("bad request from %s: %s", request.remote, why)
    resp = _error(status, why)
    resp.force_close()
    return resp


async def _generate(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    st = request.app[STATE]
    if st.draining:
        return _draining()
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        # a client that went silent part-way (a dead machine, a partition: no FIN, no RST) held
        # this handler and its socket for as long as the socket lived, which is for good with
        # no TCP keepalive; the rest of its body is never read: the connection closes
        return _unread_body(request, st, 408, f"the body did not arrive within {BODY_READ_TIMEOUT_S:g} s")
    except web.RequestPayloadError as exc:
        # a body aiohttp cannot decode (``Content-Encoding: gzip`` over bytes that are no gzip
        # stream) is the client's bad input; raised out of the handler it was a plain-text 500
        # and two ERROR tracebacks. The rest of such a stream cannot be trusted: the connection
        # closes after the answer, and aiohttp is told the body is over, or it read it again
        # after the answer and logged the same error as unhandled
        reason = getattr(exc.__cause__, "message", None) or str(exc)
        return _unread_body(request, st, 400, f"the body could not be read: {reason}")
    except ConnectionError as exc:
        # the client went away before its whole body arrived (a timeout while uploading a long
        # prompt): raised out of the handler it was an ERROR traceback from aiohttp and the
        # request in no outcome; like any client that hangs up, one line and ``abandoned``
        st.metrics.requests["abandoned"] += 1
        logger.info("request from %s: the client hung up while sending its body (%s); dropped",
                    request.remote, type(exc).__name__)
        return _error(499, "client closed the request")
    try:
        limits = dict(vocab_size=st.spec.vocab_size,
                      # a sequence longer than the device pool can never be served: refused
                      # here, not after waiting for memory that will never be enough
                      max_context_len=min(st.config.device.max_context_len, st.config.device.size_tokens,
                                          st.spec.max_positions),
                      default_max_new_tokens=st.config.server.max_new_tokens)
        if len(raw) > OFFLOOP_BODY_BYTES:
            req = await asyncio.get_running_loop().run_in_executor(None, lambda: decode_generate(raw, **limits))
        else:
            req = decode_generate(raw, **limits)
    except RequestError as exc:
        st.metrics.requests["bad_request"] += 1
        logger.info("bad request from %s: %s", request.remote, exc)
        return _error(400, str(exc))
    if req.stream:
        return await _generate_stream(request, st, req, arrival)
    job = None
    try:
        job = st.scheduler.submit(req, arrival=arrival)
        if not await _wait_for_client(request, st, job, job.future):
            return _error(499, "client closed the request")
        result = job.future.result()
    except Exception as exc:
        if job is None:  # refused by submit; a job that ran was counted by the scheduler, the same way
            st.metrics.requests[status_of(exc)[1]] += 1
        return _failure(quoted(req.rid), exc)
    if job.reference is not None:
        st.metrics.reference_checks["match" if job.reference == result.tokens else "mismatch"] += 1
    return web.json_response(_payload(req, result, job))


async def _generate_stream(request: web.Request, st: ServerState, req: GenerateRequest, arrival: float) -> web.StreamResponse:
    """NDJSON: ``{"token": t, "index": i}`` per token as it is produced, then the summary line
    (the non-streaming payload plus ``"done": true``), or ``{"error": ...}`` on failure."""
    tokens: asyncio.Queue[int] = asyncio.Queue()
    try:
        job = st.scheduler.submit(req, arrival=arrival, on_token=tokens.put_nowait)
    except Exception as exc:  # refused by submit (queue full, shutting down): as a plain request's refusal
        st.metrics.requests[status_of(exc)[1]] += 1
        return _failure(quoted(req.rid), exc)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        failed = await _stream_tokens(request, st, req, job, tokens, resp)
        if failed is not None:
            return failed
    except ConnectionError as exc:  # aiohttp's reset error on a write is one too
        # the client hung up mid-stream: one line, no traceback, and the work is dropped
        logger.info("request %s: the client hung up while streaming (%s); dropped", quoted(req.rid), type(exc).__name__)
        st.scheduler.abandon(job)
    except asyncio.CancelledError:
        _cut(st, job)
        raise
    return resp


async def _stream_tokens(request: web.Request, st: ServerState, req: GenerateRequest, job: Job,
                         tokens: asyncio.Queue[int], resp: web.StreamResponse) -> web.Response | None:
    """Stream the job's tokens into ``resp``, sent (status 200) with the first token; a job that
    fails before its first token is answered as a plain request's failure instead (503 with
    Retry-After, 400, 500), returned: sent at once, its 200 hid the failure from every client
    and balancer that retries by status."""
    index = 0
    while True:
        getter = asyncio.ensure_future(tokens.get())
        try:
            while not getter.done() and not job.future.done():
                either: set[asyncio.Future[Any]] = {getter, job.future}
                await asyncio.wait(either, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done() and not job.future.done() and _client_gone(request):
                    raise ConnectionResetError("client hung up")
        finally:
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            break
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(json.dumps({"token": getter.result(), "index": index}).encode() + b"\n")
        index += 1
    if not resp.prepared:
        failed = None if job.future.cancelled() or not tokens.empty() else job.future.exception()
        if failed is not None:
            return _failure(quoted(req.rid), failed)
        await resp.prepare(request)
    while not tokens.empty():  # tokens produced in the same step as completion
        await resp.write(json.dumps({"token": tokens.get_nowait(), "index": index}).encode() + b"\n")
        index += 1
    try:
        result = job.future.result()
        line: dict[str, Any] = {"done": True, **_payload(req, result, job)}
        if job.reference is not None:
            st.metrics.reference_checks["match" if job.reference == result.tokens else "mismatch"] += 1
    except asyncio.CancelledError:
        line = {"done": True, "error": "cancelled"}
    except Exception as exc:
        line = {"done": True, "error": str(exc) or type(exc).__name__}
    await resp.write(json.dumps(line).encode() + b"\n")
    await resp.write_eof()
    return None


async def _release(request: web.Request) -> web.Response:
    st = request.app[STATE]
    sid = request.match_info["session_id"]
    if st.draining:
        return _draining()
    try:
        # through the scheduler, not the cache: a turn of the session still queued (or between
        # two memory attempts) is invisible to the cache, and re-opened the session it released
        outcome = await st.scheduler.release_session(sid)
    except Exception as exc:  # noqa: BLE001 - a closed cache, a bad id: an answer, not a traceback
        # a release that failed still closed the session (hicache's let go of what it could);
        # the answer says it failed (a JSON 500, not aiohttp's bare page), the log has the trace
        return _failure(f"release of session {quoted(sid)}", exc)
    if outcome == "missing":
        # a 200 for an id the cache never had made a client's typo or a double release look
        # like success
        return _error(404, f"no session {quoted(sid)} (never opened, released, or expired)")
    if outcome == "deferred":
        return web.json_response({"released": sid, "deferred": True})
    return web.json_response({"released": sid})


async def _model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"spec": st.spec.to_dict(), "model": st.config.model.model_dump()})


async def _metrics(request: web.Request) -> web.Response:
    # off the loop: a scrape refreshes every cache's gauges (a backend's get_stats may touch
    # disk or the network) and, in multi-process mode, reads every worker's files
    body = await asyncio.to_thread(exposition)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"})


async def _health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = {"status": "draining" if st.draining else "ok", **st.metrics.snapshot()}
    return web.json_response(body, status=503 if st.draining else 200)


def create_app(
    cache: CacheLike,
    config: HiCacheConfig,
    *,
    spec: ModelSpec | None = None,
    model: TinyTransformer | None = None,
) -> web.Application:
    """An aiohttp app serving ``cache`` (an entered ``HiCache`` or a ``RecomputeCache``).

    The model is built from ``config.model`` (or ``spec``) on the device pool's device; the
    scheduler starts with the app and drains on shutdown. ``server.max_batch`` bounds the
    requests generating at once, ``cache.queue_size`` the queue in front of them.
    """
    if model is None:
        spec = spec or ModelSpec.from_model_config(config.model, max_positions=config.device.max_context_len)
        model = TinyTransformer(spec, device=cache.device_pool.get_key_buffer(0).device)
    spec = model.spec
    metrics = ServerMetrics(getattr(cache, "metrics_label", None))  # the cache's label: one row per deployment
    engine = Engine(cache, model)
    scheduler = Scheduler(engine, max_active=config.server.max_batch, queue_size=config.cache.queue_size, metrics=metrics)
    app = web.Application(client_max_size=8 * 1024 * 1024, middlewares=[_json_http_errors])
    app[STATE] = ServerState(config=config, cache=cache, engine=engine, scheduler=scheduler, metrics=metrics, spec=spec)

    async def on_startup(app: web.Application) -> None:
        await scheduler.start()
        logger.info("scheduler started (max_active=%d, queue=%d)", scheduler.max_active, config.cache.queue_size)

    async def on_shutdown(app: web.Application) -> None:
        app[STATE].draining = True

    async def on_cleanup(app: web.Application) -> None:
        await scheduler.aclose()
        await engine.aclose()
        await metrics.aclose()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/generate", _generate)
    app.router.add_post("/v1/sessions/{session_id}/release", _release)
    app.router.add_get("/v1/model", _model)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app
