"""``hicache inspect`` reports namespaces, pages, bytes and catches corrupt pages."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hicache.cli import main
from hicache.inspect import inspect_store
from hicache.keys import Namespace
from hicache.storage import create_async_storage


async def _fill(root: Path, ns: Namespace, n: int) -> None:
    async with create_async_storage("file", None, root=str(root), namespace=ns) as store:
        assert await store.batch_set([f"k{i}" for i in range(n)], [torch.full((256,), float(i)) for i in range(n)])


async def test_inspect_counts_and_verifies(tmp_path: Path) -> None:
    a, b = Namespace(model="a"), Namespace(model="b", kv_dtype="bfloat16")
    await _fill(tmp_path, a, 5)
    await _fill(tmp_path, b, 3)
    report = await inspect_store(str(tmp_path), verify="all", progress=False)
    assert report["pages"] == 8 and report["corrupt"] == 0 and report["checked"] == 8
    assert {v["model"] for v in report["namespaces"].values()} == {"a", "b"}
    assert report["namespaces"][b.digest]["kv_dtype"] == "bfloat16"
    # flip one payload byte of one page of namespace a
    page = next(p for p in (tmp_path / a.digest).rglob("*.page"))
    data = bytearray(page.read_bytes())
    data[200] ^= 0xFF
    page.write_bytes(bytes(data))
    report = await inspect_store(str(tmp_path), verify="all", progress=False)
    assert report["namespaces"][a.digest]["corrupt"] == 1
    assert report["corrupt"] == 1


def test_cli_inspect_json(tmp_path: Path, capsys) -> None:
    import asyncio

    asyncio.run(_fill(tmp_path, Namespace(model="cli"), 4))
    assert main(["inspect", str(tmp_path), "--json", "--verify", "all"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pages"] == 4 and out["corrupt"] == 0
    # a wrong path is an error, not a report of an empty store
    assert main(["inspect", os.fspath(tmp_path / "nothing-here"), "--json"]) == 2
    assert "no file store at" in capsys.readouterr().err


def test_cli_backends_lists_ours(capsys) -> None:
    assert main(["backends", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"file", "memory", "s3", "fsspec"} <= set(out)
    assert "root" in out["file"]


async def test_inspect_counts_unreadable_page_files_and_never_creates_a_folder(tmp_path) -> None:
    """A torn page file was left out of the listing, so it was never counted (``corrupt 0``);
    a manifest naming another namespace had inspect open it, creating an empty folder in the
    store it inspected."""
    root = str(tmp_path / "store")
    await _fill(tmp_path / "store", Namespace(model="a"), 5)
    torn = next(p for p in (tmp_path / "store").rglob("*.page"))
    os.truncate(torn, 100)
    report = await inspect_store(root, verify="all", progress=False)
    assert report["pages"] == 4 and report["corrupt"] == 1
    manifest = next((tmp_path / "store").glob("*/manifest.json"))
    manifest.write_text('{"model": "edited"}')
    before = sorted(os.listdir(root))
    report = await inspect_store(root, verify="none", progress=False)
    assert sorted(os.listdir(root)) == before and report["corrupt_manifests"] == 1


async def test_an_edited_manifest_is_one_problem_not_two(tmp_path: Path) -> None:
    """A manifest naming another namespace than its folder's was reported twice: as a corrupt
    manifest and as an unmatched one (with a warning). It is one corrupt manifest, with why."""
    ns = Namespace(model="a")
    await _fill(tmp_path, ns, 1)
    (tmp_path / ns.digest / "manifest.json").write_text('{"model": "edited"}')
    report = await inspect_store(str(tmp_path), verify="none", progress=False)
    assert report["corrupt_manifests"] == 1 and "unmatched_manifests" not in report, report
    assert "describes namespace" in report["namespaces"][ns.digest]["corrupt_manifest"]
    assert list(report["namespaces"]) == [ns.digest] and report["pages"] == 0


def test_a_backend_that_cannot_list_namespaces_is_one_line(capsys) -> None:
    """``--help`` offered an S3 URL as the root; S3 has no namespace listing, and both
    ``inspect`` and ``stats`` ended in a ``NotImplementedError`` traceback. Nothing is sent to the
    URL: the listing is asked of an unopened store."""
    import pytest

    pytest.importorskip("s3fs")
    for argv in (["inspect", "s3://no-bucket/kv", "--backend", "s3"],
                 ["stats", "s3://no-bucket/kv", "--backend", "s3", "--once"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "'s3' cannot list its namespaces" in err and "Traceback" not in err


def test_inspect_of_a_file_says_it_is_a_file(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A file given as the root was reported as 'no such folder', which reads as a typo."""
    afile = tmp_path / "store"
    afile.write_text("not a store")
    assert main(["inspect", str(afile)]) == 2
    assert "a file, not a folder" in capsys.readouterr().err


def test_inspect_of_a_memory_store_says_there_is_nothing_on_disk(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--backend memory`` ended in 'storage backend 'memory' has no option(s) ['url']': the
    ROOT was passed on as an option the memory backend does not have. A memory store lives in
    the process that made it; the error says so, and which backends can be inspected."""
    import pytest

    from hicache.errors import ConfigError

    assert main(["inspect", str(tmp_path), "--backend", "memory"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no option" not in err
    assert "'memory'" in err and "nothing on disk" in err and "file" in err.partition("inspected:")[2]
    with pytest.raises(ConfigError, match="nothing on disk"):
        import asyncio

        asyncio.run(inspect_store(backend="memory", progress=False))


async def test_inspect_lists_a_namespace_whose_manifest_is_corrupt(tmp_path: Path) -> None:
    """A namespace folder whose manifest was not JSON, or had fields of another format, was left
    out of the report with a warning line only (and an ``extra`` that is not a mapping ended
    inspect with a ValueError): an operator never saw it. It is listed, marked corrupt with the
    reason; the other namespaces are reported as before. A manifest copied from another folder
    had that namespace's pages counted twice."""
    good, bad_json, bad_fields, bad_extra = (Namespace(model=m) for m in ("good", "j", "f", "x"))
    for ns in (good, bad_json, bad_fields, bad_extra):
        await _fill(tmp_path, ns, 2)
    (tmp_path / bad_json.digest / "manifest.json").write_text("{not json")
    (tmp_path / bad_fields.digest / "manifest.json").write_text('{"model": "f", "bogus": 1}')
    (tmp_path / bad_extra.digest / "manifest.json").write_text('{"model": "x", "extra": "ab"}')
    # a manifest copied over another folder's: that folder is corrupt, and good's pages count once
    copied = Namespace(model="copied")
    await _fill(tmp_path, copied, 2)
    (tmp_path / copied.digest / "manifest.json").write_bytes((tmp_path / good.digest / "manifest.json").read_bytes())
    report = await inspect_store(str(tmp_path), verify="all", progress=False)
    assert report["namespaces"][good.digest]["pages"] == 2 and "corrupt_manifest" not in report["namespaces"][good.digest]
    assert report["pages"] == 2 and report["corrupt"] == 0 and report["corrupt_manifests"] == 4
    assert f"describes namespace {good.digest}" in report["namespaces"][copied.digest]["corrupt_manifest"]
    listed = report["namespaces"]
    assert "not JSON" in listed[bad_json.digest]["corrupt_manifest"]
    assert "bogus" in listed[bad_fields.digest]["corrupt_manifest"]
    assert "another format: ValueError" in listed[bad_extra.digest]["corrupt_manifest"]


def test_cli_inspect_shows_a_corrupt_manifest(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The table and ``--json`` both show the corrupt namespace and why."""
    import asyncio

    from hicache.observability.stats_view import render_store

    good, bad = Namespace(model="good"), Namespace(model="bad")
    asyncio.run(_fill(tmp_path, good, 1))
    asyncio.run(_fill(tmp_path, bad, 1))
    (tmp_path / bad.digest / "manifest.json").write_text("[1, 2]")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "not a JSON object" in out["namespaces"][bad.digest]["corrupt_manifest"]
    assert out["namespaces"][good.digest]["pages"] == 1
    assert main(["inspect", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert bad.digest in table and "corrupt_manifest" in table and "not a JSON object" in table
    # the stats screen of a store (the same report) shows it too
    screen = render_store(asyncio.run(inspect_store(str(tmp_path), verify="none", progress=False)), str(tmp_path))
    assert "corrupt manifest" in screen and bad.digest[:12] in screen


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every folder and file under ``root``: size and mtime of each file, and the bytes of
    the small ones (the ledger, the journal, lock files, manifests)."""
    out: dict[str, tuple] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = ("dir",)
        for name in files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            data = Path(path).read_bytes() if st.st_size < (1 << 20) else None
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, data)
    return out


async def test_inspect_changes_nothing_in_a_store_larger_than_the_default_bound(tmp_path: Path, monkeypatch) -> None:
    """``hicache inspect ROOT`` opened each namespace as a writer with the default max_bytes
    (64 GiB): once its scan was done it evicted what a server allowed more (here unbounded)
    had stored beyond 64 GiB, corrected the shared ledger, and swept temp files and trash.
    Inspect opens stores read-only now: nothing on disk changes. Pages are sparse files (1 GiB
    each, no disk used) with sound headers and footers."""
    import subprocess

    from hicache.storage.page_format import PageCodec, checksum_stream
    from hicache_backends.file import FileStorage
    from hicache_backends.file.layout import TMP_SUFFIX, encode_footer, page_id
    from hicache_backends.writers import MACHINE_HEX

    gib = 1 << 30
    ns = Namespace(model="big")
    async with FileStorage(None, root=str(tmp_path), namespace=ns, max_bytes=None, min_free_bytes=0) as server:
        assert await server.set("small", torch.full((1024,), 1.0))
        layout, codec = server.layout, PageCodec(server.namespace.digest_bytes)
    h = checksum_stream()
    zeros = bytes(64 << 20)
    for _ in range(gib // len(zeros)):
        h.update(zeros)
    digest = h.intdigest()

    class Payload:  # all the header needs of a 1 GiB payload: its length
        def __len__(self) -> int:
            return gib

    for i in range(65):  # 65 GiB: over the default bound
        key = f"big{i}"
        pid = page_id(key, "kv")
        os.makedirs(layout.subdir(pid), exist_ok=True)
        with open(layout.path(pid), "wb") as f:
            f.write(codec.encode(key, "kv", Payload(), digest))  # type: ignore[arg-type]
            f.seek(codec.header_len(key, "kv") + gib)
            f.write(encode_footer(None))
    # what the sweeps of a writer remove: a dead writer's temp file, a dead clearer's trash
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    pid = page_id("big0", "kv")
    Path(layout.subdir(pid), f".{pid}.{dead.pid}.0.{MACHINE_HEX}{TMP_SUFFIX}").write_bytes(b"partial")
    (tmp_path / f".trash-{ns.digest}-{dead.pid}-0").mkdir()
    before = _snapshot(tmp_path)

    # the store's scan ends (its eviction ran there) before inspect lists and closes the store
    listed = FileStorage.list_pages

    async def list_after_scan(self: FileStorage):  # type: ignore[no-untyped-def]
        await self.wait_background()
        return await listed(self)

    monkeypatch.setattr(FileStorage, "list_pages", list_after_scan)
    report = await inspect_store(str(tmp_path), progress=False, verify="none")
    assert report["pages"] == 66 and report["corrupt"] == 0
    assert _snapshot(tmp_path) == before


async def test_inspect_counts_a_torn_and_a_corrupt_page_as_two(tmp_path: Path) -> None:
    """Page files were counted after verification, which drops the corrupt page it finds: the
    count went down by one, hiding the torn page beside it (``corrupt 1``)."""
    ns = Namespace(model="a")
    await _fill(tmp_path, ns, 5)
    pages = sorted((tmp_path / ns.digest).rglob("*.page"))
    os.truncate(pages[0], 100)  # torn: the listing cannot read it
    data = bytearray(pages[1].read_bytes())
    data[200] ^= 0xFF  # listed, fails verification
    pages[1].write_bytes(bytes(data))
    report = await inspect_store(str(tmp_path), verify="all", progress=False)
    assert report["namespaces"][ns.digest]["corrupt"] == 2 and report["corrupt"] == 2
    assert report["pages"] == 4 and report["vanished"] == 0


async def test_a_live_servers_writes_and_evictions_during_inspect_are_no_corruption(tmp_path: Path, monkeypatch) -> None:
    """inspect observes a live server's store: pages the server published while inspect
    verified counted as corrupt (page files on disk minus pages listed), and pages it evicted
    between the listing and their read counted as corrupt too. Now: none corrupt, the
    evicted ones shown as ``vanished``."""
    from hicache_backends.file import io as file_io

    ns = Namespace(model="live")
    store_root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    await _fill(store_root, ns, 5)
    async with create_async_storage("file", None, root=str(elsewhere), namespace=ns) as other:
        assert await other.batch_set([f"new{i}" for i in range(3)], [torch.full((256,), 9.0) for _ in range(3)])
    new_pages = sorted((elsewhere / ns.digest).rglob("*.page"))
    real_read = file_io.read_page_bytes
    acted: list[str] = []

    def read_while_the_server_works(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not acted:  # on inspect's first read, the server publishes 3 pages and evicts 2
            for f in new_pages:  # published as a writer publishes: by rename
                dest = store_root / f.relative_to(elsewhere)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.rename(f, dest)
            for f in [p for p in old_pages if str(p) != path][:2]:  # two pages inspect reads later
                os.remove(f)
                acted.append(f.name)
        return real_read(path, *args, **kwargs)

    old_pages = sorted((store_root / ns.digest).rglob("*.page"))
    monkeypatch.setattr(file_io, "read_page_bytes", read_while_the_server_works)
    report = await inspect_store(str(store_root), verify="all", progress=False)
    assert len(acted) == 2 and report["pages"] == 5 and report["checked"] == 5
    assert report["corrupt"] == 0, report["namespaces"][ns.digest]
    assert report["vanished"] == 2 and report["namespaces"][ns.digest]["vanished"] == 2


async def test_inspect_progress_shows_on_a_terminal_only(tmp_path: Path, monkeypatch) -> None:
    """inspect drew its verification bar into any stderr (a log, a pipe: a line of carriage
    returns per redraw); like the trace tools' bar, it shows on a terminal only."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    await _fill(tmp_path, Namespace(model="a"), 3)
    for stderr, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stderr)
        report = await inspect_store(str(tmp_path), verify="all", progress=True)
        assert report["checked"] == 3 and ("verify" in stderr.getvalue()) is shown, stderr.getvalue()[:200]


async def test_inspect_does_not_count_a_live_writers_batch_in_flight_as_stored(tmp_path: Path, monkeypatch) -> None:
    """A live server's write batch reserves its bytes in the namespace's shared count before it
    writes a byte; inspect reported that count as the namespace's ``used_bytes``, so a store
    with a batch in flight (or a writer killed mid-batch) read fuller than what it holds. Now
    ``used_bytes`` is the pages, and the reservations are ``inflight_bytes``."""
    import asyncio
    import threading

    from hicache_backends.file import io as file_io

    ns = Namespace(model="busy")
    await _fill(tmp_path, ns, 5)
    entered, release = threading.Event(), threading.Event()
    real_write = file_io.write_page

    def hung_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(30)  # the thread really blocks, mid-batch
        return real_write(*args, **kwargs)

    async with create_async_storage("file", None, root=str(tmp_path), namespace=ns) as writer:
        monkeypatch.setattr(file_io, "write_page", hung_write)
        batch = asyncio.ensure_future(writer.batch_set([f"n{i}" for i in range(4)],
                                                       [torch.full((256,), 7.0) for _ in range(4)]))
        try:
            assert await asyncio.to_thread(entered.wait, 10)
            report = await inspect_store(str(tmp_path), verify="none", progress=False)
        finally:
            release.set()
        assert await batch
    space = report["namespaces"][ns.digest]
    assert space["pages"] == 5
    assert space["used_bytes"] == space["bytes"], space
    assert space["inflight_bytes"] > 0, space


def test_a_namespace_whose_pages_is_a_file_is_reported_damaged_and_the_rest_normally(tmp_path: Path, capsys, caplog) -> None:  # type: ignore[no-untyped-def]
    """One namespace whose ``pages`` is a file, not a folder: ``hicache inspect`` and ``hicache
    stats ROOT`` failed the whole report (NotADirectoryError), after the store's scan had logged
    an ERROR traceback. The namespace is listed as damaged, the others as ever, no traceback."""
    import asyncio
    import io
    import logging
    import shutil

    from hicache.observability.stats_view import run_stats

    good, bad = Namespace(model="good"), Namespace(model="bad")
    asyncio.run(_fill(tmp_path, good, 2))
    asyncio.run(_fill(tmp_path, bad, 1))
    shutil.rmtree(tmp_path / bad.digest / "pages")
    (tmp_path / bad.digest / "pages").write_text("not a folder")
    caplog.set_level(logging.WARNING)
    report = asyncio.run(inspect_store(str(tmp_path), verify="all", progress=False))
    assert report["namespaces"][good.digest]["pages"] == 2 and report["pages"] == 2 and report["corrupt"] == 0
    assert report["damaged_namespaces"] == 1
    damaged = report["namespaces"][bad.digest]
    assert damaged["model"] == "bad" and "not a folder" in damaged["damaged"], damaged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert main(["inspect", str(tmp_path)]) == 0
    assert "not a folder" in capsys.readouterr().out
    out = io.StringIO()
    assert run_stats(str(tmp_path), once=True, out=out) == 0
    lines = [line for line in out.getvalue().splitlines() if line.startswith(bad.digest[:12])]
    assert len(lines) == 1 and "damaged" in lines[0] and "not a folder" in lines[0], out.getvalue()
    assert (tmp_path / bad.digest / "pages").read_text() == "not a folder"  # inspecting changed nothing


def test_a_namespace_option_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """inspect opens every namespace of the store itself: a ``namespace`` among the options was
    passed again beside the one inspect gives, a ``TypeError`` traceback out of the CLI once the
    store held a namespace (an empty store took it silently)."""
    import asyncio

    asyncio.run(_fill(tmp_path, Namespace(model="cli"), 2))
    assert main(["inspect", str(tmp_path), "--json", "--options", '{"namespace": {"model": "x"}}']) == 2
    err = capsys.readouterr().err
    assert "namespace" in err and "Traceback" not in err
