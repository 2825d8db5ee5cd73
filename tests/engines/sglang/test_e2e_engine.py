"""End to end with SGLang's real engine on the CPU: ``sglang.Engine`` with
``enable_hierarchical_cache`` and hicache as its L3 store (``dynamic`` backend, file store),
SGLang's own scheduler deciding what to back up, what to look up and what to prefetch.

Every engine is a subprocess running ``engine_run.py`` with a tiny local Llama (seeded
weights, no download, ``hicache.testing.tiny_model``), the torch-native attention
backend and greedy sampling, so equal KV means equal tokens. Only what SGLang runs on a GPU
alone is a test double (``sgl_doubles``: the ``sgl_kernel`` module, the device <-> host page
copy ``transfer_kv_direct``, host-memory pinning). One engine costs about 20 s on two cores,
so the first run (which stores) is made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache.testing.tiny_model import make_tiny_llama

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PAGE = 16
NEW_TOKENS = 8
ENGINE_TIMEOUT = 420

# Two prompts, 18 and 16 full pages and a partial one. SGLang looks a prompt up in storage
# only for at least 256 tokens (its default prefetch threshold), never its last token, and
# in whole pages: those are the storage hits of a second engine.
PROMPTS = [
    [(i * 7919 + 13) % 500 + 3 for i in range(18 * PAGE + 12)],
    [(i * 104729 + 7) % 500 + 3 for i in range(16 * PAGE + 14)],
]
HITS = [(len(p) - 1) // PAGE * PAGE for p in PROMPTS]
#: full pages of KV a request leaves (its prompt and every generated token but the last)
PAGES = sum((len(p) + NEW_TOKENS - 1) // PAGE for p in PROMPTS)


def run_engine(tmp: Path, name: str, model: Path, store: Path | None, **store_kw: Any) -> dict[str, Any]:
    spec = {
        "model": str(model), "prompts": PROMPTS, "page_size": PAGE, "max_new_tokens": NEW_TOKENS,
        "store": None if store is None else {"root": str(store), **store_kw},
        "wait_pages": PAGES if store is not None else 0, "out": str(tmp / f"{name}.out.json"),
    }
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "backends"), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    # SGLang JIT-builds its C++ page hasher (torch's cpp_extension): once per test venv, not in
    # a per-user cache that other checkouts' venvs rebuild under a shared lock
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    log = tmp / f"{name}.log"
    with log.open("wb") as f:
        proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(spec_path)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT, cwd=tmp)
    assert proc.returncode == 0, f"engine {name} failed:\n{log.read_text(errors='replace')[-6000:]}"
    return json.loads(Path(spec["out"]).read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def computed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Run 1: a fresh store; everything computed, and SGLang's write-through backs every full
    page up to the host pool and from there to hicache's store."""
    tmp = tmp_path_factory.mktemp("run1")
    store = tmp / "store"
    first = run_engine(tmp, "run1", tiny, store)
    assert first["cached"] == [0, 0]
    assert all(len(o) == NEW_TOKENS for o in first["outputs"])
    assert first["pages"] == PAGES, f"{first['pages']} pages stored, {PAGES} expected"
    return store, first


def test_new_engine_generates_the_same_text_from_pages_it_read_from_the_store(
    tiny: Path, computed: Any, tmp_path: Path
) -> None:
    """Run 2, after run 1's engine was shut down: a new engine on the same store. SGLang's
    scheduler finds each prompt's pages in hicache (nothing on its device or host tiers),
    prefetches them into the host pool, loads them onto the device, computes only the rest,
    and writes the same text."""
    store, first = computed
    second = run_engine(tmp_path, "run2", tiny, store)
    assert second["cached"] == HITS
    assert [(d or {}).get("storage") for d in second["details"]] == HITS, second["details"]
    assert all(d["device"] == 0 and d["host"] == 0 for d in second["details"]), second["details"]
    assert second["outputs"] == first["outputs"]
    assert second["pages"] == PAGES  # the same pages: nothing new to store


def test_engine_without_hierarchical_cache_writes_the_same_text(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """The reference: SGLang without hierarchical cache (no host tier, no store)."""
    _, first = computed
    plain = run_engine(tmp_path, "plain", tiny, None)
    assert plain["cached"] == [0, 0]
    assert plain["outputs"] == first["outputs"]


def test_negative_control_corrupted_reads_change_the_text(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """The same restore as run 2 (on a copy of the store), with every page read overwritten
    by noise in the host pool (``corrupting_storage``): the text must change, or the test
    above could not tell KV read from the store from KV computed again."""
    store, first = computed
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    bad = run_engine(tmp_path, "corrupt", tiny, copy, module="corrupting_storage", **{"class": "CorruptingStorage"})
    assert bad["cached"] == HITS
    changed = [a != b for a, b in zip(bad["outputs"], first["outputs"])]
    assert all(changed), changed
