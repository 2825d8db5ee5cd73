"""File store races found by a concurrency fuzzer of the storage layer: a close racing calls
in flight, and two processes clearing one namespace at once."""

from __future__ import annotations

import asyncio
import logging
import os

import torch

from hicache.storage import create_async_storage
from hicache.testing.store_tests import NS_A
from hicache_backends.file import FileStorage
from hicache_backends.file import io as file_io
from hicache_backends.file.ledger import LEDGER_NAME, read_usage

from _file_helpers import all_files, slow_page_writes


def make_store(root, **options) -> FileStorage:  # type: ignore[no-untyped-def]
    store = create_async_storage("file", None, root=str(root), namespace=NS_A, min_free_bytes=0, **options)
    assert isinstance(store, FileStorage)
    return store


async def test_close_waits_for_a_write_in_flight(tmp_path, monkeypatch, caplog) -> None:
    """aclose() racing a batch whose page writes are on the I/O threads: the batch settles its
    ledger reservation and indexes its pages before the executors go (it used to find them shut
    down: 'cannot schedule new futures after shutdown', logged at ERROR, the pages it had put on
    disk reported as failed and the shared ledger left with the reservation)."""
    store = make_store(tmp_path, max_bytes=1 << 20)
    await store.open()
    await store.wait_index_ready()
    started = slow_page_writes(monkeypatch, 0.3)
    vals = [torch.full((64,), i, dtype=torch.uint8) for i in range(2)]
    task = asyncio.create_task(store.batch_set(["a", "b"], vals))
    assert await asyncio.to_thread(started.wait, 5)
    with caplog.at_level(logging.ERROR):
        await store.aclose()
        ok = await task
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert store.stats.get("backend_errors") == 0
    assert ok is True
    on_disk = sum(os.path.getsize(f) for f in all_files(tmp_path) if f.endswith(".page"))
    usage = read_usage(os.path.join(store.layout.ns_dir, LEDGER_NAME))
    assert usage is not None and usage.used == on_disk


async def test_clear_racing_a_peer_clear(tmp_path, monkeypatch, caplog) -> None:
    """Two processes clear the same namespace at once: the peer's rename of the namespace folder
    lands between this clear's makedirs and its manifest write. Both clears succeed (it used to
    answer False and log 'clear failed' at ERROR)."""
    a, b = make_store(tmp_path), make_store(tmp_path)
    async with a, b:
        assert await a.set("k", torch.zeros(16, dtype=torch.uint8))
        real = file_io._write_manifest
        raced = []

        def peer_clears_first(layout, manifest):
            if not raced:  # the peer's clear renames the folder away just now (its re-creation comes later)
                raced.append(1)
                os.rename(layout.ns_dir, os.path.join(layout.root, f".trash-{layout.digest}-1-1"))
            return real(layout, manifest)

        monkeypatch.setattr(file_io, "_write_manifest", peer_clears_first)
        with caplog.at_level(logging.ERROR):
            assert await a.clear() is True
        assert raced
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        assert a.index_ready
        assert os.path.isfile(a.layout.manifest_path)
        assert not await a.exists("k")
        assert await a.set("k2", torch.ones(16, dtype=torch.uint8))
        assert await b.exists("k2")


async def test_a_peer_clear_landing_inside_makedirs_is_set_up_again(tmp_path, monkeypatch, caplog) -> None:
    """A peer's clear renamed the namespace folder away while this clear's makedirs ran: makedirs
    found the page folder it was told exists gone and raised FileExistsError, and the clear
    failed (False, 'clear failed' at ERROR), where a rename between the steps is set up again."""
    a = make_store(tmp_path)
    async with a:
        assert await a.set("k", torch.zeros(16, dtype=torch.uint8))
        real = os.makedirs
        raced: list[int] = []

        def peer_clears_inside(name, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not raced and str(name).endswith("pages"):
                raced.append(1)
                layout = a._layout
                real(name, *args, **kwargs)  # made, then the peer's rename before makedirs looks again
                os.rename(layout.ns_dir, os.path.join(layout.root, f".trash-{layout.digest}-1-2"))
                raise FileExistsError(17, "File exists", str(name))
            return real(name, *args, **kwargs)

        monkeypatch.setattr(file_io.os, "makedirs", peer_clears_inside)
        with caplog.at_level(logging.ERROR):
            assert await a.clear() is True
        monkeypatch.setattr(file_io.os, "makedirs", real)
        assert raced and not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert await a.set("k2", torch.zeros(16, dtype=torch.uint8))


async def test_a_close_cut_short_leaves_the_namespace_to_others(tmp_path, monkeypatch) -> None:
    """A close cancelled (past a caller's limit) while a batch's page write was on an I/O
    thread released the ledger's files, then the batch's settlement on that thread opened
    them again, the ``users`` lock with them, and held it for the life of the process: every
    later store of the namespace found another process using it, and no scan of theirs
    corrected the count again. A closed ledger now lets go of its files after each call.
    Forced order: the write waits until the close was cancelled."""
    import threading

    import pytest

    from hicache_backends.file.ledger import UsageLedger

    store = make_store(tmp_path, max_bytes=1 << 20)
    await store.open()
    await store.wait_index_ready()
    started, go = threading.Event(), threading.Event()
    real = file_io.write_page

    def held(*args):  # type: ignore[no-untyped-def]
        started.set()
        assert go.wait(30)
        return real(*args)

    monkeypatch.setattr(file_io, "write_page", held)
    write = asyncio.create_task(store.batch_set(["a"], [torch.full((64,), 1, dtype=torch.uint8)]))
    try:
        assert await asyncio.to_thread(started.wait, 30)
        closing = asyncio.create_task(store.aclose())
        await asyncio.sleep(0.05)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
    finally:
        go.set()
    await asyncio.gather(write, return_exceptions=True)
    on_disk = sum(os.path.getsize(f) for f in all_files(tmp_path) if f.endswith(".page"))
    usage = read_usage(os.path.join(store.layout.ns_dir, LEDGER_NAME))
    assert usage is not None and usage.used == on_disk and usage.inflight == 0  # the settlement still landed
    other = UsageLedger(store.layout.ns_dir)  # another store's, opening the namespace now
    try:
        assert other.alone()
    finally:
        other.close()
