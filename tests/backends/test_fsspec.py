"""The ``fsspec`` backend: the conformance suite on ``memory://`` (a synchronous filesystem, run
in worker threads), and the same backend on an ``s3://`` URL, which runs natively async."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import fsspec
import pytest
import torch

from hicache.errors import ConfigError
from hicache.storage import AsyncHiCacheStorage, PageCodec, create_async_storage
from hicache.testing import StoreTests
from hicache.testing.store_tests import NS_A
from hicache_backends.s3.fs import AsyncObjectOps, DirS3ObjectOps, S3ObjectOps, ThreadObjectOps
from s3_server import raw_get, raw_put, s3_options


class TestFsspecMemoryStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        root = f"memory://hicache-tests/{uuid.uuid4().hex}"

        def make(namespace: Any = None) -> AsyncHiCacheStorage:
            return create_async_storage("fsspec", None, url=root, namespace=namespace)

        yield make
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)

    async def raw_payload(self, store: Any, key: str, pool: str = "kv") -> bytes | None:
        try:
            data = fsspec.filesystem("memory").cat_file(store.names.page(key, pool))
        except FileNotFoundError:
            return None
        header = PageCodec.parse(data)
        assert header is not None and header.key == key and header.pool == pool
        return data[header.header_len :]


async def test_memory_url_uses_threads_and_s3_url_is_native(moto_endpoint: str, moto_bucket: str) -> None:
    mem = create_async_storage("fsspec", None, url=f"memory://hicache-tests/{uuid.uuid4().hex}", namespace=NS_A)
    s3 = create_async_storage(
        "fsspec", None, url=f"s3://{moto_bucket}/fsspec/{uuid.uuid4().hex}",
        storage_options=s3_options(moto_endpoint), namespace=NS_A,
    )
    for store, ops_type in ((mem, ThreadObjectOps), (s3, S3ObjectOps)):
        async with store:
            assert await store.set("k", torch.arange(16, dtype=torch.float32))
            got = await store.get("k", torch.empty(16))
            assert got is not None and torch.equal(got, torch.arange(16, dtype=torch.float32))
            assert isinstance(store._local.get().ops, ops_type)


async def test_file_url_round_trip(tmp_path: Any) -> None:
    store = create_async_storage(
        "fsspec", None, url=f"file://{tmp_path}/store", storage_options={"auto_mkdir": True}, namespace=NS_A
    )
    async with store:
        assert await store.set("k", torch.ones(8))
        assert await store.exists("k")
        assert (tmp_path / "store" / NS_A.digest / "manifest.json").exists()
        got = await store.get("k", torch.empty(8))
        assert got is not None and torch.equal(got, torch.ones(8))
        assert await store.clear() and not await store.exists("k")


def test_unknown_protocol_is_config_error() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match="no fsspec filesystem"):
        create_async_storage("fsspec", None, url="nosuchproto://x")



@pytest.mark.parametrize("url, needle", [
    ("s3://AKIAKEY:s3cret@bucket/kv", "credentials do not go in the url"),
    ("s3://bucket/data?versionId=1/kv", "without '\\?' or '#'"),
    ("memory://x/kv#frag", "without '\\?' or '#'"),
])
def test_urls_whose_paths_would_leave_the_prefix_are_config_errors(url: str, needle: str) -> None:
    """Credentials in an s3 url became part of the bucket name (every request failed, the secret
    reached the logs); s3fs cuts object paths at "?versionId=" (every page one object outside
    the prefix, a user's object overwritten and then deleted as corrupt)."""
    from hicache.errors import ConfigError

    backend = "s3" if url.startswith("s3") else "fsspec"
    with pytest.raises(ConfigError, match=needle) as exc:
        create_async_storage(backend, None, url=url)
    assert "s3cret" not in str(exc.value)


async def test_an_object_store_url_without_a_bucket_is_refused(moto_endpoint: str) -> None:
    """The fsspec backend took ``s3://`` (only the s3 backend asked for a bucket): the namespace
    digest became the bucket's name, and pages and manifest went into a bucket nobody
    configured (on AWS, bucket names are global: a stranger's). Any bucket-style url, either
    backend, is refused; a memory store needs no bucket and keeps working."""
    from hicache.errors import ConfigError
    from s3_server import create_bucket, raw_client

    create_bucket(moto_endpoint, NS_A.digest)  # someone else's bucket, named as the digest names it
    for backend, url in [("fsspec", "s3://"), ("fsspec", "s3:///kv"), ("fsspec", "S3A://"), ("s3", "s3://"),
                         ("s3", "s3:///kv"), ("fsspec", "gs://"), ("fsspec", "abfs:///kv")]:
        with pytest.raises(ConfigError, match="must name a bucket"):
            create_async_storage(backend, None, url=url, storage_options=s3_options(moto_endpoint), namespace=NS_A)
    assert raw_client(moto_endpoint).list_objects_v2(Bucket=NS_A.digest).get("KeyCount") == 0
    memory = fsspec.filesystem("memory")
    try:
        async with create_async_storage("fsspec", None, url="memory://", namespace=NS_A) as store:
            assert await store.set("k", torch.ones(8)) and await store.exists("k")
    finally:
        if memory.exists(f"/{NS_A.digest}"):
            memory.rm(f"/{NS_A.digest}", recursive=True)


def test_an_at_sign_in_an_s3_prefix_is_a_key_character() -> None:
    """The bucket was taken after the last "@" anywhere in the url: ``s3://bucket/team@/kv``
    was refused as naming no bucket (credentials can only be in the bucket part, refused)."""
    store = create_async_storage("s3", None, url="s3://bucket/team@/kv")
    assert store.root == "bucket/team@/kv"


async def test_an_upper_case_scheme_is_the_scheme(tmp_path) -> None:
    """``FILE://`` picked the file system by the lower-cased scheme but stripped the path as
    typed: pages went under the working directory, not the folder named."""
    folder = tmp_path / "kv"
    async with create_async_storage("fsspec", None, url=f"FILE://{folder}", namespace=NS_A) as store:
        assert store.root == str(folder)
        assert await store.set("k", torch.ones(8))
    assert any(p.is_file() for p in folder.rglob("*"))


def test_credentials_parsed_as_numbers_are_kept_as_text() -> None:
    """A YAML file or a HICACHE__ variable parses an all-digit key as a number; s3fs then failed
    every request with a TypeError."""
    from hicache.errors import ConfigError

    store = create_async_storage("s3", None, url="s3://bucket/kv",
                                 storage_options={"key": 1234567890, "secret": "x",
                                                  "client_kwargs": {"aws_session_token": 42}})
    assert store._storage_options["key"] == "1234567890"
    assert store._storage_options["client_kwargs"]["aws_session_token"] == "42"
    with pytest.raises(ConfigError, match="storage_options.secret must be text") as exc:
        create_async_storage("s3", None, url="s3://bucket/kv", storage_options={"secret": 1.5e10})
    assert "1.5" not in str(exc.value)

# -- fault injection on the generic backend (no server needed) ----------------------------------


class FlakyOps:
    """Wraps a store's object operations; raises the queued errors first, then behaves."""

    def __init__(self, inner: Any, errors: list[BaseException]) -> None:
        self.inner, self.errors, self.calls = inner, list(errors), 0
        self.fs = inner.fs

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return await target(*args, **kwargs)

        return call


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def _memory_store(**options: Any) -> Any:
    return create_async_storage(
        "fsspec", None, url=f"memory://hicache-tests/{uuid.uuid4().hex}", namespace=NS_A,
        retry_backoff=0.001, retry_backoff_max=0.01, **options,
    )


async def test_transient_errors_are_retried_permanent_ones_are_not() -> None:
    store = _memory_store(retries=2)
    async with store:
        res = store._local.get()
        res.ops = FlakyOps(res.ops, [_client_error(503, "SlowDown"), TimeoutError()])
        assert await store.set("k", torch.ones(4))  # third attempt succeeds
        stats = store.get_stats()
        assert stats["retries"] == 2 and stats["throttled"] == 1 and stats["timeouts"] == 1
        res.ops = FlakyOps(res.ops.inner, [_client_error(403, "AccessDenied")])
        assert await store.set("k2", torch.ones(4)) is False
        assert res.ops.calls == 1 and store.get_stats()["permanent_errors"] == 1
        assert store.get_stats()["breaker_state"] == "closed"  # the service answered


async def test_request_timeout_bounds_a_hanging_call() -> None:
    store = _memory_store(request_timeout=0.05, retries=1, call_timeout=1.0)
    async with store:
        res = store._local.get()
        real = res.ops

        class Hanging:
            fs = real.fs

            async def get_range_into(self, *a: Any, **k: Any) -> int:
                await asyncio.sleep(3600)
                return 0

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        assert await store.set("k", torch.ones(4))
        res.ops = Hanging()
        got = await asyncio.wait_for(store.get("k", torch.empty(4)), 2.0)
        assert got is None and store.get_stats()["timeouts"] == 2
        res.ops = real


async def test_prober_survives_errors() -> None:
    store = _memory_store(breaker_cooldown=0.1)
    async with store:
        calls = 0

        async def broken() -> bool:
            nonlocal calls
            calls += 1
            raise RuntimeError("probe bug")

        store._manifest_ok = False
        store._ensure_manifest = broken  # type: ignore[method-assign]
        for _ in range(100):
            if calls >= 3:
                break
            await asyncio.sleep(0.05)
        assert calls >= 3 and store.get_stats()["probe_errors"] >= 2
        assert store._prober is not None and not store._prober.done()


async def test_big_pages_are_verified_and_copied_off_the_loop() -> None:
    """Pages of at least OFFLOAD_MIN_BYTES are hashed and copied on a worker thread (the event
    loop used to do both for every page of a batch); the result and the integrity check are the
    same: a tampered big page is a miss that leaves no unverified byte in the destination (the
    header is checked before any byte lands, the checksum after, then a failed page is zeroed)."""
    from hicache.storage.offload import OFFLOAD_MIN_BYTES
    from hicache.testing import ArrayHostPool

    url = f"memory://hicache-tests/{uuid.uuid4().hex}"
    elems = OFFLOAD_MIN_BYTES // (4 * 2)  # float16, 4 tokens a page: exactly the threshold
    async with create_async_storage("fsspec", None, url=url, namespace=NS_A) as store:
        src = ArrayHostPool(2, 4, token_elems=elems)
        src.fill_random(4)
        store.register_mem_pool_host(src)
        assert await store.batch_set_v1(["b0", "b1"], src.indices(0, 2)) == [True, True]
        fs = fsspec.filesystem("memory")
        path = store.names.page("b1", "kv")
        data = bytearray(fs.cat_file(path))
        data[-1] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        dst = ArrayHostPool(2, 4, token_elems=elems)
        store.register_mem_pool_host(dst)
        assert await store.batch_get_v1(["b0", "b1"], dst.indices(0, 2)) == [True, False]
        assert dst.page_bytes(0) == src.page_bytes(0)
        assert dst.page_bytes(4) == bytes(dst.page_nbytes)
        assert store.get_stats()["corrupt_pages"] == 1


async def test_write_bodies_are_built_ahead_of_a_slot_but_bounded() -> None:
    """Each PUT's body is ready when a request slot frees, yet at most 2 x concurrency bodies
    exist at once (a huge batch never holds a copy of every page), and every page lands."""
    store = _memory_store(concurrency=2)
    async with store:
        res = store._local.get()
        real = res.ops
        in_flight = 0
        most = 0
        most_bodies_waiting = 0

        class Slow:
            fs = real.fs

            async def put(self, path: str, data: bytes) -> None:
                nonlocal in_flight, most
                in_flight += 1
                most = max(most, in_flight)
                await asyncio.sleep(0.01)
                await real.put(path, data)
                in_flight -= 1

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        res.ops = Slow()
        staging = res.staging
        keys = [f"k{i}" for i in range(24)]
        task = asyncio.ensure_future(store.batch_set(keys, [torch.full((4,), float(i)) for i in range(24)]))
        while not task.done():
            most_bodies_waiting = max(most_bodies_waiting, 4 - staging._value)  # bodies held now
            await asyncio.sleep(0.002)
        assert await task
        res.ops = real
        assert most <= 2 and most_bodies_waiting <= 4 and most_bodies_waiting > 2
        for i, k in enumerate(keys):
            out = await store.get(k, torch.empty(4))
            assert out is not None and torch.equal(out, torch.full((4,), float(i)))


async def test_a_local_page_rewritten_while_read_is_never_seen_half_written(tmp_path: Any) -> None:
    """fsspec's local ``pipe_file`` truncates and writes in place: a reader saw half a page,
    judged it corrupt at rest and deleted the page every writer had reported stored. Without
    ``auto_mkdir`` every write failed ("bucket not found")."""
    url = f"file://{tmp_path}/store"  # no storage_options: folders are made as needed
    w = create_async_storage("fsspec", None, url=url, namespace=NS_A)
    r = create_async_storage("fsspec", None, url=url, namespace=NS_A, exists_cache_size=0)
    async with w, r:
        val = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        assert await w.batch_set(["k"], [val])
        stop = False

        async def writer() -> int:
            n = 0
            while not stop:
                assert await w.batch_set(["k"], [val])
                n += 1
            return n

        task = asyncio.create_task(writer())
        try:
            for _ in range(20):
                got = await r.get("k", torch.empty_like(val))
                assert got is not None and torch.equal(got, val)
        finally:
            stop = True
            assert await task > 0
        assert r.get_stats().get("corrupt_pages", 0) == 0
        assert not list((tmp_path / "store").rglob("*.tmp"))


async def test_a_clear_racing_writes_and_deletes_removes_every_page(tmp_path: Any, monkeypatch: Any) -> None:
    """The listing a clear deletes from names files that are gone by the time it gets to them (a
    write's temporary file renamed into place, a page another call deleted): a bulk ``rm``
    stopped at the first of them and the clear still said True, leaving most pages stored."""
    from fsspec.implementations.local import LocalFileSystem

    store = create_async_storage(
        "fsspec", None, url=f"file://{tmp_path}/store", storage_options={"auto_mkdir": True}, namespace=NS_A
    )
    real_find = LocalFileSystem.find

    def find_with_vanished(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        files = sorted(real_find(self, path, *args, **kwargs))
        gone = f"{files[0]}.vanished" if files else None
        return [gone, *files] if gone else files  # listed, then gone before its delete

    async with store:
        keys = [f"k{i}" for i in range(20)]
        assert await store.batch_set(keys, [torch.full((8,), float(i)) for i in range(20)])
        monkeypatch.setattr(LocalFileSystem, "find", find_with_vanished)
        assert await store.clear()
        monkeypatch.setattr(LocalFileSystem, "find", real_find)
        assert not any(await asyncio.gather(*(store.exists(k) for k in keys)))
        pages = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name != "manifest.json"]
        assert pages == []


async def test_a_clear_removes_the_temporary_file_of_a_writer_that_died(tmp_path: Any) -> None:
    """A local writer killed mid-write leaves ``<page>.<pid>-<n>.<machine>.tmp``; a clear spares
    the temporary files of live writers (removing one fails that write) but not a dead one's,
    which would otherwise stay on disk for good."""
    import os
    import subprocess
    import sys

    from hicache_backends.writers import MACHINE_HEX

    store = create_async_storage(
        "fsspec", None, url=f"file://{tmp_path}/store", storage_options={"auto_mkdir": True}, namespace=NS_A
    )
    async with store:
        assert await store.set("k", torch.ones(8))
        page = store.names.page("k", "kv").removeprefix("file://")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        stale = f"{page}.{int(dead.stdout)}-0.{MACHINE_HEX}.tmp"  # its writer exited
        live = f"{page}.{os.getpid()}-999.{MACHINE_HEX}.tmp"  # a write of this process, in flight
        for path in (stale, live):
            with open(path, "wb") as f:
                f.write(b"x")
        assert await store.clear()
        assert not os.path.exists(stale) and os.path.exists(live)
        os.unlink(live)


async def test_a_clear_judges_a_writer_by_its_pid_only_on_its_own_machine(tmp_path: Any) -> None:
    """A root on a shared mount: a writer in another container or on another machine has pids
    of its own. A clear judged every temporary file by its pid alone, so it deleted the file of
    a remote write in flight whose pid number no local process had, and kept for good a dead
    remote writer's file whose pid a local process happened to have. Like the file store's
    sweep, a clear judges a writer by its pid only on its own machine (the name carries it);
    any other temporary file (another machine's, or one named before machines were) goes by
    its age alone."""
    import os
    import subprocess
    import sys
    import time

    from hicache_backends.writers import MACHINE, MACHINE_HEX

    store = create_async_storage(
        "fsspec", None, url=f"file://{tmp_path}/store", storage_options={"auto_mkdir": True}, namespace=NS_A
    )
    elsewhere_hex = (MACHINE ^ 1).to_bytes(8, "little", signed=True).hex()
    async with store:
        assert await store.set("k", torch.ones(8))
        page = store.names.page("k", "kv").removeprefix("file://")
        dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
        alive = os.getppid()  # a live process of this machine, not this one
        kept = {
            "ours in flight": f"{page}.{os.getpid()}-999.{MACHINE_HEX}.tmp",
            "another machine's, its pid dead here": f"{page}.{dead}-0.{elsewhere_hex}.tmp",
            "unnamed machine, its pid dead here": f"{page}.{dead}-1.tmp",
        }
        removed = {
            "a dead writer's of this machine": f"{page}.{dead}-2.{MACHINE_HEX}.tmp",
            "another machine's, a week old, its pid alive here": f"{page}.{alive}-3.{elsewhere_hex}.tmp",
            "unnamed machine, a week old, its pid alive here": f"{page}.{alive}-4.tmp",
        }
        for path in (*kept.values(), *removed.values()):
            with open(path, "wb") as f:
                f.write(b"x")
        long_ago = time.time() - 7 * 24 * 3600
        for what in ("another machine's, a week old, its pid alive here",
                     "unnamed machine, a week old, its pid alive here"):
            os.utime(removed[what], (long_ago, long_ago))
        assert await store.clear()
        assert [what for what, path in kept.items() if not os.path.exists(path)] == []
        assert [what for what, path in removed.items() if os.path.exists(path)] == []
        for path in kept.values():
            os.unlink(path)


async def test_a_store_written_from_another_loop_waits_for_its_index_writes_safely() -> None:
    """The run-index tasks of one loop's writes were added and dropped while another loop
    iterated the same set: 'Set changed size during iteration' out of wait_index_writes (so
    out of clear and close)."""
    import threading
    import time

    from hicache.testing import ArrayHostPool
    from hicache.testing.store_tests import PAGE, keys_for

    store = create_async_storage("fsspec", None, url=f"memory://hicache-tests/{uuid.uuid4().hex}", namespace=NS_A)
    src = ArrayHostPool(2, PAGE)
    src.fill_random(1)
    store.register_mem_pool_host(src)
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer() -> None:
        async def run() -> None:
            i = 0
            while not stop.is_set():
                await store.batch_set_v1(keys_for(2, salt=i), src.indices(0, 2))
                i += 1
            await store.wait_index_writes()

        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    await store.open()
    t = threading.Thread(target=writer)
    t.start()
    errors = 0
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                await store.wait_index_writes()
            except RuntimeError:
                errors += 1
    finally:
        stop.set()
        await asyncio.to_thread(t.join)
    assert errors == 0 and not failures
    await store.aclose()


async def test_options_the_filesystem_refuses_are_a_config_error_at_open(tmp_path: Any) -> None:
    """The filesystem is built when the store opens (one per event loop); one that refused its
    storage_options raised its own TypeError/ValueError out of open() and out of every call after
    (each tried to open again), unredacted. It is now a ConfigError naming the backend and the
    filesystem's complaint, with the options' secrets scrubbed from it."""
    store = create_async_storage("fsspec", None, url="dir://", namespace=NS_A,
                                 storage_options={"path": str(tmp_path), "target_protocol": "no-such-protocol",
                                                  "password": "hunter2-secret"})
    with pytest.raises(ConfigError, match="dir filesystem") as info:
        await store.open()
    assert "hunter2-secret" not in str(info.value)
    with pytest.raises(ConfigError):
        await store.exists("k")
    await store.aclose()
    # a loop the store meets later whose filesystem cannot be built: a counted miss, not an error
    ok = create_async_storage("fsspec", None, url=f"file://{tmp_path}/store", namespace=NS_A)
    async with ok:
        assert await ok.set("k", torch.ones(4))
        ok._storage_options["no_such_option_of_local_files"] = 1  # what the next loop's filesystem gets
        ok._fs_class = fsspec.get_filesystem_class("dir")  # refuses being built without its path

        def other_loop() -> Any:
            return asyncio.run(ok.get("k", torch.empty(4)))

        assert await asyncio.to_thread(other_loop) is None
        assert ok.get_stats()["permanent_errors"] >= 1


async def test_writes_on_a_loop_whose_filesystem_cannot_be_built_are_counted_misses(tmp_path: Any, caplog) -> None:
    """A write batch on a loop whose filesystem cannot be built logged an ERROR with a
    traceback for every page (counted as backend errors); like a read, it is now a counted
    miss (``permanent_errors``) said in one warning."""
    import logging

    store = create_async_storage("fsspec", None, url=f"file://{tmp_path}/store", namespace=NS_A)
    async with store:
        assert await store.set("k", torch.ones(4))
        store._fs_class = fsspec.get_filesystem_class("dir")  # refuses being built without its path

        def other_loop() -> Any:
            return asyncio.run(store.batch_set([f"p{i}" for i in range(8)], [torch.ones(4)] * 8))

        with caplog.at_level(logging.WARNING, logger="hicache.storage.s3"):
            assert await asyncio.to_thread(other_loop) is False
        stats = store.get_stats()
        assert stats["permanent_errors"] == 8 and not stats.get("backend_errors")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "building the filesystem" in r.getMessage()]) == 1


class TestFsspecDirOverMemoryStore(StoreTests):
    """``dir://`` (fsspec's DirFileSystem) over a synchronous filesystem: refused at open (the
    backend asked for an asynchronous DirFileSystem, which a synchronous target cannot be);
    now served in worker threads like the target alone, the whole conformance suite."""

    @pytest.fixture
    def store_factory(self):
        self.base = f"/hicache-tests/{uuid.uuid4().hex}"

        def make(namespace: Any = None) -> AsyncHiCacheStorage:
            return create_async_storage("fsspec", None, url="dir://store", namespace=namespace,
                                        storage_options={"path": self.base, "target_protocol": "memory"})

        yield make
        fs = fsspec.filesystem("memory")
        if fs.exists(self.base):
            fs.rm(self.base, recursive=True)

    async def raw_payload(self, store: Any, key: str, pool: str = "kv") -> bytes | None:
        try:
            data = fsspec.filesystem("memory").cat_file(f"{self.base}/{store.names.page(key, pool)}")
        except FileNotFoundError:
            return None
        header = PageCodec.parse(data)
        assert header is not None and header.key == key and header.pool == pool
        return data[header.header_len :]


class TestFsspecDirOverS3Store(StoreTests):
    """``dir://`` over S3 (``target_protocol: s3``): refused at open ("both dirfs and fs should
    be in the same sync/async mode": the DirFileSystem was built asynchronous, its S3 target
    not); each loop now builds both asynchronous, the whole conformance suite against moto."""

    @pytest.fixture
    def store_factory(self, moto_endpoint: str, moto_bucket: str):
        self.endpoint, self.base = moto_endpoint, f"{moto_bucket}/dir-conformance/{uuid.uuid4().hex}"

        def make(namespace: Any = None) -> AsyncHiCacheStorage:
            return create_async_storage("fsspec", None, url="dir://store", namespace=namespace,
                                        storage_options={"path": self.base, "target_protocol": "s3",
                                                         "target_options": s3_options(moto_endpoint)})

        return make

    async def raw_payload(self, store: Any, key: str, pool: str = "kv") -> bytes | None:
        data = await asyncio.to_thread(raw_get, self.endpoint, f"{self.base}/{store.names.page(key, pool)}")
        if data is None:
            return None
        header = PageCodec.parse(data)
        assert header is not None and header.key == key and header.pool == pool
        return data[header.header_len :]


async def test_a_dir_store_over_s3_closes_each_loops_client(moto_endpoint: str, moto_bucket: str) -> None:
    """``dir://`` over S3: each loop's S3 client (the DirFileSystem's target, which holds the
    HTTP session) is closed by the store's close and by the end of its loop, and is configured
    as the s3 backend's own (one attempt a request: the store retries and counts)."""
    import gc
    import warnings

    from s3fs import S3FileSystem

    store = create_async_storage("fsspec", None, url="dir://store", namespace=NS_A,
                                 storage_options={"path": f"{moto_bucket}/dir-close/{uuid.uuid4().hex}",
                                                  "target_protocol": "s3",
                                                  "target_options": s3_options(moto_endpoint)})
    clients: list[Any] = []

    async def use() -> None:
        assert await store.set("k", torch.ones(4))
        ops = store._local.get().ops
        assert isinstance(ops, DirS3ObjectOps)  # served as S3 is, on the dir's target
        target = ops.fs
        assert isinstance(target, S3FileSystem) and target.retries == 1
        clients.append(target._s3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await asyncio.to_thread(asyncio.run, use())  # a loop that ends
        await use()
        got = await store.get("k", torch.empty(4))
        assert got is not None and torch.equal(got, torch.ones(4))
        await store.aclose()
        assert len(clients) == 2 and all(c._endpoint.http_session._sessions is None for c in clients)
        del clients
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_dir_store_over_an_s3_filesystem_object(moto_endpoint: str, moto_bucket: str, asynchronous: bool) -> None:
    """``dir://`` over an s3fs filesystem the caller built (``fs``): one built synchronous (s3fs's
    default) was refused at open (the DirFileSystem was built asynchronous, as s3fs can be); it
    is served in threads, as a synchronous target is. One built asynchronous is served natively,
    and stays the caller's: the store's close does not close its client."""
    from s3fs import S3FileSystem

    target = S3FileSystem(**s3_options(moto_endpoint), asynchronous=asynchronous, skip_instance_cache=True)
    store = create_async_storage("fsspec", None, url="dir://store", namespace=NS_A,
                                 storage_options={"path": f"{moto_bucket}/dir-object/{uuid.uuid4().hex}",
                                                  "fs": target})
    async with store:
        assert await store.set("k", torch.ones(4))
        got = await store.get("k", torch.empty(4))
        assert got is not None and torch.equal(got, torch.ones(4))
        assert isinstance(store._local.get().ops, AsyncObjectOps if asynchronous else ThreadObjectOps)
    if asynchronous:
        assert target._s3 is not None and target._s3._endpoint.http_session._sessions is not None
        await target._s3.close()


@pytest.mark.parametrize("damage", [b"", b"not a page at all"])
async def test_a_dir_store_over_s3_deletes_a_page_damaged_at_rest(moto_endpoint: str, moto_bucket: str,
                                                                   damage: bytes) -> None:
    """``dir://`` over S3 served through the generic coroutines: a page damaged at rest could
    not be proven so (no ETag), so it stayed, claimed by every lookup while every read failed
    (an empty object's 416 was an error, not a short read). It is served as S3 is now: the
    damage is proven by the object's MD5, the page deleted, and lookups miss."""
    base = f"{moto_bucket}/dir-damage/{uuid.uuid4().hex}"
    store = create_async_storage("fsspec", None, url="dir://store", namespace=NS_A,
                                 storage_options={"path": base, "target_protocol": "s3",
                                                  "target_options": s3_options(moto_endpoint)})
    async with store:
        assert await store.set("k", torch.ones(4))
        await asyncio.to_thread(raw_put, moto_endpoint, f"{base}/{store.names.page('k', 'kv')}", damage)
        assert await store.get("k", torch.empty(4)) is None
        assert store.get_stats().get("corrupt_pages") == 1
        assert not await store.exists("k")
        assert await asyncio.to_thread(raw_get, moto_endpoint, f"{base}/{store.names.page('k', 'kv')}") is None


async def test_a_dir_store_over_s3_takes_digit_credentials_as_text(moto_endpoint: str, moto_bucket: str) -> None:
    """Credentials made of digits (a YAML config parses them as numbers) are text to the S3
    target of a ``dir://`` store, as to an ``s3`` store, and scrubbed from what it logs."""
    store = create_async_storage("fsspec", None, url="dir://store", namespace=NS_A,
                                 storage_options={"path": f"{moto_bucket}/dir-digits/{uuid.uuid4().hex}",
                                                  "target_protocol": "s3",
                                                  "target_options": {**s3_options(moto_endpoint),
                                                                     "secret": 31415926535}})
    assert "31415926535" not in store._redactor.scrub("signature of 31415926535")
    async with store:
        assert await store.set("k", torch.ones(4))
        assert store._local.get().ops.fs.secret == "31415926535"


def _files(top: Any) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*") if p.is_file())


@pytest.mark.parametrize("target", ["target_protocol", "fs"])
async def test_a_dir_url_over_local_folders_keeps_every_file_under_its_root(tmp_path: Any, target: str) -> None:
    """``dir://`` over local files (by ``target_protocol`` or a filesystem object): pages,
    manifest and run indexes land under the dir's root only, written whole (no temporary file
    left, none a reader could see half written), read back, and cleared."""
    from fsspec.implementations.local import LocalFileSystem

    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("x")
    opts: dict[str, Any] = {"path": str(root)}
    opts.update({"target_protocol": "file"} if target == "target_protocol" else {"fs": LocalFileSystem()})
    store = create_async_storage("fsspec", None, url="dir://store", storage_options=opts, namespace=NS_A)
    async with store:
        keys = [f"k{i}" for i in range(6)]
        assert await store.batch_set(keys, [torch.full((8,), float(i)) for i in range(6)])
        assert isinstance(store._local.get().ops, ThreadObjectOps)
        assert await store.batch_exists(keys) == 6
        got = await store.get("k3", torch.empty(8))
        assert got is not None and torch.equal(got, torch.full((8,), 3.0))
        await store.wait_index_writes()
        assert (root / "store" / NS_A.digest / "manifest.json").exists()
        assert not list(root.rglob("*.tmp"))
        assert _files(tmp_path) == ["outside.txt", *(f"root/{f}" for f in _files(root))]
        assert all(f.startswith(f"store/{NS_A.digest}/") for f in _files(root))
        assert await store.clear() and not await store.exists("k3")
    assert _files(tmp_path) == ["outside.txt", *(f"root/{f}" for f in _files(root))]


def test_a_dir_url_that_climbs_out_of_its_root_is_refused(tmp_path: Any) -> None:
    """A ``dir://`` url whose path climbs above the dir's root is a configuration error (fsspec
    refuses such a path only over local files, and only in recent releases)."""
    for target in ("file", "memory"):
        with pytest.raises(ConfigError, match="under the dir's root"):
            create_async_storage("fsspec", None, url="dir://a/../../escaped", namespace=NS_A,
                                 storage_options={"path": str(tmp_path / "root"), "target_protocol": target})


def test_a_chained_url_says_what_to_write_instead() -> None:
    """``dir::file:///path`` (fsspec's chained urls) was "no fsspec filesystem for 'dir::file'":
    it now says chained urls are not taken, and how to give the same store."""
    with pytest.raises(ConfigError, match=r"chained.*storage_options") as info:
        create_async_storage("fsspec", None, url="dir::file:///tmp/x", namespace=NS_A)
    assert "target_protocol" in str(info.value)


async def test_two_dir_stores_over_different_folders_never_answer_for_each_other(tmp_path: Any) -> None:
    """The process-wide existence cache is keyed by where a store's objects are: for ``dir://``
    that is the dir's root too (``path``), not the url alone, or a page stored through one
    folder's store was a hit of the other's."""
    stores = [create_async_storage("fsspec", None, url="dir://store", namespace=NS_A,
                                   storage_options={"path": str(tmp_path / name), "target_protocol": "file"})
              for name in ("one", "two")]
    async with stores[0] as one, stores[1] as two:
        assert await one.set("k", torch.ones(4))
        assert await one.exists("k")
        assert not await two.exists("k")
        assert await two.get("k", torch.empty(4)) is None


async def test_two_dir_stores_over_buckets_of_different_services_never_answer_for_each_other(
        moto_endpoint: str, moto_bucket: str) -> None:
    """A ``dir://`` store over S3 whose service is named in ``target_options``'
    ``client_kwargs`` (as s3fs takes it; the plain s3 url's key reads it there too) shared its
    existence cache with one over the same bucket name of another service: a page stored on
    one was a hit of the other, whose service never had it."""
    opts = s3_options(moto_endpoint)
    elsewhere = "http://127.0.0.1:9"  # another service (none answers there)

    def target(endpoint: str) -> dict[str, Any]:
        return {"key": opts["key"], "secret": opts["secret"], "client_kwargs": {"endpoint_url": endpoint},
                "asynchronous": True, "skip_instance_cache": True}

    stores = [create_async_storage("fsspec", None, url="dir://store", namespace=NS_A, call_timeout=1,
                                   storage_options={"path": f"{moto_bucket}/dir-services", "target_protocol": "s3",
                                                    "target_options": target(endpoint)})
              for endpoint in (moto_endpoint, elsewhere)]
    assert stores[0]._cache_scope() != stores[1]._cache_scope()
    async with stores[0] as one:
        assert await one.set("k", torch.ones(4))
        assert await one.exists("k")
    async with stores[1] as two:
        assert not await two.exists("k")



@pytest.mark.parametrize("url", ["memory://hicache-tests/{}", "dir://store"])
async def test_calls_on_the_shared_memory_filesystem_never_run_side_by_side(url: str, monkeypatch) -> None:
    """fsspec's memory filesystem keeps every instance's files in one class-level dict, not
    thread-safe, and calls on it ran side by side in worker threads: CI saw a clear's listing
    fail ("dictionary changed size during iteration") while another namespace's store wrote.
    Every call on it now takes one lock: two stores writing and clearing at once never have
    two calls inside the filesystem together (each call is slowed here to give them room)."""
    import threading
    import time

    from fsspec.implementations.memory import MemoryFileSystem

    from hicache.testing.store_tests import NS_B

    inside, most, guard = [0], [0], threading.Lock()

    def slowed(name: str) -> None:
        real = getattr(MemoryFileSystem, name)

        def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                time.sleep(0.002)
                return real(self, *args, **kwargs)
            finally:
                with guard:
                    inside[0] -= 1

        monkeypatch.setattr(MemoryFileSystem, name, call)

    for name in ("pipe_file", "cat_file", "find", "rm_file", "info"):
        slowed(name)
    folder = uuid.uuid4().hex
    options: dict[str, Any] = {}
    if url.startswith("dir://"):
        options = {"storage_options": {"path": f"/hicache-tests/{folder}", "target_protocol": "memory"}}
    root = url.format(folder)
    page = torch.arange(64, dtype=torch.float16)
    async with create_async_storage("fsspec", None, url=root, namespace=NS_A, **options) as one, \
            create_async_storage("fsspec", None, url=root, namespace=NS_B, **options) as two:

        async def work(store: AsyncHiCacheStorage, tag: str) -> None:
            for round_ in range(3):
                keys = [f"{tag}{round_}-{j}" for j in range(6)]
                assert await store.batch_set(keys, [page] * 6)
                assert await store.clear() is True

        await asyncio.gather(work(one, "a"), work(two, "b"))
    assert most[0] == 1, f"{most[0]} calls inside the memory filesystem at once"


_KILLED_WRITER = """
import asyncio, json, os, signal, sys, torch
from hicache.storage import create_async_storage
from hicache.testing.store_tests import NS_A

def killed(*args, **kwargs):  # the page is written whole under its temporary name: die before its rename
    os.kill(os.getpid(), signal.SIGKILL)

async def main() -> None:
    store = create_async_storage("fsspec", None, url=sys.argv[1], storage_options=json.loads(sys.argv[2]),
                                 namespace=NS_A)
    async with store:
        os.replace = killed
        await store.batch_set([f"k{j}" for j in range(8)], [torch.zeros(1 << 20, dtype=torch.uint8)] * 8)

asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
async def test_an_open_removes_the_temporary_files_of_writers_killed_mid_write(tmp_path: Any, kind: str) -> None:
    """A local writer SIGKILLed mid-write leaves ``<page>.<pid>-<n>.<machine>.tmp`` files. Only a
    clear removed them, so under a crash loop the folder grew for good. An open sweeps the
    namespace for those whose writer is surely gone (the file store's rule,
    :func:`hicache_backends.writers.tmp_abandoned`), and never a live writer's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from hicache_backends.writers import MACHINE_HEX

    root = tmp_path / "root"
    url, opts = ((f"file://{root}/store", {}) if kind == "file"
                 else ("dir://store", {"path": str(root), "target_protocol": "file"}))
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # each killed at its first page's rename, its temporary file written
        done = subprocess.run([sys.executable, str(script), url, json.dumps(opts)], env=env, timeout=120)
        assert done.returncode == -signal.SIGKILL
    assert list(root.rglob("*.tmp")), "no writer was killed mid-write"
    ns_dir = root / "store" / NS_A.digest
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {  # writes in flight: this process's, and another live process's
            ns_dir / "pages" / "00" / f"x.{os.getpid()}-999.{MACHINE_HEX}.tmp",
            ns_dir / f"manifest.json.{sleeper.pid}-0.{MACHINE_HEX}.tmp",
        }
        for path in live:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
        store = create_async_storage("fsspec", None, url=url, storage_options=opts, namespace=NS_A)
        async with store:
            deadline = time.monotonic() + 30
            while set(root.rglob("*.tmp")) != live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert set(root.rglob("*.tmp")) == live
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("url", ["file://", "file:///", "FILE://", "local:///"])
async def test_a_local_url_that_names_no_folder_is_refused(
    url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file://`` (the url of an empty variable, ``file://${KV_DIR}``) is the working
    directory to fsspec, and ``file:///`` gave relative names (its root ``/`` stripped to
    nothing), so both wrote their pages and manifest under whatever folder the process
    started in. Each is now a ConfigError saying to name the store's folder; a url naming one
    still works."""
    monkeypatch.chdir(tmp_path)
    try:
        store = create_async_storage("fsspec", None, url=url, namespace=NS_A)
    except ConfigError as exc:
        assert "names no folder" in str(exc)
    else:
        async with store:
            await store.set("k", torch.arange(16, dtype=torch.float32))
    assert list(tmp_path.iterdir()) == []  # nothing under the working directory
    store = create_async_storage("fsspec", None, url=f"file://{tmp_path}/kv", namespace=NS_A)
    async with store:
        assert await store.set("k", torch.arange(16, dtype=torch.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["kv"]


@pytest.mark.parametrize("options", [None, {"target_protocol": "file"}, {"path": "", "target_protocol": "memory"}])
def test_a_dir_url_without_its_path_says_so(options: dict[str, Any] | None) -> None:
    """A ``dir://`` store needs the folder its paths are under (storage_options ``path``);
    without it the store was made, passed the config check, and failed to open with fsspec's
    "'NoneType' object has no attribute 'startswith'". It is a ConfigError naming the option
    when the store is made."""
    with pytest.raises(ConfigError, match=r"needs storage_options 'path'"):
        create_async_storage("fsspec", None, url="dir://kv", storage_options=options, namespace=NS_A)
