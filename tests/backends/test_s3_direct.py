"""Page requests sent directly (:mod:`hicache_backends.s3.direct`): signed right (a moto server
that checks every signature accepts them, and refuses a wrong secret with a clean miss), used
for every page request where the request shape allows and never where it does not (SSE, signed
payloads), and every odd answer a service or a link can give is a clean miss or error, counted,
with no unverified byte left in pool memory."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from botocore.awsrequest import AWSRequest

from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from hicache_backends.s3.direct import Route, Unsupported, _error_fields, _route_from
from hicache_backends.s3.fs import ViewFiller
from s3_proxy import FaultProxy
from s3_server import TEST_KEY, TEST_SECRET, MotoProcess, make_s3, raw_client, raw_get, raw_put
from test_s3_hostile import FAST, read_pages, write_pages

OPS = ("PutObject", "GetObject", "HeadObject")


@pytest.fixture
def prefix() -> str:
    return f"direct/{uuid.uuid4().hex}"


def routes(store: Any) -> dict[str, Route | None]:
    """The route each page operation took on this loop (``None``: botocore)."""
    learned = store._local.get().ops.direct._routes
    return {op: learned.get((store.root.split("/", 1)[0], op)) for op in OPS}


def count_botocore_calls(store: Any) -> Counter[str]:
    """Counts the requests that go through s3fs/botocore from now on, by operation."""
    fs = store._local.get().ops.fs
    calls: Counter[str] = Counter()
    real = fs._call_s3

    async def counted(method: str, *args: Any, **kwargs: Any) -> Any:
        calls[method] += 1
        return await real(method, *args, **kwargs)

    fs._call_s3 = counted
    return calls


# ---------------------------------------------------------------------- signatures


@pytest.fixture(scope="module")
def checking_moto() -> Iterator[tuple[str, str, str]]:
    """A moto server that checks the signature of every request: (endpoint, key id, secret) of
    an IAM user allowed s3:*, with a bucket ``signed``."""
    pytest.importorskip("moto.server")
    import botocore.session

    with MotoProcess() as moto:
        session = botocore.session.get_session()
        iam = session.create_client(
            "iam", endpoint_url=moto.endpoint, region_name="us-east-1",
            aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
        )
        iam.create_user(UserName="hicache")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="hicache", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="hicache")["AccessKey"]
        s3 = session.create_client(
            "s3", endpoint_url=moto.endpoint, region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"],
        )
        s3.create_bucket(Bucket="signed")
        # from now on every request must be signed by a known key
        urllib.request.urlopen(urllib.request.Request(
            moto.endpoint + "/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"},
        )).read()
        yield moto.endpoint, key["AccessKeyId"], key["SecretAccessKey"]


def _signed_store(endpoint: str, key_id: str, secret: str, **options: Any) -> Any:
    from hicache.storage import create_async_storage

    return create_async_storage(
        "s3", None, url=f"s3://signed/{uuid.uuid4().hex}", namespace=NS_A,
        storage_options={"endpoint_url": endpoint, "key": key_id, "secret": secret,
                         "client_kwargs": {"region_name": "us-east-1"}},
        **options,
    )


async def test_a_server_that_checks_signatures_accepts_direct_requests(checking_moto: tuple[str, str, str]) -> None:
    endpoint, key_id, secret = checking_moto
    keys = keys_for(6, salt=900)
    async with _signed_store(endpoint, key_id, secret) as store:
        src = await write_pages(store, keys, seed=9)
        store.exists_cache.clear()
        assert await store.exists_pages(keys) == [True] * 6  # HEADs
        got, dst = await read_pages(store, keys)
        assert got == [True] * 6 and dst.buffer.equal(src.buffer)
        assert all(r is not None and r.region == "us-east-1" for r in routes(store).values())
        stats = store.get_stats()
        assert stats.get("permanent_errors", 0) == 0 and stats.get("transient_errors", 0) == 0


async def test_a_wrong_secret_is_a_clean_miss_never_retried(checking_moto: tuple[str, str, str]) -> None:
    endpoint, key_id, _ = checking_moto
    keys = keys_for(3, salt=901)
    async with _signed_store(endpoint, key_id, "not-the-secret", retries=2) as store:
        pool = ArrayHostPool(3, PAGE)
        store.register_mem_pool_host(pool)
        assert await store.batch_set_v1(keys, pool.indices(0, 3)) == [False] * 3
        assert await store.exists_pages(keys) == [False] * 3
        got, dst = await read_pages(store, keys)
        assert got == [False] * 3 and not dst.buffer.any()
        assert routes(store)["PutObject"] is not None  # refused on the direct path
        stats = store.get_stats()
        assert stats["permanent_errors"] >= 9 and stats.get("retries", 0) == 0  # 403 is an answer


# ---------------------------------------------------------------------- which path


async def test_page_requests_skip_botocore_and_corrupt_reads_are_rejected(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    keys = keys_for(8, salt=902)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        calls = count_botocore_calls(store)
        src = await write_pages(store, keys, seed=3)
        await store.wait_index_writes()
        store.exists_cache.clear()
        assert (await store.batch_exists_v2(keys)).kv_hit_pages == 8  # run index GET + HEADs
        got, dst = await read_pages(store, keys)
        assert got == [True] * 8 and dst.buffer.equal(src.buffer)
        assert all(r is not None for r in routes(store).values())
        assert sum(calls.values()) == 0, calls  # PUT, GET, HEAD: none went through botocore

        # a page damaged at rest: rejected, nothing unverified left in the pool, deleted
        path = store.names.page(keys[2], "kv")
        good = raw_get(moto_endpoint, path)
        assert good is not None
        bad = bytearray(good)
        bad[-10] ^= 0x01
        raw_put(moto_endpoint, path, bytes(bad))
        got, dst = await read_pages(store, keys)
        assert got == [True, True, False] + [True] * 5
        assert not dst.buffer[2 * PAGE : 3 * PAGE].any()
        assert store.get_stats()["corrupt_pages"] == 1 and raw_get(moto_endpoint, path) is None
        assert calls["get_object"] == 0 and calls["put_object"] == 0


async def test_requests_botocore_must_shape_stay_with_botocore(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    from s3_server import s3_options, shared_session
    from hicache.storage import create_async_storage

    keys = keys_for(4, salt=903)
    # server-side encryption: every request carries headers only botocore adds
    sse = create_async_storage(
        "s3", None, url=f"s3://{moto_bucket}/{prefix}/sse", namespace=NS_A,
        storage_options={**s3_options(moto_endpoint), "session": shared_session(),
                         "s3_additional_kwargs": {"ServerSideEncryption": "AES256"}},
    )
    async with sse:
        src = await write_pages(sse, keys, seed=4)
        got, dst = await read_pages(sse, keys)
        assert got == [True] * 4 and dst.buffer.equal(src.buffer)
        assert routes(sse) == {op: None for op in OPS}
        head = raw_client(moto_endpoint).head_object(Bucket=moto_bucket, Key=sse.names.page(keys[0], "kv").split("/", 1)[1])
        assert head["ServerSideEncryption"] == "AES256"
        # damaged pages are rejected on this path too: torn, and one bit flipped
        good = raw_get(moto_endpoint, sse.names.page(keys[0], "kv"))
        assert good is not None
        raw_put(moto_endpoint, sse.names.page(keys[0], "kv"), good[: len(good) // 2])
        flipped = bytearray(raw_get(moto_endpoint, sse.names.page(keys[1], "kv")) or b"")
        flipped[-1] ^= 0x80
        raw_put(moto_endpoint, sse.names.page(keys[1], "kv"), bytes(flipped))
        got, dst = await read_pages(sse, keys)
        assert got == [False, False, True, True] and not dst.buffer[: 2 * PAGE].any()
        assert sse.get_stats()["corrupt_pages"] == 2
    # payload signing asked for: PUTs hash their bodies through botocore, reads go direct
    signing = create_async_storage(
        "s3", None, url=f"s3://{moto_bucket}/{prefix}/signing", namespace=NS_A,
        storage_options={**s3_options(moto_endpoint), "session": shared_session(),
                         "config_kwargs": {"s3": {"payload_signing_enabled": True}}},
    )
    async with signing:
        src = await write_pages(signing, keys, seed=5)
        got, dst = await read_pages(signing, keys)
        assert got == [True] * 4 and dst.buffer.equal(src.buffer)
        r = routes(signing)
        assert r["PutObject"] is None and r["GetObject"] is not None


async def test_concurrent_first_requests_learn_a_route_once(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        direct = store._local.get().ops.direct
        direct._routes.clear()
        found = await asyncio.gather(*(direct.route(moto_bucket, "GetObject") for _ in range(20)))
        assert found[0] is not None and all(f is found[0] for f in found) and not direct._learning


async def test_a_new_client_is_learned_again(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """s3fs replaces its client (``set_session(refresh=True)``): the old one is closed, so the
    routes learned with it are dropped and learned again with the new one."""
    keys = keys_for(3, salt=905)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        src = await write_pages(store, keys, seed=7)
        fs = store._local.get().ops.fs
        old = fs._s3
        await fs.set_session(refresh=True)
        await old.close()
        assert fs._s3 is not old
        got, dst = await read_pages(store, keys)
        assert got == [True] * 3 and dst.buffer.equal(src.buffer)
        assert store._local.get().ops.direct._clients[moto_bucket] is fs._s3


# ---------------------------------------------------------------------- odd answers


async def _cut_mid_body(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=206)
    resp.content_length = 4096
    await resp.prepare(request)
    await resp.write(b"\0" * 100)
    assert request.transport is not None
    request.transport.close()  # the link breaks: fewer bytes than promised
    return resp


def _xml(status: int, code: str) -> web.Response:
    return web.Response(status=status, content_type="application/xml",
                        text=f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>")


async def _truncated(proxy: FaultProxy, request: web.Request) -> web.Response:
    data = await asyncio.to_thread(raw_get, proxy.upstream, request.path.lstrip("/"))
    assert data is not None
    return web.Response(status=206, body=data[: len(data) // 2])


# (what the service does to which method, the call that meets it, what the caller gets, counters that must move)
ODD: dict[str, tuple[str, Callable[[FaultProxy, web.Request], Awaitable[web.StreamResponse]], str, tuple[str, ...]]] = {
    "500 with a body that is not XML": ("GET", lambda p, r: _ret(web.Response(status=500, text="<html>oops")), "read", ("transient_errors", "retries")),
    "503 SlowDown on a PUT": ("PUT", lambda p, r: _ret(_xml(503, "SlowDown")), "write", ("throttled", "retries")),
    "403 to a HEAD (no body)": ("HEAD", lambda p, r: _ret(web.Response(status=403)), "exists", ("permanent_errors",)),
    "a redirect (botocore takes the bucket, meets it too)": ("GET", lambda p, r: _ret(web.Response(status=307, headers={"Location": p.upstream + r.path})), "read", ("permanent_errors",)),
    "the bucket is gone on a PUT": ("PUT", lambda p, r: _ret(_xml(404, "NoSuchBucket")), "write", ("permanent_errors",)),
    "the page is gone on a GET": ("GET", lambda p, r: _ret(_xml(404, "NoSuchKey")), "read", ("stale_hits",)),
    "half the page, then the end": ("GET", _truncated, "read", ("transit_errors",)),
    "the link breaks mid-body": ("GET", lambda p, r: _cut_mid_body(r), "read", ("transient_errors",)),
    "a ranged GET answered with the wrong status": ("GET", lambda p, r: _ret(web.Response(status=204)), "read", ("permanent_errors",)),
}


async def _ret(resp: web.StreamResponse) -> web.StreamResponse:
    return resp


@pytest.mark.parametrize("case", list(ODD))
async def test_an_odd_answer_is_a_clean_counted_miss(moto_endpoint: str, moto_bucket: str, prefix: str, case: str) -> None:
    method, answer, call, counters = ODD[case]
    keys = keys_for(3, salt=904)
    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **{**FAST, "breaker_threshold": 100})
        async with store:
            src = await write_pages(store, keys, seed=6)
            await store.wait_index_writes()

            async def odd(request: web.Request) -> web.StreamResponse | None:
                if request.method == method and "/pages/" in request.path:
                    return await answer(proxy, request)
                return None

            proxy.answer = odd
            if call == "write":
                assert await store.batch_set_v1(keys, src.indices(0, 3)) == [False] * 3
            elif call == "exists":
                store.exists_cache.clear()
                assert await store.exists_pages(keys) == [False] * 3
            else:
                got, dst = await read_pages(store, keys)
                assert got == [False] * 3
                assert not dst.buffer.any()  # no unverified byte stays in pool memory
            stats = store.get_stats()
            assert all(stats.get(c, 0) > 0 for c in counters), {c: stats.get(c, 0) for c in counters}
            assert stats.get("backend_errors", 0) == 0  # every page's task ended cleanly
            route = routes(store)[{"GET": "GetObject", "PUT": "PutObject", "HEAD": "HeadObject"}[method]]
            assert (route is None) == case.startswith("a redirect")  # a redirect hands the bucket to botocore
            # direct requests name the client as botocore's do
            assert all("botocore" in h.get("User-Agent", "").lower() for _, _, h in proxy.seen)
            proxy.answer = None
            if case != "the page is gone on a GET":  # the pages in the bucket are intact
                got, dst = await read_pages(store, keys)
                assert got == [True] * 3 and dst.buffer.equal(src.buffer)


async def test_a_chunked_body_is_read_whole(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """A service (or proxy) that sends the page with chunked transfer encoding, each chunk's end
    arriving after its bytes were read (aiohttp then reports an empty end-of-chunk, which is not
    the end of the body): every chunk lands, the page is served."""
    keys = keys_for(3, salt=906)
    async with FaultProxy(moto_endpoint) as proxy:
        async with make_s3(proxy.endpoint, moto_bucket, prefix, NS_A) as store:
            src = await write_pages(store, keys, seed=8)

            async def chunked(request: web.Request) -> web.StreamResponse | None:
                if request.method != "GET" or "/pages/" not in request.path:
                    return None
                data = await asyncio.to_thread(raw_get, moto_endpoint, request.path.lstrip("/"))
                assert data is not None and request.transport is not None
                out = request.transport  # raw HTTP, to control when each chunk's end is sent
                out.write(b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
                half = len(data) // 2
                for piece in (data[:half], data[half:]):
                    out.write(b"%x\r\n" % len(piece) + piece)
                    await asyncio.sleep(0.05)  # the client reads the bytes before the chunk's end
                    out.write(b"\r\n")
                    await asyncio.sleep(0.05)
                out.write(b"0\r\n\r\n")
                out.close()
                raise asyncio.CancelledError  # answered by hand: the server writes nothing more

            proxy.answer = chunked
            got, dst = await read_pages(store, keys)
            assert got == [True] * 3 and dst.buffer.equal(src.buffer)
            assert routes(store)["GetObject"] is not None


# ---------------------------------------------------------------------- pieces


def _prepared(url: str, **headers: str) -> AWSRequest:
    base = {"X-Amz-Date": "20260101T000000Z", "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD", "User-Agent": "x",
            "Authorization": "AWS4-HMAC-SHA256 Credential=AKID/20260101/eu-west-1/s3/aws4_request, "
                             "SignedHeaders=host;x-amz-date, Signature=00"}
    base.update(headers)
    return AWSRequest(method="PUT", url=url, headers={k: v for k, v in base.items() if v})


def test_route_from_a_prepared_request() -> None:
    r = _route_from("PutObject", _prepared("https://b.s3.eu-west-1.amazonaws.com/probe-1"), "probe-1")
    assert r == Route("PutObject", "https://b.s3.eu-west-1.amazonaws.com/", "eu-west-1", "s3", "UNSIGNED-PAYLOAD",
                      "b.s3.eu-west-1.amazonaws.com", "x")
    anon = _route_from("GetObject", _prepared("http://h:9000/b/probe-1", Authorization=""), "probe-1")
    assert anon.region is None and anon.prefix == "http://h:9000/b/" and anon.host == "h:9000"
    v6 = _route_from("GetObject", _prepared("http://[::1]:80/b/probe-1"), "probe-1")
    assert v6.host == "[::1]"  # the default port is not part of Host, as botocore signs it


@pytest.mark.parametrize("url,headers", [
    ("http://h/b/probe-1?versionId=3", {}),  # a query string after the key
    ("http://h/b/probe-1", {"x-amz-server-side-encryption": "AES256"}),  # a header only botocore adds
    ("http://h/b/probe-1", {"Authorization": "AWS4-ECDSA-P256-SHA256 Credential=AKID/20260101/s3/aws4_request"}),
    ("http://h/b/probe-1", {"Authorization": "AWS AKID:sig"}),  # SigV2
    ("http://h/b/probe-1", {"X-Amz-Content-SHA256": "ab" * 32}),  # a signed payload
    ("ftp://h/b/probe-1", {}),
])
def test_route_from_refuses_shapes_it_cannot_reproduce(url: str, headers: dict[str, str]) -> None:
    with pytest.raises(Unsupported):
        _route_from("PutObject", _prepared(url, **headers), "probe-1")


def test_error_fields() -> None:
    assert _error_fields(b"<Error><Code>SlowDown</Code><Message>slow</Message></Error>") == ("SlowDown", "slow")
    assert _error_fields(b"<?xml version='1.0'?><R><Error><Code>X</Code></Error></R>") == ("X", None)
    assert _error_fields(b"<html>bad gateway") == (None, None)
    assert _error_fields(b"") == (None, None)


def test_view_filler_spreads_chunks_and_drops_the_rest() -> None:
    a, b = bytearray(3), bytearray(4)
    asked: list[int] = []
    views = iter([memoryview(a), memoryview(b)])

    def next_view() -> memoryview | None:
        asked.append(1)
        return next(views, None)

    filler = ViewFiller(next_view)
    filler.feed(b"ab")
    assert len(asked) == 1  # the next view is asked for only when the previous is full
    filler.feed(b"cdefghij")
    filler.feed(b"k")
    assert bytes(a) == b"abc" and bytes(b) == b"defg" and len(asked) == 3


# ---------------------------------------------------------------------- another region, client changes


def _direct(headers: dict[str, str]) -> bool:
    """Whether a request came on the direct path (botocore's carry an invocation id)."""
    return not any(h.lower() == "amz-sdk-invocation-id" for h in headers)


WRONG_REGION = {
    "301 PermanentRedirect": lambda: _xml(301, "PermanentRedirect"),
    "400 AuthorizationHeaderMalformed": lambda: _xml(400, "AuthorizationHeaderMalformed"),
    "403 naming the bucket's region": lambda: _xml(403, "AccessDenied"),
}


@pytest.mark.parametrize("case", list(WRONG_REGION))
async def test_a_bucket_in_another_region_goes_to_botocore(
    moto_endpoint: str, moto_bucket: str, prefix: str, case: str
) -> None:
    """The route was learned for us-east-1 (the probe is never sent, so botocore's region
    redirector never saw the bucket); the bucket answers direct requests as one in eu-west-1
    would. This request and every later one of the bucket go through botocore, and land."""
    keys = keys_for(4, salt=907)
    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **{**FAST, "breaker_threshold": 100})
        async with store:
            direct_seen: list[str] = []

            async def elsewhere(request: web.Request) -> web.StreamResponse | None:
                if "/pages/" not in request.path or not _direct(dict(request.headers)):
                    return None
                direct_seen.append(request.method)
                answer = WRONG_REGION[case]()
                answer.headers["x-amz-bucket-region"] = "eu-west-1"
                return answer

            proxy.answer = elsewhere
            calls = count_botocore_calls(store)
            src = await write_pages(store, keys, seed=10)
            assert routes(store) == {op: None for op in OPS}  # the bucket is botocore's now
            assert 1 <= len(direct_seen) <= len(keys) and calls["put_object"] >= len(keys)
            before = len(direct_seen)
            store.exists_cache.clear()
            assert await store.exists_pages(keys) == [True] * 4
            got, dst = await read_pages(store, keys)
            assert got == [True] * 4 and dst.buffer.equal(src.buffer)
            assert len(direct_seen) == before  # later requests never tried the direct path again
            assert calls["head_object"] >= 1 and calls["get_object"] >= 1
            stats = store.get_stats()
            assert stats.get("permanent_errors", 0) == 0 and stats.get("backend_errors", 0) == 0


async def test_a_region_error_whose_body_arrives_in_pieces_still_goes_to_botocore(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """A 400 AuthorizationHeaderMalformed with no region header, its XML split over two
    writes (TLS records, chunks, a proxy): the whole body is read, its code found, and the
    bucket handed to botocore; before, only the first piece was read and every write failed."""
    keys = keys_for(3, salt=77)
    xml = (b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>AuthorizationHeaderMalformed</Code>"
           b"<Message>the region 'us-east-1' is wrong; expecting 'eu-west-1'</Message>"
           b"<Region>eu-west-1</Region><RequestId>1</RequestId></Error>")
    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **{**FAST, "breaker_threshold": 100})
        async with store:

            async def elsewhere(request: web.Request) -> web.StreamResponse | None:
                if "/pages/" not in request.path or not _direct(dict(request.headers)):
                    return None
                await request.read()
                resp = web.StreamResponse(status=400, headers={"Content-Type": "application/xml"})
                resp.content_length = len(xml)
                await resp.prepare(request)
                await resp.write(xml[:40])
                await asyncio.sleep(0.05)
                await resp.write(xml[40:])
                await resp.write_eof()
                return resp

            proxy.answer = elsewhere
            src = await write_pages(store, keys, seed=12)
            assert routes(store)["PutObject"] is None  # the bucket is botocore's now
            got, dst = await read_pages(store, keys)
            assert got == [True] * 3 and dst.buffer.equal(src.buffer)
            assert store.get_stats().get("permanent_errors", 0) == 0


async def test_a_learning_that_outlives_its_client_is_dropped(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """A route learned with a client s3fs replaced (and closed) meanwhile is never stored: later
    requests use the new client's session, not the closed one."""
    keys = keys_for(3, salt=908)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        src = await write_pages(store, keys, seed=11)
        ops = store._local.get().ops
        direct, fs = ops.direct, ops.fs
        direct._routes.clear()
        gate, reached = asyncio.Event(), asyncio.Event()
        real = direct._learn

        async def slow(bucket: str, operation: str) -> Any:
            got = await real(bucket, operation)
            reached.set()
            await gate.wait()
            return got

        direct._learn = slow
        first = asyncio.create_task(direct.route(moto_bucket, "GetObject"))
        await reached.wait()
        old = fs._s3
        await fs.set_session(refresh=True)
        await old.close()
        direct._learn = real
        fresh = await direct.route(moto_bucket, "GetObject")  # not the old learning's task
        gate.set()
        await first
        assert fresh is not None and direct._routes[(moto_bucket, "GetObject")] is fresh
        assert direct._clients[moto_bucket] is fs._s3 and not direct._learning
        got, dst = await read_pages(store, keys)
        assert got == [True] * 3 and dst.buffer.equal(src.buffer)
        assert store.get_stats().get("transient_errors", 0) == 0


async def test_a_cancelled_or_failed_learning_is_tried_again(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        direct = store._local.get().ops.direct
        await direct.route(moto_bucket, "HeadObject")  # the client exists
        direct._routes.clear()
        real = direct._learn
        key = (moto_bucket, "HeadObject")

        async def never(bucket: str, operation: str) -> Any:
            await asyncio.Event().wait()

        direct._learn = never
        waiting = asyncio.create_task(direct.route(*key))
        await asyncio.sleep(0.01)
        direct._learning[key].cancel()
        assert await waiting is None  # this request goes through botocore
        assert key not in direct._learning and key not in direct._routes

        async def failing(bucket: str, operation: str) -> Any:
            raise OSError("network is unreachable")

        direct._learn = failing
        assert await direct.route(*key) is None
        assert key not in direct._routes  # not pinned to botocore for good
        direct._learn = real
        assert await direct.route(*key) is None  # within the backoff: botocore, no new probe
        direct._retry_at[key] = 0.0  # the backoff is over
        assert await direct.route(*key) is not None


async def test_a_closed_session_sends_through_botocore_and_relearns(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """A route whose client's session was closed (s3fs closed the client under it): the request
    goes through botocore, and the route is learned again with the client s3fs has now."""
    keys = keys_for(3, salt=909)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        src = await write_pages(store, keys, seed=12)
        ops = store._local.get().ops
        direct = ops.direct
        assert await direct.route(moto_bucket, "GetObject") is not None  # learned before the swap below
        live = direct._clients[moto_bucket]
        closed = aiohttp.ClientSession()
        await closed.close()

        async def closed_session(*_: Any) -> aiohttp.ClientSession:
            return closed

        http = SimpleNamespace(_get_session=closed_session)
        direct._clients[moto_bucket] = SimpleNamespace(
            _request_signer=live._request_signer, _endpoint=SimpleNamespace(http_session=http)
        )
        calls = count_botocore_calls(store)
        got, dst = await read_pages(store, keys)
        assert got == [True] * 3 and dst.buffer.equal(src.buffer)
        assert calls["get_object"] >= 1  # served by botocore
        assert direct._clients.get(moto_bucket) is live  # learned again, with the live client
        before = calls["get_object"]
        got, dst = await read_pages(store, keys)
        assert got == [True] * 3 and routes(store)["GetObject"] is not None
        assert calls["get_object"] == before
