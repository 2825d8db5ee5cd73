"""``exists_prefix_now``: the file store's lookup answered on the caller's own thread (SGLang's
prefetch thread asks through the blocking facade; a hop to the loop and back costs more than
the dictionary lookups it stands for). It answers what the loop would, or ``None`` when only the
loop can (not open, bad keys, a page another process wrote that the loop must index first)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import torch

from hicache.storage import create_async_storage
from hicache_backends.file import FileStorage
from hicache_backends.file.layout import page_id
from hicache_backends.memory import MemoryStorage

NS = {"model": "lookup-now"}


def _store(root: Path, **options) -> FileStorage:  # type: ignore[no-untyped-def]
    store = create_async_storage("file", None, root=str(root), namespace=NS, **options)
    assert isinstance(store, FileStorage)
    return store


def _pages(n: int, fill: int = 1) -> list[torch.Tensor]:
    return [torch.full((4096,), fill + i, dtype=torch.uint8) for i in range(n)]


async def test_it_answers_the_indexed_run_as_the_loop_does(tmp_path: Path) -> None:
    for shared in (True, False):
        async with _store(tmp_path / str(shared), shared=shared) as store:
            assert await store.batch_set(["a", "b", "d"], _pages(3))
            for keys in (["a", "b", "c", "d"], ["c", "a"], ["a", "b", "d"], []):
                assert store.exists_prefix_now(keys) == await store.exists_prefix(keys)
            assert store.exists_prefix_now(["a", "b"], "mamba") == 0  # another pool's pages


async def test_closed_stores_bad_keys_and_loop_only_backends_answer_none(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.exists_prefix_now(["a"]) is None  # never opened: the loop opens it
    async with store:
        assert await store.batch_set(["a"], _pages(1))
        assert store.exists_prefix_now([""]) is None  # the loop's path raises the proper error
        assert store.exists_prefix_now(["a", "\x00"]) is None
        assert store.exists_prefix_now(["a"]) == 1
    assert store.exists_prefix_now(["a"]) is None  # closed
    memory = create_async_storage("memory", namespace=NS)
    assert isinstance(memory, MemoryStorage)
    async with memory:
        assert await memory.batch_set(["a"], _pages(1))
        assert memory.exists_prefix_now(["a"]) is None  # no override: every lookup on the loop


async def test_a_page_another_store_wrote_goes_to_the_loop_to_be_indexed(tmp_path: Path) -> None:
    """Shared store: the first page missing from the index is looked for on disk; found, only
    the loop may index it (the answer is ``None``), and afterwards the thread answers it."""
    async with _store(tmp_path) as mine, _store(tmp_path) as other:
        assert await mine.batch_set(["a", "b"], _pages(2))
        assert await other.batch_set(["c"], _pages(1, fill=9))
        keys = ["a", "b", "c", "d"]
        assert mine.exists_prefix_now(keys) is None
        assert await mine.exists_prefix(keys) == 3  # the loop adopts "c"
        assert mine.exists_prefix_now(keys) == 3
    async with _store(tmp_path / "private", shared=False) as mine, _store(tmp_path / "private", shared=False) as other:
        await mine.wait_index_ready()
        assert await other.batch_set(["a"], _pages(1))
        # not shared, index complete: what others write is not looked for, by the loop neither
        assert mine.exists_prefix_now(["a"]) == 0 == await mine.exists_prefix(["a"])


async def test_pages_on_their_way_out_and_unreadable_files_are_not_claimed(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        assert await store.batch_set(["a", "b", "c"], _pages(3))
        pid = page_id("b", "kv")
        store._pins.deleting.add(pid)  # an unlink pending
        try:
            assert store.exists_prefix_now(["a", "b", "c"]) == 1
        finally:
            store._pins.deleting.discard(pid)
        (path,) = tmp_path.rglob(f"{pid}.page")
        store.index.entries.pop(pid)  # as if another process had written "b": on disk, not indexed
        assert store.exists_prefix_now(["a", "b", "c"]) is None  # only the loop may index it
        assert await store.exists_prefix(["a", "b", "c"]) == 3
        assert store.exists_prefix_now(["a", "b", "c"]) == 3
        store.index.entries.pop(pid)
        path.write_bytes(b"not a page")  # torn by a crash: a miss, on either path
        assert store.exists_prefix_now(["a", "b", "c"]) == 1 == await store.exists_prefix(["a", "b", "c"])


async def test_lookups_are_counted_and_a_failing_backend_falls_back(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async with _store(tmp_path) as store:
        assert await store.batch_set(["a", "b"], _pages(2))
        before = store.get_stats()
        assert store.exists_prefix_now(["a", "b", "c"]) == 2
        after = store.get_stats()
        assert after["exists_calls"] - before["exists_calls"] == 1
        assert after["exists_keys"] - before["exists_keys"] == 3
        assert after["exists_hits"] - before["exists_hits"] == 2

        def broken(pages, deadline=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("index gone")

        monkeypatch.setattr(store, "_exists_prefix_now", broken)
        assert store.exists_prefix_now(["a"]) is None
        monkeypatch.setattr(store, "_exists_prefix_now", lambda pages, deadline=None: 5)  # more than asked
        assert store.exists_prefix_now(["a"]) is None
        monkeypatch.setattr(store, "_exists_prefix_now", lambda pages, deadline=None: True)  # not a count
        assert store.exists_prefix_now(["a"]) is None
        assert store.get_stats()["backend_errors"] - before["backend_errors"] == 3
        assert await store.exists_prefix(["a", "b"]) == 2  # the loop's path is untouched


async def test_a_thread_asking_while_the_loop_writes_sees_the_run_grow(tmp_path: Path) -> None:
    """Answers from another thread during writes: a run that never shrinks and never counts a
    page the loop has not indexed (an on-disk page not yet indexed answers ``None``)."""
    keys = [f"k{i}" for i in range(40)]
    seen: list[int | None] = []
    done = threading.Event()
    async with _store(tmp_path) as store:

        def ask() -> None:
            while not done.is_set():
                seen.append(store.exists_prefix_now(keys))
                time.sleep(0.0002)  # lets the loop have the GIL between lookups

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            for i, k in enumerate(keys):
                assert await store.batch_set([k], _pages(1, fill=i))
                await asyncio.sleep(0)
        finally:
            done.set()
            await asyncio.to_thread(asker.join)
        assert store.exists_prefix_now(keys) == len(keys)
    runs = [r for r in seen if r is not None]
    assert runs and runs == sorted(runs) and all(0 <= r <= len(keys) for r in runs)


async def test_subclasses_that_change_the_lookup_are_asked_on_the_loop(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A store whose ``_exists`` or ``_exists_prefix`` is overridden (the slow store's added
    latency, a fault injector) answers ``None`` here: the override must run."""
    from hicache.testing.slow_store import SlowFileStorage

    class Refusing(FileStorage):
        async def _exists_prefix(self, pages):  # type: ignore[no-untyped-def]
            return 0

    slow = SlowFileStorage(root=str(tmp_path / "slow"), namespace=NS, latency_ms=1)
    refusing = Refusing(root=str(tmp_path / "refusing"), namespace=NS)
    for store in (slow, refusing):
        async with store:
            assert await store.batch_set(["a"], _pages(1))
            assert store.exists_prefix_now(["a"]) is None
    async with _store(tmp_path / "patched") as store:
        assert await store.batch_set(["a"], _pages(1))
        assert store.exists_prefix_now(["a"]) == 1

        async def none_exist(pages):  # type: ignore[no-untyped-def]
            return [False] * len(pages)

        monkeypatch.setattr(store, "_exists", none_exist)  # on the instance
        assert store.exists_prefix_now(["a"]) is None
        assert await store.exists_prefix(["a"]) == 0


def test_lookups_on_a_hung_mount_answer_within_the_call_timeout(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A shared store probes on disk the first page its index lacks; on a slow or hung mount
    that probe takes seconds and cannot be cut. Every lookup of the blocking facade still
    answers within ``call_timeout``: the on-thread one as a miss at that page, the ones on the
    loop with a TimeoutError, not once the probe returned. Stuck probes do not pile up."""
    from hicache.storage.sync import HiCacheStorage
    from hicache_backends.file import io as page_io

    facade = HiCacheStorage(_store(tmp_path, shared=True, min_free_bytes=0), call_timeout=0.5)
    facade.open()
    assert facade.batch_set(["a", "b"], _pages(2))
    release = threading.Event()
    probe = page_io.probe_page
    running = [0]
    peak = [0]
    lock = threading.Lock()

    def hung_probe(path):  # type: ignore[no-untyped-def]
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            release.wait(3.0)  # the mount answers 3 s late
            return probe(path)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(page_io, "probe_page", hung_probe)
    try:
        t0 = time.monotonic()
        assert facade.exists_prefix(["a", "b", "c"]) == 2  # the probe of "c" outlived the timeout
        assert time.monotonic() - t0 < 1.5
        assert facade.exists_prefix(["a", "b"]) == 2  # indexed: no probe, answered at once
        for call in (lambda: facade.exists("c"), lambda: facade.batch_exists(["a", "c"]),
                     lambda: facade.batch_exists_v2(["a", "c"])):
            t0 = time.monotonic()
            try:
                call()
            except TimeoutError:
                pass
            assert time.monotonic() - t0 < 1.5
        for _ in range(20):  # a lookup storm while the mount hangs: misses, at once once stuck
            assert facade.exists_prefix(["a", "b", "c"]) == 2
        assert peak[0] <= 8  # the store's I/O threads and a few probe threads, not one per lookup
        assert facade.get_stats()["lookup_probe_timeouts"] >= 21
    finally:
        release.set()
        facade.close()
