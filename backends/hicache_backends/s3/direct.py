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
already knows. Redirects are not followed: a redirect-type answer (301, 307, a 400
``AuthorizationHeaderMalformed`` / ``PermanentRedirect`` / ``IllegalLocationConstraintException``,
an ``x-amz-bucket-region`` other than the route's) means the bucket lives in another region than
the one the route was learned with (the probe is never sent, so botocore's region redirector never
saw it): the bucket's routes are dropped and the request raises :class:`UseBotocore`, whose
redirector then sends it, and every later one, to the right region.
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

__all__ = ["DirectRequests", "Route", "Unsupported", "UseBotocore"]

logger = logging.getLogger("hicache.storage.s3")

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
#: bodies from this size go as multipart uploads (``S3ObjectOps.put``), through botocore
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
#: error codes S3 answers a request signed for (or sent to) the wrong region with
_REDIRECT_CODES = frozenset({"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException"})
#: seconds before a bucket whose learning failed (credentials, network) is learned again
LEARN_BACKOFF = 10.0
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


class UseBotocore(Exception):
    """Send this request through botocore: the direct path cannot (the bucket is in another
    region, the client's session is closed). Raised before any byte reached the caller; the
    bucket's routes are already dropped, so later requests do not come here."""


class _Captured(Exception):
    """Raised from the ``before-send`` hook to stop botocore's probe request before it is sent."""

    def __init__(self, request: Any) -> None:
        super().__init__("probe request captured")
        self.request = request


class DirectRequests:
    """Direct PUT / ranged GET / HEAD for one s3fs filesystem (so one event loop)."""

    #: bodies from this size go through botocore, as multipart uploads
    max_put = MAX_DIRECT_PUT
    #: seconds a bucket stays with botocore after learning its route failed for a reason that
    #: may pass (credentials, network); an :class:`Unsupported` shape stays with it for good
    learn_backoff = LEARN_BACKOFF

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._routes: dict[tuple[str, str], Route | None] = {}
        self._learning: dict[tuple[str, str], asyncio.Task[Route | None]] = {}
        self._retry_at: dict[tuple[str, str], float] = {}  # loop time a failed learning may be retried
        self._clients: dict[str, Any] = {}  # bucket -> its botocore client (s3fs may keep one per region)
        self._client: Any = None  # the filesystem's client the routes were learned with

    # ------------------------------------------------------------------ routes

    def usable(self) -> bool:
        """Whether the filesystem sends nothing per request this module would leave out."""
        return not getattr(self.fs, "req_kw", None) and not getattr(self.fs, "s3_additional_kwargs", None)

    async def route(self, bucket: str, operation: str) -> Route | None:
        """How to send ``operation`` to ``bucket`` directly, or ``None``: use botocore. Learned
        once (concurrent first callers share one probe, a cancelled caller does not cancel it)."""
        self._follow_client()
        key = (bucket, operation)
        found = self._routes.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found  # type: ignore[return-value]
        loop = asyncio.get_running_loop()
        if self._retry_at.get(key, 0.0) > loop.time():
            return None  # learning failed a moment ago: botocore until the backoff ends
        task = self._learning.get(key)
        if task is None or task.done():  # done: cancelled (a finished one left the dict)
            task = self._learning[key] = loop.create_task(self._learn_once(bucket, operation))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                return None  # the learning was cancelled, not this caller: botocore serves it
            raise

    def _follow_client(self) -> None:
        """s3fs made a new client (and closed the old one, with its session): forget all that
        was learned with the old one, learnings under way included (their results are dropped)."""
        if self.fs._s3 is not self._client:
            self._client = self.fs._s3
            self._routes.clear()
            self._clients.clear()
            self._learning.clear()
            self._retry_at.clear()

    def drop(self, bucket: str) -> None:
        """Send ``bucket``'s requests through botocore from now on (until s3fs's client changes)."""
        for operation in _OPERATIONS:
            self._routes[(bucket, operation)] = None

    async def _learn_once(self, bucket: str, operation: str) -> Route | None:
        key = (bucket, operation)
        me = asyncio.current_task()
        client: Any = None
        try:
            await self.fs.set_session()
            client = self.fs._s3
            found, bucket_client = await self._learn(bucket, operation)
        except Unsupported as exc:
            logger.debug("%s on %s goes through botocore: %s", operation, bucket, exc)
            found, bucket_client = None, None
        except Exception as exc:  # noqa: BLE001 - never fatal: botocore serves the bucket meanwhile
            logger.info("%s on %s goes through botocore for %.0f s (learning its request shape failed: %s: %s)",
                        operation, bucket, self.learn_backoff, type(exc).__name__, exc)
            if client is self.fs._s3:  # (None too: set_session itself failed)
                self._follow_client()
                self._retry_at[key] = asyncio.get_running_loop().time() + self.learn_backoff
            return None
        finally:  # also when cancelled: a later route() must start afresh, not await this task
            if self._learning.get(key) is me:
                del self._learning[key]
        if client is None or client is not self.fs._s3:
            return None  # learned with a client s3fs has replaced (and closed) since: dropped
        self._follow_client()  # the first learning: the client set_session just made
        self._routes[key] = found
        self._retry_at.pop(key, None)
        if bucket_client is not None:
            self._clients[bucket] = bucket_client
        return found

    async def _learn(self, bucket: str, operation: str) -> tuple[Route, Any]:
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
        assert http is not None  # checked above: it has a _get_session
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
        return route, client

    # ------------------------------------------------------------------ requests

    async def put(self, route: Route, bucket: str, key: str, body: bytes | bytearray) -> None:
        async with await self._send(route, bucket, key, {}, body) as resp:
            if resp.status >= 300:
                await self._raise_for(resp, route, bucket)

    async def head(self, route: Route, bucket: str, key: str) -> dict[str, str]:
        """The object's headers (``FileNotFoundError`` if absent)."""
        async with await self._send(route, bucket, key, {}) as resp:
            if resp.status >= 300:
                await self._raise_for(resp, route, bucket)
            return {k.lower(): v for k, v in resp.headers.items()}

    async def get_into(self, route: Route, bucket: str, key: str, start: int, end: int | None, sink: Any) -> int:
        """Bytes ``[start, end)`` (to the object's end if ``end`` is ``None``) fed to
        ``sink(chunk)`` as they arrive; returns how many the store sent."""
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        async with await self._send(route, bucket, key, headers) as resp:
            if resp.status >= 300:
                await self._raise_for(resp, route, bucket)
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
        if session.closed:  # the client was closed under us: relearn with the one s3fs has now
            self._client = _UNKNOWN  # route() forgets all it learned and learns again
            raise UseBotocore(f"the HTTP session of {bucket}'s client is closed")
        return session.request(method, URL(url, encoded=True), headers=headers, data=body, allow_redirects=False)

    async def _raise_for(self, resp: Any, route: Route, bucket: str) -> None:
        """Raise what s3fs raises for this error answer (see the module docstring), or
        :class:`UseBotocore` (with the bucket's routes dropped) for a redirect-type one."""
        body = b"" if resp.method == "HEAD" else await _error_body(resp)
        code, message = _error_fields(body)
        if _redirected(resp.status, code, resp.headers.get("x-amz-bucket-region"), route.region):
            logger.info("bucket %s is not in %s, its requests' signing region (%s %s): botocore serves it",
                        bucket, route.region, resp.status, code or resp.headers.get("x-amz-bucket-region"))
            self.drop(bucket)
            raise UseBotocore(f"{bucket} answered {resp.status} {code or ''}: another region")
        _raise_error(resp, route.operation, code, message)


async def _error_body(resp: Any) -> bytes:
    """An error answer's body, whole up to :data:`_MAX_ERROR_BODY`. ``read(n)`` returns what
    has arrived so far: an XML error split over TLS records, chunks or a proxy's writes would
    lose its code (a region error would then never hand the bucket to botocore)."""
    body = b""
    while len(body) < _MAX_ERROR_BODY:
        chunk = await resp.content.read(_MAX_ERROR_BODY - len(body))
        if not chunk:
            break
        body += chunk
    return body


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


def _redirected(status: int, code: str | None, bucket_region: str | None, region: str | None) -> bool:
    """Whether an error answer says the bucket is in another region than the request was for."""
    return (
        status in (301, 307)
        or (status == 400 and code in _REDIRECT_CODES)
        or (bucket_region is not None and region is not None and bucket_region != region)
    )


def _raise_error(resp: Any, operation: str, code: str | None, message: str | None) -> None:
    from s3fs.errors import translate_boto_error

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
