"""``WriteBackQueue``: ``drain`` when copies can never finish (it reports them and returns, and it
never holds the event loop), and what an entry that ends leaves kept on device."""

from __future__ import annotations

import asyncio
import types

from hicache.prefix_cache import Req
from hicache.session.writeback import WriteBackQueue
from session_helpers import Conversation, hold_backups, make_stack, write_kv


class _ClosedTree:
    """A tree whose controller has closed: one node's copy is in flight for good, and
    ``drain_backups`` returns at once (nothing left to wait for)."""

    def __init__(self) -> None:
        self.root_node = types.SimpleNamespace(parent=None)
        self.node = types.SimpleNamespace(parent=self.root_node, host_value=None, backup_op=object(), value=object())
        self.drains = 0

    def write_backup(self, node: object) -> bool:
        return False

    async def drain_backups(self) -> None:
        self.drains += 1


async def test_drain_gives_up_copies_that_can_never_finish_and_yields_meanwhile() -> None:
    tree = _ClosedTree()
    counts: dict[str, int] = {}
    queue = WriteBackQueue(tree, count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))
    queue.enqueue("chat", tree.node, 12)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    try:
        await asyncio.wait_for(queue.drain(), 2.0)
    finally:
        other.cancel()
    assert len(queue) == 0
    assert counts["writeback_lost"] == 1
    assert ticks > 0  # the loop ran other work while drain went round


async def test_a_write_back_host_cannot_take_gives_way_to_a_live_request() -> None:
    """A released session's history waits on device for host room that never comes (host is
    smaller than the history). A request that needs the device gets it: the kept write-back
    is given up (counted dropped) instead of pinning the device until the cache closes."""
    import torch

    from hicache.facade import HiCache
    from hicache.replay.synthetic import write_synthetic_kv

    ps = 16
    cfg = {
        "model": {"name": "test/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 32 * ps, "page_size": ps, "max_requests": 8,
                   "max_context_len": 2048},
        "host": {"ratio": 8 / 32},
        "storage": {"backend": None},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "session": {"reap_interval_s": None},
    }

    async def turn(c: HiCache, rid: str, toks: list[int], sid: str | None = None) -> None:
        h = await c.begin(rid, toks, session_id=sid)
        write_synthetic_kv(c.device_pool, h.kv_indices[h.prefix_len:], torch.tensor(toks)[h.prefix_len:])
        await c.commit(h, finished=True)

    async with HiCache.from_config(cfg) as c:
        await turn(c, "s1", list(range(1000, 1000 + 20 * ps)), "A")
        await c.release_session("A")
        for i in range(3):
            await turn(c, f"big{i}", list(range(50000 + i * 1000, 50000 + i * 1000 + 28 * ps)))
        m = c.cache.metrics()
        assert m["writeback_dropped"] == 1 and m["writeback_pending"] == 0


async def test_a_failed_copy_of_a_kept_write_back_is_tried_again() -> None:
    """A released session's write-back waits for host room; when room comes the tree starts the
    copy itself, and the copy fails. The history stays kept on device and the copy is tried
    again, instead of the next eviction dropping it with no copy anywhere."""
    from session_helpers import Conversation, make_stack

    s = make_stack(hier=True, write_policy="write_through")
    try:
        c = Conversation(s, "S", seed=4)
        await c.turn(14, 3)
        taken = s.host_pool.alloc(s.host_pool.available_size())  # host momentarily full
        s.cache.release_session("S")
        assert list(s.inner._deferred.values()) == [True]
        ctrl = s.controller
        real = ctrl.submit_backup
        failures = [1]

        def fail_once(dev, host, on_done):  # type: ignore[no-untyped-def]
            if failures:
                failures.pop()
                return real(dev, host, lambda ok: on_done(False))
            return real(dev, host, on_done)

        ctrl.submit_backup = fail_once  # type: ignore[method-assign]
        s.host_pool.free(taken)
        s.inner._retry_deferred()  # room freed: the tree starts its deferred backup
        await s.inner.drain_backups()
        await s.inner.drain_backups()
        s.inner.evict(1 << 20)  # device pressure
        s.cache.writeback.pump()
        m = s.cache.metrics()
        assert m["writeback_done"] == 1 and m["writeback_lost"] == 0
        assert s.inner.host_size() > 0  # the history reached host on the second try
    finally:
        await s.aclose()


async def test_kept_history_is_not_pinned_after_its_write_back_entry_ends() -> None:
    """A released history's shared prefix, larger than host, is kept on device for its copy
    while its own tail is copied, evicted from device, then from host: the entry ended, and the
    prefix stayed kept for good, the device full with nothing running."""
    # device 32 pages (128 tokens), host 10 pages (40 tokens)
    s = make_stack(hier=True, device_pages=32, host_pages=10, write_policy="write_back")
    cache = s.cache
    try:
        # 1. a plain request leaves a 48-token prefix P in the tree (bigger than host)
        p = list(range(1, 49))
        r0 = Req(rid="r0", origin_input_ids=p)
        cache.match_req(r0)
        await cache.admit(r0)
        slots = await cache.alloc_extend(r0, len(p))
        write_kv(s.device_pool, slots, p, 0)
        r0.kv_committed_len = len(p)
        cache.release_req(r0)
        # 2. session A continues P with 16 tokens of its own, then is released
        conv = Conversation(s, "A", seed=1)
        conv.history = list(p)
        await conv.turn(16, 1)
        cache.release_session("A")
        # write-back: P refused for want of host room (kept on device), the tail L accepted
        await s.inner.drain_backups()
        cache.writeback.pump()
        # 3. pressure on both tiers: L (backed up) leaves the device, then host
        s.inner.evict(1 << 20)
        s.inner.evict_host(1 << 20)
        cache.writeback.pump()
        m = cache.metrics()
        assert len(cache.writeback) == 0  # the queue no longer follows anything
        # 4. a request that needs the whole device, nothing else running, no session open
        big = Req(rid="big", origin_input_ids=list(range(5000, 5000 + 128)))
        cache.match_req(big)
        await cache.admit(big)
        got = await cache.alloc_extend(big, 128)
        free = s.allocator.available_size()
        cache.abort_req(big)
        assert got is not None, (f"device pinned by a finished write-back: {s.inner.total_size()} tokens in the "
                                 f"tree, {free} free, write-back counters {m['writeback_done']=} {m['writeback_dropped']=}")
    finally:
        await s.aclose()


async def test_an_entry_the_tree_fails_on_is_given_up_not_raised_at_every_pump() -> None:
    """``write_backup`` raising (a bug, a pool in a bad state) ends that entry, counted dropped;
    the others go on, and later pumps (the reaper's, a release's) do not raise."""

    class _FailingTree:
        def __init__(self) -> None:
            self.root_node = types.SimpleNamespace(parent=None)
            self.calls: list[object] = []

        def node(self) -> object:
            return types.SimpleNamespace(parent=self.root_node, host_value=None, backup_op=None, value=object())

        def write_backup(self, node: object) -> bool:
            self.calls.append(node)
            if getattr(node, "bad", False):
                raise RuntimeError("pool in a bad state")
            node.backup_op = object()  # type: ignore[attr-defined]
            return True

    tree = _FailingTree()
    counts: dict[str, int] = {}
    queue = WriteBackQueue(tree, count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))
    bad, good = tree.node(), tree.node()
    bad.bad = True  # type: ignore[attr-defined]
    queue.enqueue("bad", bad, 8)
    queue.enqueue("good", good, 8)
    queue.pump()
    assert counts["writeback_dropped"] == 1 and len(queue) == 1
    assert good.backup_op is not None  # type: ignore[attr-defined]
    good.backup_op, good.host_value = None, object()  # type: ignore[attr-defined]  # its copy landed
    queue.pump()
    assert len(queue) == 0 and counts["writeback_done"] == 1


_PS = 16


def _small_host_config(backend: str, root: str, **cache: object) -> dict[str, object]:
    """A facade config whose host is a tenth of the device, over storage ``backend``."""
    return {
        "model": {"name": "test/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 256 * _PS, "page_size": _PS, "max_requests": 16,
                   "max_context_len": 4096},
        "host": {"ratio": 0.1},
        "storage": {"backend": backend, "options": {"root": root}},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}, **cache},
        "session": {"reap_interval_s": None},
    }


async def _twelve_released_sessions(c: object) -> None:
    """Twelve one-turn sessions of 3 pages each, then every one released: their write-backs
    queue while host is full of pages on their way to storage."""
    import torch

    from hicache.replay.synthetic import write_synthetic_kv

    for s in range(12):
        toks = list(range(10000 * (s + 1), 10000 * (s + 1) + 3 * _PS))
        h = await c.begin(f"r{s}", toks, session_id=f"S{s}")  # type: ignore[attr-defined]
        write_synthetic_kv(c.device_pool, h.kv_indices[h.prefix_len:],  # type: ignore[attr-defined]
                           torch.tensor(toks)[h.prefix_len:])
        await c.commit(h, finished=True)  # type: ignore[attr-defined]
    for s in range(12):
        await c.release_session(f"S{s}")  # type: ignore[attr-defined]


async def test_write_backs_refused_while_host_is_full_of_storage_writes_wait_for_them(tmp_path) -> None:
    """Host, a tenth of the device, is full of pages on their way to storage when the released
    sessions' write-backs drain. Each refusal used to count at once: an entry's attempts ran
    out in microseconds and it was reported dropped (with a warning), though the close then
    copied and wrote it. Now the drain waits for the writes that free the room."""
    from hicache.facade import HiCache

    async with HiCache.from_config(_small_host_config("file", str(tmp_path / "kv"))) as c:
        await _twelve_released_sessions(c)
    m = c.cache.metrics()
    assert m["writeback_dropped"] == 0 and m["writeback_lost"] == 0
    assert m["writeback_done"] == m["writeback_queued"] == 12


async def test_a_close_whose_write_backs_wait_for_slow_storage_writes_keeps_one_close_timeout(tmp_path) -> None:
    """The write-backs' wait for host room (storage writes landing) and the inner cache's drain
    share the close timeout: each took all of it, and a close with storage writes slow to land
    (below the health stall mark) took twice the timeout. What the close could not write is
    reported, as before."""
    import time

    from hicache.facade import HiCache
    from hicache.storage.registry import register_backend
    from hicache_backends.file.backend import FileStorage

    class SlowWrites(FileStorage):
        backend_name = "slow-writes-close-test"

        async def _write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.8)
            return await super()._write(*args, **kwargs)

    register_backend(SlowWrites.backend_name, SlowWrites)
    c = HiCache.from_config(_small_host_config(SlowWrites.backend_name, str(tmp_path / "kv"), backup_batch_pages=1))
    await c.start()
    c._stack.controller.config.close_timeout_s = 1.0
    await _twelve_released_sessions(c)
    t0 = time.monotonic()
    report = await c.aclose()
    took = time.monotonic() - t0
    assert took < 1.8, f"the close took {took:.2f} s against a close timeout of 1 s"
    assert report is not None and (report.unwritten_pages or report.deferred_backup_pages)


async def test_a_close_whose_write_back_copy_hangs_ends_within_the_close_timeout() -> None:
    """A device->host copy that never returns (a wedged copy stream): the write-backs' drain
    waited for the tree's copies with no bound, so ``aclose()`` hung for good, though the
    controller's own close bounds that wait by ``close_timeout_s``. The drain now waits for
    copies until the close's deadline, and the close reports what it could not write."""
    import time

    st = make_stack(controller={"close_timeout_s": 0.5})
    gate = st.hold_backups()
    await Conversation(st, "A", seed=1).turn(20, 3)  # its KV is on device, its copy hangs
    t0 = time.monotonic()
    try:
        report = await asyncio.wait_for(st.cache.aclose(), 10)
    finally:
        gate.set()
    took = time.monotonic() - t0
    assert took < 3, f"the close took {took:.2f} s against a close timeout of 0.5 s"
    assert report is not None and not report.drained
    m = st.cache.metrics()
    assert not st.cache.slots and len(st.cache.writeback) == 0
    assert m["writeback_queued"] == 1 and m["writeback_lost"] + m["writeback_dropped"] == 1, m  # reported
    await st.engine.aclose()


async def test_a_plain_drain_waits_for_a_copy_slower_than_the_close_timeout() -> None:
    """Only a close bounds the wait for copies: a drain while the cache stays open
    (``drain_writeback()``, the replay's ``drain()``) that gave a copy up at ``close_timeout_s``
    counted it lost though it landed a moment later."""
    st = make_stack(controller={"close_timeout_s": 0.2})
    gate = st.hold_backups()
    await Conversation(st, "A", seed=1).turn(20, 3)
    st.cache.release_session("A")
    asyncio.get_running_loop().call_later(0.5, gate.set)  # the copy lands after the close timeout
    await asyncio.wait_for(st.cache.drain_writeback(), 10)
    m = st.cache.metrics()
    assert len(st.cache.writeback) == 0
    assert m["writeback_queued"] == 1 and m["writeback_done"] == 1 and m["writeback_lost"] == 0, m
    await st.aclose()


async def test_a_close_whose_write_back_copy_hangs_leaves_its_store_time_to_close() -> None:
    """A write-back's copy that never lands (a wedged copy stream) held the write-backs' drain
    to the close's deadline, and the inner cache was then closed with no time left: its
    controller hurried, its store handed nothing to end its own close with (here a flush; an
    S3 store's aborts of the uploads it cut). The write-backs take half of what is left, and
    the store's close gets its share of the rest; the whole close still ends by the deadline."""
    import time
    import uuid

    from hicache.controller import ControllerConfig
    from hicache.prefix_cache import Session
    from hicache.session import SessionAwareCache
    from hicache.stack import StackConfig, build_stack
    from hicache.storage.base import time_share
    from hicache_backends.memory import MemoryStorage

    class FlushingStorage(MemoryStorage):
        """A store whose close has half a second of work to do, cut at its deadline."""

        flushed = False

        async def _close(self) -> None:
            try:
                async with asyncio.timeout(time_share(60.0, self._close_deadline)):
                    await asyncio.sleep(0.5)
                    self.flushed = True
            except TimeoutError:
                pass
            await super()._close()

    store = FlushingStorage(store_id=f"flushing-{uuid.uuid4()}")
    cfg = StackConfig(page_size=4, device_pages=16, host_pages=64, storage_backend=None,
                      controller=ControllerConfig(prefetch_threshold=4, close_timeout_s=60.0))
    stack = build_stack(cfg, storage=store)
    stack.controller.own_storage = True  # as build_stack makes it for a configured backend
    await stack.controller.open_storage()
    cache = SessionAwareCache(stack.cache)
    gate = hold_backups(stack.copy_engine)
    try:
        req = Req(rid="turn", origin_input_ids=list(range(100, 112)), session=Session("chat", streaming=True))
        cache.match_req(req)
        await cache.admit(req)
        assert await cache.alloc_extend(req, 12) is not None
        req.kv_committed_len = 12
        cache.release_req(req)
        budget = 8.0
        t0 = time.monotonic()
        report = await asyncio.wait_for(cache.aclose(deadline=t0 + budget), 30.0)
        took = time.monotonic() - t0
        assert took < budget + 2.0, took
        assert store.flushed  # the store's close had time for its work
        assert report is not None and not report.drained
        m = cache.metrics()
        assert m["writeback_queued"] == 1 and m["writeback_lost"] + m["writeback_dropped"] == 1, m  # reported
    finally:
        gate.set()
        await stack.copy_engine.aclose()
