"""A storage call the controller gives up on (timeout, abort, close) keeps its host pages out
of use until the backend has really returned.

The backend here moves bytes on a worker thread that blocks on a gate the test opens (a hung
mount that comes back), as the file backend's I/O threads do. Every host-page free is recorded
with whether that thread had finished: a page freed - and so reusable by another request -
while the thread may still write into it (a read) or read from it (a write, which would store
someone else's KV under this key) is the bug these tests catch.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence

import pytest
import torch
from hicache_backends.memory import MemoryStorage

from hicache.controller import ControllerConfig, StorageWriteJob
from hicache.keys import page_hashes
from hicache.replay import StackConfig, build_stack
from hicache.storage import PageKey
from hicache.storage.offload import run_to_completion
from hicache.testing import eventually

PS = 4
PAGES = 4


class GatedThreadStorage(MemoryStorage):
    """The memory backend whose reads and writes (once ``hold()`` is called) wait on a worker
    thread until ``open_gate()``; ``busy`` is set while such a thread runs."""

    backend_name = "gated-thread-memory"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.busy = threading.Event()

    def hold(self) -> None:
        self.gate.clear()

    def open_gate(self) -> None:
        self.gate.set()

    def _gated(self, fn, *args):  # type: ignore[no-untyped-def]
        self.busy.set()
        try:
            self.gate.wait(60)
            return fn(*args)
        finally:
            self.busy.clear()

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        return await run_to_completion(self._gated, self._read_into, pages, buffers)

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        return await run_to_completion(self._gated, self._store, pages, buffers)


def make(store: GatedThreadStorage, **controller: object):  # type: ignore[no-untyped-def]
    base: dict[str, object] = dict(
        prefetch_threshold=PS, prefetch_batch_pages=PAGES, storage_io_timeout_s=0.2, storage_stall_s=0.0,
        storage_max_retries=0, storage_retry_base_s=0.001, storage_probe_base_s=0.05,
        storage_probe_max_s=0.1, cancelled_io_grace_s=0.0, close_timeout_s=5.0,
    )
    base.update(controller)
    cfg = StackConfig(page_size=PS, device_pages=16, host_pages=32, storage_backend=None,
                      controller=ControllerConfig(**base))  # type: ignore[arg-type]
    return build_stack(cfg, storage=store)


class FreeLog:
    """The controller's host-page frees, each with whether the backend thread was still busy."""

    def __init__(self, stack, store: GatedThreadStorage) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.pool = stack.host_pool
        self.early: list[int] = []  # pages freed while the thread still ran
        self.freed = 0
        stack.controller.set_host_free(self)

    def __call__(self, indices: torch.Tensor) -> None:
        if self.store.busy.is_set():
            self.early.append(indices.numel() // PS)
        self.freed += indices.numel() // PS
        self.pool.free(indices)


async def seeded(store: GatedThreadStorage, keys: list[str]) -> None:
    """Write the pages under ``keys`` through a stack of their own (gate open)."""
    stack = make(store)
    host = stack.host_pool.alloc(len(keys) * PS)
    done: list[int] = []
    assert stack.controller.submit_storage_write(StorageWriteJob(keys, host, None, done.append))
    await stack.controller.drain()
    assert done == [len(keys)]
    stack.host_pool.free(host)
    await stack.aclose()


def keys_for(n: int) -> list[str]:
    return page_hashes(list(range(1000, 1000 + n * PS)), PS)


async def stored_pages(kind: type[GatedThreadStorage] = GatedThreadStorage) -> tuple[GatedThreadStorage, list[str]]:
    """A gated backend (of ``kind``) over a fresh medium that already holds ``PAGES`` pages,
    and their keys."""
    store_id = f"gated-{uuid.uuid4()}"
    keys = keys_for(PAGES)
    await seeded(GatedThreadStorage(store_id=store_id), keys)
    return kind(store_id=store_id), keys


def held_prefetch(stack, store: GatedThreadStorage, keys: list[str]):  # type: ignore[no-untyped-def]
    """Start a prefetch of ``keys`` whose read will hang on the gate, with frees recorded."""
    ctl = stack.controller
    log = FreeLog(stack, store)
    free_before = stack.host_pool.available_size()
    store.hold()
    op = ctl.start_prefetch("r", keys, alloc_host=stack.host_pool.alloc)
    assert op is not None
    return ctl, log, op, free_before


async def test_a_read_that_times_out_holds_its_pages_until_the_thread_returns() -> None:
    store, keys = await stored_pages()
    stack = make(store)
    ctl, log, op, free_before = held_prefetch(stack, store, keys)
    await eventually(lambda: ctl.metrics.counters.get("storage_timeouts", 0) == 1)
    await asyncio.sleep(0.3)  # where the old grace period had long ended and freed the pages
    assert not op.finished and log.freed == 0
    assert ctl.metrics.counters.get("storage_calls_stuck") == 1
    assert ctl.metrics.snapshot()["gauges"]["storage_calls_stuck_now"] == 1
    store.open_gate()
    await ctl.wait_prefetches()
    assert op.finished and op.completed_pages == 0  # a timed-out read is a miss, never a hit
    res = ctl.take_prefetch("r")
    assert res is None or res.pages == 0
    await eventually(lambda: stack.host_pool.available_size() == free_before)
    assert log.early == [] and log.freed == PAGES
    assert ctl.metrics.snapshot()["gauges"]["storage_calls_stuck_now"] == 0
    await stack.aclose()


async def test_an_aborted_read_frees_its_pages_only_after_the_thread_returns() -> None:
    store, keys = await stored_pages()
    stack = make(store, storage_io_timeout_s=30.0)
    ctl, log, op, free_before = held_prefetch(stack, store, keys)
    await eventually(store.busy.is_set)
    assert ctl.abort_prefetch("r")
    await asyncio.sleep(0.3)
    assert log.freed == 0
    store.open_gate()
    await ctl.wait_prefetches()
    await eventually(lambda: stack.host_pool.available_size() == free_before)
    assert log.early == [] and log.freed == PAGES
    await stack.aclose()


async def test_a_write_that_times_out_is_done_only_after_the_thread_returns() -> None:
    """The write job's ``on_done`` is what unlocks its host pages for eviction and reuse."""
    store = GatedThreadStorage(store_id=f"gated-{uuid.uuid4()}")
    stack = make(store)
    ctl = stack.controller
    host = stack.host_pool.alloc(PAGES * PS)
    done: list[tuple[int, bool]] = []
    store.hold()
    job = StorageWriteJob(keys_for(PAGES), host, None, lambda n: done.append((n, store.busy.is_set())))
    assert ctl.submit_storage_write(job)
    await eventually(lambda: ctl.metrics.counters.get("storage_timeouts", 0) == 1)
    await asyncio.sleep(0.3)
    assert done == []
    store.open_gate()
    await ctl.drain()
    assert done == [(0, False)]  # not counted as written: the call was given up on
    stack.host_pool.free(host)
    await stack.aclose()


async def test_close_reports_a_call_that_never_returns_and_does_not_hang() -> None:
    store, keys = await stored_pages()
    stack = make(store, storage_io_timeout_s=30.0, close_timeout_s=0.3)
    ctl = stack.controller
    store.hold()
    assert ctl.start_prefetch("r", keys, alloc_host=stack.host_pool.alloc) is not None
    await eventually(store.busy.is_set)
    closing = asyncio.ensure_future(stack.aclose())
    try:
        done, _ = await asyncio.wait({closing}, timeout=20)
        assert done, "close hung on a storage call that never returns"
    finally:
        store.open_gate()
        await asyncio.wait({closing}, timeout=20)


class LaterReadsHang(GatedThreadStorage):
    """Its first read passes; the ones after hang on the gate (a mount that hangs mid-prefetch)."""

    reads = 0

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        self.reads += 1
        if self.reads > 1:
            self.hold()
        return await super()._read(pages, buffers)


@pytest.mark.parametrize("how", ["wait", "poll", "interrupted"])
async def test_a_wait_complete_request_is_let_go_when_its_read_is_given_up_on(how: str) -> None:
    """A read stuck past the I/O timeout (the file backend waits out its I/O threads when
    cancelled, so a read on a hung mount returns only when the mount does) held a request
    waiting under ``wait_complete`` - awaiting or polling (SGLang) - until the read returned,
    long after the controller had given up on it. The wait ends when the call is given up on
    now (timed out, or interrupted when a stall marks the store down): the request takes the
    pages that completed, and the pages the stuck read was given stay out of use until it
    returns."""
    store, keys = await stored_pages(LaterReadsHang)
    limits = dict(storage_io_timeout_s=30.0, storage_stall_s=0.1) if how == "interrupted" else {}
    stack = make(store, prefetch_policy="wait_complete", prefetch_batch_pages=2, **limits)
    ctl = stack.controller
    log = FreeLog(stack, store)
    free_before = stack.host_pool.available_size()
    op = ctl.start_prefetch("r", keys, alloc_host=stack.host_pool.alloc)
    assert op is not None
    try:
        if how == "poll":
            assert not ctl.prefetch_ready("r")

            async def polled() -> None:
                while not ctl.prefetch_ready("r"):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(polled(), 10.0)
            res = ctl.take_prefetch("r")
        else:
            res = await asyncio.wait_for(ctl.wait_prefetch("r"), 10.0)
        assert res is not None and res.pages == 2  # the first batch landed before the hang
        assert store.busy.is_set() and not op.finished and op.stop == "read_failed"
        assert log.freed == 0  # the hung read's two pages are still its own
        store.open_gate()
        await ctl.wait_prefetches()
        await eventually(lambda: log.freed == 2)
        assert log.early == []
        stack.host_pool.free(res.host_indices)
        assert stack.host_pool.available_size() == free_before
    finally:
        store.open_gate()
        await stack.aclose()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
async def test_a_request_waiting_for_its_prefetch_is_let_go_when_the_prefetch_is_aborted(policy: str) -> None:
    """An abort from another task (a client that went away while its admit waited) cancels the
    prefetch, whose read is stuck on a hung mount (cancelled, it returns only when the mount
    does). The waiter was left waiting for that read - under ``wait_complete`` until it
    returned, possibly never - though nothing it waited for could come any more: it is let go
    at once with no prefetch (``None``); the stuck read's pages stay out of use until it
    returns."""
    store, keys = await stored_pages()
    stack = make(store, prefetch_policy=policy, storage_io_timeout_s=30.0, prefetch_timeout_base_s=30.0)
    ctl, log, op, free_before = held_prefetch(stack, store, keys)
    try:
        await eventually(store.busy.is_set)
        waiter = asyncio.ensure_future(ctl.wait_prefetch("r"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert ctl.abort_prefetch("r")
        done, _ = await asyncio.wait({waiter}, timeout=2.0)
        assert done, "the waiter of an aborted prefetch waited for its stuck read"
        assert waiter.result() is None
        assert ctl.prefetch_ready("r")
        assert log.freed == 0 and not op.finished  # the stuck read's pages are still its own
        store.open_gate()
        await ctl.wait_prefetches()
        await eventually(lambda: stack.host_pool.available_size() == free_before)
        assert log.early == [] and log.freed == PAGES
    finally:
        store.open_gate()
        await stack.aclose()


async def test_close_reports_a_write_stuck_past_the_close_apart_from_writes_never_started() -> None:
    """A write whose backend call hangs (a hung mount) past the close's timeout is still running
    when the close gives up on it: it may yet land. The close report listed it like a write that
    never started (reason ``"closed"``), with nothing saying a storage call was stuck (only the
    ``storage_calls_stuck`` counter did): the report now counts the stuck calls and lists the
    pages of a stuck write under reason ``"stuck"``, and its summary says so."""
    store = GatedThreadStorage(store_id=f"gated-{uuid.uuid4()}")
    stack = make(store, storage_io_timeout_s=30.0, close_timeout_s=0.3)
    ctl = stack.controller
    stuck_keys, queued_keys = keys_for(2 * PAGES)[:PAGES], keys_for(2 * PAGES)[PAGES:]
    store.hold()
    done: list[int] = []
    first = StorageWriteJob(stuck_keys, stack.host_pool.alloc(PAGES * PS), None, done.append)
    assert ctl.submit_storage_write(first)
    await eventually(store.busy.is_set)
    second = StorageWriteJob(queued_keys, stack.host_pool.alloc(PAGES * PS), stuck_keys[-1], done.append)
    assert ctl.submit_storage_write(second)  # queued behind the stuck write, never started
    closing = asyncio.ensure_future(stack.aclose())
    try:
        finished, _ = await asyncio.wait({closing}, timeout=20)
        assert finished, "close hung on a write that never returns"
        report = closing.result()
        assert ctl.metrics.counters.get("storage_calls_stuck") == 1
        assert report.stuck_storage_calls == 1
        reasons = {u.first_key: (u.reason, u.pages) for u in report.unwritten}
        assert reasons == {stuck_keys[0]: ("stuck", PAGES), queued_keys[0]: ("closed", PAGES)}
        assert report.unwritten_pages == 2 * PAGES
        assert "1 storage call(s) stuck" in report.summary()
    finally:
        store.open_gate()
        await asyncio.wait({closing}, timeout=20)
