"""``batch_get_v1_now``: a KV read done on the caller's own thread (SGLang's prefetch thread
calls the blocking facade; handing a batch of small pages to the store's loop and its I/O thread
and back costs more than the reads). Real file store on ``tmp_path``, SGLang's host layouts
through the adapter's :class:`CanonicalPagePool` (no SGLang needed for that).

It reads exactly what the loop would (pieces and live views alike, verified), leaves the index
to the loop (touches, adoptions, corrupt pages forgotten), and answers ``None`` without reading
or counting anything where only the loop's path may take the batch."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from hicache.storage import create_async_storage
from hicache_backends.file import FileStorage
from hicache_backends.file import io as file_io
from hicache_backends.file.layout import page_id
from test_segments import LAYOUTS, PS, _canonical_bytes, _indices, _pool, _store, _write


async def _settled() -> None:
    """Let the loop run the index's bookkeeping the read posted to it."""
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_it_reads_what_the_loop_reads(tmp_path, layout: str) -> None:
    writer, reader = _pool(layout, seed=1), _pool(layout, seed=2)
    async with await _store(tmp_path, writer) as store:
        assert await _write(store, writer, ["a", "b", "c"], [0, 1, 2]) == [True] * 3
        store.register_mem_pool_host(reader)
        before, untouched = store.get_stats(), _canonical_bytes(reader, 4)
        got = await asyncio.to_thread(store.batch_get_v1_now, ["c", "x", "a"], _indices([5, 4, 3]))
        assert got == [True, False, True]
        assert _canonical_bytes(reader, 5) == _canonical_bytes(writer, 2)
        assert _canonical_bytes(reader, 3) == _canonical_bytes(writer, 0)
        assert _canonical_bytes(reader, 4) == untouched  # the miss
        after = store.get_stats()
        assert after["read_pages"] - before["read_pages"] == 3 and after["read_hits"] - before["read_hits"] == 2


async def test_the_loop_learns_what_the_reads_found(tmp_path) -> None:
    """A page read is touched in the index, one another store wrote is adopted, a corrupt one
    is forgotten and counted: on the loop, after the answer."""
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer) as store, await _store(tmp_path, writer) as other:
        assert await _write(store, writer, ["a", "b"], [0, 1]) == [True, True]
        assert await _write(other, writer, ["c"], [2]) == [True]
        store.register_mem_pool_host(reader)
        a = page_id("a", "kv")
        old = store.index.entries[a].atime
        _flip_payload_byte(store.layout.path(page_id("b", "kv")))  # the checksum fails
        await asyncio.sleep(0.01)
        got = await asyncio.to_thread(store.batch_get_v1_now, ["a", "b", "c"], _indices([3, 4, 5]))
        assert got == [True, False, True]
        await _settled()
        assert store.index.entries[a].atime > old
        assert page_id("b", "kv") not in store.index.entries and store.get_stats()["corrupt_pages"] == 1
        assert page_id("c", "kv") in store.index.entries  # adopted
        assert _canonical_bytes(reader, 5) == _canonical_bytes(writer, 2)


async def test_batches_only_the_loop_may_take_answer_none_and_count_nothing(tmp_path, monkeypatch) -> None:
    pool = _pool("layer_first", seed=1)
    store = await _store(tmp_path, pool)
    assert store.batch_get_v1_now(["a"], _indices([0])) is None  # not open yet
    async with store:
        assert await _write(store, pool, ["a", "b"], [0, 1]) == [True, True]
        before = store.get_stats()
        asks = [
            (["a", ""], _indices([2, 3])),  # a bad key: the loop's path fails it alone
            (["a", "b"], _indices([2])),  # too few indices
            (["a", "b"], torch.cat([_indices([2]), _indices([3]).flip(0)])),  # a page not one run
            (["a", "b"], _indices([2, 2])),  # two pages into the same memory
            ([], torch.zeros(0, dtype=torch.int64)),
        ]
        for keys, idx in asks:
            assert store.batch_get_v1_now(keys, idx) is None
        assert store.get_stats() == before  # nothing counted: the loop's path counts them
        monkeypatch.setattr(file_io, "read_page_into", lambda *a: pytest.fail("read on a declined batch"))
        big = create_async_storage("file", root=str(tmp_path / "big"), namespace={"model": "big"}, io_threads=4)
        big_pool = _pool("layer_first", seed=1, dim=4096)  # 384 KiB pages: the loop's threads share them
        big.register_mem_pool_host(big_pool)
        async with big:
            assert big.batch_get_v1_now(["a", "b"], _indices([0, 1])) is None
        monkeypatch.undo()
        one = create_async_storage("file", root=str(tmp_path / "big"), namespace={"model": "big"}, io_threads=1)
        one.register_mem_pool_host(big_pool)
        async with one:  # one I/O thread: the loop would read them one by one too
            assert one.batch_get_v1_now(["a", "b"], _indices([0, 1])) == [False, False]
    assert store.batch_get_v1_now(["a"], _indices([0])) is None  # closed
    memory = create_async_storage("memory", namespace={"model": "m"})
    memory.register_mem_pool_host(pool)
    async with memory:
        assert memory.batch_get_v1_now(["a"], _indices([0])) is None  # a backend that reads only on its loop


async def test_an_overridden_read_is_never_skipped(tmp_path, monkeypatch) -> None:
    class Refusing(FileStorage):
        async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
            return [False] * len(pages)

    pool = _pool("layer_first", seed=1)
    refusing = Refusing(root=str(tmp_path / "r"), namespace={"model": "segments-test"})
    refusing.register_mem_pool_host(pool)
    async with refusing:
        assert await _write(refusing, pool, ["a"], [0]) == [True]
        assert refusing.batch_get_v1_now(["a"], _indices([1])) is None
    async with await _store(tmp_path / "p", pool) as store:
        assert await _write(store, pool, ["a"], [0]) == [True]

        async def nothing(pages, buffers):  # type: ignore[no-untyped-def]
            return [False] * len(pages)

        monkeypatch.setattr(store, "_read", nothing)  # on the instance
        assert store.batch_get_v1_now(["a"], _indices([1])) is None


async def test_a_timeout_fails_the_pages_not_started(tmp_path, monkeypatch) -> None:
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer) as store:
        assert await _write(store, writer, ["a", "b", "c"], [0, 1, 2]) == [True] * 3
        store.register_mem_pool_host(reader)
        real = file_io.read_page_into

        def slow(*args):  # type: ignore[no-untyped-def]
            time.sleep(0.05)
            return real(*args)

        monkeypatch.setattr(file_io, "read_page_into", slow)
        got = await asyncio.to_thread(store.batch_get_v1_now, ["a", "b", "c"], _indices([3, 4, 5]), 0.01)
        assert got == [True, False, False]
        assert store.get_stats()["call_timeouts"] == 1
        await _settled()
        assert page_id("b", "kv") in store.index.entries  # a page not read is not forgotten


async def test_a_failing_read_is_a_counted_miss(tmp_path, monkeypatch) -> None:
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer) as store:
        assert await _write(store, writer, ["a"], [0]) == [True]
        store.register_mem_pool_host(reader)

        def broken(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("disk on fire")

        monkeypatch.setattr(file_io, "read_page_into", broken)
        assert store.batch_get_v1_now(["a"], _indices([1])) == [False]
        assert store.get_stats()["backend_errors"] == 1


async def test_reads_beside_evictions_and_rewrites_are_whole_pages_or_misses(tmp_path) -> None:
    """A thread reads while the loop deletes and rewrites the same pages: every page answered
    present holds exactly what was written under its key."""
    pool = _pool("page_first", seed=1)  # written from pages 0-2, read into pages 3-5
    keys = ["a", "b", "c"]
    stop = threading.Event()
    seen: list[list[bool]] = []
    bad: list[str] = []
    async with await _store(tmp_path, pool) as store:
        assert await _write(store, pool, keys, [0, 1, 2]) == [True] * 3
        want = [_canonical_bytes(pool, i) for i in range(3)]

        def read_loop() -> None:
            while not stop.is_set():
                got = store.batch_get_v1_now(keys, _indices([3, 4, 5]))
                assert got is not None
                seen.append(got)
                for i, ok in enumerate(got):
                    if ok and _canonical_bytes(pool, 3 + i) != want[i]:
                        bad.append(keys[i])
                time.sleep(0.0005)

        t = threading.Thread(target=read_loop)
        t.start()
        try:
            for _ in range(20):
                assert (await store.batch_delete(["b"])) is not None
                assert await _write(store, pool, ["b"], [1]) == [True]
                await asyncio.sleep(0.001)
        finally:
            stop.set()
            await asyncio.to_thread(t.join)
    assert seen and not bad and any(got[1] for got in seen)


def _reads_that_pause(monkeypatch) -> tuple[threading.Event, threading.Event]:  # type: ignore[no-untyped-def]
    """Each page read on the caller's thread reads its file, sets ``was_read``, then waits for
    ``go``: the loop's removals and writes run between the read and its settlement."""
    real = file_io.read_page_into
    was_read, go = threading.Event(), threading.Event()

    def read_then_wait(*args):  # type: ignore[no-untyped-def]
        result = real(*args)
        was_read.set()
        go.wait(5)
        return result

    monkeypatch.setattr(file_io, "read_page_into", read_then_wait)
    return was_read, go


def _flip_payload_byte(path: str) -> None:
    """Bit rot: one payload byte flipped in place. Not a rewrite (``open(path, "wb")``): that
    truncates the file first, and a scan running beside it (the second store's, at open) saw
    a torn page and removed it, so the read found nothing to call corrupt."""
    with open(path, "r+b") as f:
        f.seek(-40, 2)
        byte = f.read(1)[0]
        f.seek(-40, 2)
        f.write(bytes([byte ^ 0xFF]))


async def test_a_page_removed_while_it_was_read_is_not_indexed_again(tmp_path, monkeypatch) -> None:
    """The read found the page whole, but the loop deleted it meanwhile (no pins on this
    path): the caller gets its page, the index does not get the page back."""
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer) as store:
        assert await _write(store, writer, ["a"], [0]) == [True]
        store.register_mem_pool_host(reader)
        was_read, go = _reads_that_pause(monkeypatch)
        reading = asyncio.ensure_future(asyncio.to_thread(store.batch_get_v1_now, ["a"], _indices([1])))
        await asyncio.to_thread(was_read.wait, 5)
        assert await store.batch_delete(["a"]) == [True]
        go.set()
        assert await reading == [True]
        assert _canonical_bytes(reader, 1) == _canonical_bytes(writer, 0)
        await _settled()
        assert page_id("a", "kv") not in store.index.entries
        assert await store.exists_prefix(["a"]) == 0


async def _corrupt_b_being_read(store, writer, reader, monkeypatch):  # type: ignore[no-untyped-def]
    """Pages "a" and "b" stored, "b" corrupt on disk, and a read of "b" on another thread that
    has read (and removed) the file and now waits for ``go`` before its answer and settlement."""
    assert await _write(store, writer, ["a", "b"], [0, 1]) == [True, True]
    store.register_mem_pool_host(reader)
    _flip_payload_byte(store.layout.path(page_id("b", "kv")))
    was_read, go = _reads_that_pause(monkeypatch)
    reading = asyncio.ensure_future(asyncio.to_thread(store.batch_get_v1_now, ["b"], _indices([4])))
    await asyncio.to_thread(was_read.wait, 5)
    return reading, go


async def test_a_corrupt_page_removed_by_the_read_beside_a_delete_leaves_the_shared_count(tmp_path, monkeypatch) -> None:
    """The read removes the corrupt file; the delete beside it (no pin on this path) finds no
    file to free: the read's removal is what gives the bytes back to the shared ledger."""
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer) as store:
        reading, go = await _corrupt_b_being_read(store, writer, reader, monkeypatch)
        await store.batch_delete(["b"])
        go.set()
        assert await reading == [False]
        await _settled()
        monkeypatch.undo()
        assert await _write(store, writer, ["c"], [2]) == [True]  # a reservation settles what is owed
        on_disk = sum(store.index.entries[page_id(k, "kv")].size for k in ("a", "c"))
        assert store._space.ledger.read().used == on_disk
        assert store.get_stats()["corrupt_pages"] == 1


async def test_a_corrupt_read_never_forgets_the_good_page_written_meanwhile(tmp_path, monkeypatch) -> None:
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    async with await _store(tmp_path, writer, shared=False) as store:
        reading, go = await _corrupt_b_being_read(store, writer, reader, monkeypatch)
        assert await store.batch_delete(["b"]) == [True]
        assert await _write(store, writer, ["b"], [1]) == [True]  # written again, indexed again
        go.set()
        assert await reading == [False]
        await _settled()
        assert page_id("b", "kv") in store.index.entries and await store.exists_prefix(["b"]) == 1


async def test_a_close_waits_for_reads_on_callers_threads(tmp_path, monkeypatch) -> None:
    """A read running on a caller's thread lands in pool memory before the close returns;
    a read asked after the close began is refused (``None``: the loop's path answers it)."""
    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    store = await _store(tmp_path, writer)
    await store.open()
    assert await _write(store, writer, ["a"], [0]) == [True]
    store.register_mem_pool_host(reader)
    was_read, go = _reads_that_pause(monkeypatch)
    reading = asyncio.ensure_future(asyncio.to_thread(store.batch_get_v1_now, ["a"], _indices([1])))
    await asyncio.to_thread(was_read.wait, 5)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0.1)
    assert not closing.done()
    assert store.batch_get_v1_now(["a"], _indices([2])) is None
    go.set()
    await closing
    assert reading.done() and reading.result() == [True]


def test_the_blocking_facade_reads_and_looks_up_on_the_callers_thread(tmp_path, monkeypatch) -> None:
    """Every blocking caller gets the caller-thread paths through the facade, not only the
    SGLang adapter: no call reaches the facade's loop for an indexed lookup or a small read."""
    from hicache.errors import LoopMisuseError
    from hicache.storage.sync import HiCacheStorage

    writer, reader = _pool("layer_first", seed=1), _pool("layer_first", seed=2)
    store = create_async_storage("file", root=str(tmp_path), namespace={"model": "segments-test"})
    store.register_mem_pool_host(writer)
    facade = HiCacheStorage(store)
    try:
        facade.run(store.open())
        assert facade.batch_set_v1(["a", "b"], _indices([0, 1])) == [True, True]
        store.register_mem_pool_host(reader)
        on_loop: list[object] = []
        real = facade._loop_thread.call

        def counted(coro, timeout=None, **options):  # type: ignore[no-untyped-def]
            on_loop.append(coro)
            return real(coro, timeout, **options)

        monkeypatch.setattr(facade._loop_thread, "call", counted)
        assert facade.exists_prefix(["a", "b", "c"]) == 2
        assert facade.batch_get_v1(["a", "b"], _indices([2, 3])) == [True, True]
        assert on_loop == []
        assert _canonical_bytes(reader, 3) == _canonical_bytes(writer, 1)

        async def inside_a_loop() -> None:
            with pytest.raises(LoopMisuseError):  # still the misuse it always was
                facade.batch_get_v1(["a"], _indices([4]))

        asyncio.run(inside_a_loop())
    finally:
        facade.close()


async def test_close_waits_once_for_both_kinds_of_call(tmp_path, monkeypatch) -> None:
    """A call stuck on the loop and a read stuck on a caller's thread share one close limit:
    each used to get the whole limit in turn (a minute, by default, before the threads stopped)."""
    from hicache_backends.file import backend as file_backend

    limit = 0.6
    monkeypatch.setattr(file_backend, "_CLOSE_CALLS_WAIT_SECONDS", limit)
    pool = _pool("layer_first", seed=1)
    fs = await _store(tmp_path, pool)
    await fs.open()
    fs._calls += 1  # a call on the loop that never returns
    fs._calls_idle.clear()
    assert fs._caller_reads.enter()  # and a read on a caller's thread that never returns
    t0 = time.monotonic()
    await fs.aclose()
    took = time.monotonic() - t0
    assert limit <= took < 1.6 * limit, took
    fs._caller_reads.leave()
