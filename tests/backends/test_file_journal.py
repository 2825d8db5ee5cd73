"""The removal journal: a file store learns what other processes sharing its root removed."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache.observability import ChangeKind, Tier, TierChange
from hicache.storage import create_async_storage
from hicache.testing import ArrayHostPool
from hicache.testing.store_tests import NS_A, PAGE, keys_for
from hicache_backends.file.journal import JOURNAL_NAME, RemovalJournal

REPO = Path(__file__).resolve().parents[2]

_PEER = textwrap.dedent(
    """
    import asyncio, sys
    from hicache.storage import create_async_storage
    from hicache.testing import ArrayHostPool
    from hicache.testing.store_tests import NS_A, PAGE, keys_for

    async def main(root, n, max_bytes, clear):
        pool = ArrayHostPool(n, PAGE)
        pool.fill_random(9)
        store = create_async_storage("file", None, root=root, namespace=NS_A, max_bytes=max_bytes)
        store.register_mem_pool_host(pool)
        async with store:
            await store.wait_index_ready()  # knows the other process's pages: may evict them
            keys = keys_for(n, salt=99)
            for i in range(n):
                assert await store.batch_set_v1(keys[i:i + 1], pool.indices(i, 1)) == [True]
            if clear:
                assert await store.clear()
        print("peer done", store.get_stats()["evicted_pages"])

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"))
    """
)


def run_peer(root: Path, n: int, max_bytes: int, clear: bool) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _PEER, str(root), str(n), str(max_bytes), "1" if clear else "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


async def wait_for(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def test_evictions_and_clears_by_another_process_are_reported_as_peer_removals(tmp_path: Path) -> None:
    keys = keys_for(6, salt=1)
    pool = ArrayHostPool(len(keys), PAGE)
    pool.fill_random(1)
    store = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, max_bytes=None,
                                 journal_poll_s=0.05)
    store.register_mem_pool_host(pool)
    seen: list[TierChange] = []
    store.tier_changes.subscribe(seen.append)
    async with store:
        assert all(await store.batch_set_v1(keys, pool.indices(0, len(keys))))
        page = store.layout.file_size(keys[0], "kv", pool.page_nbytes)
        # the peer is bounded to 4 pages: its 4 writes evict our 6 (older) pages; then it clears
        out = await asyncio.to_thread(run_peer, tmp_path, 4, 4 * page, True)
        assert "peer done 6" in out
        assert await wait_for(lambda: any(c.kind is ChangeKind.CLEARED for c in seen))
        peer = [c for c in seen if c.origin == "peer"]
        removed = [c for c in peer if c.kind is ChangeKind.REMOVED]
        assert sorted(k for c in removed for k in c.keys) == sorted(keys)
        assert all(c.tier is Tier.STORAGE and c.reason == "evicted" for c in removed)
        assert [c.kind for c in peer][-1] is ChangeKind.CLEARED  # in the order the peer made them
        assert store.get_stats()["peer_removed_pages"] == len(keys)
        assert await store.exists_pages(keys) == [False] * len(keys)
        # our own removals are not reported twice (as peer lines of our own)
        seen.clear()
        assert await store.clear()
        await asyncio.sleep(0.3)
        assert [(c.kind, c.origin) for c in seen] == [(ChangeKind.CLEARED, "local")]


def test_journal_is_bounded_skips_its_own_and_malformed_lines(tmp_path: Path) -> None:
    ours = RemovalJournal(str(tmp_path), max_bytes=2000)
    theirs = RemovalJournal(str(tmp_path), max_bytes=2000)
    for i in range(200):
        theirs.append_removed([(f"k{i}", "kv")], "evicted")
        if i % 20 == 19:  # a reader that keeps up through rotations loses nothing
            got = [k for r in ours.poll() for k, _ in r.pages]
            assert got == [f"k{j}" for j in range(i - 19, i + 1)]
    sizes = [os.path.getsize(tmp_path / n) for n in (JOURNAL_NAME, JOURNAL_NAME + ".1")]
    assert all(s <= 2000 + 100 for s in sizes)  # bounded: two files of about max_bytes
    ours.append_removed([("mine", "kv")], "evicted")
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b"not json\n[1,2]\n" + json.dumps({"w": "x", "rm": [["a", "kv"]]}).encode() + b"\n{\"w\": \"x\", \"rm\"")
    got = theirs.poll()  # many rotations behind (it never read): that much is known
    assert [r.missed for r in got] == [True, False, False] and theirs.missed_files == 1
    assert [r.pages for r in got[1:]] == [(("mine", "kv"),), (("a", "kv"),)]  # not its own lines
    got = ours.poll()
    assert [r.pages for r in got] == [(("a", "kv"),)] and ours.malformed_lines == 2
    assert ours.missed_files == 0
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b": [[\"b\", \"kv\"]]}\n")  # the torn last line completes later
    assert [r.pages for r in ours.poll()] == [(("b", "kv"),)]
    ours.close()
    theirs.close()


def test_a_line_nested_too_deep_to_parse_costs_no_other_line(tmp_path: Path) -> None:
    """A line nested deeper than the JSON parser recurses (damage, or any process that may
    write the namespace folder) raised ``RecursionError``, which the reader did not take for
    a malformed line: the whole poll failed after moving past everything it had read, so the
    removals in the lines around it were lost, never reported and never counted missed."""
    reader = RemovalJournal(str(tmp_path))
    writer = RemovalJournal(str(tmp_path))
    writer.append_removed([("before", "kv")], "evicted")
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b'{"w":"x","rm":' + b"[" * 100_000 + b"\n")
    writer.append_removed([("after", "kv")], "evicted")
    got = reader.poll()
    assert [r.pages for r in got] == [(("before", "kv"),), (("after", "kv"),)]
    assert reader.malformed_lines == 1
    reader.close()
    writer.close()


def test_lines_a_later_writer_appends_are_read_from_the_journals_start(tmp_path: Path) -> None:
    reader = RemovalJournal(str(tmp_path))
    assert reader.poll() == []
    RemovalJournal(str(tmp_path)).append_removed([("k", "kv")], "corrupt")
    got = reader.poll()
    assert [(r.pages, r.reason) for r in got] == [((("k", "kv"),), "corrupt")]
    reader.close()


@pytest.mark.parametrize("how", ["short", "raises"])
def test_an_append_that_fails_part_way_costs_no_later_line(tmp_path: Path, monkeypatch, how: str) -> None:
    """An append that fails after part of its line went out (a short write on a full disk, or
    a write that raises once some bytes are in the file) left that part as a line with no end,
    and the next line appended joined it: a reader skipped both as one malformed line, losing
    a removal that was written right. Cutting the part off again was no cure: a reader in
    another process may read it before the cut, and then read the next line from the wrong
    place. Here the reader polls in the middle of the failed write, as it may at any time."""
    reader = RemovalJournal(str(tmp_path))
    failing = RemovalJournal(str(tmp_path))
    real_write = os.write

    def write_half(fd, data):  # what a write does when only part of a journal line fits
        if bytes(data).lstrip(b"\n")[:5] != b'{"w":':
            return real_write(fd, data)
        n = real_write(fd, data[: len(data) // 2])
        assert reader.poll() == []  # (it reads the part: a line not yet ended)
        if how == "raises":
            raise OSError(errno.ENOSPC, "No space left on device")
        return n

    monkeypatch.setattr(os, "write", write_half)
    assert not failing.append_removed([("lost", "kv"), ("lost-too", "kv")], "evicted")
    assert failing.dropped_lines == 1  # visible: the store's journal_dropped_lines
    monkeypatch.undo()
    other = RemovalJournal(str(tmp_path))
    assert other.append_removed([("after", "kv")], "evicted")  # another writer, after the failure
    assert [r.pages for r in reader.poll()] == [(("after", "kv"),)]
    assert reader.malformed_lines == 1  # the part, skipped alone
    assert other.torn_lines == 1  # the writer found the part and ended it before its own line
    assert failing.append_removed([("later", "kv")], "evicted")
    assert [r.pages for r in reader.poll()] == [(("later", "kv"),)]
    for journal in (reader, failing, other):
        journal.close()


def test_a_line_left_torn_by_a_writer_that_died_costs_no_later_line(tmp_path: Path) -> None:
    """A writer killed in the middle of its append (a fatal signal ends a write early) leaves
    part of a line and nobody to clean it up: the next append ends it first."""
    reader = RemovalJournal(str(tmp_path))
    line = RemovalJournal._line({"w": "dead", "rm": [["gone", "kv"]], "r": "evicted"})
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(line[: len(line) // 2])
    writer = RemovalJournal(str(tmp_path))
    assert writer.append_removed([("after", "kv")], "evicted")
    assert [r.pages for r in reader.poll()] == [(("after", "kv"),)]
    assert reader.malformed_lines == 1 and writer.torn_lines == 1
    assert writer.append_removed([("next", "kv")], "evicted") and writer.torn_lines == 1  # (ended once)
    assert [r.pages for r in reader.poll()] == [(("next", "kv"),)]
    reader.close()
    writer.close()


def test_a_reader_finds_a_whole_line_behind_a_torn_one(tmp_path: Path) -> None:
    """A journal written by a writer that did not end a torn part (an older version sharing the
    root) holds the part and the next line as one: the reader reads the line behind the part."""
    reader = RemovalJournal(str(tmp_path))
    torn = RemovalJournal._line({"w": "dead", "rm": [["gone", "kv"]], "r": "evicted"})
    whole = RemovalJournal._line({"w": "old", "rm": [["after", "kv"], ["b", "kv"]], "r": "corrupt"})
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(torn[:9] + whole + torn[:30] + b"\n")
    got = reader.poll()
    assert [(r.pages, r.reason) for r in got] == [((("after", "kv"), ("b", "kv")), "corrupt")]
    assert reader.malformed_lines == 2  # the part before the line, and the part alone
    reader.close()


@pytest.mark.parametrize("how", ["cleared", "deleted"])
def test_writers_still_exclude_each_other_after_the_namespace_folder_is_replaced(tmp_path: Path, how: str) -> None:
    """A clear renames the namespace folder away and sets up a new one; a /tmp cleaner deletes
    it and the next write recreates it. A writer that had opened the old lock file kept locking
    it while writers that opened afterwards locked the new one: they no longer excluded each
    other, and two rotations at once moved a journal that was not full over the full one."""
    ns = tmp_path / "ns"
    ns.mkdir()
    old = RemovalJournal(str(ns))
    old.append_removed([("before", "kv")], "evicted")  # its lock file is open from now on
    if how == "cleared":
        ns.rename(tmp_path / "trash")
    else:
        shutil.rmtree(ns)
    ns.mkdir()
    new = RemovalJournal(str(ns))
    meanwhile = []
    rotate = old._rotate

    def rotate_holding_the_lock() -> None:  # another writer tries to append while `old` holds it
        meanwhile.append(new.append_removed([("meanwhile", "kv")], "evicted"))
        rotate()

    old._rotate = rotate_holding_the_lock  # type: ignore[method-assign]
    assert old.append_removed([("after", "kv")], "evicted")
    assert meanwhile == [False] and new.dropped_lines == 1  # it waited for the lock, then gave up
    del old._rotate
    assert new.append_removed([("later", "kv")], "evicted")
    assert [k for ln in _journal_lines(ns) for k, _ in ln["rm"]] == ["after", "later"]
    old.close()
    new.close()


def _journal_lines(root: Path) -> list[dict]:
    return [json.loads(line) for p in root.rglob(JOURNAL_NAME) for line in p.read_text().splitlines() if line]


def _store_with_pool(root: Path, pages: int, seed: int, **options: object):  # type: ignore[no-untyped-def]
    """A file store on ``root`` (namespace A) with a host pool of ``pages`` random pages."""
    pool = ArrayHostPool(pages, PAGE)
    pool.fill_random(seed)
    store = create_async_storage("file", None, root=str(root), namespace=NS_A, **options)
    store.register_mem_pool_host(pool)
    return store, pool


async def test_each_removal_is_journalled_once(tmp_path: Path) -> None:
    """Evictions and corrupt pages go through report_removed, the one place that journals."""
    store, pool = _store_with_pool(tmp_path, 8, 4)
    keys = keys_for(2, salt=5)
    async with store:
        await store.wait_index_ready()
        assert await store.batch_set_v1(keys, pool.indices(0, 2)) == [True, True]
        page = next(tmp_path.rglob("*.page"))
        data = bytearray(page.read_bytes())
        data[-100] ^= 0xFF  # the footer's neighbour: a payload byte
        page.write_bytes(bytes(data))
        got = await store.batch_get_v1(keys, pool.indices(2, 2))
        assert got.count(False) == 1 and store.get_stats()["corrupt_pages"] == 1
    lines = [ln for ln in _journal_lines(tmp_path) if "rm" in ln]
    assert [(ln["r"], len(ln["rm"])) for ln in lines] == [("corrupt", 1)]


def test_the_lock_file_stays_open_and_a_forked_child_opens_its_own(tmp_path: Path) -> None:
    journal = RemovalJournal(str(tmp_path))
    journal.append_removed([("a", "kv")], "evicted")
    lock = journal._lock_file.fd
    assert lock is not None
    journal.append_removed([("b", "kv")], "evicted")
    assert journal._lock_file.fd == lock  # not reopened per append
    read, write = os.pipe()
    journal._append_mutex.acquire()  # as if another thread of ours were appending at the fork
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            journal.append_removed([("c", "kv")], "evicted")
            os.write(write, b"1" if journal._lock_pid == os.getpid() else b"0")
        finally:
            os._exit(0)
    journal._append_mutex.release()
    os.close(write)
    assert select.select([read], [], [], 20)[0], "the forked child hung on the journal"
    assert os.read(read, 1) == b"1"  # the child used a lock file (and a mutex) of its own
    os.close(read)
    os.waitpid(child, 0)
    assert journal._lock_file.fd == lock and journal._lock_pid == os.getpid()
    journal.append_removed([("d", "kv")], "evicted")
    assert [k for ln in _journal_lines(tmp_path) for k, _ in ln["rm"]] == ["a", "b", "c", "d"]
    journal.close()
    assert journal._lock_file.fd is None
    journal.append_removed([("e", "kv")], "evicted")  # after close: reopened, still works
    journal.close()


async def test_a_clear_by_another_store_empties_this_ones_index(tmp_path: Path) -> None:
    """The clear line was reported but the index kept every page: lookups answered "present"
    for pages no read returned. A page written after the clear is still found."""
    keys = keys_for(6, salt=1)
    pool = ArrayHostPool(len(keys), PAGE)
    pool.fill_random(1)
    a = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    b = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    a.register_mem_pool_host(pool)
    async with a, b:
        assert all(await a.batch_set_v1(keys, pool.indices(0, len(keys))))
        await b.wait_index_ready()
        assert await b.clear()
        assert await wait_for(lambda: a.get_stats().get("peer_clears") == 1)
        assert await a.batch_exists(keys) == 0
        assert await a.batch_get_v1(keys, pool.indices(0, len(keys))) == [False] * len(keys)
        assert await a.batch_set_v1(keys[:2], pool.indices(0, 2)) == [True, True]
        assert await a.batch_exists(keys) == 2


async def test_a_journal_line_no_store_could_write_is_skipped_and_the_tail_goes_on(tmp_path: Path) -> None:
    """A key that is not storable text (a lone surrogate is valid JSON) ended the journal's
    tail for good: no removal by another process was seen again."""
    pool = ArrayHostPool(4, PAGE)
    pool.fill_random(1)
    a = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    b = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    b.register_mem_pool_host(pool)
    async with a, b:
        keys = keys_for(4, salt=3)
        assert all(await b.batch_set_v1(keys, pool.indices(0, 4)))
        with open(os.path.join(a.layout.ns_dir, JOURNAL_NAME), "ab") as f:
            f.write(b'{"w":"zz","rm":[["\\ud800","kv"]],"r":"evicted"}\n')
            f.write(b'{"w":"zz","rm":[["k","' + b"p" * 70000 + b'"]],"r":"evicted"}\n')
        assert await wait_for(lambda: a._peers.journal.malformed_lines == 2)
        assert await b.batch_delete(keys) == [True] * 4
        assert await wait_for(lambda: a.get_stats().get("peer_removed_pages") == 4)
        assert not a._peers._task.done()


def test_a_line_appended_to_the_old_file_while_the_reader_moves_on_is_read(tmp_path: Path) -> None:
    """A poll reads its file to the end, then looks whether the journal was rotated. A line
    appended to the old file between the two (and the file rotated by the next append) was
    never read: the reader saw the new file and left the old one without reading it again."""
    reader = RemovalJournal(str(tmp_path), max_bytes=1)
    writer = RemovalJournal(str(tmp_path), max_bytes=1)
    read_lines = reader._read_lines
    calls = 0

    def read_then_another_process_appends(out):  # type: ignore[no-untyped-def]
        nonlocal calls
        read_lines(out)
        calls += 1
        if calls == 1:  # the reader has read the old file to its end
            writer.append_removed([("old", "kv")], "evicted")  # into the old file (empty: not rotated)
            writer.append_removed([("new", "kv")], "evicted")  # rotates it, into the new file

    reader._read_lines = read_then_another_process_appends  # type: ignore[method-assign]
    got = [k for r in reader.poll() for k, _ in r.pages]
    assert got == ["old", "new"]
    assert reader.missed_files == 0
    reader.close()
    writer.close()


def test_a_journal_file_rotated_away_unread_is_detected(tmp_path: Path) -> None:
    """A reader more than one rotation behind cannot read the file in between (it was
    replaced as removals.1): that is detected, counted, and marked in what the poll returns."""
    reader = RemovalJournal(str(tmp_path), max_bytes=1)
    writer = RemovalJournal(str(tmp_path), max_bytes=1)
    writer.append_removed([("a", "kv")], "evicted")  # the reader's file
    writer.append_removed([("b", "kv")], "evicted")  # rotated: the next file
    got = reader.poll()  # one rotation behind: nothing lost
    assert [k for r in got for k, _ in r.pages] == ["a", "b"] and not any(r.missed for r in got)
    writer.append_removed([("c", "kv")], "evicted")  # rotated: the reader's file is removals.1
    writer.append_removed([("d", "kv")], "evicted")  # rotated again: the reader's file is gone
    got = reader.poll()
    assert [(r.missed, [k for k, _ in r.pages]) for r in got] == [(True, []), (False, ["d"])]
    assert reader.missed_files == 1
    reader.close()
    writer.close()


async def test_removals_in_a_journal_file_the_tail_missed_leave_the_index(tmp_path: Path) -> None:
    """The fallback for lines that went by unread: the index is checked against the disk, and
    pages whose files are gone are forgotten (a lookup no longer answers present for them)."""
    from hicache_backends.file.layout import page_id

    b, pool = _store_with_pool(tmp_path, 4, 1)
    keys = keys_for(3, salt=11)
    async with b:
        assert all(await b.batch_set_v1(keys, pool.indices(0, 3)))
        a = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=3600)
        async with a:  # (its tail never polls by itself here: this test drives it)
            assert await a.wait_index_ready(10)
            assert all(page_id(k, "kv") in a.index for k in keys)
            journal = os.path.join(a.layout.ns_dir, JOURNAL_NAME)
            rotor = RemovalJournal(a.layout.ns_dir, max_bytes=1)
            rotor.append_removed([("filler-1", "kv")], "evicted")  # a's file
            rotor.append_removed([("filler-2", "kv")], "evicted")  # rotated: the next file
            assert await b.batch_delete(keys[:2]) == [True, True]  # journalled into that one
            assert await wait_for(lambda: keys[1] in Path(journal).read_text())
            rotor.append_removed([("filler-3", "kv")], "evicted")  # rotated again: a's file gone
            rotor.close()
            for removal in a._peers.journal.poll():
                a._peer_removal(removal)
            await a.wait_background()
            stats = a.get_stats()
            assert stats["journal_missed_files"] == 1 and stats["pruned_pages"] == 2
            assert [page_id(k, "kv") in a.index for k in keys] == [False, False, True]
            assert await a.batch_exists(keys) == 0 and await a.exists(keys[2])


_KILLED_CLEAR = textwrap.dedent(
    """
    import asyncio, os, sys
    from hicache.storage import create_async_storage
    from hicache.testing.store_tests import NS_A
    from hicache_backends.file import io as page_io

    async def main(root, where):
        store = create_async_storage("file", None, root=root, namespace=NS_A)
        async with store:
            await store.wait_background()
            def die(*args):
                os.kill(os.getpid(), 9)
            if where == "after_rename":  # the folder renamed to trash, no fresh one yet
                page_io.prepare_namespace = die
            else:  # the fresh folder set up, the clear line not yet journalled
                async def die_async():
                    die()
                store._peers.append_cleared = die_async
            await store.clear()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize("where", ["after_rename", "before_line"])
async def test_a_clear_killed_before_its_journal_line_still_empties_the_peers_index(tmp_path: Path, where: str) -> None:
    """A process killed in the middle of a clear (SIGKILL after it renamed the namespace folder
    away, before its clear line reached the journal) left every peer answering present for
    each page the clear took, until a read missed it, and its trash (the whole old namespace)
    on disk outside every count until a restart. A peer's tail now finds the journal in a
    fresh folder with no predecessor: the folder was replaced, so it checks its index against
    the disk and finishes the dead clear's deletion."""
    keys = keys_for(6, salt=21)
    a, pool = _store_with_pool(tmp_path, len(keys), 2, journal_poll_s=0.05)
    async with a:
        assert all(await a.batch_set_v1(keys, pool.indices(0, len(keys))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "backends")]))
        done = subprocess.run([sys.executable, "-c", _KILLED_CLEAR, str(tmp_path), where], env=env, timeout=120)
        assert done.returncode == -9
        assert any(n.startswith(".trash-") for n in os.listdir(tmp_path))
        if where == "after_rename":  # a server (re)starting on the namespace sets the folder up
            async with create_async_storage("file", None, root=str(tmp_path), namespace=NS_A) as c:
                await c.wait_background()
        assert await wait_for(lambda: not any(pid in a.index for pid in _pids(keys)))
        assert await a.batch_exists(keys) == 0
        await a.wait_background()
        assert not any(n.startswith(".trash-") for n in os.listdir(tmp_path))
        assert all(await a.batch_set_v1(keys[:2], pool.indices(0, 2)))
        assert await a.batch_exists(keys) == 2


async def test_pruned_pages_counts_in_the_scrape_after_a_scrape_saw_it_zero(tmp_path: Path) -> None:
    """A backend figure's metric kind is fixed for the process by the first scrape that sees
    it. The file store reports ``pruned_pages`` (0) before it ever prunes, and StorageStats
    holds it only once counted: the first scrape made ``hicache_backend_pruned_pages`` a
    gauge, and once pages were pruned the counter of that name was refused (another kind), so
    the scrape showed 0 pruned pages for the life of the process. It is a counter from the
    first scrape on."""
    from hicache.observability.cache_gauges import _export_storage
    from hicache.observability.metrics import InstanceMetrics, exposition_text
    from hicache.observability.scrape import Scrape

    writer, pool = _store_with_pool(tmp_path, 4, 1)
    keys = keys_for(3, salt=21)
    metrics = InstanceMetrics()
    try:
        async with writer:
            assert all(await writer.batch_set_v1(keys, pool.indices(0, 3)))
            reader = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=3600)
            async with reader:
                assert await reader.wait_index_ready(10)
                metrics.on_refresh(lambda m: _export_storage(m, reader))
                before = Scrape(exposition_text())
                assert before.value("hicache_backend_pruned_pages_total", cache=metrics.label) == 0
                # the journal's tail misses a whole file (rotated twice between two polls): the
                # reader checks its index against the disk and forgets the two pages deleted
                journal = os.path.join(reader.layout.ns_dir, JOURNAL_NAME)
                rotor = RemovalJournal(reader.layout.ns_dir, max_bytes=1)
                rotor.append_removed([("filler-1", "kv")], "evicted")
                rotor.append_removed([("filler-2", "kv")], "evicted")
                assert await writer.batch_delete(keys[:2]) == [True, True]
                assert await wait_for(lambda: keys[1] in Path(journal).read_text())
                rotor.append_removed([("filler-3", "kv")], "evicted")
                rotor.close()
                for removal in reader._peers.journal.poll():
                    reader._peer_removal(removal)
                await reader.wait_background()
                assert reader.get_stats()["pruned_pages"] == 2
                after = Scrape(exposition_text())
                assert after.value("hicache_backend_pruned_pages_total", cache=metrics.label) == 2
                assert after.select("hicache_backend_pruned_pages", cache=metrics.label) == []
    finally:
        metrics.close()


def _pids(keys: list[str]) -> list[str]:
    from hicache_backends.file.layout import page_id

    return [page_id(k, "kv") for k in keys]


async def test_a_store_does_not_take_its_own_clear_for_a_replaced_folder(tmp_path: Path) -> None:
    """A clearer's own journal reader finds the fresh folder its clear made: it counted
    ``namespace_folder_replaced`` and checked its (empty) index against the disk again, so
    every ordinary clear looked like a peer's killed one. Nor does a peer, which finds the
    clear's line there (see the next test)."""
    a = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    b = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=0.05)
    async with a, b:
        await a.wait_background()
        await b.wait_background()
        await a.clear()
        for _ in range(3):
            await asyncio.sleep(0.2)
            await a.exists("x")
            await b.exists("x")
        assert a.stats.snapshot().get("namespace_folder_replaced", 0) == 0
        assert b.stats.snapshot().get("namespace_folder_replaced", 0) == 0
        assert b.stats.snapshot().get("peer_clears", 0) == 1


_ORDINARY_CLEAR = textwrap.dedent(
    """
    import asyncio, sys
    from hicache.storage import create_async_storage
    from hicache.testing.store_tests import NS_A

    async def main(root, n):
        store = create_async_storage("file", None, root=root, namespace=NS_A)
        async with store:
            await store.wait_background()
            for _ in range(n):
                assert await store.clear()
                await asyncio.sleep(0.3)  # the peer's tail reads each clear's journal

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def test_a_peers_ordinary_clears_are_not_taken_for_killed_ones(tmp_path: Path) -> None:
    """A peer's tail finds each clear's journal in a fresh folder with no predecessor, which
    also says a clear killed before its line. It took every ordinary clear, journalled as
    usual, for such a one as well: each counted ``namespace_folder_replaced`` and cost a check
    of the whole index against the disk and a housekeeping pass beside the clear's line. A
    fresh folder whose journal soon holds a clear line is now that clear's; only one that
    holds none a poll later is taken for a killed clear (the test above)."""
    keys = keys_for(6, salt=31)
    a, pool = _store_with_pool(tmp_path, len(keys), 3, journal_poll_s=0.05)
    async with a:
        assert all(await a.batch_set_v1(keys, pool.indices(0, len(keys))))
        await a.wait_background()
        passes = {"prune": 0, "rehouse": 0}
        prune, rehouse = a._prune, a._rehouse

        async def counted_prune() -> None:
            passes["prune"] += 1
            await prune()

        def counted_rehouse() -> bool:
            passes["rehouse"] += 1
            return rehouse()

        a._prune, a._rehouse = counted_prune, counted_rehouse
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "backends")]))
        # (this loop keeps polling while the peer clears)
        peer = await asyncio.create_subprocess_exec(sys.executable, "-c", _ORDINARY_CLEAR, str(tmp_path), "3", env=env)
        assert await asyncio.wait_for(peer.wait(), 120) == 0
        assert await wait_for(lambda: a.get_stats().get("peer_clears") == 3)
        for _ in range(4):  # polls enough for a replaced folder's record to come
            await asyncio.sleep(0.1)
            await a.exists("x")
        await a.wait_background()
        assert await a.batch_exists(keys) == 0
        stats = a.get_stats()
        assert stats.get("namespace_folder_replaced", 0) == 0
        assert passes == {"prune": 0, "rehouse": 0}


async def test_journal_totals_outlive_the_close(tmp_path: Path) -> None:
    """A closed store's journal figures read 0 while its other counters kept their values: a
    multi-process scrape's last read (taken after the store closed) lost what the close's
    flush dropped, and ``get_stats()`` after a close said no journal file was ever missed."""
    store = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=3600)
    async with store:
        assert await store.wait_index_ready(10)
        rotor = RemovalJournal(store.layout.ns_dir, max_bytes=1)
        for i in range(3):  # rotated twice before this store reads: one file missed
            rotor.append_removed([(f"filler-{i}", "kv")], "evicted")
        rotor.close()
        store._peers.journal.poll()
        assert store.get_stats()["journal_missed_files"] == 1
    assert store.get_stats()["journal_missed_files"] == 1


def test_journal_failures_that_repeat_are_logged_once_a_minute_with_their_count(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A peer frozen holding the journal's lock failed every flush (about two a second) and a
    journal that could not be read failed every poll (two a second): each logged a warning, a
    flood for as long as it lasted. Now the first is said, then one line a minute with the count."""
    import fcntl
    import logging

    journal = RemovalJournal(str(tmp_path))
    holder = os.open(tmp_path / "removals.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file of the lock: excludes this process's too
    caplog.set_level(logging.WARNING, logger="hicache.storage.file")
    try:
        for i in range(3):
            assert not journal.append_removed([(f"k{i}", "kv"), (f"j{i}", "kv")], "evicted")
        dropped = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
        assert len(dropped) == 1, dropped
        journal._drop_warnings.period = 0  # a minute on: the next line says how many went unsaid
        assert not journal.append_removed([("k3", "kv")], "evicted")
    finally:
        os.close(holder)
    assert journal.dropped_lines == 4
    dropped = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(dropped) == 2 and "3 removal journal line(s)" in dropped[1], dropped
    assert journal.append_removed([("k4", "kv")], "evicted")  # the lock free: written again

    caplog.clear()
    os.remove(tmp_path / JOURNAL_NAME)
    os.symlink(JOURNAL_NAME, tmp_path / JOURNAL_NAME)  # a loop: every look at the name fails
    for _ in range(4):
        assert journal.poll() == []
    failed = [r.getMessage() for r in caplog.records if "reading the removal journal failed" in r.getMessage()]
    assert len(failed) == 1, failed
    journal._poll_warnings.period = 0
    journal.poll()
    failed = [r.getMessage() for r in caplog.records if "reading the removal journal failed" in r.getMessage()]
    assert len(failed) == 2 and "4 poll(s)" in failed[1], failed
    journal.close()
