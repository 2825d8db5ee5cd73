"""Page requests signed with botocore's SigV4 signer and sent on the filesystem's own aiohttp session.

Why: a page's PUT, ranged GET or HEAD through s3fs runs botocore's whole per-request machinery -
parameter validation, the endpoint ruleset, a dozen event hooks, the REST serializer and
response parser. Profiled at 16 requests in flight, that was about half of the client CPU of a
request (the rest: aiohttp and the kernel), and client CPU per request is what bounds a batch's
throughput once requests overlap. These three requests need none of it: a URL, a signature and
the status code. (Measured: ``scripts/bench_s3.py``, client CPU per page; README.)

What is kept from the s3fs filesystem, so nothing is configured twice or differently:

* **where and how to sign** - learned once per bucket and operation from a request botocore
  itself prepared and signed for a probe key, stopped before it is sent (a ``before-send``
  hook): the URL up to the key (endpoint, addressing style, access points...), the signing
  region and service from its credential scope, the payload hash it used;
* **credentials** - the client's own, frozen per request (refreshable ones refresh as botocore's do);
* **the connection pool** - the client's aiohttp session (pool size, timeouts, TLS settings).

A request shape this module does not reproduce falls back to botocore for that bucket and
operation (:meth:`DirectRequests.route` answers ``None``): extra headers (server-side
encryption, requester pays, checksums), a signature that is not plain SigV4 (SigV4a, S3 Express,
SigV2), a signed payload (``payload_signing_enabled=True``), a proxy, or an aiobotocore without
the hooks used here.

Answers are mapped as s3fs maps them: an error status becomes botocore's ``ClientError`` (code
and message from the XML body, or the status for a bodiless answer, as botocore does) translated
by ``s3fs.errors.translate_boto_error``, so retries, misses and error messages do not depend on
which path a request took; connection errors and timeouts are aiohttp's, which the retry policy
already knows. Redirects are not followed (an S3 redirect means a misconfigured region: an error).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from botocore.auth import S3SigV4Auth
from botocore.auth import _host_from_url  # what botocore signs as Host when none is given
from botocore.awsrequest import AWSRequest
from botocore.exceptions import ClientError
from yarl import URL

__all__ = ["DirectRequests", "Route", "Unsupported"]

logger = logging.getLogger("hicache.storage.s3")

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
#: s3fs sends bodies from this size as multipart uploads (``_pipe_file``): those stay with it
MAX_DIRECT_PUT = 100 << 20
#: an error answer's body is read up to this many bytes (S3's are a few hundred)
_MAX_ERROR_BODY = 64 << 10
#: headers botocore adds that carry no meaning this module must reproduce (signing and SDK
#: bookkeeping, framing); any other header botocore sends makes the request shape unsupported
_KNOWN_HEADERS = frozenset({
    "authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token", "user-agent",
    "amz-sdk-invocation-id", "amz-sdk-request", "content-length", "range", "expect", "host",
})
_OPERATIONS = {"PutObject": "PUT", "GetObject": "GET", "HeadObject": "HEAD"}
_UNKNOWN = object()


@dataclass(frozen=True)
class Route:
    """How to send one operation to one bucket: the URL before the key, the signing scope
    (``region`` ``None``: anonymous, unsigned) and the ``x-amz-content-sha256`` to send.
    ``host`` is the ``Host`` header, signed and sent as given (as botocore derives it from the
    URL; deriving it twice per request was a quarter of signing's 130 us)."""


    operation: str
    prefix: str
    region: str | None
    service: str
    content_sha256: str
    host: str = ""
    user_agent: str = ""  # botocore's, so the service sees one client whichever path a request took


class _Signer(S3SigV4Auth):
    """botocore's S3 SigV4 signer with the payload hash fixed: ``UNSIGNED-PAYLOAD`` for a body
    (only used where botocore would send that too), botocore's own value for bodiless requests.
    (Keeping the signing key per day and the selected headers per request saved ~15 of its
    ~65 us a request, 1% of a request's CPU: not worth overriding more of botocore.)"""

    def __init__(self, credentials: Any, service: str, region: str, content_sha256: str) -> None:
        super().__init__(credentials, service, region)
        self._content_sha256 = content_sha256

    def payload(self, request: Any) -> str:
        return self._content_sha256


class Unsupported(Exception):
    """This bucket's requests of one operation have a shape :mod:`.direct` does not reproduce."""


class _Captured(Exception):
    """Raised from the ``before-send`` hook to stop botocore's probe request before it is sent."""

    def __init__(self, request: Any) -> None:
        super().__init__("probe request captured")
        self.request = request


class DirectRequests:
    """Direct PUT / ranged GET / HEAD for one s3fs filesystem (so one event loop)."""

    #: bodies from this size go to s3fs, which sends them as multipart uploads
    max_put = MAX_DIRECT_PUT

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._routes: dict[tuple[str, str], Route | None] = {}
        self._learning: dict[tuple[str, str], asyncio.Task[Route | None]] = {}
        self._clients: dict[str, Any] = {}  # bucket -> its botocore client (s3fs may keep one per region)
        self._client: Any = None  # the filesystem's client the routes were learned with

    # ------------------------------------------------------------------ routes

    def usable(self) -> bool:
        """Whether the filesystem sends nothing per request this module would leave out."""
        return not getattr(self.fs, "req_kw", None) and not getattr(self.fs, "s3_additional_kwargs", None)

    async def route(self, bucket: str, operation: str) -> Route | None:
        """How to send ``operation`` to ``bucket`` directly, or ``None``: use botocore. Learned
        once (concurrent first callers share one probe, a cancelled caller does not cancel it)."""
        if self.fs._s3 is not self._client:  # s3fs made a new client (or closed it): learn again
            self._client = self.fs._s3
            self._routes.clear()
            self._clients.clear()
        key = (bucket, operation)
        found = self._routes.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found  # type: ignore[return-value]
        task = self._learning.get(key)
        if task is None:
            task = self._learning[key] = asyncio.get_running_loop().create_task(self._learn_once(bucket, operation))
        return await asyncio.shield(task)

    async def _learn_once(self, bucket: str, operation: str) -> Route | None:
        try:
            await self.fs.set_session()
            self._client = self.fs._s3
            found = await self._learn(bucket, operation)
        except Unsupported as exc:
            logger.debug("%s on %s goes through botocore: %s", operation, bucket, exc)
            found = None
        except Exception as exc:  # noqa: BLE001 - never fatal: botocore serves the bucket then
            logger.info("%s on %s goes through botocore (learning its request shape failed: %s: %s)",
                        operation, bucket, type(exc).__name__, exc)
            found = None
        self._routes[(bucket, operation)] = found
        self._learning.pop((bucket, operation), None)
        return found

    async def _learn(self, bucket: str, operation: str) -> Route:
        if not self.usable():
            raise Unsupported("the filesystem adds request parameters (s3_additional_kwargs, requester pays)")
        client = await self.fs.get_s3(bucket)
        http = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if not callable(getattr(http, "_get_session", None)) or getattr(client, "_request_signer", None) is None:
            raise Unsupported("this aiobotocore has no session or signer where this module looks")
        probe = f"hicache-probe-{uuid.uuid4().hex}"

        def capture(request: Any, **_: Any) -> None:
            if probe in request.url:
                raise _Captured(request)

        events = client.meta.events
        event = f"before-send.s3.{operation}"
        events.register_first(event, capture)
        try:
            params: dict[str, Any] = {"Bucket": bucket, "Key": probe}
            if operation == "PutObject":
                params["Body"] = b""
            elif operation == "GetObject":
                params["Range"] = "bytes=0-0"
            method = {"PutObject": client.put_object, "GetObject": client.get_object, "HeadObject": client.head_object}
            await method[operation](**params)
        except _Captured as got:
            request = got.request
        else:  # pragma: no cover - the hook always fires before a send
            raise Unsupported("botocore sent the probe request")
        finally:
            events.unregister(event, capture)
        route = _route_from(operation, request, probe)
        if http._proxy_config.proxy_url_for(route.prefix):
            raise Unsupported("requests go through a proxy")
        # what every request will use, tried once here: an aiobotocore whose internals differ
        # fails now and leaves the bucket to botocore, instead of failing every request
        session = await http._get_session(None)
        if not isinstance(session, aiohttp.ClientSession):
            raise Unsupported(f"the client's HTTP session is a {type(session).__name__}")
        if route.region is not None:
            frozen = client._request_signer._credentials.get_frozen_credentials()
            if inspect.isawaitable(frozen):
                await frozen
        self._clients[bucket] = client
        return route

    # ------------------------------------------------------------------ requests

    async def put(self, route: Route, bucket: str, key: str, body: bytes | bytearray) -> None:
        async with await self._send(route, bucket, key, {}, body) as resp:
            if resp.status >= 300:
                await _raise_for(resp, route.operation)

    async def head(self, route: Route, bucket: str, key: str) -> dict[str, str]:
        """The object's headers (``FileNotFoundError`` if absent)."""
        async with await self._send(route, bucket, key, {}) as resp:
            if resp.status >= 300:
                await _raise_for(resp, route.operation)
            return {k.lower(): v for k, v in resp.headers.items()}

    async def get_into(self, route: Route, bucket: str, key: str, start: int, end: int | None, sink: Any) -> int:
        """Bytes ``[start, end)`` (to the object's end if ``end`` is ``None``) fed to
        ``sink(chunk)`` as they arrive; returns how many the store sent."""
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        async with await self._send(route, bucket, key, headers) as resp:
            if resp.status >= 300:
                await _raise_for(resp, route.operation)
            if resp.status != 206 and (resp.status != 200 or start):  # 200: a whole object, fine from 0
                raise OSError(errno.EIO, f"S3 answered {resp.status} to a ranged GET of {bucket}/{key}")
            total = 0
            content = resp.content
            while True:
                chunk, http_chunk_end = await content.readchunk()  # a buffered chunk, not a joined copy
                if chunk:
                    total += len(chunk)
                    sink(chunk)
                elif not http_chunk_end:  # (b"", True) only ends a chunk of a chunked body
                    return total

    async def _send(self, route: Route, bucket: str, key: str, headers: dict[str, str], body: Any = None) -> Any:
        client = self._clients[bucket]
        url = route.prefix + quote(key, safe="/~")
        method = _OPERATIONS[route.operation]
        if route.host:
            headers["Host"] = route.host
        if route.user_agent:
            headers["User-Agent"] = route.user_agent
        if route.region is not None:
            credentials = client._request_signer._credentials
            frozen = credentials.get_frozen_credentials()
            if inspect.isawaitable(frozen):
                frozen = await frozen
            request = AWSRequest(method=method, url=url, headers=headers)
            _Signer(frozen, route.service, route.region, route.content_sha256).add_auth(request)
            headers = dict(request.headers.items())
        headers["Accept-Encoding"] = "identity"  # as aiobotocore: bytes as stored, never re-encoded
        session = await client._endpoint.http_session._get_session(None)
        return session.request(method, URL(url, encoded=True), headers=headers, data=body, allow_redirects=False)


def _route_from(operation: str, request: Any, probe: str) -> Route:
    """The :class:`Route` botocore's prepared ``request`` for key ``probe`` implies;
    :class:`Unsupported` where it has something this module does not reproduce."""
    url = request.url
    at = url.find(probe)
    if at < 0 or url[at + len(probe):] or "?" in url[:at] or not url[:at].endswith("/"):
        raise Unsupported("the key is not the tail of the URL")
    if urlsplit(url).scheme not in ("http", "https"):
        raise Unsupported("neither http nor https")
    headers = {k.lower(): v for k, v in request.headers.items()}
    extra = set(headers) - _KNOWN_HEADERS
    if extra:  # SSE, requester pays, checksums...
        raise Unsupported(f"botocore adds headers {sorted(extra)}")
    sha = headers.get("x-amz-content-sha256", UNSIGNED_PAYLOAD)
    if isinstance(sha, bytes):
        sha = sha.decode()
    auth = headers.get("authorization")
    host = _host_from_url(url)
    agent = headers.get("user-agent", "")
    if isinstance(agent, bytes):
        agent = agent.decode()
    if auth is None:  # anonymous access: botocore sent it unsigned
        return Route(operation, url[:at], None, "s3", sha, host, agent)
    if isinstance(auth, bytes):
        auth = auth.decode()
    if not auth.startswith("AWS4-HMAC-SHA256 Credential="):
        raise Unsupported(f"signature {auth.split(' ', 1)[0]!r} is not SigV4")  # SigV4a, S3 Express, SigV2
    scope = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/")
    if len(scope) != 5 or scope[4] != "aws4_request":
        raise Unsupported("an unexpected credential scope")
    if operation == "PutObject" and sha != UNSIGNED_PAYLOAD:
        raise Unsupported("payload signing is on (payload_signing_enabled)")  # hashing every body: botocore's job
    return Route(operation, url[:at], scope[2], scope[3], sha, host, agent)


async def _raise_for(resp: Any, operation: str) -> None:
    """Raise what s3fs raises for this error answer (see the module docstring)."""
    from s3fs.errors import translate_boto_error

    body = b"" if resp.method == "HEAD" else await resp.content.read(_MAX_ERROR_BODY)
    code, message = _error_fields(body)
    error = ClientError(
        {
            "Error": {"Code": code or str(resp.status), "Message": message or (resp.reason or "")},
            "ResponseMetadata": {"HTTPStatusCode": resp.status, "HTTPHeaders": dict(resp.headers)},
        },
        operation,
    )
    raise translate_boto_error(error)


def _error_fields(body: bytes) -> tuple[str | None, str | None]:
    """``Code`` and ``Message`` of an S3 XML error body; ``None`` where it has none."""
    if not body:
        return None, None
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None, None
    code = root.findtext("Code") if root.tag == "Error" else root.findtext(".//Error/Code")
    message = root.findtext("Message") if root.tag == "Error" else root.findtext(".//Error/Message")
    return code or None, message or None
