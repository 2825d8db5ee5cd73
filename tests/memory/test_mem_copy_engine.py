"""CopyEngine: off-loop execution, layer-wise load ordering, failures, cancellation, strategies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest
import torch

from hicache.errors import CacheClosedError
from hicache.memory import AllocatorError, CopyEngine, LayerDoneCounter
from hicache.memory import transfer
from hicache.memory.copy_engine import INLINE_MAX_BYTES
from hicache.memory.spans import NATIVE_AVAILABLE

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DEVICE_SENTINEL = 0xCD
#: CPU copy paths: the native span copier (where built) and the numpy/torch fallback
COPY_PATHS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not NATIVE_AVAILABLE, reason="span copier not built")),
    pytest.param(False, id="numpy"),
]


def token_idx(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)


def layer_bytes(pool, layer: int, pages: list[int]) -> bytes:
    ps = pool.page_size
    parts = [pool.kv_data[:, layer, p * ps : (p + 1) * ps].contiguous().cpu() for p in pages]
    return b"".join(t.view(torch.uint8).numpy().tobytes() for t in parts)


@pytest.fixture
def pools(device_pool_factory, host_pool_factory, fill_bytes):
    def build(device: str = "cpu", layout: str = "page_first", kind: str = "mha", layers: int = 6):
        src = device_pool_factory(kind, size=16 * 4, page_size=4, layers=layers, device=device)
        dst = device_pool_factory(kind, size=16 * 4, page_size=4, layers=layers, device=device)
        fill_bytes(src.kv_data, 21)
        dst.kv_data.view(torch.uint8).fill_(DEVICE_SENTINEL)
        host = host_pool_factory(src, layout=layout, pages=16)
        return src, dst, host

    return build


@pytest.mark.parametrize("native", COPY_PATHS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
async def test_async_backup_and_load(device, layout, native, pools):
    src, dst, host = pools(device, layout)
    async with CopyEngine(src, host, native=native) as eng:
        assert eng.native == (native and device == "cpu")
        await eng.backup(token_idx([3, 4, 5, 9], 4), token_idx([0, 1, 7, 8], 4))
    async with CopyEngine(dst, host, native=native) as eng:
        handle = eng.load(token_idx([0, 1, 7, 8], 4), token_idx([10, 11, 12, 2], 4))
        assert isinstance(handle.counter, LayerDoneCounter)
        await handle.wait()
        assert handle.done()
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [10, 11, 12, 2]) == layer_bytes(src, layer, [3, 4, 5, 9])


async def test_backup_runs_off_the_event_loop(pools):
    src, _, host = pools()
    threads: list[int] = []

    class Spy(CopyEngine):
        def _backup_cpu(self, plan):
            threads.append(threading.get_ident())
            super()._backup_cpu(plan)

    async with Spy(src, host, inline_max_bytes=0) as eng:
        await eng.backup(token_idx([1], 4), token_idx([1], 4))
    assert threads and threads[0] != threading.get_ident()


async def test_small_copies_run_on_the_callers_thread_while_the_engine_is_idle(pools):
    """A backup or load of at most ``inline_max_bytes`` is copied where it is asked for (a hop
    to the copy thread costs the loop more); a bigger one goes to the copy thread. Both land
    byte-exact."""
    src, dst, host = pools(layers=3)
    threads: list[tuple[str, int]] = []

    class Spy(CopyEngine):
        def _backup_cpu(self, plan):
            threads.append(("backup", threading.get_ident()))
            super()._backup_cpu(plan)

        def _load_layer(self, plan, layer):
            threads.append(("load", threading.get_ident()))
            super()._load_layer(plan, layer)

    here = threading.get_ident()
    async with Spy(src, host) as eng:
        step = eng._step_bytes
        await eng.backup(token_idx([2, 3], 4), token_idx([6, 7], 4))
        eng.inline_max_bytes = 2 * step - 1  # two pages are one byte too many now
        await eng.backup(token_idx([8, 9], 4), token_idx([10, 11], 4))
    assert [t == here for _, t in threads] == [True, False]
    threads.clear()
    async with Spy(dst, host) as eng:
        handle = eng.load(token_idx([6, 7], 4), token_idx([0, 1], 4))
        assert handle.done()  # copied before load() returned
        eng.inline_max_bytes = 2 * eng._step_bytes - 1
        await eng.load(token_idx([10, 11], 4), token_idx([4, 5], 4)).wait()
    assert [t == here for _, t in threads] == [True] * 3 + [False] * 3
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [0, 1, 4, 5]) == layer_bytes(src, layer, [2, 3, 8, 9])


async def test_a_small_copy_never_overtakes_one_queued_before_it(pools):
    """While the copy thread has work, a small copy queues behind it (the engine is a FIFO, as
    a CUDA stream is): it must not run on the caller's thread ahead of it."""
    src, dst, host = pools(layers=2)
    gate = threading.Event()
    order: list[str] = []
    async with CopyEngine(src, host) as eng:
        eng._submit(lambda: (gate.wait(10), order.append("earlier")))
        real = eng._backup_cpu
        eng._backup_cpu = lambda plan: (order.append("small"), real(plan))  # type: ignore[method-assign]
        task = asyncio.create_task(eng.backup(token_idx([1], 4), token_idx([3], 4)))
        await asyncio.sleep(0.02)
        assert not task.done() and order == []
        gate.set()
        await asyncio.wait_for(task, 10)
        assert order == ["earlier", "small"]
        # idle again: the next small copy runs at once
        await eng.backup(token_idx([2], 4), token_idx([4], 4))
        assert order == ["earlier", "small", "small"]
    async with CopyEngine(dst, host) as eng:
        await eng.load(token_idx([3, 4], 4), token_idx([7, 8], 4)).wait()
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [7, 8]) == layer_bytes(src, layer, [1, 2])


async def test_layer_wise_load_never_exposes_a_layer_early(pools):
    """Gate each layer's copy; a consumer awaiting layer i wakes only after layer i landed, and
    layer i+1 is still untouched at that point."""
    src, dst, host = pools(layers=5)
    async with CopyEngine(src, host) as eng:
        await eng.backup(token_idx([2, 3, 8], 4), token_idx([4, 5, 6], 4))
    gates = [threading.Event() for _ in range(src.layer_num)]
    copied: list[int] = []

    class Gated(CopyEngine):
        def _load_layer(self, plan, layer):
            assert gates[layer].wait(10)
            super()._load_layer(plan, layer)
            copied.append(layer)

    sentinel_layer = bytes([DEVICE_SENTINEL]) * len(layer_bytes(src, 0, [2, 3, 8]))
    async with Gated(dst, host, inline_max_bytes=0) as eng:
        handle = eng.load(token_idx([4, 5, 6], 4), token_idx([0, 1, 9], 4))
        for i in range(src.layer_num):
            waiter = asyncio.create_task(handle.counter.wait(i))
            await asyncio.sleep(0.01)
            assert not waiter.done() and not handle.counter.is_done(i)
            assert layer_bytes(dst, i, [0, 1, 9]) == sentinel_layer
            gates[i].set()
            await asyncio.wait_for(waiter, 10)
            assert i in copied
            assert layer_bytes(dst, i, [0, 1, 9]) == layer_bytes(src, i, [2, 3, 8])
            if i + 1 < src.layer_num:
                assert layer_bytes(dst, i + 1, [0, 1, 9]) == sentinel_layer
        await handle.wait()


async def test_many_consumers_see_complete_layers(pools):
    """Ungated but slowed copies; every consumer (async and thread) checks its layer's bytes
    the moment it wakes."""
    src, dst, host = pools(layers=8)
    pages_d, pages_h, pages_t = [0, 1, 2, 3, 7], [9, 10, 11, 12, 15], [4, 5, 6, 13, 14]
    async with CopyEngine(src, host) as eng:
        await eng.backup(token_idx(pages_d, 4), token_idx(pages_h, 4))
    expected = [layer_bytes(src, i, pages_d) for i in range(src.layer_num)]

    class Slow(CopyEngine):
        def _load_layer(self, plan, layer):
            threading.Event().wait(0.003)
            super()._load_layer(plan, layer)

    seen_bad: list[int] = []

    async with Slow(dst, host, inline_max_bytes=0) as eng:
        handle = eng.load(token_idx(pages_h, 4), token_idx(pages_t, 4))

        async def consumer(i: int) -> None:
            await handle.counter.wait(i)
            if layer_bytes(dst, i, pages_t) != expected[i]:
                seen_bad.append(i)

        def thread_consumer(i: int) -> None:
            handle.counter.wait_sync(i, timeout=10)
            if layer_bytes(dst, i, pages_t) != expected[i]:
                seen_bad.append(i)

        threads = [threading.Thread(target=thread_consumer, args=(i,)) for i in range(src.layer_num)]
        for t in threads:
            t.start()
        await asyncio.gather(*(consumer(i) for i in reversed(range(src.layer_num))))
        for t in threads:
            t.join()
    assert seen_bad == []


@pytest.mark.parametrize("inline_max_bytes", [0, INLINE_MAX_BYTES], ids=["thread", "caller"])
async def test_load_failure_reaches_waiters(pools, inline_max_bytes):
    src, dst, host = pools(layers=4)

    class Broken(CopyEngine):
        def _load_layer(self, plan, layer):
            if layer == 2:
                raise RuntimeError("DMA exploded")
            super()._load_layer(plan, layer)

    async with Broken(dst, host, inline_max_bytes=inline_max_bytes) as eng:
        handle = eng.load(token_idx([0], 4), token_idx([0], 4))
        await handle.counter.wait(1)
        with pytest.raises(RuntimeError, match="DMA exploded"):
            await handle.counter.wait(2)
        with pytest.raises(RuntimeError):
            await handle.wait()
        with pytest.raises(RuntimeError):
            handle.counter.is_done(3)


async def test_cancelled_backup_waits_for_the_copy(pools):
    src, _, host = pools()
    gate = threading.Event()
    finished = threading.Event()

    class Gated(CopyEngine):
        def _backup_cpu(self, plan):
            assert gate.wait(10)
            super()._backup_cpu(plan)
            finished.set()

    async with Gated(src, host, inline_max_bytes=0) as eng:
        task = asyncio.create_task(eng.backup(token_idx([5], 4), token_idx([2], 4)))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.02)
        assert not task.done()  # still waiting for the copy it started
        task.cancel()  # again (a shutdown cancels every task): it still waits
        await asyncio.sleep(0.02)
        assert not task.done()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()
    ps = 4
    assert host.get_data_page(2 * ps).view(torch.uint8).numpy().tobytes() == (
        src.kv_data[:, :, 5 * ps : 6 * ps].contiguous().view(torch.uint8).numpy().tobytes()
    )


async def test_misuse_fails_at_the_call_site(pools):
    src, _, host = pools()
    async with CopyEngine(src, host) as eng:
        with pytest.raises(AllocatorError, match="match"):
            await eng.backup(token_idx([1, 2], 4), token_idx([1], 4))
        with pytest.raises(AllocatorError, match="twice"):
            await eng.backup(token_idx([1, 2], 4), token_idx([3, 3], 4))
        with pytest.raises(AllocatorError, match="out of range"):
            eng.load(token_idx([16], 4), token_idx([0], 4))
        with pytest.raises(AllocatorError, match="whole page"):
            eng.load(torch.arange(1, 5), token_idx([0], 4))
        empty = eng.load(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        await empty.wait()
    with pytest.raises(CacheClosedError):
        await eng.backup(token_idx([1], 4), token_idx([1], 4))
    with pytest.raises(CacheClosedError):
        eng.load(token_idx([1], 4), token_idx([1], 4))


@pytest.mark.parametrize("shared", [True, False], ids=["shared-executor", "own-executor"])
def test_a_close_racing_a_submit_waits_for_that_copy(pools, shared):
    """A ``close()`` from another thread while a copy is being submitted either refuses it
    (:class:`CacheClosedError`, once closed) or waits for it: never returns with it still to
    run. On an executor the engine does not own the close waits for the engine's copies in
    ``_pending``, and one landing between the closed check and the entry returned at once, the
    copy running after it (into pages the caller had given back). The check, the submit and
    the entry are one step now, under the lock the close marks the engine closed under, so a
    close that comes during the submit waits for the copy, on either executor."""
    src, _, host = pools()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if shared else None
    eng = CopyEngine(src, host, executor=executor, inline_max_bytes=0)
    real_submit = eng._executor.submit
    events: list[str] = []
    closer: list[threading.Thread] = []

    def submit_with_a_close_racing(fn, *args):  # type: ignore[no-untyped-def]
        t = threading.Thread(target=lambda: (eng.close(), events.append("closed")))
        t.start()
        closer.append(t)
        time.sleep(0.05)  # the close runs now, as far as it can

        def job():  # type: ignore[no-untyped-def]
            time.sleep(0.05)
            events.append("copied")
            return fn(*args)

        return real_submit(job)

    eng._executor.submit = submit_with_a_close_racing  # type: ignore[method-assign]
    try:
        handle = eng.load(token_idx([1], 4), token_idx([1], 4))
        handle.wait_sync(5)
        closer[0].join(5)
        assert events == ["copied", "closed"]
        with pytest.raises(CacheClosedError):
            eng.load(token_idx([1], 4), token_idx([1], 4))
    finally:
        if executor is not None:
            executor.shutdown()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-executor", "own-executor"])
def test_a_second_close_returns_only_when_the_queued_copies_landed(pools, shared):
    """``close()`` finishes queued copies, for every caller: a close while another thread's
    close was still draining returned at once (the engine was already marked closed), with a
    load still writing device pages its caller then freed or reused."""
    src, dst, host = pools(layers=3)
    gate = threading.Event()

    class Gated(CopyEngine):
        def _load_layer(self, plan, layer):  # type: ignore[no-untyped-def]
            assert gate.wait(10)
            super()._load_layer(plan, layer)

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if shared else None
    eng = Gated(dst, host, executor=executor, inline_max_bytes=0)
    try:
        handle = eng.load(token_idx([0, 1], 4), token_idx([2, 3], 4))
        first = threading.Thread(target=eng.close)
        first.start()
        deadline = time.monotonic() + 5
        while not eng._closed and time.monotonic() < deadline:  # the first close is draining
            time.sleep(0.001)
        threading.Timer(0.2, gate.set).start()
        eng.close()
        assert handle.counter.ended()  # landed before the second close returned
        first.join(5)
    finally:
        gate.set()
        if executor is not None:
            executor.shutdown()


def test_geometry_mismatch_rejected(device_pool_factory, host_pool_factory):
    a = device_pool_factory("mha", size=16, page_size=4, layers=2)
    b = device_pool_factory("mha", size=16, page_size=4, layers=3)
    with pytest.raises(ValueError, match="geometry"):
        CopyEngine(a, host_pool_factory(b, layout="page_first", pages=2))
    c = device_pool_factory("mha", size=16, page_size=4, layers=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtypes"):
        CopyEngine(a, host_pool_factory(c, layout="page_first", pages=2))


@pytest.mark.parametrize("min_bytes", [0, 1 << 40], ids=["runs", "index"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_both_copy_strategies_agree(min_bytes, layout, monkeypatch, device_pool_factory, host_pool_factory, fill_bytes):
    """Many scattered pages: run copies and index gather/scatter must give the same bytes."""
    monkeypatch.setattr(transfer, "RUN_COPY_MIN_BYTES", min_bytes)
    rng = np.random.default_rng(5)
    ps = 2
    src = device_pool_factory("mha", size=64 * ps, page_size=ps, layers=3)
    dst = device_pool_factory("mha", size=64 * ps, page_size=ps, layers=3)
    fill_bytes(src.kv_data, 2)
    host = host_pool_factory(src, layout=layout, pages=64)
    d = [int(x) for x in rng.permutation(64)[:40]]
    h = [int(x) for x in rng.permutation(64)[:40]]
    t = [int(x) for x in rng.permutation(64)[:40]]
    with CopyEngine(src, host) as eng:
        eng.backup_sync(token_idx(d, ps), token_idx(h, ps))
    with CopyEngine(dst, host) as eng:
        eng.load_sync(token_idx(h, ps), token_idx(t, ps))
    for layer in range(3):
        assert layer_bytes(dst, layer, t) == layer_bytes(src, layer, d)


def test_plan_groups_runs():
    plan = transfer.make_plan(
        token_idx([5, 6, 7, 1, 2], 2), 20, token_idx([0, 1, 2, 8, 3], 2), 20, 2,
        src_what="s", dst_what="d",
    )
    assert plan.runs.tolist() == [[1, 8, 1], [2, 3, 1], [5, 0, 3]]


@CUDA
async def test_cuda_load_events_and_stream_wait(pools):
    src, dst, host = pools("cuda", "page_first")
    async with CopyEngine(src, host) as eng:
        await eng.backup(token_idx([1, 2], 4), token_idx([3, 4], 4))
    async with CopyEngine(dst, host) as eng:
        handle = eng.load(token_idx([3, 4], 4), token_idx([7, 8], 4))
        for layer in range(src.layer_num):
            handle.wait_on_stream(layer)
        torch.cuda.current_stream().synchronize()
        await handle.wait()
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [7, 8]) == layer_bytes(src, layer, [1, 2])


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["tiny-chunks", "one-chunk"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_cuda_copy_logic_on_cpu_tensors(chunk_bytes, layout, monkeypatch, device_pool_factory,
                                        host_pool_factory, fill_bytes):
    """The CUDA path's gather -> host runs -> scatter logic, run on CPU tensors so it is
    checked on machines without a GPU too."""
    monkeypatch.setattr(transfer, "CUDA_CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(8)
    ps = 2
    src = device_pool_factory("mla", size=32 * ps, page_size=ps, layers=3)
    dst = device_pool_factory("mla", size=32 * ps, page_size=ps, layers=3)
    fill_bytes(src.kv_data, 4)
    host = host_pool_factory(src, layout=layout, pages=32)
    d = [int(x) for x in rng.permutation(32)[:13]]
    h = [0, 1, 2, 3, 9, 10, 20, 5, 6, 7, 30, 31, 15]
    t = [int(x) for x in rng.permutation(32)[:13]]
    (dev_v,), (host_v,) = src.transfer_views(), host.transfer_views()
    plan = transfer.make_plan(token_idx(d, ps), src.size, token_idx(h, ps), host.size, ps,
                              src_what="d", dst_what="h")
    transfer.copy_across(host_v, dev_v, plan, src_is_device=True)
    (dst_v,) = dst.transfer_views()
    plan = transfer.make_plan(token_idx(h, ps), host.size, token_idx(t, ps), dst.size, ps,
                              src_what="h", dst_what="t")
    for layer in range(3):
        transfer.copy_across(dst_v[:, :, layer], host_v[:, :, layer], plan, src_is_device=False)
    for layer in range(3):
        assert layer_bytes(dst, layer, t) == layer_bytes(src, layer, d)


@pytest.mark.parametrize("np_max", [None, 0, 1 << 40], ids=["native", "torch_runs", "numpy_runs"])
@pytest.mark.parametrize("pattern", ["runs", "scattered"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_numpy_and_torch_run_copies_agree(
    np_max, pattern, layout, dtype, monkeypatch, device_pool_factory, host_pool_factory, fill_bytes
):
    """CPU runs copied by the span copier, ``np.copyto`` or ``Tensor.copy_``: identical bytes,
    every layer, and nothing outside the named pages is touched (host and device sentinels
    survive)."""
    native = np_max is None
    if native and not NATIVE_AVAILABLE:
        pytest.skip("span copier not built")
    if not native:
        monkeypatch.setattr(transfer, "NUMPY_RUN_MAX_BYTES", np_max)
    rng = np.random.default_rng(11)
    ps, pages, layers = 4, 24, 3
    src = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=layers, dtype=dtype)
    dst = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=layers, dtype=dtype)
    fill_bytes(src.kv_data, 3)
    dst.kv_data.view(torch.uint8).fill_(DEVICE_SENTINEL)
    host = host_pool_factory(src, layout=layout, pages=pages)
    host._buf.fill_(0xAB)
    if pattern == "runs":
        d, h, t = list(range(2, 14)), list(range(5, 17)), list(range(8, 20))
    else:
        d, h, t = ([int(x) for x in rng.permutation(pages)[:12]] for _ in range(3))
    with CopyEngine(src, host, native=native) as eng:
        eng.backup_sync(token_idx(d, ps), token_idx(h, ps))
    untouched = [p for p in range(pages) if p not in h]
    for p in untouched:
        assert bool((host.get_data_page(p * ps).view(torch.uint8) == 0xAB).all())
    for i, p in enumerate(h):
        want = src.kv_data[:, :, d[i] * ps : (d[i] + 1) * ps].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(host.get_data_page(p * ps).view(torch.uint8), want)
    with CopyEngine(dst, host, native=native) as eng:
        eng.load_sync(token_idx(h, ps), token_idx(t, ps))
    for layer in range(layers):
        assert layer_bytes(dst, layer, t) == layer_bytes(src, layer, d)
        others = [p for p in range(pages) if p not in t]
        assert set(layer_bytes(dst, layer, others)) == {DEVICE_SENTINEL}


def test_numpy_run_choice():
    plan = transfer.make_plan(token_idx([0, 1, 2, 7], 2), 20, token_idx([3, 4, 5, 9], 2), 20, 2,
                              src_what="s", dst_what="d")
    assert plan.run_list() == [(0, 3, 3), (7, 9, 1)]
    assert plan.run_list() is plan.run_list()  # cached
    assert transfer.prefers_numpy_runs(plan, 1024)  # 2 KiB per run: overhead-bound
    assert not transfer.prefers_numpy_runs(plan, 1 << 20)  # 2 MiB per run: torch's threaded copy
    assert transfer.numpy_view(torch.zeros(4, dtype=torch.bfloat16)) is None
    view = transfer.numpy_view(torch.zeros(4, dtype=torch.uint8))
    assert view is not None and view.shape == (4,)


async def test_numpy_copies_run_off_the_loop(monkeypatch, pools):
    """The numpy run path, for copies sent to the engine's thread, runs there, never on the
    event loop's."""
    seen: list[int] = []
    orig = transfer.copy_runs_np

    def spy(segments, runs):
        seen.append(threading.get_ident())
        orig(segments, runs)

    monkeypatch.setattr("hicache.memory.copy_engine.copy_runs_np", spy)
    src, dst, host = pools("cpu", "page_first")
    async with CopyEngine(src, host, native=False, inline_max_bytes=0) as eng:
        await eng.backup(token_idx([1, 3], 4), token_idx([2, 5], 4))
    async with CopyEngine(dst, host, native=False, inline_max_bytes=0) as eng:
        await eng.load(token_idx([2, 5], 4), token_idx([0, 9], 4)).wait()
    assert seen and threading.get_ident() not in seen
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [0, 9]) == layer_bytes(src, layer, [1, 3])


def test_split_runs_halves():
    first, second = transfer.split_runs([(0, 10, 3), (7, 2, 1), (20, 30, 4)])
    assert first == [(0, 10, 3), (7, 2, 1)] and second == [(20, 30, 4)]
    first, second = transfer.split_runs([(0, 5, 5)])  # the middle run is cut
    assert first == [(0, 5, 3)] and second == [(3, 8, 2)]
    assert transfer.split_runs([(4, 4, 1)]) == ([(4, 4, 1)], [])


@pytest.mark.parametrize("pattern", ["runs", "scattered"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_split_copy_is_byte_exact_and_close_stops_its_thread(
    pattern, layout, monkeypatch, device_pool_factory, host_pool_factory, fill_bytes
):
    """Big scattered units are copied half on the engine thread, half on a second thread: both
    halves land byte-exact (nothing else touched), the step completes only after both, and
    close() stops the second thread."""
    monkeypatch.setattr("hicache.memory.copy_engine.os.cpu_count", lambda: 2)
    monkeypatch.setattr(transfer, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "SPLIT_UNIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "SPLIT_UNIT_MAX_RUN_BYTES", 1 << 40)
    monkeypatch.setattr(transfer, "NUMPY_RUN_MAX_BYTES", 0)  # every step takes the split path
    calls: list[tuple[str, list]] = []
    orig = transfer.copy_runs_np

    def spy(segments, runs):
        calls.append((threading.current_thread().name, list(runs)))
        orig(segments, runs)

    monkeypatch.setattr("hicache.memory.copy_engine.copy_runs_np", spy)
    rng = np.random.default_rng(5)
    ps, pages, layers = 4, 24, 3
    src = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=layers)
    dst = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=layers)
    fill_bytes(src.kv_data, 9)
    dst.kv_data.view(torch.uint8).fill_(DEVICE_SENTINEL)
    host = host_pool_factory(src, layout=layout, pages=pages)
    if pattern == "runs":
        d, h, t = list(range(2, 13)), list(range(5, 16)), list(range(8, 19))
    else:
        d, h, t = ([int(x) for x in rng.permutation(pages)[:11]] for _ in range(3))

    def split_threads() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.name.startswith("hicache-copy-split")]

    before = set(split_threads())
    eng = CopyEngine(src, host, native=False, inline_max_bytes=0)
    eng.backup_sync(token_idx(d, ps), token_idx(h, ps))
    assert {name.split("_")[0] for name, _ in calls} == {"hicache-copy", "hicache-copy-split"}
    assert sorted(u for _, runs in calls for s, _, k in runs for u in range(s, s + k)) == sorted(d)
    assert set(split_threads()) - before
    eng.close()
    assert not set(split_threads()) - before  # close() joined the second thread
    for p in range(pages):
        page = host.get_data_page(p * ps).view(torch.uint8)
        if p in h:
            i = h.index(p)
            want = src.kv_data[:, :, d[i] * ps : (d[i] + 1) * ps].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(page, want)
        else:
            assert bool((page == 0xAB).all())
    calls.clear()
    with CopyEngine(dst, host, native=False, inline_max_bytes=0) as eng2:
        handle = eng2.load(token_idx(h, ps), token_idx(t, ps))
        handle.wait_sync()
        assert handle.done()
    assert {name.split("_")[0] for name, _ in calls} == {"hicache-copy", "hicache-copy-split"}
    assert not set(split_threads()) - before
    for layer in range(layers):
        assert layer_bytes(dst, layer, t) == layer_bytes(src, layer, d)
        assert set(layer_bytes(dst, layer, [p for p in range(pages) if p not in t])) == {DEVICE_SENTINEL}


def test_no_split_thread_on_one_cpu(monkeypatch, pools):
    monkeypatch.setattr("hicache.memory.copy_engine.os.cpu_count", lambda: 1)
    monkeypatch.setattr(transfer, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "SPLIT_UNIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "NUMPY_RUN_MAX_BYTES", 0)
    src, dst, host = pools()
    with CopyEngine(src, host, native=False) as eng:
        eng.backup_sync(token_idx([1, 5, 3], 4), token_idx([2, 9, 4], 4))
        assert eng._helper is None
    with CopyEngine(dst, host, native=False) as eng:
        eng.load_sync(token_idx([2, 9, 4], 4), token_idx([0, 7, 6], 4))
    for layer in range(src.layer_num):
        assert layer_bytes(dst, layer, [0, 7, 6]) == layer_bytes(src, layer, [1, 5, 3])


def test_split_half_failure_waits_for_the_other_half(monkeypatch, pools):
    """If the engine thread's half fails, the step still waits for the second thread's half
    before the error surfaces (no copy outlives the failed operation)."""
    monkeypatch.setattr("hicache.memory.copy_engine.os.cpu_count", lambda: 2)
    monkeypatch.setattr(transfer, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "SPLIT_UNIT_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "NUMPY_RUN_MAX_BYTES", 0)
    other_done = threading.Event()

    def fake(segments, runs):
        if threading.current_thread().name.startswith("hicache-copy-split"):
            time.sleep(0.05)
            other_done.set()
        else:
            raise RuntimeError("boom")

    monkeypatch.setattr("hicache.memory.copy_engine.copy_runs_np", fake)
    src, _, host = pools()
    with CopyEngine(src, host, native=False) as eng:
        with pytest.raises(RuntimeError, match="boom"):
            eng.backup_sync(token_idx([1, 5, 3, 8], 4), token_idx([2, 9, 4, 0], 4))
        assert other_done.is_set()


def _busy_shared_executor() -> tuple[concurrent.futures.ThreadPoolExecutor, threading.Event]:
    """A one-thread executor another owner shares with the engine, busy until the event is set."""
    shared = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    shared.submit(gate.wait, 10)
    return shared, gate


async def test_a_copy_a_shared_executor_drops_fails_clearly(pools):
    """A shared executor shut down with ``cancel_futures`` drops this engine's queued copies
    unrun. A load's waiters get a clear error (they waited forever: nothing settled the layer
    counter), and a backup raises one too, not a ``CancelledError``: its caller was not
    cancelled, and a worker that took it for its own cancellation stopped for good."""
    src, dst, host = pools(layers=2)
    shared, gate = _busy_shared_executor()
    eng = CopyEngine(dst, host, executor=shared, inline_max_bytes=0)
    handle = eng.load(token_idx([0], 4), token_idx([1], 4))
    backup = asyncio.create_task(eng.backup(token_idx([2], 4), token_idx([3], 4)))
    await asyncio.sleep(0.01)
    shared.shutdown(wait=False, cancel_futures=True)
    gate.set()
    with pytest.raises(CacheClosedError, match="dropped"):
        await asyncio.wait_for(handle.wait(), 5)
    with pytest.raises(CacheClosedError, match="dropped"):
        handle.wait_layer_sync(0, timeout=5)
    with pytest.raises(CacheClosedError, match="dropped"):
        await asyncio.wait_for(backup, 5)
    eng.close()


def test_a_dropped_blocking_backup_fails_clearly(pools):
    src, _, host = pools(layers=2)
    shared, gate = _busy_shared_executor()
    eng = CopyEngine(src, host, executor=shared, inline_max_bytes=0)
    threading.Timer(0.05, lambda: (shared.shutdown(wait=False, cancel_futures=True), gate.set())).start()
    with pytest.raises(CacheClosedError, match="dropped"):
        eng.backup_sync(token_idx([2], 4), token_idx([3], 4))
    eng.close()


def test_close_on_a_shared_executor_waits_for_this_engines_queued_copies(pools):
    """``close()`` finishes queued copies: with a shared executor it returned at once, and a
    load still queued wrote device pages after it."""
    src, dst, host = pools(layers=2)
    shared, gate = _busy_shared_executor()
    eng = CopyEngine(dst, host, executor=shared, inline_max_bytes=0)
    handle = eng.load(token_idx([0, 1], 4), token_idx([2, 3], 4))
    threading.Timer(0.2, gate.set).start()
    eng.close()
    assert handle.done()  # landed before close returned
    shared.shutdown()
