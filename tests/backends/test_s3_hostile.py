"""The ``s3`` backend against a hostile link and a bucket that goes away: moto's server, reached
through a fault-injecting HTTP proxy (:mod:`s3_proxy`) where a test needs one. Each test failed
before its fix (issue 14, items 5-7)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from s3_proxy import FaultProxy
from s3_server import create_bucket, eventually, make_s3, raw_client, raw_get, raw_put

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
