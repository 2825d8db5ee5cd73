"""The ``s3`` backend against a hostile link and a bucket that goes away: moto's server, reached
through a fault-injecting HTTP proxy (:mod:`s3_proxy`) where a test needs one. Each test failed
before its fix (issue 14, items 5-7)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hicache.storage import create_async_storage
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from s3_proxy import FaultProxy
from s3_server import create_bucket, eventually, make_s3, raw_client, raw_get, raw_put, s3_options, shared_session

FAST: dict[str, Any] = dict(
    request_timeout=1.0, call_timeout=3.0, retries=1, retry_backoff=0.01, retry_backoff_max=0.05,
    breaker_threshold=2, breaker_cooldown=0.5,
)


@pytest.fixture
def prefix() -> str:
    return f"hostile/{uuid.uuid4().hex}"


@pytest.fixture
async def proxy(moto_endpoint: str):
    async with FaultProxy(moto_endpoint) as p:
        yield p


async def write_pages(store: Any, keys: list[str], seed: int) -> ArrayHostPool:
    src = ArrayHostPool(len(keys), PAGE)
    src.fill_random(seed)
    store.register_mem_pool_host(src)
    assert await store.batch_set_v1(keys, src.indices(0, len(keys))) == [True] * len(keys)
    return src


async def read_pages(store: Any, keys: list[str]) -> tuple[list[bool], ArrayHostPool]:
    dst = ArrayHostPool(len(keys), PAGE)
    store.register_mem_pool_host(dst)
    return await store.batch_get_v1(keys, dst.indices(0, len(keys))), dst


# ---------------------------------------------------------------------- item 5: bit flips in transit


async def test_a_link_that_flips_bits_never_deletes_shared_pages(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """One reader's link flips a bit in every page it GETs: its reads are misses, counted, and
    the pages stay in the bucket for everyone else (they used to be deleted as corrupt)."""
    keys = keys_for(12, salt=140)
    good = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    flaky = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **FAST)
    async with good, flaky:
        src = await write_pages(good, keys, seed=140)
        proxy.flip_bits = True
        got, _ = await read_pages(flaky, keys)
        assert got == [False] * len(keys) and proxy.flipped >= len(keys)
        assert await flaky.get("k-unknown-size") is None
        raw = await flaky.get(keys[0])  # the unknown-size path flips too
        assert raw is None
        stats = flaky.get_stats()
        assert stats.get("corrupt_pages", 0) == 0 and stats["transit_errors"] >= len(keys) + 1
        # every page is still there, intact, for a reader whose link is sound
        got, dst = await read_pages(good, keys)
        assert got == [True] * len(keys)
        assert all(dst.page_bytes(i * PAGE) == src.page_bytes(i * PAGE) for i in range(len(keys)))


async def test_a_page_corrupt_at_rest_is_still_deleted(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """The stored bytes themselves are bad (what arrived is what the bucket holds): delete."""
    keys = keys_for(2, salt=141)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        await write_pages(store, keys, seed=141)
        path = store.names.page(keys[0], "kv")
        data = bytearray(await asyncio.to_thread(raw_get, moto_endpoint, path))
        data[len(data) // 2] ^= 0x10
        await asyncio.to_thread(raw_put, moto_endpoint, path, bytes(data))
        got, _ = await read_pages(store, keys)
        assert got == [False, True]
        assert store.get_stats()["corrupt_pages"] == 1
        assert await asyncio.to_thread(raw_get, moto_endpoint, path) is None


# ---------------------------------------------------------------------- item 6: outage and lookups


async def test_lookups_answer_misses_while_the_store_is_unreachable(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    keys = keys_for(6, salt=150)
    async with make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **FAST) as store:
        await write_pages(store, keys, seed=150)
        assert await store.batch_exists(keys) == len(keys)  # known present: cached, no HEAD
        proxy.outage = True
        got, _ = await read_pages(store, keys)  # fails, opens the breaker
        assert got == [False] * len(keys)
        assert store.get_stats()["breaker_state"] != "closed"
        # the positive cache must not claim pages a prefetch then fails to read
        assert await store.batch_exists(keys) == 0
        proxy.outage = False

        async def back() -> bool:
            return await store.batch_exists(keys) == len(keys)

        await eventually(back)  # the prober closes the breaker; the pages are found again
        got, _ = await read_pages(store, keys)
        assert got == [True] * len(keys)


# ---------------------------------------------------------------------- item 7: bucket re-created


def _delete_bucket(endpoint: str, bucket: str) -> None:
    """Empty and delete ``bucket``; again if the store's prober re-created its manifest in the
    meantime (BucketNotEmpty)."""
    client = raw_client(endpoint)
    for _ in range(20):
        for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
        try:
            client.delete_bucket(Bucket=bucket)
            return
        except client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketNotEmpty":
                raise
    raise AssertionError(f"could not delete bucket {bucket}")


def _has_object(endpoint: str, bucket: str, key: str) -> bool:
    client = raw_client(endpoint)
    try:
        client.head_object(Bucket=bucket, Key=key)
    except client.exceptions.ClientError:
        return False
    return True


@pytest.mark.parametrize("write_while_gone", [True, False], ids=["write-while-gone", "no-write-while-gone"])
async def test_manifest_is_written_again_after_the_bucket_is_recreated(moto_endpoint: str, write_while_gone: bool) -> None:
    bucket = f"hicache-recreated-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(create_bucket, moto_endpoint, bucket)
    keys = keys_for(3, salt=160)
    store = make_s3(moto_endpoint, bucket, "ns", NS_A, **FAST, manifest_check_interval=0.3)
    async with store:
        manifest = store.names.manifest.split("/", 1)[1]
        await write_pages(store, keys, seed=160)
        assert await asyncio.to_thread(_has_object, moto_endpoint, bucket, manifest)
        await asyncio.to_thread(_delete_bucket, moto_endpoint, bucket)
        if write_while_gone:
            src = ArrayHostPool(1, PAGE)
            store.register_mem_pool_host(src)
            assert await store.batch_set_v1(keys[:1], src.indices(0, 1)) == [False]
        await asyncio.to_thread(create_bucket, moto_endpoint, bucket)

        async def manifest_back() -> bool:
            return await asyncio.to_thread(_has_object, moto_endpoint, bucket, manifest)

        await eventually(manifest_back)
        await write_pages(store, keys, seed=161)
    await asyncio.to_thread(_delete_bucket, moto_endpoint, bucket)


async def test_writes_to_a_deleted_bucket_are_said_once_a_minute(
    moto_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every page written to a bucket that is gone logged its own warning ("bucket not found"):
    a server writing back thousands of pages a second flooded its log. It is said once a
    minute, with how many writes it stands for, as every other permanent failure is."""
    bucket = f"hicache-gone-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(create_bucket, moto_endpoint, bucket)
    keys = keys_for(24, salt=162)
    async with make_s3(moto_endpoint, bucket, "ns", NS_A, **FAST) as store:
        await asyncio.to_thread(_delete_bucket, moto_endpoint, bucket)
        caplog.set_level(logging.WARNING, logger="hicache")
        src = ArrayHostPool(len(keys), PAGE)
        store.register_mem_pool_host(src)
        for half in (keys[:12], keys[12:]):
            assert await store.batch_set_v1(half, src.indices(0, len(half))) == [False] * len(half)
        stats = store.get_stats()
        assert stats["permanent_errors"] >= len(keys)
    said = [r for r in caplog.records if r.name.startswith("hicache.storage.s3") and "write" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


# ---------------------------------------------------------------------- reads cut mid-body, clears refused per key


async def _stored_through(proxy: FaultProxy, bucket: str, prefix: str, keys: list[str], seed: int) -> Any:
    """A store reached through ``proxy`` (a breaker that never opens), holding ``keys``; to
    be entered again (``async with``) by the caller, which closes it."""
    store = make_s3(proxy.endpoint, bucket, prefix, NS_A, **{**FAST, "breaker_threshold": 100})
    await store.open()
    await write_pages(store, keys, seed=seed)
    await store.wait_index_writes()
    return store


async def test_a_body_cut_mid_way_leaves_no_unchecked_byte_in_the_pool(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """The header checked out, so the payload streamed straight into the pool page; the link
    then broke on every attempt and the miss left three quarters of a page of unchecked bytes
    there (a wipe covered only a finished read)."""
    from aiohttp import web

    keys = keys_for(3, salt=141)
    async with await _stored_through(proxy, moto_bucket, prefix, keys, seed=141) as store:

        async def cut(request: Any) -> Any:
            if request.method == "GET" and "/pages/" in request.path:
                data = await asyncio.to_thread(raw_get, proxy.upstream, request.path.lstrip("/"))
                resp = web.StreamResponse(status=206)
                resp.content_length = len(data)
                await resp.prepare(request)
                await resp.write(data[: len(data) * 3 // 4])
                request.transport.close()
                return resp
            return None

        proxy.answer = cut
        got, dst = await read_pages(store, keys)
        assert got == [False] * 3 and int(dst.buffer.count_nonzero()) == 0


async def test_a_clear_that_s3_refuses_per_key_says_so(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """DeleteObjects answers 200 with an error per key under load: the clear reported success,
    counted nothing, and every page was still there."""
    import re

    from aiohttp import web

    keys = keys_for(5, salt=142)
    async with await _stored_through(proxy, moto_bucket, prefix, keys, seed=142) as store:

        async def refuse(request: Any) -> Any:
            if request.method == "POST" and "delete" in request.query:
                names = re.findall(r"<Key>([^<]+)</Key>", (await request.read()).decode())
                errors = "".join(f"<Error><Key>{k}</Key><Code>InternalError</Code><Message>again</Message></Error>"
                                 for k in names)
                return web.Response(status=200, content_type="application/xml", text=(
                    '<?xml version="1.0" encoding="UTF-8"?>'
                    f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'))
            return None

        proxy.answer = refuse
        assert await store.clear() is False
        assert store.get_stats().get("backend_errors", 0) >= 1
        proxy.answer = None
        assert await store.clear() is True
        assert await store.exists_pages(keys) == [False] * 5


async def test_an_empty_page_round_trips(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """A stored zero-length value read into an empty target was deleted as corrupt, and read
    without a target raised from torch."""
    import torch

    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        assert await store.set("empty", torch.empty(0, dtype=torch.uint8))
        got = await store.get("empty")
        assert got is not None and got.numel() == 0
        got = await store.get("empty", torch.empty(0, dtype=torch.uint8))
        assert got is not None and got.numel() == 0
        assert await store.exists("empty") and store.get_stats().get("corrupt_pages", 0) == 0


async def test_a_close_with_reads_in_flight_leaves_no_client_behind(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """The in-flight reads failed when the client closed, retried, and built a new client for
    the loop that nobody closed ("Unclosed client session")."""
    keys = keys_for(4, salt=143)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, request_timeout=5, call_timeout=10)
    await store.open()
    await write_pages(store, keys, seed=143)
    await store.wait_index_writes()

    async def slow(request: Any) -> Any:
        if request.method == "GET" and "/pages/" in request.path:
            await asyncio.sleep(1.0)
        return None

    proxy.answer = slow
    reading = asyncio.create_task(read_pages(store, keys))
    await asyncio.sleep(0.3)
    await store.aclose()
    got, dst = await reading
    assert got == [False] * 4 and int(dst.buffer.count_nonzero()) == 0
    assert len(store._local) == 0  # no loop holds a client any more


async def test_a_close_during_a_read_opens_no_new_client(moto_endpoint: str, moto_bucket: str) -> None:
    """A server shutting down while a prefetch reads: the requests queued behind the ones in
    flight ran after the close and built a new S3 client nobody closed; the reads our own close
    cut were counted as transient errors (feeding the breaker)."""
    import gc
    import warnings

    async with FaultProxy(moto_endpoint) as proxy:
        async def slow(req):  # type: ignore[no-untyped-def]
            if req.method == "GET" and "/pages/" in req.path:
                await asyncio.sleep(0.3)
            return None

        store = make_s3(proxy.endpoint, moto_bucket, f"closeread/{uuid.uuid4().hex}", NS_A)
        keys = keys_for(64, salt=31)
        await store.open()
        await write_pages(store, keys, seed=1)
        proxy.answer = slow
        dst = ArrayHostPool(64, PAGE)
        store.register_mem_pool_host(dst)
        task = asyncio.create_task(store.batch_get_v1(keys, dst.indices(0, 64)))
        await asyncio.sleep(0.1)
        fs = store._local.get().ops.fs
        await store.aclose()
        await task  # misses, whatever landed
        assert fs._s3 is None  # no client built after the close
        stats = store.get_stats()
        assert not stats.get("transient_errors") and store.breaker.state.value == "closed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


async def test_a_clear_right_after_a_write_removes_its_run_index(moto_endpoint: str, moto_bucket: str) -> None:
    """The run index of a write that returned is written in the background; a clear right after
    it removed the pages, then the index landed and survived, vouching (once the exists cache
    expired) for pages this very process had cleared."""
    async with FaultProxy(moto_endpoint) as proxy:
        async def slow_index(req):  # type: ignore[no-untyped-def]
            if req.method == "PUT" and "/pages/runs/" in req.path:
                await asyncio.sleep(0.3)
            return None

        proxy.answer = slow_index
        store = make_s3(proxy.endpoint, moto_bucket, f"clearidx/{uuid.uuid4().hex}", NS_A, concurrency=4,
                        exists_cache_ttl=0.3)
        async with store:
            keys = keys_for(40, salt=61)
            src = await write_pages(store, keys, seed=1)  # its index PUT is still on its way
            assert await store.clear()
            await store.wait_index_writes()
            assert raw_get(moto_endpoint, store.names.run_index(keys[0], "kv")) is None
            assert await store.batch_set_v1(keys[:6], src.indices(0, 6)) == [True] * 6
            await store.wait_index_writes()
            await asyncio.sleep(0.4)  # the exists cache forgets: lookups read indexes again
            assert await store.exists_prefix(keys) == 6


async def test_a_big_eviction_gives_each_delete_request_its_own_timeout(
    moto_endpoint: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction of more pages than one DeleteObjects takes sent them all in one request,
    one timeout for every batch in turn: it timed out, was retried from scratch, opened the
    breaker, and reported nothing deleted although the first batches were. (Batches of 10
    keys here stand for S3's 1,000.)"""
    from hicache_backends.s3 import fs as s3_fs

    monkeypatch.setattr(s3_fs, "DELETE_BATCH", 10)
    async with FaultProxy(moto_endpoint) as proxy:
        async def slow_bulk_delete(req):  # type: ignore[no-untyped-def]
            if req.method == "POST" and "delete" in req.query:
                await asyncio.sleep(0.4)
            return None

        store = make_s3(proxy.endpoint, moto_bucket, f"bigdel/{uuid.uuid4().hex}", NS_A, request_timeout=1.0,
                        retries=1)
        async with store:
            keys = keys_for(40, salt=77)
            await write_pages(store, keys, seed=3)
            proxy.answer = slow_bulk_delete
            assert await store.batch_delete(keys) == [True] * 40
            stats = store.get_stats()
            assert not stats.get("timeouts") and store.breaker.state.value == "closed"
            proxy.answer = None
            assert await store.exists_pages(keys) == [False] * 40


async def test_a_delete_answers_within_the_call_timeout(
    moto_endpoint: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeleteObjects the store never answers: each attempt had its own request timeout and
    was retried, so a batch_delete ran (retries + 1) x request_timeout past its HEADs, far
    beyond ``call_timeout``. Now the whole call answers within it: the requests that answered
    count, the stalled one's pages are reported not deleted, and the timeout is counted.
    (Batches of 10 keys here stand for S3's 1,000.)"""
    import time

    from aiohttp import web

    from hicache_backends.s3 import fs as s3_fs

    monkeypatch.setattr(s3_fs, "DELETE_BATCH", 10)
    release = asyncio.Event()
    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, f"stalldel/{uuid.uuid4().hex}", NS_A, request_timeout=0.8,
                        retries=3, retry_backoff=0.01, retry_backoff_max=0.05, call_timeout=1.0, breaker_threshold=10)
        async with store:
            keys = keys_for(20, salt=78)
            await write_pages(store, keys, seed=5)
            victim = store.names.page(keys[15], "kv").split("/", 1)[1].encode()

            async def stall_second_batch(req):  # type: ignore[no-untyped-def]
                if req.method == "POST" and "delete" in req.query and victim in await req.read():
                    await release.wait()  # never forwarded: the pages stay
                    return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
                return None

            proxy.answer = stall_second_batch
            try:
                t0 = time.monotonic()
                flags = await store.batch_delete(keys)
                took = time.monotonic() - t0
            finally:
                release.set()
            assert took < 2.0  # 4 attempts of 0.8 s each before
            assert flags == [True] * 10 + [False] * 10
            assert store.get_stats()["call_timeouts"] == 1
            assert raw_get(moto_endpoint, store.names.page(keys[0], "kv")) is None
            assert raw_get(moto_endpoint, store.names.page(keys[15], "kv")) is not None


async def test_a_refusal_repeated_for_every_page_is_one_warning(
    moto_endpoint: str, moto_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader without ``s3:ListBucket`` gets 403 for every missing key: each was one WARNING
    line (2,560 for ten lookups of a 256-page prompt); now one line says how many it stands
    for, and the count is still exact."""
    import logging

    from aiohttp import web

    async with FaultProxy(moto_endpoint) as proxy:
        async def no_list(req):  # type: ignore[no-untyped-def]
            if req.method in ("HEAD", "GET") and "/pages/" in req.path:
                return web.Response(status=403, body=b"" if req.method == "HEAD" else
                                    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
            return None

        proxy.answer = no_list
        store = make_s3(proxy.endpoint, moto_bucket, f"nolist/{uuid.uuid4().hex}", NS_A)
        async with store:
            keys = keys_for(64, salt=7)
            with caplog.at_level(logging.WARNING, logger="hicache"):
                for _ in range(5):
                    assert await store.exists_pages(keys) == [False] * 64
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING and "failed" in r.getMessage()]
            assert len(lines) == 1
            assert store.get_stats()["permanent_errors"] == 5 * 64
            assert store.breaker.state.value == "closed"


async def test_a_read_only_store_is_not_asked_for_its_manifest_every_few_seconds(
    moto_endpoint: str, moto_bucket: str
) -> None:
    """A read-only principal (the manifest PUT answered 403) was asked again at every probe
    tick, a warning each time, forever; a refusal now waits for the manifest check interval."""
    from aiohttp import web

    async with FaultProxy(moto_endpoint) as proxy:
        async def read_only(req):  # type: ignore[no-untyped-def]
            if req.method == "PUT":
                return web.Response(status=403, body=b"<Error><Code>AccessDenied</Code>"
                                                     b"<Message>Access Denied</Message></Error>")
            return None

        proxy.answer = read_only
        store = make_s3(proxy.endpoint, moto_bucket, f"readonly/{uuid.uuid4().hex}", NS_A, breaker_cooldown=0.2,
                        manifest_check_interval=60.0)
        async with store:
            await asyncio.sleep(1.0)  # ten probe ticks
            assert store.get_stats()["manifest_errors"] == 1


async def test_region_caching_clients_are_all_closed(
    moto_endpoint: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With s3fs's region caching (on AWS with no endpoint given: here the endpoint comes from
    ``AWS_ENDPOINT_URL``), the per-region clients the page requests use were never closed."""
    import gc
    import warnings

    from hicache.storage import create_async_storage
    from s3_server import TEST_KEY, TEST_SECRET

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    store = create_async_storage("s3", None, url=f"s3://{moto_bucket}/regions/{uuid.uuid4().hex}",
                                 storage_options={"key": TEST_KEY, "secret": TEST_SECRET, "cache_regions": True},
                                 namespace=NS_A)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with store:
            await write_pages(store, keys_for(4, salt=71), seed=2)
            fs = store._local.get().ops.fs
            assert fs.cache_regions and getattr(fs._s3creator, "_regions", None)
        del store, fs
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


async def test_a_prefix_lookup_answers_within_the_call_timeout(moto_endpoint: str, moto_bucket: str) -> None:
    """A slow but healthy store: each wave of a prefix lookup had its own ``call_timeout``, so
    a long prompt's lookup took waves x timeout; now the whole lookup answers within it, with
    the run confirmed so far."""
    import time

    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, f"slowlookup/{uuid.uuid4().hex}", NS_A, concurrency=4,
                        call_timeout=30.0, exists_cache_size=0)
        async with store:
            keys = keys_for(72, salt=91)  # 24 waves of 3 HEADs, a quarter second each: 6 s by waves
            await write_pages(store, keys, seed=4)  # unhurried: a loaded machine's writes took over 1 s
            await store.wait_index_writes()
            store.call_timeout = 1.0  # the lookup's bound (read at each call)

            from aiohttp import web

            async def slow(req):  # type: ignore[no-untyped-def]
                if "/pages/runs/" in req.path:  # no run index: the lookup goes by HEADs, in waves
                    return web.Response(status=404, body=b"<Error><Code>NoSuchKey</Code></Error>")
                if req.method in ("HEAD", "GET"):
                    await asyncio.sleep(0.25)
                return None

            proxy.answer = slow
            t0 = time.monotonic()
            found = await store.exists_prefix(keys)
            took = time.monotonic() - t0
            assert took < 3.0 and 0 <= found < 72
            assert store.get_stats()["call_timeouts"] >= 1


async def test_a_clear_racing_a_close_is_not_an_error_of_the_endpoint(
    moto_endpoint: str, moto_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A clear in flight when the store closed: the close shut the client under its listing,
    and the clear was logged at ERROR as 'Could not connect to the endpoint', the namespace
    half cleared (found by a concurrency fuzzer, with no fault injected). The close waits for it."""
    prefix = f"fuzz/{uuid.uuid4().hex}"
    async with FaultProxy(moto_endpoint) as proxy:
        store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A)
        await store.open()
        keys = keys_for(4, salt=7)
        src = ArrayHostPool(4, PAGE)
        src.fill_random(7)
        store.register_mem_pool_host(src)
        assert await store.batch_set_v1(keys, src.indices(0, 4)) == [True] * 4
        await store.wait_index_writes()

        async def slow_list(req):  # type: ignore[no-untyped-def]
            if req.method == "GET" and "list-type" in req.query_string:
                await asyncio.sleep(0.5)
            return None

        proxy.answer = slow_list
        caplog.set_level(logging.WARNING)
        clearing = asyncio.create_task(store.clear())
        await asyncio.sleep(0.15)
        await store.aclose()
        cleared = await clearing
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        left = raw_client(moto_endpoint).list_objects_v2(Bucket=moto_bucket, Prefix=f"{prefix}/{NS_A.digest}/pages/")
        assert not errors, [r.getMessage() for r in errors]
        assert cleared is True and left.get("KeyCount") == 0



def slow_page_puts(delay: float, *, runs_too: bool = True) -> Callable[[Any], Awaitable[None]]:
    """A proxy answer that holds each page PUT (a run object's too, unless not ``runs_too``)
    ``delay`` seconds before it reaches the server: writes a close finds in progress."""
    async def slow_put(request: Any) -> None:
        if request.method == "PUT" and "/pages/" in request.path and (runs_too or "/runs/" not in request.path):
            await asyncio.sleep(delay)

    return slow_put


async def writing_slowly(
    proxy: FaultProxy, bucket: str, prefix: str, pages: int, *, salt: int, concurrency: int, put_delay: float,
    runs_too: bool = True,
) -> tuple[Any, list[str], asyncio.Task[list[bool]]]:
    """An open S3 store (through ``proxy``) with a write batch of ``pages`` pages in progress on
    this loop, each page PUT held ``put_delay`` seconds: (store, keys, the batch's task)."""
    keys = keys_for(pages, salt=salt)
    store = make_s3(proxy.endpoint, bucket, prefix, NS_A, concurrency=concurrency, call_timeout=10)
    await store.open()
    src = ArrayHostPool(len(keys), PAGE)
    src.fill_random(salt)
    store.register_mem_pool_host(src)
    proxy.answer = slow_page_puts(put_delay, runs_too=runs_too)
    return store, keys, asyncio.create_task(store.batch_set_v1(keys, src.indices(0, len(keys))))

async def test_a_close_lets_the_writes_in_progress_finish(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """A server shutting down after its last write-back: the close cut the write batch at once,
    the pages waiting for a slot were dropped and those whose PUT had landed were reported as
    failed, and nothing was logged. The close waits for the writes (as for a clear)."""
    store, keys, writing = await writing_slowly(proxy, moto_bucket, prefix, 16, salt=181, concurrency=4, put_delay=0.2, runs_too=False)  # four rounds of PUTs
    await asyncio.sleep(0.1)
    await store.aclose()
    assert writing.done() and writing.result() == [True] * len(keys)
    stats = store.get_stats()
    assert stats["write_ok"] == len(keys) and not stats.get("close_cut_write_pages")
    pages = raw_client(moto_endpoint).list_objects_v2(Bucket=moto_bucket, Prefix=f"{prefix}/{NS_A.digest}/pages/")
    assert sum("/runs/" not in o["Key"] for o in pages.get("Contents", [])) == len(keys)


async def test_a_close_cancelled_while_it_waits_for_writes_still_releases_the_store(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """A shutdown that gives the close less time than the writes in progress need (``wait_for``
    on ``aclose``) cancelled it while it waited: the store was marked closed, so no later close
    did anything, yet its prober went on probing the bucket and its client stayed open for good.
    A cancelled close stops waiting and still releases them."""
    store, keys, writing = await writing_slowly(proxy, moto_bucket, prefix, 8, salt=193, concurrency=2, put_delay=0.5)
    await asyncio.sleep(0.1)
    prober = store._prober
    assert prober is not None
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.aclose(), 0.2)
    await asyncio.wait_for(asyncio.gather(writing, return_exceptions=True), 10)
    assert prober.done() and store.runner.closed
    assert len(store._local) == 0  # every loop's client closed
    await store.aclose()  # (nothing left to do)


async def test_a_second_close_waits_for_the_first(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """Two closes at once (a shutdown handler and an ``async with`` exit): the second returned
    at once, while the first still waited for the writes in progress, and its caller went on
    (exited, checked the bucket) with the store's clients open and its writes unfinished. Every
    close returns once the store is closed."""
    store, keys, writing = await writing_slowly(proxy, moto_bucket, prefix, 4, salt=195, concurrency=2, put_delay=0.3)
    await asyncio.sleep(0.1)
    first = asyncio.create_task(store.aclose())
    await asyncio.sleep(0)  # the first close is waiting for the writes
    await store.aclose()
    assert writing.done() and writing.result() == [True] * len(keys)
    assert store.runner.closed and len(store._local) == 0  # every client closed
    await first


def _write_on_another_loop(store: Any, keys: list[str], *, seed: int) -> tuple[Any, list[list[bool]]]:
    """Start a batch write of random pages under ``keys`` on a thread's own event loop (the
    blocking facade's way), which a close on the test's loop cannot wait for; the thread and
    the list its answer lands in."""
    import threading

    src = ArrayHostPool(len(keys), PAGE)
    src.fill_random(seed)
    store.register_mem_pool_host(src)
    answered: list[list[bool]] = []
    thread = threading.Thread(target=lambda: answered.append(
        asyncio.run(store.batch_set_v1(keys, src.indices(0, len(keys))))))
    thread.start()
    return thread, answered


def _multipart_on_another_loop(store: Any) -> tuple[Any, list[bool]]:
    """Start a 12 MiB tensor's ``set`` (a multipart upload of three parts) on a thread's own
    event loop; the thread and the list its answer lands in."""
    import threading

    import torch

    big = torch.rand(3 << 20)  # 12 MiB: three parts
    answered: list[bool] = []
    thread = threading.Thread(target=lambda: answered.append(asyncio.run(store.set("big", big))))
    thread.start()
    return thread, answered


async def test_writes_a_close_cannot_wait_for_are_counted_and_logged(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A write on another event loop (the blocking facade's) cannot be waited for by a close on
    this one: it is cut, and the close says so - a warning and ``close_cut_write_pages`` - rather
    than leaving failed pages nobody can explain."""
    keys = keys_for(8, salt=191)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, concurrency=2, call_timeout=10)
    await store.open()
    proxy.answer = slow_page_puts(0.5)
    thread, answered = _write_on_another_loop(store, keys, seed=191)
    try:
        async def putting() -> bool:  # the other loop's batch is uploading
            return any(method == "PUT" and "/pages/" in path for method, path, _ in proxy.seen)

        await eventually(putting)
        caplog.set_level(logging.WARNING, logger="hicache")
        await store.aclose()
    finally:
        await asyncio.to_thread(thread.join, 20)
    assert store.get_stats()["close_cut_write_pages"] == len(keys)
    assert any("still running" in r.getMessage() for r in caplog.records)
    assert answered and False in answered[0]


async def test_a_close_counts_only_the_pages_it_cut(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """A close cutting a write batch on another event loop counted every page of the batch in
    ``close_cut_write_pages`` (and its warning), the pages already stored and answered written
    too: the counter said more pages were lost than the batch answered failed. It counts the
    pages still being written."""
    keys = keys_for(16, salt=192)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, concurrency=2, call_timeout=10)
    await store.open()
    proxy.answer = slow_page_puts(0.2)
    thread, answered = _write_on_another_loop(store, keys, seed=192)
    try:
        async def some_stored() -> bool:  # the other loop's batch has stored a few pages
            return sum(method == "PUT" and "/pages/" in path for method, path, _ in proxy.served) >= 4

        await eventually(some_stored)
        await store.aclose()
    finally:
        await asyncio.to_thread(thread.join, 20)
    assert answered and 0 < answered[0].count(False) < len(keys)
    assert store.get_stats()["close_cut_write_pages"] == answered[0].count(False)


async def test_a_multipart_upload_cut_short_is_aborted(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page big enough to go as a multipart upload (from twice the part size: 100 MiB by
    default, 10 MiB here) whose upload timed out part-way: the parts already sent stayed in the
    bucket for good, listed by no listing and billed until a lifecycle rule aborts them (s3fs
    aborts an upload that fails, not one that is cancelled). It is aborted now."""
    import torch

    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part
    release = asyncio.Event()

    async def stall_second_part(request: Any) -> Any:
        if request.method == "PUT" and request.query.get("partNumber") == "2":
            await release.wait()  # the attempt times out meanwhile
        return None

    proxy.answer = stall_second_part
    client = raw_client(moto_endpoint)
    try:
        async with make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, **FAST) as store:
            big = torch.rand(3 << 20)  # 12 MiB: three parts
            assert await store.set("big", big) is False
            assert store.get_stats()["timeouts"] >= 1

            async def no_upload_left() -> bool:
                out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
                return not out.get("Uploads")

            await eventually(no_upload_left, timeout=5.0)
        release.set()
        async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:  # (the multipart path works)
            assert await store.set("big", big) is True
            got = await store.get("big", torch.empty(3 << 20))
            assert got is not None and torch.equal(got, big)
            assert await no_upload_left()
    finally:
        release.set()


async def test_a_close_aborts_the_multipart_uploads_it_cuts(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A big page uploading in parts on another event loop (the blocking facade's) when the
    store closes: the close cut its client, the upload's own abort was refused as "cut by a
    close", and the upload stayed in the bucket for good (billed, listed by no listing). The
    close aborts every multipart upload it cuts before the client goes, and the page is
    counted and answered as not written."""
    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part
    release = asyncio.Event()

    async def stall_second_part(request: Any) -> Any:
        if request.method == "PUT" and request.query.get("partNumber") == "2":
            await release.wait()  # never answered before the close
        return None

    proxy.answer = stall_second_part
    client = raw_client(moto_endpoint)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, request_timeout=30.0, call_timeout=30.0)
    await store.open()
    thread, answered = _multipart_on_another_loop(store)
    try:
        async def uploading() -> bool:
            out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
            return bool(out.get("Uploads"))

        await eventually(uploading)
        await asyncio.sleep(0.3)  # its parts are on their way
        caplog.set_level(logging.WARNING, logger="hicache")
        await store.aclose()
        out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
        assert not out.get("Uploads"), out.get("Uploads")
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 20)
    assert answered == [False]
    assert store.get_stats()["close_cut_write_pages"] == 1
    assert not any("not aborted" in r.getMessage() for r in caplog.records)


async def test_a_close_aborts_a_multipart_upload_still_being_begun(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close cuts a big page's upload while the service is still answering the request that
    begins it: the upload the service then began was never known here, so never aborted, and
    stayed in the bucket for good. The close waits for that answer (within the abort's own
    timeout) and aborts the upload."""
    import threading

    import torch

    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part

    async def slow_create(request: Any) -> Any:
        if request.method == "POST" and "uploads" in request.query:
            await asyncio.sleep(1.0)  # the close comes meanwhile; then the service begins it
        return None

    proxy.answer = slow_create
    client = raw_client(moto_endpoint)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, request_timeout=30.0, call_timeout=30.0)
    await store.open()
    answered: list[bool] = []
    thread = threading.Thread(target=lambda: answered.append(asyncio.run(store.set("big", torch.rand(3 << 20)))))
    thread.start()
    try:
        async def beginning() -> bool:
            return any(method == "POST" for method, _, _ in proxy.seen)

        await eventually(beginning)
        await store.aclose()
        await asyncio.sleep(1.5)  # the service has begun it by now
        out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
        assert not out.get("Uploads"), out.get("Uploads")
    finally:
        await asyncio.to_thread(thread.join, 20)
    assert answered == [False]


def _abort_uploads_left(client: Any, bucket: str, prefix: str) -> None:
    """Abort the multipart uploads under ``prefix`` that a close reported it left (one may be
    aborted meanwhile: its own abort, let through at last)."""
    import contextlib

    for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
        with contextlib.suppress(client.exceptions.NoSuchUpload):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


async def test_a_close_given_a_deadline_ends_by_it_and_reports_what_it_left(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store used from two event loops (the server's and the blocking facade's) on a slow
    service: writes stalled on this loop, a big page uploading in parts on the other, and
    aborts that take longer than the shutdown has. Its close waited for the writes
    (``call_timeout``), then the aborts (10 s), then the other loop (15 s): well past a
    server's 20 s drain. Given what is left of the caller's budget (``aclose(timeout)``), it
    ends by then and says what it left: the page writes cut, the upload not aborted."""
    import time

    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part
    release = asyncio.Event()

    async def slow_service(request: Any) -> Any:
        if request.method == "PUT" and (request.query.get("partNumber") == "2" or "/pages/" in request.path):
            await release.wait()  # a part, a page: not answered before the close
        if request.method == "DELETE" and "uploadId" in request.query:
            await release.wait()  # an abort: slower than the shutdown
        return None

    proxy.answer = slow_service
    client = raw_client(moto_endpoint)
    store = make_s3(proxy.endpoint, moto_bucket, prefix, NS_A, request_timeout=30.0, call_timeout=30.0)
    await store.open()
    thread, answered = _multipart_on_another_loop(store)
    keys = keys_for(4, salt=194)
    src = ArrayHostPool(len(keys), PAGE)
    src.fill_random(194)
    store.register_mem_pool_host(src)
    writing = asyncio.create_task(store.batch_set_v1(keys, src.indices(0, len(keys))))
    try:
        async def both_sending() -> bool:
            out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
            return bool(out.get("Uploads")) and any(
                method == "PUT" and "/pages/" in path and "uploadId" not in path for method, path, _ in proxy.seen)

        await eventually(both_sending)
        caplog.set_level(logging.WARNING, logger="hicache")
        started = time.monotonic()
        await store.aclose(timeout=3.0)
        took = time.monotonic() - started
        assert took < 3.0 + 2.0, took  # (its own bounds: 30 s for the writes alone)
        stats = store.get_stats()
        assert stats["close_uploads_not_aborted"] == 1
        report = [r.getMessage() for r in caplog.records if "leaving" in r.getMessage()]
        assert report and "5 page write(s) cut, 1 multipart upload(s) not aborted" in report[0], report  # (4 + the big one)
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 30)
        await asyncio.gather(writing, return_exceptions=True)
        await asyncio.to_thread(_abort_uploads_left, client, moto_bucket, prefix)
    assert answered == [False] and writing.result() == [False] * len(keys)


async def test_a_cache_close_hands_the_store_the_time_it_waits_for_its_close(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cache's close waits for its store's close ``close_timeout_s`` (at least 1 s), then
    stops the storage I/O loop under it. An S3 store whose uploads hung on a slow service spent
    that time waiting for them (its ``call_timeout``), so its close was abandoned mid-way: the
    close returned with the store's client open and its uploads neither aborted nor reported.
    The store is handed the time the close waits for it: it ends by then, closes its client,
    and says what it left."""
    from hicache.controller import ControllerConfig
    from hicache.replay import StackConfig, build_stack, serve_request
    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 256)  # a 1 KiB page: four parts
    release = asyncio.Event()

    async def slow_service(request: Any) -> Any:
        if (request.method == "PUT" and "/pages/" in request.path) or (
                request.method == "DELETE" and "uploadId" in request.query):
            await release.wait()  # a part, an abort: not answered before the close
        return None

    cfg = StackConfig(storage_backend="s3", storage_options={
        "url": f"s3://{moto_bucket}/{prefix}", "storage_options": s3_options(proxy.endpoint),
        "request_timeout": 60.0, "call_timeout": 60.0}, controller=ControllerConfig(close_timeout_s=1.0))
    stack = build_stack(cfg)
    try:
        await stack.controller.open_storage()
        store = stack.storage
        proxy.answer = slow_service
        await serve_request(stack, list(range(256)), rid="a")

        async def uploading() -> bool:  # an upload begun (a POST), its parts on their way
            seen = [method for method, path, _ in proxy.seen if "/pages/" in path]
            return "POST" in seen and "PUT" in seen

        await eventually(uploading)
        client = next(iter(store._local._values.values())).ops.fs._s3  # the I/O loop's
        caplog.set_level(logging.WARNING, logger="hicache")
        report = await asyncio.wait_for(stack.aclose(), 30)
        assert not report.drained
        assert client._endpoint.http_session._sessions is None  # closed, not abandoned
        assert any("multipart upload(s) not aborted" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        await asyncio.to_thread(_abort_uploads_left, raw_client(moto_endpoint), moto_bucket, prefix)


#: ``hicache`` (the CLI) whose pages go to S3 as multipart uploads (parts of 1 KiB: moto checks
#: a part's size only when the upload completes), with the engine's ``generate`` hanging for
#: the request id ``hang`` (a request that outlasts any drain); says when its drain ended
SERVE_S3_WITH_A_HANG = """
import asyncio, sys, time
from hicache.engine.runner import Engine
from hicache_backends.s3.fs import S3ObjectOps
S3ObjectOps.part_size = 1024
generate = Engine.generate
async def hanging(self, rid, *args, **kwargs):
    if rid == "hang":
        await asyncio.Event().wait()
    return await generate(self, rid, *args, **kwargs)
Engine.generate = hanging
from hicache.cli import main
code = main(sys.argv[1:])
print(f"drained at {time.monotonic()}", file=sys.stderr, flush=True)
sys.exit(code)
"""


async def test_a_server_drain_with_a_slow_store_ends_within_its_budget_and_says_what_the_store_left(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    """SIGTERM to a server whose S3 store is slow: its pages' uploads hang, and so do their
    aborts. The requests took half the drain's budget, the cache's close a quarter, and then
    the wait for its workers (stuck aborting the uploads), the store's close and the I/O
    thread's stop a quarter each: the drain ran past its budget, into a container's SIGKILL,
    and the store's close was abandoned without a word of the uploads it left. The close is
    handed the drain's deadline: it ends by it, and the store says what it left."""
    import json
    import signal
    import sys
    import time

    import aiohttp

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "server"))
    from server_helpers import small_config

    release = asyncio.Event()

    async def slow_service(request: Any) -> Any:
        if (request.method == "PUT" and "/pages/" in request.path) or (
                request.method == "DELETE" and "uploadId" in request.query):
            await release.wait()  # a page, a part, an abort: not answered within the drain
        return None

    budget = 8.0
    cfg = small_config().model_dump(mode="json")
    cfg["storage"] = {"backend": "s3", "options": {
        "url": f"s3://{moto_bucket}/{prefix}", "storage_options": s3_options(proxy.endpoint),
        "request_timeout": 60.0, "call_timeout": 60.0}}
    config_file = tmp_path / "server.json"
    config_file.write_text(json.dumps(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVE_S3_WITH_A_HANG, "--log-level", "INFO", "serve", "-c", str(config_file),
        "--shutdown-timeout", str(budget), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert "hicache server on http://" in line, line + (await proc.stderr.read()).decode()
        url = line.split(" on ", 1)[1].split()[0]
        proxy.answer = slow_service
        async with aiohttp.ClientSession() as http:
            for n in range(3):  # their pages go to the store, and hang there
                async with http.post(f"{url}/v1/generate", json={"tokens": list(range(n * 70, n * 70 + 64)),
                                                                  "max_new_tokens": 2}) as resp:
                    assert resp.status == 200, await resp.text()

            async def uploading() -> bool:  # an upload begun (a POST), its parts on their way
                seen = [method for method, path, _ in proxy.seen if "/pages/" in path]
                return "POST" in seen and "PUT" in seen

            await eventually(uploading, timeout=30)
            request = asyncio.create_task(http.post(f"{url}/v1/generate", json={"tokens": [1, 2, 3], "rid": "hang"}))
            for _ in range(400):
                async with http.get(f"{url}/health") as resp:
                    if (await resp.json())["active"] == 1:
                        break
                await asyncio.sleep(0.05)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            stderr = (await asyncio.wait_for(proc.stderr.read(), 120)).decode()
            (await request).release()
        assert await asyncio.wait_for(proc.wait(), 60) == 0, stderr
        drained = float(stderr.rsplit("drained at ", 1)[1].split()[0])
        # room for a loaded 2-core machine; the old drain overran into the log line's absence below
        assert drained - sent < budget + 3.0, (drained - sent, stderr)  # (it was 1.25 times the budget)
        assert "cache closed: close: drained=False" in stderr, stderr
        assert "multipart upload(s) not aborted" in stderr, stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        release.set()
        await asyncio.to_thread(_abort_uploads_left, raw_client(moto_endpoint), moto_bucket, prefix)


async def test_verifying_a_page_does_not_download_a_huge_foreign_object(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy
) -> None:
    """``verify_page`` (``hicache inspect``) of a page whose name holds a foreign object (24 MiB
    of something else) downloaded it whole, held it in memory and hashed it. The first bytes
    are read first now: an object that is no page, bigger than the store reads whole to prove
    damage at rest (lowered to 1 MiB here; 100 MiB by default), costs those (4 KiB)."""
    import torch

    from hicache.storage import PageKey

    keys = keys_for(2, salt=151)
    async with make_s3(proxy.endpoint, moto_bucket, prefix, NS_A) as store:
        store.verify_whole_max = 1 << 20
        await write_pages(store, keys, seed=151)
        assert await store.verify_page(PageKey(keys[1], "kv")) is True  # a good page still verifies
        path = store.names.page(keys[0], "kv")
        await asyncio.to_thread(raw_put, moto_endpoint, path, b"\x5a" * (24 << 20))
        proxy.served.clear()
        assert await store.verify_page(PageKey(keys[0], "kv")) is False
        got = [n for method, p, n in proxy.served if method == "GET" and p.endswith(path.split("/", 1)[1])]
        assert got and sum(got) <= 4096
        # a page bigger than those first bytes is read whole (in two ranges), and checked whole
        big = torch.rand(8192)
        assert await store.set("big", big) is True
        back = await store.get("big")
        assert back is not None and bytes(back.numpy()) == bytes(big.numpy())
        stored = await asyncio.to_thread(raw_get, moto_endpoint, store.names.page("big", "kv"))
        await asyncio.to_thread(raw_put, moto_endpoint, store.names.page("big", "kv"), stored + b"+")
        assert await store.get("big") is None  # trailing bytes: a wrong length


@pytest.mark.parametrize("damage", ["header", "trailing"])
async def test_a_page_damaged_at_rest_outside_its_payload_is_deleted_by_verify_page(
    moto_endpoint: str, moto_bucket: str, prefix: str, damage: str
) -> None:
    """``verify_page`` reads a page in ranges (the header first), and a page whose header is
    damaged, or that has bytes after it, failed verification on a part of the object: the
    proof of damage at rest (the whole object's MD5 against its ETag) could not pass, so the
    page was kept and counted damaged in transit at every inspect (the sized read deletes it).
    The rest of such an object, up to ``verify_whole_max``, is read for the proof now."""
    import torch

    from hicache.storage import PageKey

    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        assert await store.set("p", torch.rand(8192)) is True
        path = store.names.page("p", "kv")
        stored = await asyncio.to_thread(raw_get, moto_endpoint, path)
        bad = (bytes([stored[0] ^ 0xFF]) + stored[1:]) if damage == "header" else stored + b"x" * 40
        await asyncio.to_thread(raw_put, moto_endpoint, path, bad)
        assert await store.verify_page(PageKey("p", "kv")) is False
        stats = store.get_stats()
        assert stats["corrupt_pages"] == 1 and stats.get("transit_errors", 0) == 0, stats
        assert await asyncio.to_thread(raw_get, moto_endpoint, path) is None  # deleted


async def test_a_multipart_upload_on_a_slow_link_gets_request_timeout_per_request(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big page's multipart upload (create, each part, complete: 5 requests here, 0.5 s
    each) was bounded by ``request_timeout`` as a whole: on a link where every request fits
    well within it, the page never got written, every attempt counted as a timeout and a
    transient error, and enough of them opened the circuit breaker. Each request gets
    ``request_timeout`` now; a part that hangs still fails the write in about that time."""
    import time

    import torch

    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part
    hang = asyncio.Event()
    release = asyncio.Event()

    async def slow_link(request: Any) -> Any:
        if request.method in ("POST", "PUT") and "/pages/" in request.path:
            await asyncio.sleep(0.5)
            if hang.is_set() and request.query.get("partNumber") == "2":
                await release.wait()
        return None

    proxy.answer = slow_link
    options = dict(FAST, request_timeout=2.0, call_timeout=30.0, breaker_threshold=3)
    try:
        store = create_async_storage(  # parts one after another (max_concurrency 1)
            "s3", None, url=f"s3://{moto_bucket}/{prefix}", namespace=NS_A, **options,
            storage_options={**s3_options(proxy.endpoint), "session": shared_session(), "max_concurrency": 1})
        async with store:
            big = torch.rand(3 << 20)  # 12 MiB: three parts
            assert await store.set("big", big) is True
            stats = store.get_stats()
            assert stats.get("timeouts", 0) == 0 and stats.get("transient_errors", 0) == 0
            got = await store.get("big", torch.empty(3 << 20))
            assert got is not None and torch.equal(got, big)

            hang.set()  # a part that never answers: the write fails, bounded by the part's timeout
            t0 = time.monotonic()
            assert await store.set("big2", big) is False
            assert time.monotonic() - t0 < 15.0
            assert store.get_stats()["timeouts"] >= 1
    finally:
        release.set()


async def test_a_multipart_upload_begun_after_its_request_timed_out_is_aborted(
    moto_endpoint: str, moto_bucket: str, prefix: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request that begins a multipart upload has its own timeout now: the service may
    still begin the upload after it, and that upload is aborted, not left in the bucket. (The
    socket's read timeout is set longer here: when it ends the request first, the upload the
    service begins after is never known, so never aborted.)"""
    import torch

    from hicache_backends.s3.fs import S3ObjectOps

    monkeypatch.setattr(S3ObjectOps, "part_size", 5 << 20)  # S3's smallest part

    async def slow_create(request: Any) -> Any:
        if request.method == "POST" and "uploads" in request.query:
            await asyncio.sleep(1.5)  # past request_timeout; then the service begins it
        return None

    proxy.answer = slow_create
    client = raw_client(moto_endpoint)
    options = dict(FAST, request_timeout=1.0, call_timeout=30.0, retries=0)
    store = create_async_storage(
        "s3", None, url=f"s3://{moto_bucket}/{prefix}", namespace=NS_A, **options,
        storage_options={**s3_options(proxy.endpoint), "session": shared_session(),
                         "config_kwargs": {"read_timeout": 10.0}})
    async with store:
        assert await store.set("big", torch.rand(3 << 20)) is False
        assert store.get_stats()["timeouts"] == 1

        async def no_upload_left() -> bool:
            out = await asyncio.to_thread(client.list_multipart_uploads, Bucket=moto_bucket, Prefix=prefix)
            return not out.get("Uploads")

        await asyncio.sleep(1.0)  # the service has begun it by now
        await eventually(no_upload_left, timeout=5.0)
