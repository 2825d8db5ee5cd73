"""The ``s3`` backend against a moto S3 server on loopback: the conformance suite, checked
against the bucket through plain botocore, plus what only an object store has - two processes
sharing a bucket, ranged single-GET reads, the existence cache, corrupt objects, secrets."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.keys import Namespace
from hicache.storage import AsyncHiCacheStorage, PageCodec, create_async_storage
from hicache.testing import ArrayHostPool, StoreTests
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from s3_server import TEST_KEY, TEST_SECRET, make_s3, raw_client, raw_get, raw_put, s3_options, shared_session

REPO = Path(__file__).resolve().parents[2]


class TestS3Store(StoreTests):
    @pytest.fixture
    def store_factory(self, moto_endpoint: str, moto_bucket: str):
        prefix = f"conformance/{uuid.uuid4().hex}"

        def make(namespace: Any = None) -> AsyncHiCacheStorage:
            return make_s3(moto_endpoint, moto_bucket, prefix, namespace)

        self.endpoint = moto_endpoint
        return make

    async def raw_payload(self, store: Any, key: str, pool: str = "kv") -> bytes | None:
        """The payload in the bucket, read with plain botocore (not through the store)."""
        data = await asyncio.to_thread(raw_get, self.endpoint, store.names.page(key, pool))
        if data is None:
            return None
        header = PageCodec.parse(data)
        assert header is not None and header.key == key and header.pool == pool
        return data[header.header_len :]


# ---------------------------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex}"


async def _write_pages(store: AsyncHiCacheStorage, keys: list[str], seed: int = 1) -> ArrayHostPool:
    src = ArrayHostPool(len(keys), PAGE)
    src.fill_random(seed)
    store.register_mem_pool_host(src)
    assert await store.batch_set_v1(keys, src.indices(0, len(keys))) == [True] * len(keys)
    await store.wait_index_writes()  # its run index is stored in the background
    return src


async def test_layout_manifest_and_hashed_names(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    keys = ["../../escape", "plain"]
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        await _write_pages(store, keys)
        names = store.names
        assert names.namespace_dir == f"{moto_bucket}/{prefix}/{NS_A.digest}"
        manifest = raw_get(moto_endpoint, names.manifest)
        assert manifest is not None and json.loads(manifest) == NS_A.to_dict()
        for k in keys:
            path = names.page(k, "kv")
            assert path.startswith(names.pages_dir + "/") and k not in path
            assert raw_get(moto_endpoint, path) is not None


async def test_a_prefix_with_a_leading_slash_is_the_prefix_without_it(
    moto_endpoint: str, moto_bucket: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``s3://bucket//lead`` (``f"s3://{bucket}/{prefix}"`` with ``prefix="/lead"``): s3fs wrote
    its pages under the key ``/lead/...`` but listed ``lead/...``, so its clear deleted the pages
    of the store at ``s3://bucket/lead`` and kept its own, and said it had cleared. The leading
    slash is dropped (with a warning): both urls are one store, and its clear removes its pages."""
    keys = keys_for(4, salt=171)
    caplog.set_level(logging.WARNING, logger="hicache")
    slashed = make_s3(moto_endpoint, moto_bucket, "/" + prefix, NS_A)
    assert slashed.root == f"{moto_bucket}/{prefix}" and "leading '/'" in caplog.text
    async with slashed, make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as plain:
        await _write_pages(slashed, keys[:2], seed=1)
        await _write_pages(plain, keys[2:], seed=2)
        listed = raw_client(moto_endpoint).list_objects_v2(Bucket=moto_bucket, Prefix=f"/{prefix}")
        assert listed.get("KeyCount") == 0  # no key with a leading slash, which no listing finds
        assert await slashed.exists_pages(keys) == [True] * 4
        assert await slashed.clear() is True
        pages = raw_client(moto_endpoint).list_objects_v2(Bucket=moto_bucket, Prefix=f"{prefix}/{NS_A.digest}/pages/")
        assert pages.get("KeyCount") == 0
        assert await plain.exists_pages(keys) == [False] * 4


async def test_a_tree_removal_deletes_nothing_its_listing_puts_outside_the_prefix(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """s3fs lists ``bucket//p`` as ``bucket/p/...`` (it strips a key's leading slashes): a tree
    removal deleted every name the listing gave, another prefix's objects. It deletes only names
    under its prefix, and fails (a clear reports it) rather than claim it removed the tree."""
    ours, theirs = f"{moto_bucket}//{prefix}/pages/aa/1", f"{moto_bucket}/{prefix}/pages/aa/1"
    raw_put(moto_endpoint, ours, b"ours")  # the key "/<prefix>/pages/aa/1"
    raw_put(moto_endpoint, theirs, b"theirs")
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        ops = store._local.get().ops
        with pytest.raises(OSError, match="1 object\\(s\\) outside it"):
            await ops.remove_tree(f"{moto_bucket}//{prefix}/pages")
    assert raw_get(moto_endpoint, theirs) == b"theirs"


async def test_read_is_one_ranged_get_per_page(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    keys = keys_for(6, salt=3)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        src = await _write_pages(store, keys)
        dst = ArrayHostPool(len(keys), PAGE)
        store.register_mem_pool_host(dst)
        before = store.get_stats()["requests"]
        assert await store.batch_get_v1(keys, dst.indices(0, 6)) == [True] * 6
        assert store.get_stats()["requests"] - before == 6  # no HEAD before the GET
        assert torch.equal(dst.buffer, src.buffer)
        # the connection pool is sized to the concurrency
        fs = store._local.get().ops.fs
        assert fs._s3._client_config.max_pool_connections == store.concurrency


async def test_exists_cache_saves_round_trips_and_forgets_cleared_pages(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    keys = keys_for(5, salt=4)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        await _write_pages(store, keys[:3])
        before = store.get_stats()["requests"]
        assert await store.exists_pages(keys) == [True, True, True, False, False]
        assert store.get_stats()["requests"] - before == 2  # the three written pages are known
        # a second store of this process on the same namespace
        async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as twin:
            assert await twin.exists_pages(keys[:3]) == [True] * 3
            assert await store.clear() is True
            assert await store.exists_pages(keys) == [False] * 5
            assert await twin.exists_pages(keys[:3]) == [False] * 3  # it saw the clear
        # another store sees what this one writes
        async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as other:
            await _write_pages(other, keys[:1])
        assert await store.exists_pages(keys[:1]) == [True]


@pytest.mark.parametrize("url, endpoint_tail", [("s3a://{bucket}/{prefix}", ""), ("s3://{bucket}/{prefix}/", "/")])
async def test_stores_of_one_location_spelled_differently_share_the_exists_cache(
    moto_endpoint: str, moto_bucket: str, prefix: str, url: str, endpoint_tail: str
) -> None:
    """``s3a://`` for ``s3://``, or the endpoint with a trailing slash: the same objects, but
    two exists caches; after a clear through one store the other answered the removed pages as
    hits until its entries expired (a prefetch promised pages no read could find)."""
    keys = keys_for(3, salt=172)
    twin = create_async_storage(
        "s3", None, url=url.format(bucket=moto_bucket, prefix=prefix), namespace=NS_A,
        storage_options={**s3_options(moto_endpoint + endpoint_tail), "session": shared_session()},
    )
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store, twin:
        await _write_pages(store, keys)
        assert await twin.exists_pages(keys) == [True] * 3  # now in the twin's cache
        assert await store.clear() is True
        assert await twin.exists_pages(keys) == [False] * 3


async def test_corrupt_objects_are_counted_misses(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    keys = keys_for(5, salt=5)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        src = await _write_pages(store, keys)
        names = store.names
        good = raw_get(moto_endpoint, names.page(keys[0], "kv"))
        assert good is not None
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        raw_put(moto_endpoint, names.page(keys[0], "kv"), bytes(flipped))  # bad checksum
        raw_put(moto_endpoint, names.page(keys[1], "kv"), good[: len(good) // 2])  # torn
        raw_put(moto_endpoint, names.page(keys[2], "kv"), good)  # another key's page
        raw_put(moto_endpoint, names.page(keys[3], "kv"), b"")  # empty object
        assert await store.exists_pages(keys) == [True] * 5  # known from the writes
        dst = ArrayHostPool(len(keys), PAGE)
        store.register_mem_pool_host(dst)
        assert await store.batch_get_v1(keys, dst.indices(0, 5)) == [False, False, False, False, True]
        assert dst.page_bytes(0) == bytes(src.page_nbytes)  # nothing unverified reached the pool
        assert dst.page_bytes(4 * PAGE) == src.page_bytes(4 * PAGE)
        stats = store.get_stats()
        assert stats["corrupt_pages"] == 4
        # corrupt pages are forgotten and removed, so lookups stop finding them
        assert await store.exists_pages(keys) == [False, False, False, False, True]
        assert await store.get(keys[0]) is None
        # v0 reads of unknown size verify too
        raw_put(moto_endpoint, names.page("v0", "kv"), flipped)
        assert await store.get("v0") is None
        assert store.get_stats()["corrupt_pages"] == 5
        # a read that only asked for a different size is a miss, not corruption
        assert await store.set("sized", torch.zeros(16))
        assert await store.get("sized", torch.empty(8)) is None
        assert store.get_stats()["corrupt_pages"] == 5 and store.get_stats()["size_mismatches"] == 1
        assert store.get_stats().get("backend_errors", 0) == 0


_WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    from hicache.keys import Namespace
    from hicache.storage import create_async_storage
    from hicache.testing import ArrayHostPool
    from hicache.testing.store_tests import keys_for

    endpoint, url, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    async def main():
        ns = Namespace(model="two-process", kv_dtype="float16", page_size=4)
        store = create_async_storage("s3", None, url=url, storage_options=opts, namespace=ns)
        async with store:
            pool = ArrayHostPool(8, 4)
            pool.fill_random(1234)
            store.register_mem_pool_host(pool)
            ok = await store.batch_set_v1(keys_for(8, salt=77), pool.indices(0, 8))
            print(json.dumps(ok))

    asyncio.run(main())
    """
)


async def test_two_processes_share_one_bucket(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    url = f"s3://{moto_bucket}/{prefix}"
    opts = s3_options(moto_endpoint)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, moto_endpoint, url, json.dumps(opts),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(REPO),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().strip().splitlines()[-1]) == [True] * 8
    expected = ArrayHostPool(8, 4)
    expected.fill_random(1234)
    ns = Namespace(model="two-process", kv_dtype="float16", page_size=4)
    store = create_async_storage("s3", None, url=url, storage_options=opts, namespace=ns)
    async with store:
        keys = keys_for(8, salt=77)
        assert await store.batch_exists(keys) == 8
        dst = ArrayHostPool(8, 4)
        store.register_mem_pool_host(dst)
        assert await store.batch_get_v1(keys, dst.indices(0, 8)) == [True] * 8
        assert torch.equal(dst.buffer, expected.buffer)


async def test_secrets_never_shown(moto_endpoint: str, moto_bucket: str, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache")
    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A, request_timeout=0.5, retries=0)
    shown = [repr(store), str(store)]
    async with store:
        await _write_pages(store, keys_for(2))
        shown.append(repr(store.get_stats()))
    # a store pointed at a dead endpoint logs failures: still no secrets
    dead = create_async_storage(
        "s3", None, url=f"s3://{moto_bucket}/{prefix}",
        storage_options={**s3_options("http://127.0.0.1:9"), "token": "session-token-secret"},
        request_timeout=0.5, retries=0, breaker_threshold=1,
    )
    shown.append(repr(dead))
    async with dead:
        assert await dead.exists_pages(["a"]) == [False]
        shown.append(repr(dead.get_stats()))
    text = "\n".join(shown) + "\n" + caplog.text
    for secret in (TEST_KEY, TEST_SECRET, "session-token-secret"):
        assert secret not in text
    assert "***" in repr(store)
    # a secret in the URL is redacted too
    with pytest.raises(Exception) as info:
        create_async_storage("s3", None, url=f"ftp://{TEST_KEY}:{TEST_SECRET}@bucket/x")
    assert TEST_SECRET not in str(info.value)


def test_bad_options_are_config_errors() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match="s3://"):
        create_async_storage("s3", None, url="memory://x")
    with pytest.raises(ConfigError, match="concurrency"):
        create_async_storage("s3", None, url="s3://b/p", concurrency=0)
    with pytest.raises(ConfigError, match="request_timeout"):
        create_async_storage("s3", None, url="s3://b/p", request_timeout=-1)
    with pytest.raises(ConfigError, match="needs option"):
        create_async_storage("s3", None)


async def test_one_store_on_two_event_loops(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """The blocking facade drives the store on its own loop; this loop gets its own filesystem."""
    from hicache.storage import HiCacheStorage

    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    facade = HiCacheStorage(store)
    try:
        assert await asyncio.to_thread(facade.set, "shared", torch.ones(8))
        got = await store.get("shared", torch.empty(8))  # this loop
        assert got is not None and torch.equal(got, torch.ones(8))
        assert store.get_stats()["event_loops"] == 2
    finally:
        await asyncio.to_thread(facade.close)


async def test_a_close_does_not_wait_for_a_loop_that_stops_without_closing_its_filesystem(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """A close waits for other running loops to close their filesystems (and abort their
    uploads), but a loop that stops before it runs that close never will: the close waited its
    whole bound for it (15 s) instead of giving up on it when it stopped."""
    import threading
    import time

    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    await store.open()
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever)
    thread.start()
    try:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(store.exists_pages(["a"]), other))
        other.call_soon_threadsafe(time.sleep, 0.3)  # busy, then stopping: the close comes meanwhile
        other.call_soon_threadsafe(other.stop)
        started = time.monotonic()
        await store.aclose()
        assert time.monotonic() - started < 5.0
    finally:
        await asyncio.to_thread(thread.join, 20)
        await asyncio.to_thread(other.run_until_complete, asyncio.sleep(0.2))  # (its owner runs the close late)
        other.close()


def test_loops_closed_since_leave_no_resources_behind(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """A caller that runs each call in a new loop (a CLI, a test, a server restarting its loop,
    ``asyncio.run``): each loop's S3 client and its HTTP session were left open when that loop
    ended, and only dropped by the next loop's first call ("Unclosed client session" per loop,
    its pooled connections open until garbage collection). The loop's shutdown closes them."""
    import gc
    import warnings

    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    clients: list[Any] = []

    async def lookup() -> None:
        await store.exists_pages(["a", "b"])
        clients.append(store._local.get().ops.fs._s3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(12):
            asyncio.run(lookup())
            assert len(store._local) == 0  # nothing held for a loop that is gone
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]
    assert all(c._endpoint.http_session._sessions is None for c in clients)  # aiobotocore's "closed"

    async def close() -> None:
        await store.aclose()

    asyncio.run(close())


def test_loops_closed_without_a_shutdown_leave_no_client_open(moto_endpoint: str, moto_bucket: str,
                                                               prefix: str) -> None:
    """A hand-made loop ended by ``loop.close()`` alone runs no shutdown, so its S3 client was
    only dropped by the next loop's first call (or the close), its HTTP session left open until
    garbage collection ("Unclosed client session" per loop). The next loop to use the store, and
    the store's close, close them; the live loop's client stays open."""
    import gc
    import warnings

    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    clients: list[Any] = []

    async def lookup() -> None:
        await store.exists_pages(["a", "b"])
        clients.append(store._local.get().ops.fs._s3)
        await asyncio.sleep(0)  # the closes of the loops closed before this one run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            loop = asyncio.new_event_loop()
            loop.run_until_complete(lookup())
            loop.close()
            assert len(store._local) == 1
        assert all(c._endpoint.http_session._sessions is None for c in clients[:-1])
        assert clients[-1]._endpoint.http_session._sessions is not None  # its loop's close ran no closer

        async def close() -> None:
            await store.aclose()

        asyncio.run(close())
        assert clients[-1]._endpoint.http_session._sessions is None
        del clients
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


def test_a_close_from_another_loop_leaves_an_idle_loops_client_to_its_shutdown(
    moto_endpoint: str, moto_bucket: str, prefix: str
) -> None:
    """A store used through an ``asyncio.Runner`` (a blocking wrapper: its loop idles between
    calls) and closed from another loop: the idle loop's client was taken from it and closed by
    nobody (its loop not running, the close had no way to run there), its HTTP session open
    until garbage collection ("Unclosed client session"). It is left to that loop, whose
    shutdown closes it."""
    store = make_s3(moto_endpoint, moto_bucket, prefix, NS_A)
    with asyncio.Runner() as runner:
        runner.run(store.open())
        runner.run(store.exists_pages(["a"]))
        client = store._local._values[runner.get_loop()].ops.fs._s3

        async def close() -> None:
            await store.aclose()

        asyncio.run(close())  # another loop, while the runner's idles
    assert client._endpoint.http_session._sessions is None  # aiobotocore's "closed"


async def test_batch_delete_is_one_head_per_page_and_one_delete_request(moto_endpoint: str, moto_bucket: str, prefix: str) -> None:
    """An eviction of many pages: the HEADs tell which existed (and so what was freed), then a
    single DeleteObjects removes them all (was a DELETE per page)."""
    keys = keys_for(12, salt=77)
    async with make_s3(moto_endpoint, moto_bucket, prefix, NS_A) as store:
        await _write_pages(store, keys)
        absent = keys_for(1, salt=78)
        before = store.get_stats()["requests"]
        flags = await store.batch_delete(keys[:10] + absent)
        assert flags == [True] * 10 + [False]
        assert store.get_stats()["requests"] - before == 11 + 1
        assert await store.exists_pages(keys) == [False] * 10 + [True] * 2
        for k in keys[:10]:
            assert raw_get(moto_endpoint, store.names.page(k, "kv")) is None
        assert raw_get(moto_endpoint, store.names.page(keys[10], "kv")) is not None
