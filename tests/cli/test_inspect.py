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
