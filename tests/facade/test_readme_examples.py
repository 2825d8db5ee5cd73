"""The README's Python examples, run as a new user copies them: the text is read from README.md,
so an example that stops working (a renamed call, a config path that moved) fails here.

Each runs in a temporary folder holding a copy of ``configs/`` (the quickstart names
``configs/default.toml``, whose file store is ``./.hicache/store``), with only the names the
example leaves to the reader filled in (``token_ids``, ``host_pool``, ``keys``) and its store
root moved under the temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hicache.testing import ArrayHostPool

REPO = Path(__file__).resolve().parents[2]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def _block(marker: str) -> str:
    (block,) = [b for b in _python_blocks() if marker in b]
    return block


@pytest.fixture
def in_a_user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("HICACHE__")]:
        monkeypatch.delenv(name)  # the example as written, not a deployment's overrides
    return tmp_path


async def _quickstart(token_ids: list[int]) -> Any:
    """The README's first example in a coroutine (it uses ``async with`` at top level); returns
    its handle ``h``."""
    source = "async def example(token_ids):\n" + textwrap.indent(_block("HiCache.from_config"), "    ") + "    return h\n"
    scope: dict[str, Any] = {}
    exec(compile(source, "README.md (Using it)", "exec"), scope)
    return await scope["example"](token_ids)


async def test_quickstart_runs_as_written_and_a_restart_reads_its_pages(in_a_user_folder: Path) -> None:
    tokens = [1_000 + i for i in range(600)]  # above the default prefetch threshold (256 tokens)
    first = await _quickstart(tokens)
    assert first.prefix_len == 0 and first.kv_indices.numel() == len(tokens)
    assert (in_a_user_folder / ".hicache" / "store").is_dir()
    second = await _quickstart(tokens)  # a new cache on the same file store
    assert second.hits["storage"] == len(tokens) // 16 * 16, second.hits
    assert second.prefix_len == len(tokens) // 16 * 16


def test_storage_alone_runs_as_written(in_a_user_folder: Path) -> None:
    block = _block("create_storage")
    assert "/var/cache/kv" in block
    root = in_a_user_folder / "kv"
    scope: dict[str, Any] = {"host_pool": ArrayHostPool(8, 16), "keys": [f"page-{i}" for i in range(4)]}
    exec(compile(block.replace("/var/cache/kv", str(root)), "README.md (Storage alone)", "exec"), scope)
    store = scope["store"]
    try:
        assert scope["hits"].kv_hit_pages == 0
        assert root.is_dir()
    finally:
        store.close()
