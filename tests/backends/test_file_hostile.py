"""The ``file`` backend against a hostile root: FIFOs and other non-regular files where pages and
manifests belong, a 100% full file system (a real tmpfs), a free-space floor larger than the
disk, and several processes sharing one ``max_bytes``. Each test failed before its fix (issue 14,
items 1-4)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from hicache.inspect import inspect_store
from hicache.storage.types import PageKey
from hicache.testing.store_tests import NS_A, NS_B
from hicache_backends.file import FileStorage
from hicache_backends.file import io as file_io
from hicache_backends.file.ledger import LEDGER_NAME, USERS_NAME, read_usage

from _file_helpers import hold_publish_window, page_path, slow_page_writes

LIMIT = 3.0  # seconds any call may take here (a blocked open would take forever)


def make_store(root, namespace=NS_A, **options) -> FileStorage:
    options.setdefault("min_free_bytes", 0)
    return FileStorage(None, root=str(root), namespace=namespace, **options)


def v0(size: int, fill: int) -> torch.Tensor:
    return torch.full((size,), fill, dtype=torch.uint8)


@contextlib.contextmanager
def fifos_released(paths: list[str]) -> Iterator[None]:
    """On the way out, open every FIFO for writing: a thread blocked opening one for reading
    (the bug this guards against) is then released, so a failing test fails instead of hanging."""
    try:
        yield
    finally:
        for p in paths:
            try:
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            os.close(fd)


async def within(coro, limit: float = LIMIT):
    t0 = time.monotonic()
    out = await asyncio.wait_for(coro, limit)
    assert time.monotonic() - t0 < limit
    return out


# ---------------------------------------------------------------------- item 1: non-regular files


async def test_fifo_at_a_page_path_never_blocks_and_is_a_miss(tmp_path) -> None:
    size = 4096
    store = make_store(tmp_path)
    await store.__aenter__()
    fifo = page_path(store.root, store.namespace.digest, "fifo")
    with fifos_released([fifo]):
        try:
            assert await store.set("fifo", v0(size, 1))
            os.unlink(fifo)
            os.mkfifo(fifo)
            assert await within(store.get("fifo", torch.empty(size, dtype=torch.uint8))) is None
            assert await within(store.get("fifo")) is None  # the unknown-size path
            assert not await within(store.exists("fifo"))
            assert not os.path.lexists(fifo)  # not ours: removed, like a symlink
            os.mkfifo(fifo)  # planted again while the index no longer knows the page
            assert not await within(store.exists("fifo"))  # the stat fallback sees no page
            assert await within(store.set("fifo", v0(size, 2)))  # a write replaces it
            got = await within(store.get("fifo", torch.empty(size, dtype=torch.uint8)))
            assert got is not None and torch.equal(got, v0(size, 2))
        finally:
            await within(store.aclose())
    # FIFOs where the shared usage ledger and its users lock live: replaced, never waited on
    ledger_files = [os.path.join(store.layout.ns_dir, n) for n in (LEDGER_NAME, USERS_NAME)]
    with fifos_released(ledger_files):
        for p in ledger_files:
            os.unlink(p)
            os.mkfifo(p)
        async with make_store(tmp_path, max_bytes=1 << 20) as again:
            assert await within(again.set("after-fifos", v0(size, 3)))
        assert all(os.path.isfile(p) for p in ledger_files)


async def test_fifos_and_devices_in_a_root_do_not_block_open_scan_or_inspect(tmp_path) -> None:
    size = 2048
    async with make_store(tmp_path) as store:
        assert await store.batch_set(["a", "b"], [v0(size, 1), v0(size, 2)])
        digest = store.namespace.digest
    fifos = [page_path(tmp_path, digest, "a"), str(tmp_path / digest / "manifest.json")]
    with fifos_released(fifos):
        for p in fifos:
            os.unlink(p)
            os.mkfifo(p)
        null_page = page_path(tmp_path, digest, "b")
        os.unlink(null_page)
        os.symlink("/dev/zero", null_page)
        # inspect lists namespaces (reads manifests) and their pages (reads headers)
        report = await within(inspect_store(str(tmp_path), progress=False))
        assert report["corrupt"] == 0
        # open reads the manifest, the scan reads footers: a FIFO at either blocks neither
        store = make_store(tmp_path)
        await within(store.__aenter__())
        try:
            assert await within(store.wait_index_ready(LIMIT))
            assert await within(store.batch_exists(["a", "b"])) == 0
            assert await within(store.get("a", torch.empty(size, dtype=torch.uint8))) is None
            assert await within(store.get("b")) is None
            assert os.path.isfile(fifos[1])  # the manifest was rewritten as a regular file
        finally:
            await within(store.aclose())


# ---------------------------------------------------------------------- item 2: a 100% full disk


def fill_to_the_brim(folder: Path, name: str = "filler") -> Path:
    """Write a file until the file system refuses even one more byte (ENOSPC)."""
    path = folder / name
    with open(path, "ab", buffering=0) as f:
        chunk = 1 << 16
        while chunk:
            try:
                f.write(b"\0" * chunk)
            except OSError:
                chunk //= 2
    st = os.statvfs(folder)
    assert st.f_bavail * st.f_frsize == 0
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_clear_on_a_full_disk_reclaims_its_trash_and_keeps_working(small_tmpfs) -> None:
    mnt = small_tmpfs(2 << 20)
    size = 150_000
    async with make_store(mnt, max_bytes=None) as store:
        n = 0
        while await store.set(f"p{n}", v0(size, n % 250 + 1)):
            n += 1
        assert n >= 5
        fill_to_the_brim(mnt)
        assert await within(store.clear())
        await within(store.wait_background())
        # the trash is gone (the disk has room again) and the fresh manifest was written after
        assert not [x for x in os.listdir(mnt) if x.startswith(".trash")]
        assert os.path.isfile(store.layout.manifest_path)
        assert await store.set("after", v0(size, 7))
        got = await store.get("after", torch.empty(size, dtype=torch.uint8))
        assert got is not None and torch.equal(got, v0(size, 7))


async def test_store_opens_on_a_full_disk_and_reclaims_a_dead_clear(small_tmpfs) -> None:
    """A process killed mid-clear left its trash, and the disk is 100% full: the next store must
    open anyway (it used to write the manifest first and fail), delete the trash in the
    background, then write its manifest and accept pages again."""
    mnt = small_tmpfs(2 << 20)
    size = 150_000
    async with make_store(mnt, max_bytes=None) as store:
        assert await store.batch_set([f"q{i}" for i in range(8)], [v0(size, i + 1) for i in range(8)])
        digest = store.namespace.digest
    os.rename(mnt / digest, mnt / f".trash-{digest}-{dead_pid()}-0")  # what a killed clear leaves
    filler = fill_to_the_brim(mnt)
    async with make_store(mnt, max_bytes=None) as again:
        await within(again.wait_background(), 10)
        assert not [x for x in os.listdir(mnt) if x.startswith(".trash")]
        assert os.path.isfile(again.layout.manifest_path)
        assert await again.set("back", v0(size, 9))
    assert filler.exists()  # what is not ours is never touched


# ---------------------------------------------------------------------- item 3: one bound, N processes


@contextlib.asynccontextmanager
async def _four_pages_with_a_peer(root, bound: int, page: int) -> AsyncIterator[tuple[FileStorage, FileStorage]]:
    """A store bounded to ``bound`` bytes holding four pages of ``page`` bytes, and a peer
    that keeps the namespace open (so no lone scan corrects the shared count)."""
    async with make_store(root, max_bytes=bound) as store, make_store(root, max_bytes=bound) as peer:
        await within(store.wait_background())
        await within(peer.wait_background())
        for i in range(4):
            assert await within(store.set(f"k{i}", v0(page, i)))
        yield store, peer


def _flip_a_byte(root, store: FileStorage, keys: tuple[str, ...]) -> None:
    """Flip one byte in the middle of each of ``keys``' page files: corrupt pages."""
    for key in keys:
        path = page_path(root, store.namespace.digest, key)
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(path).write_bytes(data)


async def _settled_by_the_next_write(store: FileStorage, ledger: str) -> None:
    """A write of ``store`` takes the ledger's lock, which settles a dead process's marked
    bytes: the shared count is then what the namespace holds on disk."""
    assert await within(store.set("k-parent", v0(1 << 10, 1)))
    for _ in range(2):
        await within(store.wait_background(), 10.0)
        await asyncio.sleep(0.2)
    on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
    assert read_usage(ledger).used == on_disk


def _killed_after(func: str, op: str, options: str = "") -> str:
    """A child script, run as ``python -c SCRIPT ROOT MAX_BYTES SIZE``: a file store at ROOT
    bounded to MAX_BYTES (more keyword arguments: ``options``, such as ``"read_only=True"``)
    runs ``op`` (SIZE is ``sys.argv[3]``), and is SIGKILLed right after its ``page_io.<func>``
    returns: files unlinked, their bytes not yet off the shared count."""
    more = f", {options}" if options else ""
    return (
        "import asyncio, os, sys, torch\n"
        "from hicache.testing.store_tests import NS_A\n"
        "from hicache_backends.file import FileStorage\n"
        "from hicache_backends.file import io as page_io\n"
        "async def main():\n"
        f"    s = FileStorage(None, root=sys.argv[1], namespace=NS_A, min_free_bytes=0, max_bytes=int(sys.argv[2]){more})\n"
        "    async with s:\n"
        "        await s.wait_background()\n"
        f"        real = page_io.{func}\n"
        "        def die(*args):\n"
        "            real(*args)\n"
        "            os.kill(os.getpid(), 9)  # unlinked, not subtracted\n"
        f"        page_io.{func} = die\n"
        f"        await {op}\n"
        "asyncio.run(main())\n"
    )


def namespace_bytes(ns_dir: str) -> int:
    """Bytes of page files and in-flight temporary files under a namespace folder, by size."""
    total = 0
    pages = os.path.join(ns_dir, "pages")
    try:
        subdirs = os.listdir(pages)
    except FileNotFoundError:
        return 0
    for sub in subdirs:
        try:
            with os.scandir(os.path.join(pages, sub)) as it:
                for e in it:
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
        except (FileNotFoundError, NotADirectoryError):
            pass
    return total


@pytest.fixture(scope="module")
def forkserver():
    from _file_helpers import ForkServer

    server = ForkServer()
    yield server
    server.close()


async def test_max_bytes_holds_across_processes_sharing_a_root(forkserver, small_tmpfs) -> None:
    """Four writer processes, each told ``max_bytes`` = 24 pages, write 4 x 60 distinct pages
    (rewriting some) at once on one tmpfs: its used blocks, sampled every few milliseconds with
    ``statvfs`` (an atomic reading, unlike a walk of the folders while they churn), stay within
    ``max_bytes`` plus the stated slack of one page, during and after; then a fifth process
    that never saw their pages still makes room for its own."""
    import signal

    root = small_tmpfs(64 << 20)
    size = 64 * 1024
    ns = NS_A.to_dict()
    probe = make_store(root)
    page = probe.layout.file_size("w0-0", "kv", size)
    limit = 24 * page
    ns_dir = probe.layout.ns_dir
    async with make_store(root) as first:  # manifest, ledger, folders: the baseline
        await first.wait_background()
    block = os.statvfs(root).f_frsize
    page_blocks = -(-page // block) * block  # what one page takes on this file system

    def used() -> int:
        st = os.statvfs(root)
        # the removal journal is bounded store metadata, outside max_bytes (file/journal.py)
        journal = 0
        for name in ("removals", "removals.1"):
            try:
                journal += -(-os.stat(os.path.join(ns_dir, name)).st_size // block) * block
            except FileNotFoundError:
                pass
        return (st.f_blocks - st.f_bfree) * st.f_frsize - journal

    baseline = used()
    pids = [
        forkserver.call(
            op="write", root=str(root), ns=ns, keys=[f"w{w}-{i}" for i in range(60)], size=size,
            forever=True, max_bytes=limit,
        )["pid"]
        for w in range(4)
    ]
    peak = 0
    t_end = time.monotonic() + 2.5
    try:
        while time.monotonic() < t_end:
            peak = max(peak, used() - baseline)
            await asyncio.sleep(0.002)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            forkserver.call(op="wait", pid=pid)
    peak_pages, after = peak / page_blocks, namespace_bytes(ns_dir)
    print(f"peak {peak_pages:.2f} pages of 24 allowed, after {after / limit:.3f}x max_bytes")
    assert peak_pages > 12, "the writers never filled the store: the test measured nothing"
    assert peak_pages <= 25, f"peak {peak_pages:.2f} pages, max_bytes allows 24"
    assert after <= limit, f"{after / limit:.2f}x max_bytes after the writers died"
    # a new process knows none of those pages, yet its writes make room (it indexes them)
    async with make_store(root, max_bytes=limit) as store:
        assert await store.wait_index_ready(10)
        # alone on the root, its scan replaced the count (killed writers' reservations in it)
        # with what is on disk
        usage = read_usage(os.path.join(ns_dir, LEDGER_NAME))
        assert usage is not None and usage.used == namespace_bytes(ns_dir)
        ok = await store.batch_set([f"new-{i}" for i in range(8)], [v0(size, i + 1) for i in range(8)])
        assert ok
    assert namespace_bytes(ns_dir) <= limit


# ---------------------------------------------------------------------- item 4: refusals are visible


async def test_a_floor_above_a_small_disk_refuses_visibly(small_tmpfs, caplog) -> None:
    """The default ``min_free_bytes`` (1 GiB) on an 8 MiB file system refuses every write: once a
    minute a WARNING says so and why, the metric counts it, and ``hicache inspect`` (another
    store, as another process would be) shows it."""
    mnt = small_tmpfs(8 << 20)
    size = 4096
    with caplog.at_level(logging.WARNING, logger="hicache.storage.file"):
        async with FileStorage(None, root=str(mnt), namespace=NS_B) as store:  # default floor
            for i in range(5):
                assert not await store.set(f"r{i}", v0(size, 1))
            stats = store.get_stats()
            assert stats["rejected_pages_no_space"] == 5
    warnings = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "min_free_bytes" in warnings[0].getMessage()
    report = await inspect_store(str(mnt), progress=False)
    assert report["writes_refused_for_free_space"] is True
    assert report["free_bytes"] < report["min_free_bytes"] == 1 << 30
    (ns,) = report["namespaces"].values()
    assert ns["refused_pages_no_space"] == 5 and "last_refused_at" in ns


@contextlib.contextmanager
def frozen_lock_holder(path: str) -> Iterator[None]:
    """Another process that takes an exclusive ``flock`` on ``path`` and then stops (SIGSTOP,
    as a debugger or a paused container would), holding it until it is killed on the way out."""
    import signal
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import fcntl, os, signal\n"
            f"fd = os.open({path!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGSTOP)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


async def test_a_frozen_process_holding_the_ledger_lock_does_not_hang_writers(tmp_path) -> None:
    """A process stopped (SIGSTOP) while it holds the usage ledger's lock: writes here go on
    within a bounded wait, counting this process only, and use the ledger again after."""
    async with make_store(tmp_path, max_bytes=1 << 20) as store:
        assert await store.set("before", v0(4096, 1))
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        with frozen_lock_holder(ledger):
            assert await within(store.set("during", v0(4096, 2)))
        assert await within(store.set("after", v0(4096, 3)))
        usage = read_usage(ledger)
        assert usage is not None and usage.used >= 2 * store.layout.file_size("after", "kv", 4096)


def peer_takes_the_ledger_lock(ledger: str, seconds: float = 0.8) -> None:
    """Another open file of the ledger takes its lock for ``seconds`` (longer than the store's
    patience, ``LOCK_PATIENCE``): a peer frozen holding it, for that long."""
    import fcntl

    fd = os.open(ledger, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(seconds, os.close, (fd,)).start()


def peer_locks_the_ledger_after_each_write(monkeypatch, ledger: str) -> None:  # type: ignore[no-untyped-def]
    """Right after each page write, before its batch settles, a peer takes the ledger's lock
    past the store's patience (:func:`peer_takes_the_ledger_lock`): the settlement finds the
    ledger unavailable."""
    real_write = file_io.write_page

    def write_then_peer_locks(*args):  # type: ignore[no-untyped-def]
        result = real_write(*args)
        peer_takes_the_ledger_lock(ledger)
        return result

    monkeypatch.setattr(file_io, "write_page", write_then_peer_locks)


def own_slot_bytes(ledger: str) -> int:
    """Bytes this process's slot of the ledger's in-flight table holds (both stores here are
    one process: one slot)."""
    from hicache_backends.file.ledger import _decode_slots, _taken

    with open(ledger, "rb") as f:
        slots = _decode_slots(f.read())
    return sum(slots[i + 2] for i in _taken(slots) if slots[i + 1] == os.getpid())


@pytest.mark.parametrize("where", ["last_write", "after_cancel"])
async def test_a_settlement_the_ledger_is_unavailable_for_is_owed_not_lost(tmp_path, monkeypatch, where) -> None:
    """A peer holds the ledger's lock past our patience exactly when a batch settles, on the
    batch's last I/O thread (``last_write``) or on the loop after a cancelled reservation
    (``after_cancel``). The settlement was dropped: what the batch reserved and did not keep
    (here a page it replaced) stayed counted for good, and its in-flight bytes stayed in this
    process's slot, for a peer to take off the count again once this process dies. Now both
    are owed and settled by the next reservation."""
    from hicache_backends.file.space import SpaceAccountant

    size = 8192
    a, b = make_store(tmp_path, max_bytes=1 << 22), make_store(tmp_path, max_bytes=1 << 22)
    ns_dir = a.layout.ns_dir
    ledger = os.path.join(ns_dir, LEDGER_NAME)
    async with a, b:
        await a.wait_index_ready(10)
        await b.wait_index_ready(10)
        assert await a.set("k", v0(size, 1))
        if where == "last_write":
            peer_locks_the_ledger_after_each_write(monkeypatch, ledger)
            assert await within(b.set("k", v0(size, 2)))  # b did not know it: replaced
        else:
            reserved = threading.Event()
            real_reserve = SpaceAccountant._reserve

            def reserve_then_peer_locks(self, res, amount, debt):
                real_reserve(self, res, amount, debt)
                peer_takes_the_ledger_lock(ledger)
                reserved.set()
                time.sleep(0.1)  # the caller's cancellation lands while this call runs

            async def on_a_round_trip_of_its_own(self, incoming):  # not on the batch's thread
                return False

            monkeypatch.setattr(SpaceAccountant, "reserves_in_batch", on_a_round_trip_of_its_own)
            monkeypatch.setattr(SpaceAccountant, "_reserve", reserve_then_peer_locks)
            task = asyncio.create_task(b.set("k", v0(size, 2)))
            assert await within(asyncio.to_thread(reserved.wait, LIMIT))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await within(task)
        monkeypatch.undo()
        await asyncio.sleep(1.0)  # the peer lets go
        for i in range(2):  # later writes of both stores settle what is owed
            assert await a.set(f"a{i}", v0(size, 3)) and await b.set(f"b{i}", v0(size, 4))
        usage = read_usage(ledger)
        assert usage is not None and usage.used == namespace_bytes(ns_dir)
        assert own_slot_bytes(ledger) == 0


async def test_what_a_settlement_could_not_tell_the_ledger_is_told_at_close(tmp_path, monkeypatch) -> None:
    """The same unavailable settlement, then the store closes with no later write to carry
    what it owes: the close tells the ledger. Dropped, this process's slot kept the batch's
    bytes, and a peer took them off the count once the process exited: pages on disk
    under-counted for as long as peers kept the namespace open."""
    size = 8192
    a, b = make_store(tmp_path, max_bytes=1 << 22), make_store(tmp_path, max_bytes=1 << 22)
    ns_dir = a.layout.ns_dir
    ledger = os.path.join(ns_dir, LEDGER_NAME)
    async with a:
        await a.wait_index_ready(10)
        async with b:
            await b.wait_index_ready(10)
            assert await a.set("k", v0(size, 1))
            peer_locks_the_ledger_after_each_write(monkeypatch, ledger)
            assert await within(b.set("k", v0(size, 2)))  # b did not know it: replaced
            monkeypatch.undo()
            assert b._space.debt or b._space.unreleased  # owed: the settlement found no ledger
            await asyncio.sleep(1.0)  # the peer lets go; b closes with no write after
        usage = read_usage(ledger)
        assert usage is not None and usage.used == namespace_bytes(ns_dir)
        assert own_slot_bytes(ledger) == 0


async def test_a_frozen_process_holding_the_journal_lock_does_not_hang_page_io(tmp_path) -> None:
    """A process stopped while it holds the removal journal's lock: this store keeps evicting
    (each eviction is a journal line) and reading and writing within a bounded wait; the lines
    it could not append are dropped and counted, and appends work again once the lock is free."""
    size = 4096
    # two I/O threads and room for five pages: from the sixth write on, every write evicts
    async with make_store(tmp_path, io_threads=2, max_bytes=5 * (size + 512)) as store:
        await store.wait_background()
        with frozen_lock_holder(os.path.join(store.layout.ns_dir, "removals.lock")):
            for i in range(12):
                assert await within(store.set(f"k{i}", v0(size, i)))
            assert store.get_stats()["evicted_pages"] >= 6
            got = torch.empty(size, dtype=torch.uint8)
            assert await within(store.get("k11", got)) is not None and bool((got == 11).all())
            await within(store.wait_background())
            deadline = time.monotonic() + LIMIT
            while store.get_stats()["journal_dropped_lines"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert store.get_stats()["journal_dropped_lines"] > 0
        dropped = store.get_stats()["journal_dropped_lines"]
        for i in range(12, 15):
            assert await within(store.set(f"k{i}", v0(size, i)))
        journal = os.path.join(store.layout.ns_dir, "removals")
        deadline = time.monotonic() + LIMIT
        while time.monotonic() < deadline and not os.path.getsize(journal):
            await asyncio.sleep(0.05)
        assert os.path.getsize(journal) > 0  # the lock is free again: evictions are journaled
        assert store.get_stats()["journal_dropped_lines"] == dropped


async def test_the_shared_count_stays_exact_through_cancellations_failures_and_foreign_clears(tmp_path, monkeypatch) -> None:
    """Two stores on one root (as two processes would be): a write cancelled mid-batch, a write
    that fails (ENOSPC injected), rewrites, and a clear by the *other* store leave the shared
    count equal to the bytes on disk."""
    import errno

    from hicache_backends.file import io as file_io

    size = 8192
    a, b = make_store(tmp_path, max_bytes=1 << 22), make_store(tmp_path, max_bytes=1 << 22)
    ledger = os.path.join(a.layout.ns_dir, LEDGER_NAME)
    ns_dir = a.layout.ns_dir

    def exact() -> bool:
        usage = read_usage(os.path.join(ns_dir, LEDGER_NAME))
        return usage is not None and usage.used == namespace_bytes(ns_dir)

    async with a, b:
        await a.wait_index_ready(10)
        await b.wait_index_ready(10)
        assert await a.batch_set([f"a{i}" for i in range(4)], [v0(size, 1)] * 4)
        assert await b.batch_set([f"a{i}" for i in range(2)] + ["b0"], [v0(size, 2)] * 3)  # rewrites
        assert exact()
        real_write = file_io.write_page
        started = slow_page_writes(monkeypatch, 0.1)
        task = asyncio.create_task(a.batch_set([f"c{i}" for i in range(3)], [v0(size, 3)] * 3))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert exact()
        real_pwritev = file_io._pwritev
        monkeypatch.setattr(file_io, "write_page", real_write)

        def full(fd, bufs, offset):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        monkeypatch.setattr(file_io, "_pwritev", full)
        assert not await a.set("d0", v0(size, 4))
        monkeypatch.setattr(file_io, "_pwritev", real_pwritev)
        assert exact()
        assert await b.clear()  # the other store clears: the ledger goes with the old folder
        await b.wait_background()
        assert await a.batch_set(["e0", "e1"], [v0(size, 5)] * 2)  # a's next write: new ledger
        assert exact() and read_usage(ledger).used == 2 * a.layout.file_size("e0", "kv", size)


async def test_two_stores_publishing_one_page_at_once_count_it_once(tmp_path, monkeypatch) -> None:
    """Two stores on one root (two data-parallel servers with a shared prompt prefix) publish
    the same page at once. Each measured the file it would replace, found none, then renamed:
    the shared count held the page twice, one file on disk, for as long as peers stayed open.
    Held in that window until the other store has measured too, both writers still count the
    page once between them."""
    size = 8192
    both = threading.Barrier(2, timeout=0.5)

    def meet(path: str) -> None:  # since the fix only the second publish measures: alone, it goes on
        with contextlib.suppress(threading.BrokenBarrierError):
            both.wait()

    a, b = make_store(tmp_path, max_bytes=1 << 22), make_store(tmp_path, max_bytes=1 << 22)
    ns_dir = a.layout.ns_dir
    async with a, b:
        await a.wait_index_ready(10)
        await b.wait_index_ready(10)
        hold_publish_window(monkeypatch, meet)
        assert all(await within(asyncio.gather(a.set("same", v0(size, 1)), b.set("same", v0(size, 2)))))
        usage = read_usage(os.path.join(ns_dir, LEDGER_NAME))
        assert usage is not None and usage.used == namespace_bytes(ns_dir) == a.layout.file_size("same", "kv", size)


async def test_a_page_unlinked_by_a_peer_while_it_is_published_again_is_counted_right(tmp_path, monkeypatch) -> None:
    """One store deletes a page while another publishes it again (it did not know the page).
    The publisher measured the old file, the peer unlinked it (subtracted), the rename then
    put a new page there counted nowhere (its size less the old one's): the shared count was
    a page below the disk, and ``max_bytes`` let the namespace grow past it."""
    size = 8192
    measured, deleted = threading.Event(), threading.Event()

    def wait_for_the_delete(path: str) -> None:
        measured.set()
        deleted.wait(LIMIT)

    a, b = make_store(tmp_path, max_bytes=1 << 22), make_store(tmp_path, max_bytes=1 << 22)
    ns_dir = a.layout.ns_dir
    async with a, b:
        await a.wait_index_ready(10)
        await b.wait_index_ready(10)
        assert await a.set("k", v0(size, 1))
        hold_publish_window(monkeypatch, wait_for_the_delete)
        again = asyncio.create_task(b.set("k", v0(size, 2)))
        assert await within(asyncio.to_thread(measured.wait, LIMIT))
        assert await within(a.batch_delete(["k"])) == [True]
        deleted.set()
        assert await within(again)
        usage = read_usage(os.path.join(ns_dir, LEDGER_NAME))
        assert usage is not None and usage.used == namespace_bytes(ns_dir)


@pytest.mark.parametrize("how", ["delete", "evict"])
async def test_a_page_written_while_its_unlink_is_pending_survives_the_unlink(tmp_path, monkeypatch, how) -> None:
    """A page deleted (a placement policy's choice) or evicted (``max_bytes``) is written again
    while its unlink is still in flight: the write waits for the unlink, so the page it writes
    is on disk, indexed and readable, never removed behind the index's back."""
    import threading

    from hicache_backends.file import io as file_io

    size = 4096
    unlinking, release = threading.Event(), threading.Event()
    real = file_io.remove_files

    def slow_remove(paths, sizes, *rest):
        unlinking.set()
        release.wait(LIMIT)
        return real(paths, sizes, *rest)

    max_bytes = 2 * (size + 512) if how == "evict" else 1 << 20
    async with make_store(tmp_path, shared=False, max_bytes=max_bytes) as store:
        await store.wait_index_ready()
        assert await store.set("k", v0(size, 7))
        monkeypatch.setattr(file_io, "remove_files", slow_remove)
        if how == "delete":
            removal = asyncio.create_task(store.batch_delete(["k"]))
        else:  # two more pages overflow max_bytes: "k", the oldest, is the victim
            assert await store.set("a", v0(size, 1))
            removal = asyncio.create_task(store.set("b", v0(size, 2)))
        while not unlinking.is_set():
            await asyncio.sleep(0.01)
        write = asyncio.create_task(store.set("k", v0(size, 9)))
        await asyncio.sleep(0.2)
        assert not write.done()  # waiting for the unlink of the same page
        release.set()
        await within(removal)
        assert await within(write)
        got = torch.empty(size, dtype=torch.uint8)
        assert await store.exists("k")
        assert await store.get("k", got) is not None and bool((got == 9).all())


@pytest.mark.parametrize("shared", [True, False])
async def test_pages_torn_by_a_crash_are_never_claimed_present(tmp_path, shared) -> None:
    """A crash before a renamed page's data reached the disk leaves it zero-length or
    zero-filled at its full size. Neither the start-up scan nor a lookup of an unindexed page
    claims such a file: a positive ``exists`` must be readable."""
    size = 4096
    keys = [f"k{i}" for i in range(4)]
    async with make_store(tmp_path) as store:
        assert await store.batch_set(keys, [v0(size, i + 1) for i in range(4)])
        paths = [page_path(tmp_path, store.namespace.digest, k) for k in keys]
    with open(paths[1], "wb"):
        pass  # zero-length
    full = os.path.getsize(paths[2])
    with open(paths[2], "wb") as f:
        f.write(b"\0" * full)  # zero-filled
    async with make_store(tmp_path, shared=shared) as store:
        await store.wait_index_ready()
        assert await store.exists_pages(keys) == [True, False, False, True]
        assert await store.batch_exists(keys) == 1
        got = await store.batch_get(keys, [torch.empty(size, dtype=torch.uint8) for _ in keys])
        assert [g is not None for g in got] == [True, False, False, True]


# ---------------------------------------------------------------------- symbolic links in the root


def _precious(folder: Path) -> list[Path]:
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("keep me")
    (folder / "sub" / "b.txt").write_text("me too")
    return sorted(folder.rglob("*.txt"))


async def test_a_link_named_like_stale_trash_loses_only_the_link(tmp_path) -> None:
    """Opening a store finishes dead processes' deletions of cleared namespaces: a link named
    like one had the whole folder it pointed to emptied, outside the root."""
    outside = tmp_path / "outside"
    files = _precious(outside)
    root = tmp_path / "root"
    store = make_store(root)
    root.mkdir()
    link = root / f".trash-{store.namespace.digest}-999999-0"  # a pid that is not alive
    link.symlink_to(outside)
    async with store:
        await within(store.wait_background())
    assert sorted(outside.rglob("*.txt")) == files and not os.path.lexists(link)


async def test_a_namespace_folder_that_is_a_link_is_refused_and_clear_spares_its_target(tmp_path) -> None:
    outside = tmp_path / "outside"
    files = _precious(outside)
    root = tmp_path / "root"
    store = make_store(root)
    root.mkdir()
    (root / store.namespace.digest).symlink_to(outside)
    with pytest.raises(Exception, match="symbolic link"):
        await within(store.__aenter__())
    os.unlink(root / store.namespace.digest)
    async with make_store(root) as store:  # a link planted while the store is open
        assert await within(store.set("a", v0(512, 1)))
        ns = Path(store.layout.ns_dir)
        os.rename(ns, tmp_path / "moved")
        ns.symlink_to(outside)
        assert await within(store.clear())
        await within(store.wait_background())
    assert sorted(outside.rglob("*.txt")) == files


async def test_links_planted_at_the_ledger_and_lock_files_are_replaced_and_the_bound_holds(tmp_path) -> None:
    """A link planted at the usage ledger, its ``users`` lock or the journal's lock file was
    never followed, but never replaced either (a FIFO there was): the ledger stayed unavailable
    for good, each process counted only its own pages, and two stores bounded to three pages
    held five. Only the link goes, never what it points to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    async with make_store(root) as store:
        ns = Path(store.layout.ns_dir)
    for name in (LEDGER_NAME, USERS_NAME, "removals.lock"):
        (outside / name).write_bytes(b"keep me")
        if os.path.lexists(ns / name):
            os.unlink(ns / name)
        (ns / name).symlink_to(outside / name)
    size, pages = 4000, 3
    bound = pages * (size + 200)
    a, b = make_store(root, max_bytes=bound), make_store(root, max_bytes=bound)
    async with a, b:
        await within(a.wait_background())
        await within(b.wait_background())
        for i in range(6):
            assert await within((a if i % 2 else b).set(f"k{i}", v0(size, i)))
        on_disk = sum(p.stat().st_size for p in ns.rglob("*.page"))
        usage = read_usage(str(ns / LEDGER_NAME))
        assert usage is not None and usage.used == on_disk <= bound
    assert all((outside / n).read_bytes() == b"keep me" for n in (LEDGER_NAME, USERS_NAME, "removals.lock"))
    assert not any(os.path.islink(ns / n) for n in (LEDGER_NAME, USERS_NAME, "removals.lock"))


async def test_a_link_planted_at_the_manifests_temporary_name_takes_no_write_outside(tmp_path, monkeypatch) -> None:
    """The manifest is written to a temporary name (the writer's pid and a counter: easy to
    guess) opened by a plain ``open``, which followed a link planted there: opening the store
    truncated the file it pointed to, outside the root, and wrote the manifest into it."""
    import itertools

    from hicache_backends.writers import MACHINE_HEX

    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    root = tmp_path / "root"
    store = make_store(root)
    ns = root / store.namespace.digest
    ns.mkdir(parents=True)
    monkeypatch.setattr(file_io, "_serial", itertools.count(0))
    planted = ns / f"manifest.json.{os.getpid()}.0.{MACHINE_HEX}.tmp"
    planted.symlink_to(outside)
    async with store:
        await within(store.wait_background())
        assert await within(store.set("k", v0(64, 1)))
    assert outside.read_text() == "keep me"
    assert (ns / "manifest.json").is_file() and not (ns / "manifest.json").is_symlink()
    assert not os.path.lexists(planted)


async def test_a_manifest_temporary_file_left_by_a_killed_process_is_swept(tmp_path) -> None:
    """A process killed while writing a namespace's manifest (between creating its temporary
    file and renaming it into place) left ``manifest.json.<pid>.<n>.tmp`` for good: scans only
    visit the page folders. Housekeeping now sweeps one whose writer is dead (or that is
    older than the bound on temporary files), never one a live process is writing."""
    from hicache_backends.writers import STALE_TMP_SECONDS

    child = (
        "import asyncio, os, sys\n"
        "from hicache.testing.store_tests import NS_A\n"
        "from hicache_backends.file import FileStorage\n"
        "real = os.replace\n"
        "def die(src, dst, *a, **k):\n"
        "    if str(dst).endswith('manifest.json'):\n"
        "        os.kill(os.getpid(), 9)  # written, not renamed into place\n"
        "    return real(src, dst, *a, **k)\n"
        "os.replace = die\n"
        "asyncio.run(FileStorage(None, root=sys.argv[1], namespace=NS_A, min_free_bytes=0).open())\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path)], timeout=120)
    assert done.returncode == -9
    ns = tmp_path / make_store(tmp_path).namespace.digest
    (left,) = ns.glob("manifest.json.*.tmp")
    live = ns / f"manifest.json.{os.getppid()}.7.tmp"  # a live process's, no machine in the name: by age
    old = ns / f"manifest.json.{os.getppid()}.8.tmp"
    live.write_text("{}")
    old.write_text("{}")
    os.utime(old, (time.time() - STALE_TMP_SECONDS - 60,) * 2)
    async with make_store(tmp_path) as store:
        await within(store.wait_background(), 10.0)
        assert (ns / "manifest.json").is_file()
    assert not left.exists() and not old.exists()
    assert live.exists()

async def test_pages_never_go_through_a_linked_page_folder(tmp_path) -> None:
    """Page files are opened without following links, but the folders on their path were
    followed: a write landed outside the root and was then served as a hit."""
    from hicache_backends.file.layout import page_id

    outside = tmp_path / "outside"
    outside.mkdir()
    async with make_store(tmp_path / "root") as store:
        await within(store.wait_background())
        sub = store.layout.subdir(page_id("k1", "kv"))
        os.rmdir(sub)
        os.symlink(outside, sub)
        assert not await within(store.set("k1", v0(64, 1)))
        assert list(outside.iterdir()) == []
        assert await within(store.get("k1")) is None
    async with make_store(tmp_path / "root") as again:  # reopening replaces the link
        await within(again.wait_background())
        assert not os.path.islink(sub) and os.path.isdir(sub)
        assert await within(again.set("k1", v0(64, 2)))
    assert list(outside.iterdir()) == []


# ---------------------------------------------------------------------- a writer killed mid-batch


async def test_a_killed_writers_reservation_is_given_back_while_others_keep_the_store_open(tmp_path) -> None:
    """A writer reserves its batch in the shared ledger before writing. Killed in between (the
    OOM killer), its bytes stayed counted for as long as any other process kept the namespace
    open: each kill shrank max_bytes for good, until a 4 MiB store refused 1 MiB with nothing
    on disk. The next process to take the ledger's lock now gives a dead writer's back."""
    import sys

    from hicache_backends.file.ledger import read_usage

    async with make_store(tmp_path, max_bytes=4 << 20) as store:  # this process keeps it open
        await within(store.wait_background())
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        child = (
            "import os, sys\n"
            "from hicache_backends.file.ledger import UsageLedger\n"
            "UsageLedger(sys.argv[1]).add(3 << 20, inflight=3 << 20)  # reserved, never settled\n"
            "os.kill(os.getpid(), 9)\n"
        )
        done = subprocess.run([sys.executable, "-c", child, store.layout.ns_dir], timeout=60)
        assert done.returncode == -9
        assert read_usage(ledger).used == 3 << 20  # counted, nothing on disk
        assert await within(store.set("after", v0(2 << 20, 1)), 10.0)
        assert read_usage(ledger).used < 3 << 20
        assert store.get_stats().get("rejected_pages_no_space", 0) == 0


async def test_a_writer_killed_after_publishing_leaves_its_pages_counted_and_evictable(tmp_path) -> None:
    """Giving back a dead writer's whole reservation also gave back the pages it had
    published before it died: the count fell below what was on disk, and no live process
    knew those pages to evict them. The reclaim now makes the store index the namespace
    again, and the scan raises the count to the bytes it finds."""
    import sys

    from hicache_backends.file.ledger import read_usage

    child = (
        "import asyncio, os, sys, torch\n"
        "from hicache.testing.store_tests import NS_A\n"
        "from hicache_backends.file import FileStorage\n"
        "async def main():\n"
        "    s = FileStorage(None, root=sys.argv[1], namespace=NS_A, min_free_bytes=0, max_bytes=8 << 20)\n"
        "    async with s:\n"
        "        await s.wait_background()\n"
        "        async def die(*a, **k):\n"
        "            os.kill(os.getpid(), 9)  # published, not settled\n"
        "        def die_now(*a, **k):\n"
        "            os.kill(os.getpid(), 9)\n"
        "        s._space.settle = die\n"
        "        s._space.settle_last = die_now  # (on the batch's I/O thread)\n"
        "        await s.set('k-child', torch.full((1 << 20,), 3, dtype=torch.uint8))\n"
        "asyncio.run(main())\n"
    )
    async with make_store(tmp_path, max_bytes=8 << 20) as store:
        await within(store.wait_background())
        done = subprocess.run([sys.executable, "-c", child, str(tmp_path)], timeout=120)
        assert done.returncode == -9
        assert await within(store.set("k-parent", v0(1 << 10, 1)))  # takes the lock: reclaims
        await within(store.wait_background(), 10.0)
        await asyncio.sleep(0.2)
        await within(store.wait_background(), 10.0)
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert read_usage(ledger).used >= on_disk > 1 << 20
        assert await within(store.exists("k-child"))


async def test_an_evictor_killed_between_its_unlinks_and_its_subtraction_leaves_no_over_count(tmp_path) -> None:
    """An eviction unlinks its victims, then subtracts their bytes from the shared count. A
    process killed in between left them counted for as long as any other process kept the
    namespace open (only a scan of the namespace alone corrects the count): each such kill
    shrank ``max_bytes`` for good, here by a page, evicted again from a store with room. The
    evictor now marks the victims' bytes in its reservation slot before unlinking them, so
    the next process to take the ledger's lock settles a dead evictor's removal."""
    page = 64 << 10
    bound = 4 * (page + 512)
    child = _killed_after("remove_files", "s.set('k-child', torch.full((int(sys.argv[3]),), 3, dtype=torch.uint8))")
    async with _four_pages_with_a_peer(tmp_path, bound, page) as (store, peer):
        done = subprocess.run([sys.executable, "-c", child, str(tmp_path), str(bound), str(page)], timeout=120)
        assert done.returncode == -9
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        await _settled_by_the_next_write(store, ledger)
        assert len(list(Path(store.layout.ns_dir).rglob("*.page"))) == 4  # 3 of ours and the new one

async def test_a_reader_killed_between_removing_a_corrupt_page_and_its_subtraction_leaves_no_over_count(tmp_path) -> None:
    """A read that finds a page failing verification unlinks it; its bytes left the shared
    count only with this process's next write batch (or its close). A process killed in
    between left them counted for as long as any other process kept the namespace open: each
    such kill shrank ``max_bytes`` for good, a sound page evicted again for it. The reader now
    marks the page's bytes in its reservation slot before the unlink and takes them off the
    count right after it, so the next process to take the ledger's lock settles a dead one's."""
    page = 64 << 10
    bound = 8 * (page + 512)
    child = _killed_after("_discard", "s.get('k1', torch.empty(int(sys.argv[3]), dtype=torch.uint8))")
    async with _four_pages_with_a_peer(tmp_path, bound, page) as (store, peer):
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        _flip_a_byte(tmp_path, store, ("k1", "k2"))  # a read removes those pages
        # a live reader's removal leaves the count at once, not with its next write
        assert await within(peer.get("k2", torch.empty(page, dtype=torch.uint8))) is None
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert read_usage(ledger).used == on_disk
        done = subprocess.run([sys.executable, "-c", child, str(tmp_path), str(bound), str(page)], timeout=120)
        assert done.returncode == -9
        assert not os.path.exists(page_path(tmp_path, store.namespace.digest, "k1"))
        await _settled_by_the_next_write(store, ledger)
        assert len(list(Path(store.layout.ns_dir).rglob("*.page"))) == 3  # 2 of the 4 and the new one


async def test_an_observer_killed_between_removing_a_corrupt_page_and_its_give_back_leaves_no_over_count(
    tmp_path, monkeypatch
) -> None:
    """A read-only observer (``hicache inspect --verify``) that finds a corrupt page unlinks it
    and then gives its bytes back to the shared count. Killed in between (SIGKILL), it left
    them counted for as long as any writer kept the namespace open: it keeps out of the
    reservation table, so no dead slot told the next process to take them off. It now marks
    the page's bytes in its process's observer slot before the unlink (freed by its give-back),
    so the next writer to take the ledger's lock settles a dead observer's removal. That slot
    is never the writer slot of the same process (here the observer shares its process with
    two writers): one slot shared by both had each side's settlement move the other's bytes."""
    from hicache_backends.file import ledger as L

    page = 64 << 10
    bound = 8 * (page + 512)
    child = _killed_after("_discard", "s.check_page(PageKey('k1', 'kv'))", "read_only=True")
    child = child.replace("import asyncio, os, sys, torch\n",
                          "import asyncio, os, sys, torch\nfrom hicache.storage.types import PageKey\n")
    async with _four_pages_with_a_peer(tmp_path, bound, page) as (store, peer):
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        _flip_a_byte(tmp_path, store, ("k1", "k2"))  # a verification removes those pages
        tables: list[list[int]] = []
        real = file_io._discard

        def seen_after(*args):  # the table between the observer's unlink and its give-back
            removed = real(*args)
            tables.append(L._decode_slots(Path(ledger).read_bytes()))
            return removed

        monkeypatch.setattr(file_io, "_discard", seen_after)
        # a live observer's removal leaves the count, and leaves no slot of its own behind
        async with FileStorage(None, root=str(tmp_path), namespace=NS_A, min_free_bytes=0, read_only=True) as observer:
            assert await within(observer.check_page(PageKey("k2", "kv"))) == "corrupt"
            on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
            usage = read_usage(ledger)
            assert (usage.used, usage.inflight) == (on_disk, 0)
        monkeypatch.undo()
        (table,) = tables
        marked = [table[i : i + 3] for i in L._taken(table)]
        size = os.path.getsize(page_path(tmp_path, store.namespace.digest, "k0"))
        assert [L._owner(), os.getpid() | L._OBSERVING, size] in marked
        assert not [s for s in marked if s[1] == os.getpid()]  # the writers' slot: untouched
        done = subprocess.run([sys.executable, "-c", child, str(tmp_path), str(bound), str(page)], timeout=120)
        assert done.returncode == -9
        assert not os.path.exists(page_path(tmp_path, store.namespace.digest, "k1"))
        await _settled_by_the_next_write(store, ledger)
        assert len(list(Path(store.layout.ns_dir).rglob("*.page"))) == 3  # 2 of the 4 and the new one


async def test_a_damaged_reservation_slot_neither_fails_every_write_nor_raises_the_count(tmp_path) -> None:
    """The reservation table is read back from a file any damage can reach (a torn write, a
    bad block, a tool). A slot of this machine naming a pid no process can have (beyond the
    kernel's pid range) made every ledger call raise ``OverflowError`` (``os.kill``), which is
    no ``OSError``: every write batch of every process on the namespace failed for good, and
    so did the scan that would have corrected the table. Bytes below zero in a dead writer's
    slot were "given back" by adding them to the count. Such a slot is now no process's (given
    back at once), and a slot gives back no bytes below zero."""
    import struct

    from hicache_backends.file import ledger as L

    async with make_store(tmp_path, max_bytes=1 << 20) as store:
        await within(store.wait_background())
        assert await within(store.set("a", v0(1000, 1)))
        path = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        raw = bytearray(Path(path).read_bytes())
        struct.pack_into("<qqq", raw, L._FORMAT.size + 5 * L._SLOT.size, L.MACHINE, 1 << 62, 100)
        struct.pack_into("<qqq", raw, L._FORMAT.size + 6 * L._SLOT.size, L.MACHINE, -1, -5000)
        Path(path).write_bytes(raw)
        assert await within(store.set("b", v0(1000, 2)))
        for _ in range(2):
            await within(store.wait_background(), 10.0)
            await asyncio.sleep(0.2)
        assert store.get_stats().get("backend_errors", 0) == 0
        usage = await asyncio.to_thread(store._space.ledger.read)
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert usage is not None and usage.inflight == 0
        assert usage.used == on_disk


def _spawn_with_pid(pid: int, argv: list[str]) -> subprocess.Popen | None:
    """A process started as ``pid`` (a dead one's, reused: ``ns_last_pid``, root only), or
    ``None`` when this machine will not give it (no permission, another process took it)."""
    for _ in range(50):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


async def test_a_process_reusing_a_dead_writers_pid_does_not_inherit_its_reservation(tmp_path) -> None:
    """The reservation table keyed a slot by machine and pid: a writer killed mid-batch whose
    pid a new process got (pids wrap, fast on a busy host or in a container) was judged alive
    for as long as that process lived, and the process took the slot as its own, so the dead
    writer's bytes stayed counted (``max_bytes`` shrunk) until it exited. A slot now also
    names its process's start time, and one whose pid runs another process is given back."""
    reserve = (
        "import os, sys\n"
        "from hicache_backends.file.ledger import UsageLedger\n"
        "UsageLedger(sys.argv[1]).add(3 << 20, inflight=3 << 20)  # reserved, never settled\n"
        "os.kill(os.getpid(), 9)\n"
    )
    heir = (  # writes a batch of its own (reserved and settled), then stays alive
        "import sys\n"
        "from hicache_backends.file.ledger import UsageLedger\n"
        "led = UsageLedger(sys.argv[1])\n"
        "led.add(4096, inflight=4096)\n"
        "led.add(-4096, inflight=-4096)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    async with make_store(tmp_path, max_bytes=4 << 20) as store:
        await within(store.wait_background())
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        dead = subprocess.Popen([sys.executable, "-c", reserve, store.layout.ns_dir])
        assert dead.wait(timeout=60) == -9
        assert read_usage(ledger).used == 3 << 20
        proc = _spawn_with_pid(dead.pid, [sys.executable, "-c", heir, store.layout.ns_dir])
        if proc is None:
            pytest.skip("cannot start a process with a chosen pid here (needs root)")
        try:
            assert proc.stdout.readline().strip() == "ready"
            usage = await asyncio.to_thread(store._space.ledger.read)
            assert usage.used == 0 and usage.inflight == 0
        finally:
            proc.kill()
            proc.wait()

async def test_a_reservation_left_by_a_writer_no_process_here_can_judge_goes_at_a_lone_scan(tmp_path) -> None:
    """A writer of another machine or PID namespace (a container sharing the root's volume)
    killed between its reservation and its settlement left its slot in the reservation table:
    no process here may judge its pid, so it was never freed. A scan of the namespace alone
    corrected the count to the pages on disk but kept the slot, whose bytes then passed for a
    write in flight for good: the eviction after the scan left them out, and a store reopened
    with a lower max_bytes stayed over it (twice its bound here) however much it wrote. Alone,
    nothing is in flight: the correction now empties the table too."""
    page = 4000
    async with make_store(tmp_path, max_bytes=1 << 20) as store:
        await within(store.wait_background())
        for i in range(8):
            assert await within(store.set(f"k{i}", v0(page, i)))
        ns_dir = store.layout.ns_dir
    child = (
        "import os, sys\n"
        "from hicache_backends.file import ledger as L\n"
        "L.MACHINE ^= 1  # a writer in another PID namespace, or on another machine\n"
        "L.UsageLedger(sys.argv[1]).add(64_000, inflight=64_000)  # reserved, never settled\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, ns_dir], timeout=60)
    assert done.returncode == -9
    bound = 4 * (page + 200)
    async with make_store(tmp_path, max_bytes=bound) as store:  # alone: its scan corrects the count
        await within(store.wait_background(), 10.0)
        for i in range(8, 12):
            assert await within(store.set(f"k{i}", v0(page, i)))
        await within(store.wait_background(), 10.0)
        usage = await asyncio.to_thread(store._space.ledger.read)
        on_disk = sum(p.stat().st_size for p in Path(ns_dir).rglob("*.page"))
        assert usage is not None and usage.inflight == 0
        assert usage.used == on_disk <= bound


@pytest.mark.parametrize("shared", [True, False])
async def test_a_write_racing_a_clear_leaves_the_index_equal_to_the_disk(tmp_path, monkeypatch, shared) -> None:
    """A write that starts before ``clear()`` and lands after it (its folder recreated) is
    ordered after the clear: the page it published is indexed (found, counted, evictable),
    never a file on disk that the index and ``max_bytes`` do not know."""
    import threading

    from hicache_backends.file import io as file_io

    size = 4096
    entered, release = threading.Event(), threading.Event()
    real = file_io.write_page

    def held_write(*args):
        entered.set()
        release.wait(LIMIT)
        return real(*args)

    async with make_store(tmp_path, shared=shared, max_bytes=1 << 22) as store:
        await store.wait_index_ready()
        assert await store.set("old", v0(size, 1))
        monkeypatch.setattr(file_io, "write_page", held_write)
        write = asyncio.create_task(store.set("racer", v0(size, 2)))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        assert await within(store.clear())
        release.set()
        assert await within(write)
        monkeypatch.setattr(file_io, "write_page", real)
        await store.wait_background()
        ns_dir = store.layout.ns_dir
        on_disk = namespace_bytes(ns_dir)
        assert on_disk == store.layout.file_size("racer", "kv", size)  # published after the clear
        assert store.index.nbytes == on_disk  # ... and indexed
        assert await store.exists("racer") and not await store.exists("old")
        got = torch.empty(size, dtype=torch.uint8)
        assert await store.get("racer", got) is not None and bool((got == 2).all())
        if shared:
            usage = read_usage(os.path.join(ns_dir, LEDGER_NAME))
            assert usage is not None and usage.used == on_disk


async def test_close_during_the_opening_scan_starts_no_new_scan(tmp_path, monkeypatch, caplog) -> None:
    """A reclaim noticed while the opening scan runs asks for one more scan after it; a close
    that cancels the scan must not start that one (nothing would wait for it: it ran against
    the shut-down threads, logging errors, and could outlive the close)."""
    import threading

    from hicache_backends.file import io as file_io

    gate = threading.Event()
    real = file_io.list_subdirs

    def slow_list(layout):
        gate.wait(LIMIT)  # a large namespace: the opening scan is busy
        return real(layout)

    monkeypatch.setattr(file_io, "list_subdirs", slow_list)
    store = make_store(tmp_path, shared=True, max_bytes=1 << 30)
    try:
        with caplog.at_level(logging.ERROR):
            await store.open()
            await asyncio.sleep(0.05)
            assert store._scanner.task is not None and not store._scanner.task.done()
            store._scanner.maybe_rescan(None, reclaimed=True)  # what a ledger call that reclaimed does
            # the close cancels the scan, then waits for its thread (in the slow listing): let
            # the listing end once the close began, or the close took the gate's whole LIMIT
            # from the scan's start and missed ``within`` by the time a loaded machine adds
            closing = asyncio.ensure_future(store.aclose())
            await asyncio.sleep(0.05)
            gate.set()
            await within(closing)
            assert store._scanner.task is None
            assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("hicache-file-")]
    finally:
        gate.set()
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_cancelled_batch_read_starts_no_more_pages(tmp_path, monkeypatch) -> None:
    """A caller's timeout (SGLang's ``hicache_call_timeout``) cancels a batch read: the pages
    already being read finish (they land in the caller's memory), but the rest of the batch
    was read too, holding the caller's thread for the whole batch (SGLang's detach gave up)."""
    import threading

    from hicache_backends.file import io as file_io

    size = 4096
    started = 0
    lock = threading.Lock()
    real = file_io.read_page_into

    def slow_read(*args):
        nonlocal started
        with lock:
            started += 1
        time.sleep(0.2)
        return real(*args)

    async with make_store(tmp_path, shared=False, io_threads=1) as store:
        await store.wait_index_ready()
        keys = [f"k{i}" for i in range(12)]
        assert await store.batch_set(keys, [v0(size, i) for i in range(12)])
        monkeypatch.setattr(file_io, "read_page_into", slow_read)
        bufs = [torch.empty(size, dtype=torch.uint8) for _ in keys]
        task = asyncio.create_task(store.batch_get(keys, bufs))
        await asyncio.sleep(0.1)
        task.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 1.5  # the page in flight, not the other eleven
        assert started <= 2


def test_a_write_batch_past_the_call_timeout_stops_and_counts_what_landed(tmp_path, monkeypatch) -> None:
    """SGLang's ``hicache_call_timeout`` on a write: the facade cancels the batch and SGLang
    gets misses (False), but the store's threads wrote every page of the batch to the end
    (the call held its thread for the whole batch), and the pages that landed were counted
    nowhere (``write_ok`` counts no cancelled call). Now the batch starts no page after the
    caller gave up, the shared ledger holds exactly the bytes of the pages on disk (the bytes
    reserved for the pages not written are given back) and the pages that did land are
    counted as ``write_late_pages``."""
    from hicache.storage import HiCacheStorage
    from hicache.testing import ArrayHostPool
    from hicache.testing.store_tests import PAGE

    n = 12
    store = make_store(tmp_path, shared=True, max_bytes=1 << 30, io_threads=1)
    facade = HiCacheStorage(store, call_timeout=0.5)
    try:
        assert facade.run(store.wait_index_ready(LIMIT))
        src = ArrayHostPool(n, PAGE)
        src.fill_random(7)
        facade.register_mem_pool_host(src)
        keys = [f"late{i}" for i in range(n)]
        slow_page_writes(monkeypatch, 0.2)  # the whole batch: 2.4 s, five times the limit
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            facade.batch_set_v1(keys, src.indices(0, n))
        assert time.monotonic() - t0 < 1.5  # the pages in flight, not the whole batch
        on_disk = [k for k in keys if os.path.exists(page_path(store.root, store.namespace.digest, k))]
        assert 1 <= len(on_disk) < n, f"{len(on_disk)} of {n} pages written after the caller gave up"
        assert on_disk == keys[: len(on_disk)]  # in order: the batch stopped between pages
        usage = read_usage(os.path.join(store.layout.ns_dir, LEDGER_NAME))
        assert usage is not None and usage.used == namespace_bytes(store.layout.ns_dir) > 0
        stats = facade.get_stats()
        assert stats["call_timeouts"] == 1
        assert stats["write_late_pages"] == len(on_disk) == stats["stored_pages"]  # counted and indexed
        assert stats.get("io_errors", 0) == stats["backend_errors"] == 0  # pages not started are no failures
        assert facade.batch_exists(keys) == len(on_disk)
    finally:
        facade.close()


# ---------------------------------------------------------------------- exhaustion, found while running


@pytest.mark.parametrize("which", ["pages", "namespace"])
async def test_a_namespace_folder_swapped_for_a_link_while_running_takes_no_write_outside(tmp_path, which) -> None:
    """The open refuses linked namespace folders, but one swapped for a link while the store
    ran (``mv ns elsewhere; ln -s elsewhere ns``) was followed: page files, the usage ledger and
    the removal journal were all created outside the root, and the writes reported success."""
    size = 4096
    outside = tmp_path / "outside"
    outside.mkdir()
    async with make_store(tmp_path / "root", max_bytes=4 * (size + 512)) as store:
        await within(store.wait_background())
        assert await within(store.batch_set(["a", "b"], [v0(size, 1), v0(size, 2)]))
        folder = store.layout.pages_dir if which == "pages" else store.layout.ns_dir
        os.rename(folder, tmp_path / "moved")
        os.symlink(outside, folder)
        # six pages over a four-page bound: writes, evictions and journal lines are all tried
        assert not await within(store.batch_set([f"x{i}" for i in range(6)], [v0(size, 3)] * 6))
        await asyncio.sleep(0.1)  # the journal's thread has flushed whatever was queued
        assert list(outside.rglob("*")) == []
        assert store.get_stats()["io_errors"] > 0
        os.unlink(folder)
        os.rename(tmp_path / "moved", folder)  # put back: the store works again
        got = torch.empty(size, dtype=torch.uint8)
        assert await within(store.get("a", got)) is not None and torch.equal(got, v0(size, 1))
        assert await within(store.set("y", v0(size, 4)))
        assert await within(store.get("y", got)) is not None and torch.equal(got, v0(size, 4))


@pytest.mark.parametrize("which", ["pages", "namespace"])
async def test_a_read_through_a_swapped_link_removes_no_bad_page_outside(tmp_path, which) -> None:
    """A read that finds a bad page removes it; through a namespace folder swapped for a link
    while the store ran, the file it removed was outside the root."""
    size = 4096
    async with make_store(tmp_path / "root") as store:
        await within(store.wait_background())
        assert await within(store.batch_set(["a"], [v0(size, 1)]))
        folder = store.layout.pages_dir if which == "pages" else store.layout.ns_dir
        os.rename(folder, tmp_path / "moved")
        os.symlink(tmp_path / "moved", folder)
        page = next(p for p in (tmp_path / "moved").rglob("*") if p.is_file() and p.stat().st_size > size)
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped byte: the read finds a corrupt page
        page.write_bytes(bytes(data))
        got = torch.empty(size, dtype=torch.uint8)
        assert await within(store.get("a", got)) is None
        assert page.exists(), "a file outside the root was removed"


async def test_a_namespace_folder_deleted_while_running_gets_its_manifest_back(tmp_path) -> None:
    """A cleaner deleted the namespace folder (the default root is under /tmp) and the next write
    made it again, with no manifest: ``hicache inspect``, which finds namespaces by their
    manifests, reported no namespace and none of the pages written since, until a restart."""
    size = 4096
    async with make_store(tmp_path) as store:
        await within(store.wait_background())
        assert await within(store.batch_set(["a", "b"], [v0(size, 1), v0(size, 2)]))
        shutil.rmtree(store.layout.ns_dir)
        assert await within(store.batch_set(["c", "d"], [v0(size, 3), v0(size, 4)]))
        await within(store.wait_background())
        assert os.path.isfile(store.layout.manifest_path)
        report = await within(inspect_store(str(tmp_path), progress=False, verify="all"))
        assert list(report["namespaces"]) == [NS_A.digest]
        assert report["pages"] == 2 and report["corrupt"] == 0
        assert len(os.listdir(store.layout.pages_dir)) == 256  # its page folders were made again too


async def test_page_io_errors_that_repeat_for_every_page_log_one_line(tmp_path, monkeypatch, caplog) -> None:
    """A root remounted read-only (or EMFILE, EACCES, EFBIG) fails every page: each failed
    page logged its own WARNING (56 lines for one 56-page batch, again at every retry), where a
    full disk logs one a minute. Counted per page, logged once, for writes and reads alike."""
    import errno

    from hicache_backends.file import io as file_io

    size = 2048
    keys = [f"k{i}" for i in range(20)]
    async with make_store(tmp_path) as store:
        assert await store.batch_set(keys, [v0(size, 1)] * 20)

        def read_only(fd, bufs, offset):
            raise OSError(errno.EROFS, "Read-only file system (injected)")

        def io_error(fd, bufs, offset):
            raise OSError(errno.EIO, "Input/output error (injected)")

        monkeypatch.setattr(file_io, "_pwritev", read_only)
        monkeypatch.setattr(file_io, "_preadv", io_error)
        caplog.set_level(logging.WARNING, logger="hicache.storage.file")
        for _ in range(2):  # a retry
            assert not await store.batch_set([f"n{i}" for i in range(20)], [v0(size, 2)] * 20)
            got = await store.batch_get(keys, [torch.empty(size, dtype=torch.uint8) for _ in keys])
            assert got == [None] * 20
        assert store.get_stats()["io_errors"] == 80
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2, lines
        assert sorted("write(s) failed" in m for m in lines) == [False, True]  # one for reads, one for writes
        monkeypatch.undo()
        got = await store.batch_get(keys, [torch.empty(size, dtype=torch.uint8) for _ in keys])
        assert all(g is not None and torch.equal(g, v0(size, 1)) for g in got)  # nothing was dropped


async def test_a_page_file_this_process_may_not_open_is_forgotten_and_rewritten(tmp_path, monkeypatch) -> None:
    """A page whose file this process may not open (permissions changed; another user's writer
    with a private umask) stayed indexed: answered present for good, every read failed, and
    skip_existing reported every rewrite done without replacing it. (EACCES is injected at the
    open: root may open any file.)"""
    from hicache_backends.file import io as file_io

    size = 2048
    async with make_store(tmp_path) as store:
        assert await store.set("locked", v0(size, 1))
        locked = page_path(store.root, store.namespace.digest, "locked")
        real_open = os.open

        def guarded_open(path, flags, *args, **kwargs):
            if os.fspath(path) == locked:
                raise PermissionError(13, "Permission denied (injected)", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(file_io.os, "open", guarded_open)
        got = torch.empty(size, dtype=torch.uint8)
        assert await within(store.get("locked", got)) is None
        assert not await within(store.exists("locked"))  # no longer answered present
        os.chmod(locked, 0o600)  # what the injected error stands for
        monkeypatch.undo()
        assert await within(store.set("locked", v0(size, 2)))
        assert store.get_stats().get("write_skipped_pages", 0) == 0  # really rewritten
        assert os.stat(locked).st_mode & 0o777 == 0o644
        assert await within(store.get("locked", got)) is not None and torch.equal(got, v0(size, 2))


@contextlib.contextmanager
def immutable(paths: list[str]) -> Iterator[None]:
    """The files at ``paths`` made immutable (``chattr +i``: no one, root included, may unlink
    them), as another user's pages are to this process; made mutable again on the way out."""
    for p in paths:
        done = subprocess.run(["chattr", "+i", p], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a file immutable here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        for p in paths:
            subprocess.run(["chattr", "-i", p], capture_output=True)


async def test_a_page_this_process_may_not_unlink_is_neither_reported_removed_nor_counted_evicted(tmp_path) -> None:
    """A page file the store may not unlink (another user's writer's folder; made immutable
    here) stays on disk and is still served. A delete of it answered ``True``, and both the
    delete and an eviction that picked it reported it REMOVED (the tree's storage directory
    dropped a page every read still finds) and counted it in ``evicted_pages``; now only the
    pages really removed are answered, reported and counted, and the eviction takes the next
    victim for the room."""
    from hicache.observability.tier_events import ChangeKind, Tier

    size = 4096
    async with make_store(tmp_path, max_bytes=3 * (size + 600)) as store:
        await within(store.wait_background())
        seen: list = []
        store.tier_changes.subscribe(lambda c: seen.append((c.keys, c.reason)), wants={(ChangeKind.REMOVED, Tier.STORAGE)})
        for i, key in enumerate("abc"):
            assert await within(store.set(key, v0(size, i)))
        with immutable([page_path(store.root, store.namespace.digest, "a")]):
            assert await within(store.set("x", v0(size, 9)))  # evicts: "a" (kept, immutable), then "b"
            assert seen == [(("b",), "evicted")]
            assert store.get_stats()["evicted_pages"] == 1
            assert await store.exists_pages(["a", "b", "c", "x"]) == [True, False, True, True]
        seen.clear()
        with immutable([page_path(store.root, store.namespace.digest, "x")]):
            assert await within(store.batch_delete(["x", "c"])) == [False, True]
            assert seen == [(("c",), "deleted")]
            got = torch.empty(size, dtype=torch.uint8)
            assert await within(store.get("x", got)) is not None and torch.equal(got, v0(size, 9))


async def test_pages_written_while_the_ledger_is_unavailable_are_counted_once_it_is_back(tmp_path, monkeypatch) -> None:
    """A batch written while the usage ledger was unavailable (a peer frozen holding its lock,
    no descriptor left, the namespace folder deleted under us) reserved nothing and was never
    counted, and evictions meanwhile were never subtracted: with a 10-page bound, 15 pages
    written during an outage left 20 on disk for good, counted as 10."""
    from hicache_backends.file.ledger import UsageLedger

    size = 4096
    page = make_store(tmp_path).layout.file_size("k0", "kv", size)
    real_add = UsageLedger.add
    down = True

    def add(self, delta, **kwargs):
        return None if down else real_add(self, delta, **kwargs)

    monkeypatch.setattr(UsageLedger, "add", add)
    async with make_store(tmp_path, max_bytes=10 * page) as store:
        await within(store.wait_background())
        for i in range(15):  # evicts from the eleventh on: by this process's own count
            assert await store.set(f"during{i}", v0(size, i))
        down = False
        for i in range(20):
            assert await store.set(f"after{i}", v0(size, i))
        ledger = read_usage(os.path.join(store.layout.ns_dir, LEDGER_NAME))
        on_disk = namespace_bytes(store.layout.ns_dir)
        assert on_disk <= 10 * page
        assert ledger is not None and ledger.used == on_disk


async def test_what_was_owed_to_a_cleared_ledger_is_not_carried_into_the_next(tmp_path, monkeypatch) -> None:
    """Pages written while the ledger was unavailable are owed to it with the next reservation;
    a clear drops what is owed, since those pages go with the cleared folder. A batch that had
    taken the debt and whose reservation failed while a clear ran put it back after the clear:
    the new folder's ledger counted the old folder's pages for good (eviction came early)."""
    from hicache_backends.file.ledger import UsageLedger

    size = 4096
    real_add = UsageLedger.add
    mode = "down"
    ns_dir = make_store(tmp_path).layout.ns_dir

    def add(self, delta, **kwargs):
        if mode == "down":
            return None
        if mode == "clearing" and kwargs.get("inflight", 0) > 0:  # the racing batch's reservation
            before, t0 = os.stat(ns_dir).st_ino, time.monotonic()
            while time.monotonic() - t0 < 5:  # still unavailable until the clear renamed the folder
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(ns_dir).st_ino != before:
                        break
                time.sleep(0.005)
            return None
        return real_add(self, delta, **kwargs)

    monkeypatch.setattr(UsageLedger, "add", add)
    async with make_store(tmp_path) as store:
        await within(store.wait_background())
        for i in range(3):  # owed to the ledger
            assert await store.set(f"old{i}", v0(size, i))
        mode = "clearing"
        racing = asyncio.ensure_future(store.set("racing", v0(size, 9)))
        await asyncio.sleep(0.05)  # its reservation waits
        await within(store.clear())
        assert await within(racing)
        mode = "up"
        assert await store.set("new", v0(size, 1))
        ledger = read_usage(os.path.join(ns_dir, LEDGER_NAME))
        assert ledger is not None and ledger.used == namespace_bytes(ns_dir)


@pytest.mark.parametrize("which", ["pages", "namespace"])
async def test_a_folder_swapped_for_a_link_during_a_batch_takes_no_later_write_outside(tmp_path, monkeypatch, which) -> None:
    """A folder swapped for a link between two pages of one write batch: every page checks
    the folders above it, so the batch's later pages are refused too (a check remembered for
    the batch let them out)."""
    size = 4096
    outside = tmp_path / "outside"
    outside.mkdir()
    async with make_store(tmp_path / "root", io_threads=1) as store:
        await within(store.wait_background())
        folder = store.layout.pages_dir if which == "pages" else store.layout.ns_dir
        real_write, calls = file_io.write_page, []

        def write_then_swap(*args):  # type: ignore[no-untyped-def]
            calls.append(args[2])
            if len(calls) == 2:
                os.rename(folder, tmp_path / "moved")
                os.symlink(outside, folder)
            return real_write(*args)

        monkeypatch.setattr(file_io, "write_page", write_then_swap)
        await within(store.batch_set([f"x{i}" for i in range(4)], [v0(size, 3)] * 4))
        monkeypatch.setattr(file_io, "write_page", real_write)
        assert len(calls) == 4
        assert [p for p in outside.rglob("*") if p.is_file()] == []


async def test_a_write_cancelled_while_its_declined_reservation_runs_writes_nothing(tmp_path, monkeypatch) -> None:
    """A batch whose reservation on its I/O thread finds the store full (declined: the event
    loop must make room) and whose caller is cancelled meanwhile stops there, as a cancelled
    reservation always did: nothing evicted, nothing written, CancelledError, and the shared
    count equal to the bytes on disk."""
    size = 64 << 10
    async with make_store(tmp_path, max_bytes=4 * (size + 4096)) as store:
        await within(store.wait_background())
        assert await within(store.batch_set([f"old{i}" for i in range(4)], [v0(size, 1)] * 4))
        space = store._space
        real = space._reserve
        entered = threading.Event()

        def slow(*a, **k):  # type: ignore[no-untyped-def]
            entered.set()
            time.sleep(0.3)
            return real(*a, **k)

        monkeypatch.setattr(space, "_reserve", slow)
        task = asyncio.create_task(store.batch_set(["new0", "new1"], [v0(size, 2)] * 2))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.get_stats().get("evicted_pages", 0) == 0
        assert await within(store.batch_exists(["new0", "new1"])) == 0
        usage = read_usage(os.path.join(store.layout.ns_dir, LEDGER_NAME))
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert usage is not None and usage.used == on_disk


def test_the_ledger_reservation_table_keeps_every_slot_it_cannot_judge() -> None:
    """The reservation table (one ``unpack`` for all 128 slots): a dead writer of this machine
    is given back, a live one, another machine's and a full table are left alone, this
    process's slot is taken and freed at zero, and a file from before the table reads empty."""
    from hicache_backends.file import ledger as L

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    slots = L._decode_slots(b"\0" * L._SIZE)
    assert slots == [0] * (3 * L._SLOTS) and L._decode_slots(b"\0" * L._FORMAT.size) == slots
    slots[0:3] = (L.MACHINE, dead.pid, 100)  # this machine, gone
    slots[3:6] = (L.MACHINE ^ 1, dead.pid, 200)  # another machine: never judged
    slots[9:12] = (L.MACHINE, os.getppid(), 300)  # this machine, alive
    raw = b"\0" * L._FORMAT.size + L._encode_slots(slots)
    assert L._decode_slots(raw) == slots
    assert L._reclaim(slots) == 100 and slots[0:3] == [0, 0, 0]
    assert slots[3:12] == [L.MACHINE ^ 1, dead.pid, 200, 0, 0, 0, L.MACHINE, os.getppid(), 300]
    L._move_own(slots, 50)
    assert slots[0:3] == [L._owner(), os.getpid(), 50]  # the first free slot
    L._move_own(slots, -50)
    assert slots[0:3] == [0, 0, 0]
    # a pid now running another process than the slot's (reused), this process's pid in a
    # slot that is not its own (a dead process had it): both dead, never taken over
    # (the parent's slot names a start time one tick off the parent's own: built from ours, it
    # could equal the parent's, which starts a tick or two before this process under a script)
    started = L._started(os.getppid())
    assert started is not None
    parent = ((started ^ 1) & L._LOW) << 32 | (L.MACHINE & L._LOW)
    parent = parent - (1 << 64) if parent >= 1 << 63 else parent
    own = L._owner() ^ (1 << 33)
    slots[0:3], slots[12:15] = (parent, os.getppid(), 400), (own, os.getpid(), 500)
    L._move_own(slots, 60)
    assert slots[12:15] == [own, os.getpid(), 500] and slots[6:9] == [L._owner(), os.getpid(), 60]
    assert L._reclaim(slots) == 900 and slots[0:3] == slots[12:15] == [0, 0, 0]
    assert slots[6:12] == [L._owner(), os.getpid(), 60, L.MACHINE, os.getppid(), 300]  # ours; by the pid alone
    # an observer's slot of this process is its own, apart from its writer slot; a dead
    # process's observer slot is given back as its writer slot would be
    L._move_own(slots, 70, L._OBSERVING)
    L._move_own(slots, -60)
    assert slots[0:3] == [L._owner(), os.getpid() | L._OBSERVING, 70] and slots[6:9] == [0, 0, 0]
    slots[12:15] = (L.MACHINE, dead.pid | L._OBSERVING, 80)
    assert L._reclaim(slots) == 80 and slots[12:15] == [0, 0, 0]
    L._move_own(slots, -70, L._OBSERVING)
    assert slots[0:3] == [0, 0, 0]
    full = [L.MACHINE ^ 1, 1, 1] * L._SLOTS
    L._move_own(full, 10)  # no free slot: counted in ``used`` only, the table unchanged
    assert full == [L.MACHINE ^ 1, 1, 1] * L._SLOTS


async def test_a_journal_line_left_torn_is_ended_by_the_next_append_and_counted(tmp_path) -> None:
    """A process that died (or ran out of disk) in the middle of a removal journal append left
    part of a line: this store's next eviction ends it before its own line, counts it in
    ``journal_torn_lines``, and its own lines stay whole (peers read them)."""
    size = 4096
    async with make_store(tmp_path, max_bytes=3 * (size + 512)) as store:
        await store.wait_background()
        journal = os.path.join(store.layout.ns_dir, "removals")
        with open(journal, "ab") as f:
            f.write(b'{"w":"dead","rm":[["gone"')  # a writer killed mid-write
        for i in range(5):  # room for three: the later writes evict, each a journal line
            assert await within(store.set(f"k{i}", v0(size, i)))
        await within(store.wait_background())
        deadline = time.monotonic() + LIMIT
        while store.get_stats()["journal_torn_lines"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert store.get_stats()["journal_torn_lines"] == 1
        with open(journal, "rb") as f:
            lines = f.read().split(b"\n")
        assert lines[0] == b'{"w":"dead","rm":[["gone"' and lines[1].startswith(b'{"w":')
        assert all(line.startswith(b'{"w":') for line in lines[1:-1]) and lines[-1] == b""


def test_two_ledgers_never_both_find_the_namespace_to_themselves(tmp_path, monkeypatch) -> None:
    """``alone`` asks for an exclusive ``flock`` on ``users`` over its shared one. The kernel
    converts by dropping the shared lock first, and a conversion refused (a peer is open) left
    none until it was taken again: a peer asking then found the namespace to itself, and its
    scan replaced the shared count, a write in flight of the first store's left out of it (an
    under-count: the namespace then held more than ``max_bytes``). Forced order: ``a``'s
    conversion is refused and held there, then ``b`` asks."""
    import fcntl

    from hicache_backends.file.ledger import UsageLedger

    a, b = UsageLedger(str(tmp_path)), UsageLedger(str(tmp_path))
    try:
        assert a.read() is not None and b.read() is not None  # both joined (a shared lock each)
        real, users_a = fcntl.flock, a._users.fd
        refused, go_on = threading.Event(), threading.Event()

        def flock(fd: int, op: int) -> None:
            try:
                real(fd, op)
            except BlockingIOError:
                if fd == users_a and op & fcntl.LOCK_EX and not refused.is_set():
                    refused.set()  # a's shared lock is gone now: held here until b has asked
                    go_on.wait(LIMIT)
                raise

        monkeypatch.setattr(fcntl, "flock", flock)
        answers: list[bool] = []
        asking = threading.Thread(target=lambda: answers.append(a.alone()))
        asking.start()
        try:
            assert refused.wait(LIMIT)
            assert not b.alone()  # a still has the namespace open
        finally:
            go_on.set()
            asking.join(LIMIT)
        assert answers == [False]
        monkeypatch.undo()
        assert not a.alone() and not b.alone()  # each still holds its shared lock
        b.close()
        assert a.alone()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("left", [0, 20, None])
async def test_a_ledger_cut_short_under_open_stores_is_raised_back_to_the_pages_on_disk(tmp_path, left) -> None:
    """The usage ledger cut short (or deleted) while stores have it open (by hand, a repair
    after a crash) read as an empty namespace: the count lost every page on disk, and with a
    peer keeping the namespace open (no lone scan corrects it) the namespace went on to hold
    up to twice ``max_bytes`` for as long as peers kept it open. A ledger call that finds the
    file it had open cut short (or made anew in its folder) now has its store index the
    namespace again, and the scan's floor raises the count back to the pages on disk (the
    writes after it evict what is over)."""
    page = 64 << 10
    bound = 6 * (page + 512)
    async with _four_pages_with_a_peer(tmp_path, bound, page) as (store, peer):
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        if left is None:
            os.unlink(ledger)  # deleted: the next call creates it anew
        else:
            os.truncate(ledger, left)
        for i in range(4, 8):
            assert await within(store.set(f"k{i}", v0(page, i)))
            await within(store.wait_background(), 10.0)
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert on_disk <= bound
        assert read_usage(ledger).used == on_disk


async def test_a_lone_scan_leaves_the_count_alone_while_an_observer_is_removing_a_page(tmp_path) -> None:
    """An observer (``hicache inspect --verify``) keeps out of the ``users`` lock: a writer's
    scan finds the namespace to itself while an observer is between the unlink of a corrupt
    page (its bytes marked in its slot) and giving them back. The scan replaced the count
    with the pages it found, the page already left out, and emptied the table, mark and all;
    the give-back then took the page off a second time: the count a page below the disk for
    as long as peers kept the namespace open (the namespace over ``max_bytes`` by as much).
    A slot of a live process of this machine now keeps the count as it is. Forced order: the
    observer's steps are this test's, the writer opens between the unlink and the give-back."""
    from hicache_backends.file.ledger import give_back, mark

    page = 64 << 10
    bound = 8 * (page + 512)
    async with make_store(tmp_path, max_bytes=bound) as store:
        await within(store.wait_background())
        for i in range(4):
            assert await within(store.set(f"k{i}", v0(page, i)))
        ledger = os.path.join(store.layout.ns_dir, LEDGER_NAME)
        victim = page_path(tmp_path, store.namespace.digest, "k0")
    size = os.path.getsize(victim)
    token = read_usage(ledger).token
    assert mark(ledger, size, token) is True  # the observer marks the page, then unlinks it
    os.unlink(victim)
    async with make_store(tmp_path, max_bytes=bound) as store:  # alone: its scan may correct the count
        await within(store.wait_background())
        assert give_back(ledger, size, token, size) is True
        on_disk = sum(p.stat().st_size for p in Path(store.layout.ns_dir).rglob("*.page"))
        assert on_disk == 3 * size
        assert read_usage(ledger).used >= on_disk


def test_a_forked_child_takes_the_ledgers_lock_on_a_file_of_its_own(tmp_path) -> None:
    """A child forked from a process with the usage ledger open (a server forking workers
    after its store opened) used the parent's descriptors: a ``flock`` on one open file does
    not exclude its sharers, so the child changed the counters while the parent was in the
    middle of changing them (one change lost); and a child forked while a thread of the parent
    was in a ledger call waited for the parent's mutex forever. The child now opens the files
    (and takes a mutex) of its own, as the removal journal does. Forced: the parent is inside
    a ledger call (its mutex and its file's lock held) when it forks."""
    import fcntl
    import select

    from hicache_backends.file.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path))
    assert ledger.add(100) is not None
    fd = ledger._counters.fd
    assert fd is not None
    read, write = os.pipe()
    ledger._lock.acquire()
    fcntl.flock(fd, fcntl.LOCK_EX)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, b"1" if ledger.add(10) is None else b"0")  # the parent holds the lock
        finally:
            os._exit(0)
    os.close(write)
    answered = select.select([read], [], [], 20)[0]
    try:
        if not answered:
            os.kill(child, 9)
        assert answered, "the forked child hung on the ledger"
        assert os.read(read, 1) == b"1"  # excluded by the parent's lock: it waited, then gave up
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        ledger._lock.release()
        os.close(read)
        os.waitpid(child, 0)
    assert ledger._counters.fd == fd
    usage = ledger.read()
    assert usage is not None and usage.used == 100
    ledger.close()


async def test_a_clear_is_not_taken_for_a_lost_ledger(tmp_path, caplog) -> None:
    """A clear renames the namespace folder away, and the fresh folder's ledger starts empty:
    no store takes that for a ledger cut short (no warning, no scan of the namespace again)."""
    page = 64 << 10
    async with make_store(tmp_path, max_bytes=8 * (page + 512)) as a, make_store(tmp_path, max_bytes=8 * (page + 512)) as b:
        await within(a.wait_background())
        await within(b.wait_background())
        assert await within(a.set("k0", v0(page, 0)))
        with caplog.at_level(logging.WARNING):
            assert await within(b.clear())
            for store in (a, b):
                assert await within(store.set(f"k-{id(store)}", v0(page, 1)))
                await within(store.wait_background())
        assert not [r for r in caplog.records if "cut short" in r.getMessage()]
        assert a.get_stats().get("rescans", 0) == b.get_stats().get("rescans", 0) == 0


def test_a_peers_clear_met_first_by_alone_is_no_lost_ledger(tmp_path, caplog) -> None:
    """A peer's clear renames the namespace folder away; the fresh folder has no ledger until
    a call makes it. Where ``alone`` (a scan's check, after its reading) was the call that
    opened it, the next ``add`` took the empty file it had not read for one it had read and
    that was since cut short: "usage ledger was cut short, overwritten or deleted" at WARNING
    and a re-index of the namespace, for an ordinary clear. A file the ledger has not read yet
    is a first reading, whichever call opened it."""
    from hicache_backends.file.ledger import UsageLedger

    ns = tmp_path / "ns"
    ns.mkdir()
    ledger = UsageLedger(str(ns))
    try:
        assert ledger.add(4096) is not None
        os.rename(ns, tmp_path / ".trash-peer")  # the peer's clear
        ns.mkdir()
        assert ledger.alone()
        caplog.set_level(logging.WARNING, logger="hicache")
        usage = ledger.add(0)
        assert usage is not None and not usage.lost and usage.used == 0
        assert not [r for r in caplog.records if "cut short" in r.getMessage()]
    finally:
        ledger.close()


async def test_a_close_given_a_deadline_ends_by_it_and_reports_the_writes_it_left(tmp_path, monkeypatch, caplog) -> None:
    """A write stuck on a hung mount when the store closes. The close waited 30 s for the
    calls in progress whatever the caller's budget (``aclose(timeout)``: what is left of a
    server's drain), then for the I/O threads with no bound at all: past the drain, the
    shutdown's SIGKILL came before a word of the write it left. Given a budget, it ends by it
    and counts and logs the pages of the writes it left running."""
    import threading

    from hicache.testing.pools import ArrayHostPool
    from hicache.testing.store_tests import keys_for

    entered, release = threading.Event(), threading.Event()
    real = file_io.write_page

    def hung_write(*args):
        entered.set()
        release.wait(60)
        return real(*args)

    store = make_store(tmp_path)
    await store.open()
    keys = keys_for(3, salt=77)
    src = ArrayHostPool(len(keys), 4096)
    src.fill_random(77)
    store.register_mem_pool_host(src)
    monkeypatch.setattr(file_io, "write_page", hung_write)
    writing = asyncio.create_task(store.batch_set_v1(keys, src.indices(0, len(keys))))
    try:
        while not entered.is_set():
            await asyncio.sleep(0.005)
        caplog.set_level(logging.WARNING, logger="hicache")
        started = time.monotonic()
        await asyncio.wait_for(store.aclose(timeout=3.0), 30.0)
        took = time.monotonic() - started
        assert took < 3.0 + 5.0, took  # (its own bounds: 30 s for the calls, the threads' end unbounded)
        assert store.get_stats()["close_left_write_pages"] == len(keys)
        said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
        assert said and f"writes of {len(keys)} page(s)" in said[0], said
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(writing, return_exceptions=True), 30.0)


def test_evictions_the_medium_refuses_log_one_line_not_one_per_page(tmp_path: Path, caplog) -> None:
    """An eviction whose unlinks the medium refuses (a file system remounted read-only after an
    error, a folder another user took) logged a WARNING per page, at every eviction pass: a
    store evicting hundreds of pages a second flooded the server's log. One line says how many
    of the batch were kept and why (the first error), at most once a minute."""
    import logging

    from hicache.observability.throttle import Throttle
    from hicache_backends.file import io as page_io

    victims = []
    for i in range(200):  # unlink refuses a folder, also as root: the medium's refusal, for real
        (tmp_path / f"p{i}").mkdir()
        victims.append(str(tmp_path / f"p{i}"))
    with caplog.at_level(logging.WARNING, logger="hicache.storage.file"):
        warn = Throttle(60.0)  # the store's own, as SpaceAccountant passes it
        freed, kept = page_io.remove_files(victims, [4096] * len(victims), warn)
        assert (freed, kept) == (0, list(range(200)))  # every page is still there: none is told gone
        first = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(first) == 1, [r.getMessage() for r in first[:3]]
        assert "200 of 200" in first[0].getMessage()
        caplog.clear()
        assert page_io.remove_files(victims, [4096] * len(victims), warn)[1] == list(range(200))
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the next pass: counted, quiet
