"""Bad inputs and slow stores behind SGLang's controller: misses and clear errors, never a crash
of SGLang's I/O threads, never KV written after a call gave up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
import sgl_drive as drive
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

PAGE = 16
LAYERS = 4


def _ctl(backend: str = "memory", layout: str = "page_head", **extra):
    dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, layout)
    helpers.fill_random(host, 1)
    cfg = helpers.extra_config(backend)
    cfg.update(extra)
    return host, helpers.controller(dev, host, cfg)


def test_memory_backend_round_trip_in_one_server():
    host, ctl = _ctl("memory")
    try:
        drive.write_then_read(ctl, host, ctl, host, 4, LAYERS)
    finally:
        ctl.detach_storage_backend()


def test_a_call_past_the_timeout_is_a_miss_and_nothing_lands_late(monkeypatch):
    from hicache_backends.memory import MemoryStorage

    # (1 s: at 0.2 s the backup and lookup themselves could time out on a loaded 2-core machine)
    host, ctl = _ctl("memory", hicache_call_timeout=1.0)
    try:
        toks = drive.tokens(PAGE * 4)
        src = ctl.mem_pool_host.alloc(len(toks))
        assert drive.backup(ctl, toks, src) == len(toks)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        original = MemoryStorage._read

        async def slow_read(self, pages, buffers):
            await asyncio.sleep(1.5)
            return await original(self, pages, buffers)

        monkeypatch.setattr(MemoryStorage, "_read", slow_read)
        dst = ctl.mem_pool_host.alloc(len(toks))
        before = host.kv_buffer.clone()
        t0 = time.monotonic()
        assert ctl.storage_backend.batch_get_v1(keys, dst) == [False] * 4
        assert time.monotonic() - t0 < 1.2  # gave up at the timeout (0.2 s), not after the read (1.5 s)
        assert ctl.storage_backend.hicache_stats()["call_timeouts"] == 1  # counted, not only logged
        time.sleep(1.6)
        assert torch.equal(host.kv_buffer, before)  # the cancelled read never wrote into the pool
        monkeypatch.setattr(MemoryStorage, "_read", original)
        assert ctl.storage_backend.batch_get_v1(keys, dst) == [True] * 4
    finally:
        ctl.detach_storage_backend()


def test_malformed_requests_are_misses():
    host, ctl = _ctl("memory")
    st = ctl.storage_backend
    try:
        toks = drive.tokens(PAGE * 2)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        idx = ctl.mem_pool_host.alloc(len(toks))
        assert st.batch_set_v1(keys, idx[:-1]) == [False, False]  # wrong length
        shuffled = idx.clone()
        shuffled[3], shuffled[4] = idx[4], idx[3]
        assert st.batch_set_v1(keys, shuffled) == [False, False]  # first page not consecutive
        assert st.batch_set_v1(keys, idx) == [True, True]
        assert st.batch_get_v1(keys, torch.full((2 * PAGE,), 10**9)) == [False, False]  # out of range
        assert st.batch_exists([""]) == 0  # an invalid key is a miss
        assert st.batch_get_v2([PoolTransfer(PoolName.MAMBA, idx, keys=keys)]) == {PoolName.MAMBA: [False, False]}
    finally:
        ctl.detach_storage_backend()


def test_a_failed_write_stops_the_batch_and_says_so(monkeypatch):
    from hicache_backends.memory import MemoryStorage

    host, ctl = _ctl("memory", hicache_staging_mib=1)  # small chunks: several per batch
    try:
        original = MemoryStorage._write
        calls = {"n": 0}

        async def flaky_write(self, pages, buffers, parents):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError("disk gone")
            return await original(self, pages, buffers, parents)

        monkeypatch.setattr(MemoryStorage, "_write", flaky_write)
        toks = drive.tokens(PAGE * 40)
        src = ctl.mem_pool_host.alloc(len(toks))
        chunk = ctl.storage_backend._mover._area("set").chunk_pages
        assert chunk < 40
        assert drive.backup(ctl, toks, src) == 0  # SGLang counts a batch only when all of it is stored
        monkeypatch.setattr(MemoryStorage, "_write", original)
        done, dst = drive.prefetch(ctl, toks)  # the chunk before the failure is stored, nothing after it
        assert done == chunk * PAGE and drive.pages_equal(host, src[:done], host, dst[:done], LAYERS)
    finally:
        ctl.detach_storage_backend()


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_batches_larger_than_the_staging_area(layout, store_root):
    host, ctl = _ctl("file", layout, hicache_options={"root": store_root}, hicache_staging_mib=1)
    try:
        assert ctl.storage_backend._mover is not None
        drive.write_then_read(ctl, host, ctl, host, 40, LAYERS)
    finally:
        ctl.detach_storage_backend()


@contextlib.contextmanager
def _held_by_another_call(pool, index: int, staging: torch.Tensor):
    """Host page ``index`` bound to ``staging``, as an overlapping call would hold it."""
    assert pool.bind([(index, staging)]) == [index]
    try:
        yield
    finally:
        pool.unbind([index])


def test_a_page_another_call_holds_is_neither_read_into_nor_written_from():
    """A host page bound to another in-flight call's staging page (a get and a set of one page
    at once) must not route this call's I/O to that staging page: the run stops before it."""
    host, ctl = _ctl("memory", layout="page_head")
    try:
        backend = ctl.storage_backend
        pool = backend._kv
        assert pool is not None and not pool.has_live_pages
        toks = drive.tokens(PAGE * 4, seed=3)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        src = ctl.mem_pool_host.alloc(len(toks))
        foreign = torch.full((pool.page_nbytes,), 0xAB, dtype=torch.uint8)
        with _held_by_another_call(pool, int(src[2 * PAGE]), foreign):
            assert backend.batch_set_v1(keys, src) == [True, True, False, False]
        assert torch.all(foreign == 0xAB)
        dst = ctl.mem_pool_host.alloc(len(toks))
        assert backend.batch_get_v1(keys, dst) == [True, True, False, False]  # page 2 never stored
        assert drive.backup(ctl, toks, src) == len(toks)  # nothing held now: all four land
        with _held_by_another_call(pool, int(dst[1 * PAGE]), foreign):
            assert backend.batch_get_v1(keys, dst) == [True, False, False, False]
        assert torch.all(foreign == 0xAB)  # the other call's staging page was not read into
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        for i in range(4):
            assert torch.equal(host.get_data_page(int(src[i * PAGE])), host.get_data_page(int(dst[i * PAGE])))
    finally:
        ctl.detach_storage_backend()


# ---------------------------------------------------------------- review findings (stop 39)
def _open_fds_under(root: str) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(root):
                out.append(target)
    return out


def _users_lock_free(root: str) -> bool:
    import fcntl
    import glob

    users = glob.glob(os.path.join(root, "*", "users"))
    assert users, "the store made no ledger"
    fd = os.open(users[0], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_a_close_longer_than_the_call_timeout_is_finished_and_frees_the_store(store_root, monkeypatch):
    """call_timeout bounds one I/O, not a close: a close that waits longer (here for the opening
    scan of a slow folder) runs to its end and releases the ledger's files and lock, which a
    later store of the namespace needs free to correct its usage."""
    import hicache_backends.file.io as file_io

    root = str(store_root)

    def file_ctl(**extra):  # type: ignore[no-untyped-def]
        dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
        host = helpers.host_pool(dev, "page_first")
        return helpers.controller(dev, host, {**helpers.extra_config("file", root=root), **extra})

    ctl = file_ctl()
    toks = drive.tokens(PAGE * 8)
    assert drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks))) == len(toks)
    ctl.detach_storage_backend()

    real_scan = file_io.scan_subdir

    def slow_scan(*args, **kwargs):  # listing a big page folder on a slow file system
        time.sleep(2.0)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(file_io, "scan_subdir", slow_scan)
    ctl = file_ctl(hicache_call_timeout=0.5)
    time.sleep(0.2)  # the opening scan is under way
    t0 = time.monotonic()
    ctl.detach_storage_backend()
    assert time.monotonic() - t0 > 0.5  # not cut short at call_timeout
    assert _open_fds_under(root) == []
    assert _users_lock_free(root)


def test_a_clear_longer_than_the_call_timeout_clears_the_whole_namespace(monkeypatch):
    """call_timeout bounds one I/O, not a clear, which removes a whole namespace (many list and
    delete calls on an object store; the S3 store gives its clear 300 s): SGLang's flush of the
    store was cancelled at call_timeout and left the pages stored."""
    from hicache_backends.memory import MemoryStorage

    host, ctl = _ctl("memory", hicache_call_timeout=0.2)
    try:
        toks = drive.tokens(PAGE * 4)
        assert drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks))) == len(toks)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        original = MemoryStorage._clear

        async def slow_clear(self):  # a namespace of many objects
            await asyncio.sleep(3.0)
            return await original(self)

        monkeypatch.setattr(MemoryStorage, "_clear", slow_clear)
        assert ctl.storage_backend.clear() is True
        assert ctl.storage_backend.batch_exists(keys) == 0
        assert ctl.storage_backend.hicache_stats()["call_timeouts"] == 0
    finally:
        ctl.detach_storage_backend()


def test_a_store_left_open_closes_cleanly_at_interpreter_exit(store_root):
    """A server that exits without closing the backend: its facade closes the store before
    Python stops the executors the close needs (no error, nothing left unwritten)."""
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {here!r})
        import sgl_doubles
        sgl_doubles.install_module_doubles(sgl_doubles.TORCHVISION)
        from sglang.srt.runtime_context import get_parallel
        get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                            attn_dcp_size=1, attn_dcp_rank=0)
        import sgl_drive as drive, sgl_helpers as helpers
        dev = helpers.device_pool(size=2048, page_size={PAGE}, layers={LAYERS})
        host = helpers.host_pool(dev, "page_first")
        helpers.fill_random(host, 1)
        ctl = helpers.controller(dev, host, helpers.extra_config("file", root={str(store_root)!r}))
        toks = drive.tokens({PAGE} * 4)
        assert drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks))) == len(toks)
        time.sleep(0.5)
        print("exiting without close", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exiting without close" in out.stdout
    for bad in ("error while closing", "cannot schedule new futures", "Traceback"):
        assert bad not in out.stderr, out.stderr[-3000:]


def test_two_pages_read_into_one_host_page_stop_the_staged_batch(monkeypatch):
    """Through the mover's staging (one page per chunk), keys read into the same host page two
    chunks apart: the batch stops before the second, as the direct path fails it; the first
    page keeps its own KV."""
    dev = helpers.device_pool(size=256, page_size=PAGE, layers=8, heads=8, head_dim=128)
    host = helpers.host_pool(dev, "layer_first")
    helpers.fill_random(host, 1)
    ctl = helpers.controller(dev, host, {**helpers.extra_config("memory"), "hicache_staging_mib": 1})
    st = ctl.storage_backend
    try:
        assert st._mover is not None and not st._mover.moves_directly
        pages = lambda ps: torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in ps])  # noqa: E731
        keys = ["page-a", "page-b", "page-c"]
        want_a = host.get_data_page(0, flat=True).clone()
        assert st.batch_set_v1(keys, pages([0, 1, 2])) == [True, True, True]
        assert st.batch_get_v1(keys, pages([5, 6, 5])) == [True, True, False]
        assert torch.equal(host.get_data_page(5 * PAGE, flat=True), want_a)
        assert st.hicache_stats()["invalid_requests"] >= 1
    finally:
        ctl.detach_storage_backend()


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_an_unstorable_key_is_a_miss_for_itself_alone(backend, store_root):
    options = {"root": str(store_root)} if backend == "file" else {}
    dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "page_first")
    helpers.fill_random(host, 1)
    ctl = helpers.controller(dev, host, helpers.extra_config(backend, **options))
    st = ctl.storage_backend
    try:
        toks = drive.tokens(PAGE * 4)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        idx = ctl.mem_pool_host.alloc(len(toks))
        assert st.batch_set_v1(keys, idx) == [True] * 4
        assert st.batch_exists(keys[:2] + [""] + keys[2:]) == 2  # a prefix lookup stops there
        assert st.batch_exists_v2(keys[:2] + [""] + keys[2:]).kv_hit_pages == 2
        # a write fails the bad key alone
        two = ctl.mem_pool_host.alloc(3 * PAGE)
        assert st.batch_set_v1(["fresh-a", "", "fresh-b"], two) == [True, False, True]
        assert st.batch_exists(["fresh-a"]) == 1 and st.batch_exists(["fresh-b"]) == 1
        # a read misses the bad key alone too (the staged read failed the whole batch with it)
        dst = ctl.mem_pool_host.alloc(3 * PAGE)
        assert st.batch_get_v1([keys[0], None, keys[1]], dst) == [True, False, True]
        for i in (0, 2):
            assert torch.equal(host.get_data_page(int(idx[(i // 2) * PAGE])), host.get_data_page(int(dst[i * PAGE])))
    finally:
        ctl.detach_storage_backend()


def test_an_open_slower_than_the_call_timeout_still_attaches(store_root, monkeypatch):
    """call_timeout bounds one I/O, not the store's opening: a root whose first touch is slow
    (an NFS automount mounting it, seconds) opened past hicache_call_timeout, and SGLang's
    launch failed with a bare 'TimeoutError: '. The store opens, and I/O is still bounded."""
    import hicache_backends.file.io as file_io

    real_prepare = file_io.prepare_namespace

    def slow_prepare(*args, **kwargs):  # the mount's first access
        time.sleep(1.0)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(file_io, "prepare_namespace", slow_prepare)
    host, ctl = _ctl("file", "page_first", hicache_options={"root": store_root}, hicache_call_timeout=0.3)
    try:
        monkeypatch.setattr(file_io, "prepare_namespace", real_prepare)
        assert ctl.storage_backend.settings.call_timeout == 0.3
        drive.write_then_read(ctl, host, ctl, host, 4, LAYERS)
    finally:
        ctl.detach_storage_backend()


def test_lookups_on_a_hung_mount_answer_misses_within_the_call_timeout(store_root, monkeypatch):
    """A shared file store (the default) checks on disk the first page its index lacks; on a
    slow or hung mount that check takes seconds. SGLang's batch_exists, batch_exists_v2 and
    exists (on its prefetch thread) still answer within hicache_call_timeout, the unchecked
    page a miss, instead of holding the prefetch thread until the mount answers."""
    import threading

    import hicache_backends.file.io as file_io

    host, ctl = _ctl("file", "page_first", hicache_options={"root": store_root}, hicache_call_timeout=0.5)
    st = ctl.storage_backend
    release = threading.Event()
    real_probe = file_io.probe_page
    try:
        toks = drive.tokens(PAGE * 4)
        src = ctl.mem_pool_host.alloc(len(toks))
        assert drive.backup(ctl, toks, src) == len(toks)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        assert st.backend.shared
        monkeypatch.setattr(file_io, "probe_page", lambda path: (release.wait(3.0), real_probe(path))[1])
        asked = keys + ["not-stored-" + keys[-1]]
        calls = {
            "batch_exists": (lambda: st.batch_exists(asked), 4),
            "batch_exists_v2": (lambda: st.batch_exists_v2(asked).kv_hit_pages, 4),
            "exists": (lambda: st.exists(asked[-1]), False),
        }
        for name, (call, want) in calls.items():
            t0 = time.monotonic()
            assert call() == want, name
            assert time.monotonic() - t0 < 1.5, name  # the timeout (0.5 s), not the disk (3 s)
        assert st.batch_exists(keys) == 4  # indexed pages need no probe
        assert st.hicache_stats()["call_timeouts"] >= 3
    finally:
        release.set()
        ctl.detach_storage_backend()


@pytest.mark.parametrize("policy", ["all_pages", "trailing_pages"])
def test_a_hybrid_lookup_on_a_hung_mount_answers_within_one_call_timeout(store_root, monkeypatch, policy):
    """A hybrid model's hit query (SGLang's controller calls batch_exists_v2 with its SWA or
    Mamba pool) on a shared file store whose disk hangs: the KV prefix's check of the first
    unindexed page (on the prefetch thread) and the extra pool's check (on the loop) were each
    bounded by hicache_call_timeout, one after the other, so the prefetch thread waited twice
    that. The whole call answers within it; the pool not answered is a miss, counted."""
    import threading

    import hicache_backends.file.io as file_io
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    timeout = 2.0  # wide: the bound below must hold on a loaded 2-core CI machine
    dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "page_first")
    _, swa = helpers.swa_entry(PAGE)
    ctl = helpers.controller(dev, host, helpers.extra_config("file", root=store_root) | {"hicache_call_timeout": timeout},
                             extra_entries=[swa])
    st = ctl.storage_backend
    release = threading.Event()
    real_probe = file_io.probe_page
    try:
        toks = drive.tokens(PAGE * 5)
        assert drive.backup(ctl, toks[: PAGE * 4], ctl.mem_pool_host.alloc(PAGE * 4)) == PAGE * 4
        assert st.backend.shared  # the 5th KV page and every SWA page are checked on disk
        monkeypatch.setattr(file_io, "probe_page", lambda path: (release.wait(8.0), real_probe(path))[1])
        swa_query = [PoolTransfer(PoolName.SWA, keys=[], hit_policy=PoolHitPolicy(policy))]
        op = PrefetchOperation(CacheRequestHandle("r", 0), toks, None, prefix_keys=[], pool_transfers=swa_query)
        t0 = time.monotonic()
        _, hit_tokens = ctl._storage_hit_query(op)
        took = time.monotonic() - t0
        assert took < timeout * 1.6, took  # one call timeout, not one for the KV and one for the pool
        assert hit_tokens == 0  # the SWA pages were never answered: a miss
        assert op.query_pool_hit_pages == {PoolName.KV: 4}  # the KV prefix was answered; no SWA verdict
        assert st.hicache_stats()["call_timeouts"] >= 2  # the KV page's check and the pool's
    finally:
        release.set()
        ctl.detach_storage_backend()


def test_a_lookup_on_a_slow_mount_answers_within_one_call_timeout(store_root, monkeypatch):
    """SGLang's batch_exists (every non-hybrid model's hit query) on a shared file store whose
    disk is slow: the page another server wrote is checked on disk on the prefetch thread
    (found just inside hicache_call_timeout), then looked up again on the loop, which had a
    call timeout of its own; the prefetch thread waited nearly twice it. Both tries share one."""
    import hicache_backends.file.io as file_io

    timeout = 2.0  # wide: the bound below must hold on a loaded 2-core CI machine
    _, ctl = _ctl("file", "page_first", hicache_options={"root": store_root}, hicache_call_timeout=timeout)
    _, other = _ctl("file", "page_first", hicache_options={"root": store_root})
    real_probe = file_io.probe_page
    try:
        toks = drive.tokens(PAGE * 4)
        assert drive.backup(other, toks, other.mem_pool_host.alloc(len(toks))) == len(toks)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        st = ctl.storage_backend
        monkeypatch.setattr(file_io, "probe_page", lambda path: (time.sleep(0.7 * timeout), real_probe(path))[1])
        t0 = time.monotonic()
        assert st.batch_exists(keys) in (0, 4)
        took = time.monotonic() - t0
        assert took < timeout * 1.4, took  # one call timeout, not one on the thread and one on the loop
    finally:
        ctl.detach_storage_backend()
        other.detach_storage_backend()


@pytest.mark.parametrize("write", [False, True], ids=["get", "set"])
def test_a_v2_call_of_several_pools_answers_within_one_call_timeout(monkeypatch, write):
    """A hybrid model's batch_get_v2 / batch_set_v2 of its KV and SWA pools in one call on a
    store that stalls: each pool's I/O was bounded by hicache_call_timeout on its own, so
    SGLang's I/O thread waited once per pool. The whole call answers within one call timeout;
    the pages not moved by then fail."""
    from hicache_backends.memory import MemoryStorage

    timeout = 2.0  # wide: the bound below must hold on a loaded 2-core CI machine
    dev = helpers.device_pool(size=2048, page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "page_head")
    helpers.fill_random(host, 1)
    swa_host, swa = helpers.swa_entry(PAGE)
    ctl = helpers.controller(dev, host, helpers.extra_config("memory") | {"hicache_call_timeout": timeout},
                             extra_entries=[swa])
    st = ctl.storage_backend
    try:
        keys = drive.get_storage_hash_str(drive.tokens(PAGE * 2), None, page_size=PAGE)

        def transfers() -> list[PoolTransfer]:
            return [PoolTransfer(PoolName.KV, ctl.mem_pool_host.alloc(PAGE * 2), keys=keys),
                    PoolTransfer(PoolName.SWA, swa_host.alloc(PAGE * 2), keys=keys)]

        assert st.batch_set_v2(transfers()) == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
        primitive = "_write" if write else "_read"
        original = getattr(MemoryStorage, primitive)

        async def stalled(self, *args, **kwargs):
            await asyncio.sleep(5.0)
            return await original(self, *args, **kwargs)

        monkeypatch.setattr(MemoryStorage, primitive, stalled)
        if write:
            keys = drive.get_storage_hash_str(drive.tokens(PAGE * 2, seed=9), None, page_size=PAGE)
        t0 = time.monotonic()
        got = (st.batch_set_v2 if write else st.batch_get_v2)(transfers())
        took = time.monotonic() - t0
        assert took < timeout * 1.5, took  # one call timeout, not one per pool
        assert got == {PoolName.KV: [False, False], PoolName.SWA: [False, False]}
        assert st.hicache_stats()["call_timeouts"] >= 1
    finally:
        ctl.detach_storage_backend()
