"""Regression tests of the storage core (``hicache.storage``): lifecycle races, cancellation,
malformed transfers, staging, the blocking facade and the registry - with tiny in-test backends
whose timing the tests control, so nothing here depends on a real medium's speed."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hicache.errors import BackendLoadError, InvalidKeyError, StorageStateError
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorage,
    PageKey,
    PoolTransfer,
    StorageState,
    backend_class,
    register_backend,
)
from hicache.storage.offload import run_to_completion
from hicache.testing import ArrayHostPool
from hicache_backends.memory import MemoryStorage

PAGE = 4


class DictStore(AsyncHiCacheStorage):
    """A minimal backend; hooks let a test slow down or break one primitive."""

    backend_name = "dict-test"

    def __init__(self, storage_config: Any = None, **kw: Any) -> None:
        super().__init__(storage_config, **kw)
        self.pages: dict[PageKey, bytes] = {}
        self.opened = 0
        self.closed = 0
        self.open_gate: asyncio.Event | None = None
        self.read_delay = 0.0
        self.read_in_thread = False
        self.flags_override: list[bool] | None = None

    async def _open(self) -> None:
        if self.open_gate is not None:
            await self.open_gate.wait()
        self.opened += 1

    async def _close(self) -> None:
        self.closed += 1

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        if self.flags_override is not None:
            return self.flags_override
        return [p in self.pages for p in pages]

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        def fill() -> list[bool]:
            time.sleep(self.read_delay)
            out = []
            for p, b in zip(pages, buffers):
                data = self.pages.get(p)
                if data is None or len(data) != len(b):
                    out.append(False)
                else:
                    b[:] = data
                    out.append(True)
            return out

        if self.read_in_thread:
            return await run_to_completion(fill)
        if self.read_delay:
            await asyncio.sleep(self.read_delay)
        delay, self.read_delay = self.read_delay, 0.0
        try:
            return fill()
        finally:
            self.read_delay = delay

    async def _write(self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]) -> list[bool]:
        for p, b in zip(pages, buffers):
            self.pages[p] = bytes(b)
        return [True] * len(pages)

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        return self.pages.get(page)

    async def _clear(self) -> None:
        self.pages.clear()


def filled_pool(num_pages: int = 8, direct: bool = True, seed: int = 1) -> ArrayHostPool:
    pool = ArrayHostPool(num_pages, PAGE, direct=direct)
    pool.fill_random(seed)
    return pool


# ---------------------------------------------------------------------- lifecycle


async def test_aclose_while_opening_undoes_the_open() -> None:
    """aclose() racing an open() in progress used to leave the store OPEN after aclose (and
    whatever _open built - executors, sessions, tasks - alive for ever)."""
    store = DictStore()
    store.open_gate = asyncio.Event()
    opening = asyncio.create_task(store.open())
    await asyncio.sleep(0)  # open() is now waiting inside _open()
    closing = asyncio.create_task(store.aclose())
    await asyncio.sleep(0)
    store.open_gate.set()
    await closing
    with pytest.raises(StorageStateError, match="closed"):
        await opening
    assert store.state is StorageState.CLOSED
    assert (store.opened, store.closed) == (1, 1)
    with pytest.raises(StorageStateError):
        await store.exists("k")


def test_callers_on_several_event_loops_share_one_open() -> None:
    """A backend that serves several loops (S3: a server's loop and a facade's) is opened by
    the first caller; callers on other loops meanwhile wait for that open, however many."""

    class SlowOpen(DictStore):
        async def _open(self) -> None:
            await asyncio.sleep(0.3)
            self.opened += 1

    store = SlowOpen()
    out: dict[int, Any] = {}

    def caller(i: int) -> None:
        async def go() -> Any:
            await asyncio.sleep(0.05 * i)
            return await asyncio.wait_for(store.exists_pages(["k"]), 5)

        try:
            out[i] = asyncio.run(go())
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[i] = exc

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: [False], 1: [False], 2: [False]}
    assert store.opened == 1


async def test_a_failed_or_cancelled_open_is_tried_again_by_the_next_caller() -> None:
    class Flaky(DictStore):
        fail = True

        async def _open(self) -> None:
            await asyncio.sleep(0.05)
            if self.fail:
                self.fail = False
                raise OSError("injected: the first open fails")
            self.opened += 1

    store = Flaky()
    first = asyncio.create_task(store.open())
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(store.open())  # waits for the first, then opens itself
    with pytest.raises(OSError, match="injected"):
        await first
    await waiter
    assert store.state is StorageState.OPEN and store.opened == 1

    store2 = DictStore()
    store2.open_gate = asyncio.Event()
    opener = asyncio.create_task(store2.open())
    await asyncio.sleep(0)
    impatient = asyncio.create_task(store2.open())
    await asyncio.sleep(0)
    impatient.cancel()  # a cancelled waiter leaves the open running
    with pytest.raises(asyncio.CancelledError):
        await impatient
    store2.open_gate.set()
    await opener
    assert store2.state is StorageState.OPEN and store2.opened == 1


async def test_aclose_while_opening_file_backend_shuts_executors(tmp_path) -> None:
    from hicache_backends.file import FileStorage

    store = FileStorage(None, root=str(tmp_path), min_free_bytes=0)
    opening = asyncio.create_task(store.open())
    await asyncio.sleep(0)
    await store.aclose()
    with pytest.raises(StorageStateError):
        await opening
    assert store.state is StorageState.CLOSED
    assert store._threads.executor is not None and store._threads.executor._shutdown


# ---------------------------------------------------------------------- malformed transfers


async def test_pages_with_scattered_or_negative_indices_fail_alone() -> None:
    """Page i is moved from host_indices[i * page_size]; indices that are not one run from a
    non-negative start used to move the page onto tokens the caller never named."""
    store = MemoryStorage()
    src = filled_pool()
    store.register_mem_pool_host(src)
    keys = ["a", "b", "c"]
    assert await store.batch_set_v1(keys, src.indices(0, 3)) == [True] * 3
    dst = ArrayHostPool(8, PAGE)
    store.register_mem_pool_host(dst)
    scattered = torch.tensor([4, 9, 10, 11])  # starts at 4, but tokens 5..7 are not named
    idx = torch.cat([src.indices(0, 1), scattered, src.indices(2, 1)])
    before = store.get_stats().get("invalid_requests", 0)
    assert await store.batch_get_v1(keys, idx) == [True, False, True]
    assert store.get_stats()["invalid_requests"] == before + 1
    assert dst.page_bytes(4) == bytes(dst.page_nbytes)  # untouched
    assert dst.page_bytes(0) == src.page_bytes(0) and dst.page_bytes(8) == src.page_bytes(8)
    # writes: a negative start (Python slicing would wrap to the pool's end) fails that page
    neg = torch.cat([torch.arange(-4, 0), src.indices(1, 1)])
    assert await store.batch_set_v1(["n0", "n1"], neg) == [False, True]
    assert not await store.exists("n0")
    # float indices are not indices at all: the batch is invalid
    assert await store.batch_set_v1(["f"], src.indices(0, 1).float()) == [False]


@pytest.mark.parametrize(
    ("indices", "said"),
    [
        (torch.arange(8).float(), "got 8 of dtype torch.float32, not an integer dtype"),
        (torch.arange(8).bool(), "got 8 of dtype torch.bool, not an integer dtype"),
        (torch.arange(7), "got 7"),
        (torch.arange(6).reshape(2, 3), "got 6 (shape (2, 3))"),
        (None, "got None"),
        ([0, 1, 2, 3, 4, 5, 6, 7], "got a list, not a tensor"),
    ],
)
async def test_a_batch_of_malformed_host_indices_is_logged_as_what_is_wrong(
    indices: Any, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Float indices were logged as "expects 8 integer host indices ..., got 8": the count,
    which was right, not the dtype, which was wrong. The log says what is wrong: the dtype,
    the count (and the shape where it is not 1-D), or that there is no tensor."""
    store = MemoryStorage()
    store.register_mem_pool_host(filled_pool())
    for call in (store.batch_set_v1, store.batch_get_v1):
        caplog.clear()
        with caplog.at_level("ERROR", logger="hicache.storage"):
            assert await call(["a", "b"], indices) == [False, False]
        assert f"expects 8 integer host indices (2 keys x page {PAGE}), {said}" in caplog.text
    assert store.get_stats()["invalid_requests"] == 2


async def test_pool_names_are_validated_with_clear_errors() -> None:
    store = MemoryStorage()
    pool = filled_pool()
    for bad in ("", "nul\x00", "p" * 256):
        with pytest.raises(InvalidKeyError, match="pool name"):
            store.register_mem_host_pool_v2(pool, bad)
        with pytest.raises(InvalidKeyError, match="pool name"):
            await store.batch_exists_v2(["k"], [PoolTransfer(bad, keys=["k"])])
        with pytest.raises(InvalidKeyError, match="pool name"):
            await store.exists_pages(["k"], bad)
    store.register_mem_host_pool_v2(pool, "p" * 255)  # the limit itself is fine
    with pytest.raises(TypeError):
        store.register_mem_host_pool_v2(pool, 3)


@pytest.mark.parametrize("page_size", [0, -4, True, 4.0])
async def test_a_pool_whose_page_size_is_not_a_positive_int_is_refused_at_registration(page_size: Any) -> None:
    """Before: any ``int`` passed (0, negatives, ``True``); every transfer of the pool then
    failed as an invalid request, and a read with no host indices raised numpy's "slice step
    cannot be zero" out of ``batch_get_v1``."""
    store = MemoryStorage()
    pool = filled_pool()
    pool.page_size = page_size
    with pytest.raises(TypeError, match=f"page_size must be a positive int, got {page_size!r}"):
        store.register_mem_pool_host(pool)
    assert store.registered_pools == {}
    await store.aclose()


async def test_a_store_that_never_failed_reports_its_well_known_counters_as_zero() -> None:
    """``get_stats()["backend_errors"]`` of a store that never failed is 0, not a KeyError."""
    from hicache.storage.stats import WELL_KNOWN

    stats = DictStore().get_stats()
    assert all(stats[name] == 0 for name in WELL_KNOWN)
    assert stats["backend_errors"] == 0


async def test_backend_answering_wrong_number_of_flags_is_a_miss() -> None:
    store = DictStore()
    store.flags_override = [True]  # one flag for three pages: a backend bug
    assert await store.exists_pages(["a", "b", "c"]) == [False, False, False]
    assert store.get_stats()["backend_errors"] == 1
    store.flags_override = [True, True, True, True]
    assert await store.batch_exists(["a", "b", "c"]) == 0



async def test_backend_answers_of_the_wrong_type_are_counted_misses() -> None:
    """A primitive that forgot its ``return`` (``None``) was a silent miss, uncounted; a
    ``_read_bytes`` answering text raised TypeError to the caller; a prefix count that is a
    numpy integer was taken for a bug."""
    import numpy as np

    class NoReturn(MemoryStorage):
        async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
            return None

        async def _exists(self, pages):  # type: ignore[no-untyped-def]
            return None

    class Text(MemoryStorage):
        async def _read_bytes(self, page):  # type: ignore[no-untyped-def]
            return "not bytes"

    class NumpyRun(MemoryStorage):
        async def _exists_prefix(self, pages):  # type: ignore[no-untyped-def]
            return np.int64(len(pages))

        def _exists_prefix_now(self, pages):  # type: ignore[no-untyped-def]
            return None  # the loop's lookup answers

    store = NoReturn()
    assert await store.set("k", torch.arange(4, dtype=torch.uint8))
    assert await store.get("k", torch.empty(4, dtype=torch.uint8)) is None
    assert await store.batch_exists(["k"]) == 0
    assert store.get_stats()["backend_errors"] == 2
    text = Text()
    assert await text.set("k", torch.arange(4, dtype=torch.uint8))
    assert await text.get("k") is None and text.get_stats()["backend_errors"] == 1
    counted = NumpyRun()
    run = await counted.exists_prefix(["a", "b"])
    assert run == 2 and type(run) is int and counted.get_stats()["backend_errors"] == 0

async def test_v0_non_tensor_target_is_a_miss_not_a_crash() -> None:
    store = MemoryStorage()
    assert await store.set("k", torch.ones(4))
    got = await store.batch_get(["k", "k"], [bytearray(16), torch.empty(4)])
    assert got[0] is None and torch.equal(got[1], torch.ones(4))
    assert store.get_stats()["invalid_requests"] == 1


async def test_v0_targets_that_share_memory_read_the_first_key_only() -> None:
    """Two keys read into one tensor (or overlapping views of one): both reads would land in
    the same bytes and both report a hit, so the later key is a miss, counted."""
    store = MemoryStorage()
    assert await store.set("a", torch.full((4,), 1.0)) and await store.set("b", torch.full((4,), 2.0))
    same = torch.empty(4)
    got = await store.batch_get(["a", "b"], [same, same])
    assert got[1] is None and torch.equal(got[0], torch.full((4,), 1.0))
    wide = torch.empty(6)
    got = await store.batch_get(["a", "b"], [wide[2:6], wide[0:4]])  # overlapping views
    assert got[1] is not None and got[0] is None  # the lower address is kept
    apart = torch.empty(8)
    got = await store.batch_get(["a", "b"], [apart[:4], apart[4:]])
    assert torch.equal(apart, torch.tensor([1.0] * 4 + [2.0] * 4))
    assert store.get_stats()["invalid_requests"] == 2


async def test_v0_strided_values_are_stored_in_order() -> None:
    store = MemoryStorage()
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    assert await store.set("s", value)
    out = torch.empty(4, 3)
    assert torch.equal(await store.get("s", out), value)


# ---------------------------------------------------------------------- staging


class SharedScratchPool(ArrayHostPool):
    """A pool that hands out one scratch page for every ``get_dummy_flat_data_page`` call - fine
    for SGLang's read-then-commit loop, fatal for read-all-then-commit-all."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self._scratch = super().get_dummy_flat_data_page()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self._scratch


async def test_shared_scratch_page_does_not_mix_pages() -> None:
    store = MemoryStorage()
    src = filled_pool()
    store.register_mem_pool_host(src)
    keys = ["a", "b", "c"]
    await store.batch_set_v1(keys, src.indices(0, 3))
    dst = SharedScratchPool(8, PAGE, direct=False)
    store.register_mem_pool_host(dst)
    assert await store.batch_get_v1(keys, dst.indices(0, 3)) == [True] * 3
    for i in range(3):
        assert dst.page_bytes(i * PAGE) == src.page_bytes(i * PAGE), i


class SlowCommitPool(ArrayHostPool):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.commits: list[float] = []

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        time.sleep(0.05)
        super().set_from_flat_data_page(index, data_page)
        self.commits.append(time.monotonic())


async def test_cancelled_staged_read_finishes_commits_before_unwinding() -> None:
    """Staged pages are committed into the pool on a thread; a cancelled caller used to get
    control back while that thread was still writing into the pages it then frees."""
    store = MemoryStorage()
    src = filled_pool()
    store.register_mem_pool_host(src)
    keys = [f"k{i}" for i in range(4)]
    await store.batch_set_v1(keys, src.indices(0, 4))
    dst = SlowCommitPool(8, PAGE, direct=False)
    store.register_mem_pool_host(dst)
    task = asyncio.create_task(store.batch_get_v1(keys, dst.indices(0, 4)))
    while not dst.commits:  # the commit thread is running
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    unwound = time.monotonic()
    n = len(dst.commits)
    await asyncio.sleep(0.15)
    assert len(dst.commits) == n and all(t <= unwound for t in dst.commits)


# ---------------------------------------------------------------------- the blocking facade


def test_facade_timeout_cancels_the_call_before_returning() -> None:
    """A facade call that timed out used to leave its coroutine running: it later wrote into
    the host pool the caller had already taken back. (Times are scaled for a loaded 2-core
    machine: at 0.1 s the first, undelayed write itself sometimes timed out.)"""
    backend = DictStore()
    facade = HiCacheStorage(backend, call_timeout=0.5)
    try:
        src = filled_pool()
        facade.register_mem_pool_host(src)
        assert facade.batch_set_v1(["a"], src.indices(0, 1)) == [True]
        dst = ArrayHostPool(8, PAGE)
        facade.register_mem_pool_host(dst)
        backend.read_delay = 1.5  # awaits, then fills the buffer
        with pytest.raises(TimeoutError):
            facade.batch_get_v1(["a"], dst.indices(0, 1))
        assert facade.get_stats()["call_timeouts"] == 1  # counted, not only raised
        time.sleep(1.7)
        assert dst.page_bytes(0) == bytes(dst.page_nbytes)  # nothing landed after the timeout
        # a read that fills buffers on a thread is waited for, so the pool is stable once the
        # exception reaches the caller
        backend.read_in_thread = True
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            facade.batch_get_v1(["a"], dst.indices(1, 1))
        assert time.monotonic() - t0 >= 1.25
        snapshot = dst.buffer.clone()
        time.sleep(0.1)
        assert torch.equal(dst.buffer, snapshot)
    finally:
        backend.read_delay = 0.0
        facade.close()


def test_dropped_facade_closes_its_backend_and_thread() -> None:
    backend = DictStore()
    facade = HiCacheStorage(backend)
    assert facade.batch_exists(["x"]) == 0
    thread = facade._loop_thread._thread
    del facade
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert backend.state is StorageState.CLOSED and backend.closed == 1


def test_facade_close_is_idempotent_and_joins_thread() -> None:
    facade = HiCacheStorage(DictStore())
    facade.batch_exists(["x"])
    thread = facade._loop_thread._thread
    facade.close()
    facade.close()
    assert not thread.is_alive()
    assert threading.active_count() >= 1


# ---------------------------------------------------------------------- registry


def test_backend_whose_import_fails_oddly_is_a_load_error() -> None:
    register_backend("empty-module", ":Thing")  # importlib raises ValueError, not ImportError
    with pytest.raises(BackendLoadError, match="empty-module"):
        backend_class("empty-module")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_device_tensors_and_device_indices() -> None:
    """v0 values/targets on the GPU are copied on a worker thread; device host_indices are
    brought to the CPU once."""
    store = MemoryStorage()
    value = torch.arange(1024, dtype=torch.float16, device="cuda")
    assert await store.set("g", value)
    target = torch.empty(1024, dtype=torch.float16, device="cuda")
    got = await store.get("g", target)
    assert got is target and torch.equal(target, value)
    src = filled_pool()
    store.register_mem_pool_host(src)
    assert await store.batch_set_v1(["a", "b"], src.indices(0, 2).cuda()) == [True, True]
    dst = ArrayHostPool(8, PAGE)
    store.register_mem_pool_host(dst)
    assert await store.batch_get_v1(["a", "b"], dst.indices(2, 2).cuda()) == [True, True]
    assert dst.page_bytes(2 * PAGE) == src.page_bytes(0)


def test_loop_thread_stopped_from_its_own_thread_ends() -> None:
    """A facade collected on its own loop thread runs the finalizer there; stop() used to try to
    join the current thread (RuntimeError) and leave the loop running for ever."""
    from hicache.storage.sync import LoopThread

    lt = LoopThread(name="hicache-test-loop")
    lt.loop.call_soon_threadsafe(lt.stop)
    lt._thread.join(timeout=5)
    assert not lt._thread.is_alive()
    lt.stop()  # and again from outside: closes the loop
    assert lt.loop.is_closed()


def test_facade_close_with_a_call_stuck_in_a_thread_keeps_its_deadline_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose open hangs in a thread call (a folder made on a hard NFS mount whose server
    is down): a caller's call waits for it, and the close's own wait ends at its timeout. The
    loop's stop then joined its thread for a fixed 10 s more (the cancelled open waits for its
    thread), whatever the close's deadline. Now the stop ends at the deadline, logs the call it
    left running, and that call still gets its error and the loop still closes once the thread
    call returns."""
    from hicache.storage import sync

    mount_back = threading.Event()

    class HungOpen(DictStore):
        async def _open(self) -> None:
            await run_to_completion(mount_back.wait, 30)  # really blocks a thread
            await super()._open()

    backend = HungOpen()
    facade = HiCacheStorage(backend)
    loop_thread = facade._loop_thread
    got: list[BaseException] = []

    def caller() -> None:
        try:
            facade.batch_exists(["x"])
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            got.append(exc)

    worker = threading.Thread(target=caller)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while backend._opening is None and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(sync, "CLOSE_TIMEOUT_S", 0.5)
        began = time.monotonic()
        with pytest.raises(TimeoutError):  # the store's close timed out waiting for the open
            facade.close()
        assert time.monotonic() - began < 2.5  # was 0.5 s + 10 s
        assert loop_thread._thread.is_alive()  # still in the mount
        assert "1 task(s) still running" in caplog.text and "batch_exists" in caplog.text
    finally:
        mount_back.set()
    worker.join(5)
    assert [type(exc) for exc in got] == [StorageStateError]
    loop_thread._thread.join(5)
    assert not loop_thread._thread.is_alive() and loop_thread.loop.is_closed()


async def test_reads_into_overlapping_host_pages_fail_except_the_first() -> None:
    """Two keys read into the same host page were filled concurrently (file: two threads) and
    both could be reported True while the page held only one of them."""
    store = MemoryStorage()
    src = filled_pool()
    store.register_mem_pool_host(src)
    assert await store.batch_set_v1(["a", "b", "c"], src.indices(0, 3)) == [True] * 3
    dst = ArrayHostPool(8, PAGE)
    store.register_mem_pool_host(dst)
    same = torch.cat([dst.indices(1, 1), dst.indices(1, 1), dst.indices(3, 1)])
    assert await store.batch_get_v1(["a", "b", "c"], same) == [True, False, True]
    assert dst.page_bytes(PAGE) == src.page_bytes(0)
    assert dst.page_bytes(3 * PAGE) == src.page_bytes(2 * PAGE)
    # writes may share a source page: both keys get its bytes
    assert await store.batch_set_v1(["x", "y"], torch.cat([src.indices(0, 1), src.indices(0, 1)])) == [True, True]


async def test_a_second_close_given_a_timeout_waits_for_the_first_no_longer() -> None:
    """A close while another is closing waits for it, but no longer than its own ``timeout``
    (what is left of its caller's shutdown budget): it waited for the first close whatever it
    was given, so a shutdown step that bounded its store's close by its budget (a cache's
    close, a server's drain) hung with the first close (a store stuck on a hung mount or a
    stalled service), past the budget the caller meant to keep."""
    gate = asyncio.Event()

    class SlowToClose(DictStore):
        async def _close(self) -> None:
            await gate.wait()
            await super()._close()

    store = SlowToClose()
    await store.open()
    first = asyncio.create_task(store.aclose())
    await asyncio.sleep(0)  # the first close is under way
    try:
        second = asyncio.create_task(store.aclose(timeout=0.2))
        done, _ = await asyncio.wait({second}, timeout=20)
        assert second in done and not first.done()  # by its own bound, the first still closing
        assert store.closed == 0
    finally:
        gate.set()
        await first
    assert store.closed == 1
    await store.aclose(timeout=0.2)  # closed: at once


async def _misses_50_lookups_and_reads(store: MemoryStorage) -> None:
    """50 lookups and 50 reads of a store whose primitives fail every call: each answers a
    miss, and each failure is counted."""
    for _ in range(50):
        assert await store.batch_exists(["a", "b"]) == 0
        assert await store.get("a", torch.empty(4, dtype=torch.uint8)) is None
    assert store.get_stats()["backend_errors"] == 100


async def test_a_primitive_that_fails_every_call_logs_its_traceback_once_a_period_with_the_count(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken backend fails every call, a page at a time under load: a traceback per failure
    flooded the server's log. One traceback per primitive per period, saying how many failures
    it stands for; every failure is still counted."""
    import logging

    import hicache.storage.base as storage_base

    class Broken(MemoryStorage):
        async def _exists(self, pages):  # type: ignore[no-untyped-def]
            raise RuntimeError("the service is down")

        async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
            raise RuntimeError("the service is down")

    store = Broken()
    caplog.set_level(logging.ERROR, logger="hicache.storage.base")
    await _misses_50_lookups_and_reads(store)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 2, [r.getMessage() for r in failed]  # one per primitive: exists, read
    assert all(r.exc_info is not None for r in failed)
    monkeypatch.setattr(storage_base, "FAILURE_LOG_PERIOD_S", 0.0)
    caplog.clear()
    quiet = Broken()  # (a store's throttles take the period they were made with)
    await quiet.batch_exists(["a"])
    await quiet.batch_exists(["a"])
    assert len([r for r in caplog.records if "exists failed" in r.getMessage()]) == 2


async def test_a_primitive_that_answers_wrongly_every_call_logs_once_a_period_with_the_count(
        caplog: pytest.LogCaptureFixture) -> None:
    """A buggy backend that answers every lookup with flags of the wrong count (or a stray
    CancelledError) logged an ERROR line per call: under load, one per request. As for a
    primitive that raises, one line per primitive per period, saying how many it stands for;
    every bad answer is still counted."""
    import logging

    class Miscounts(MemoryStorage):
        async def _exists(self, pages):  # type: ignore[no-untyped-def]
            return [True] * (len(pages) + 1)  # one flag too many: trusting it shifts every answer

        async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
            raise asyncio.CancelledError  # nobody cancelled the call

    store = Miscounts()
    caplog.set_level(logging.ERROR, logger="hicache.storage.base")
    await _misses_50_lookups_and_reads(store)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 2, lines[:4]  # one per primitive: exists, read
    assert any("flags for" in line for line in lines) and any("CancelledError" in line for line in lines)
