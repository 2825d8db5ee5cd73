"""End to end with SGLang's real engine on the CPU: ``sglang.Engine`` with
``enable_hierarchical_cache`` and hicache as its L3 store (``dynamic`` backend; file store, and
s3 against the tests' moto server), SGLang's own scheduler deciding what to back up, what to
look up and what to prefetch.

Every engine is a subprocess running ``engine_run.py`` with a tiny local Llama (seeded
weights, no download, ``hicache.testing.tiny_model``), the torch-native attention
backend and greedy sampling, so equal KV means equal tokens. Only what SGLang runs on a GPU
alone is a test double (``sgl_doubles``: the ``sgl_kernel`` module, the device <-> host page
copies of the ``direct`` I/O backend, host-memory pinning; ``test_doubles.py`` checks the
copies against SGLang's pools). One engine costs about 15-20 s on two cores, so the first run
(which stores) is made once per module and the other tests start one engine each (two for
the s3 restore), on copies of its store where they change it:

* restore: a new engine serves the prompts from the stored pages, same text (file store,
  ``layer_first``; s3, ``page_first`` as SGLang runs it with direct I/O);
* the references: SGLang without hierarchical cache, and a negative control whose restored KV
  is noise (the text changes);
* failures: pages damaged on disk and an S3 endpoint that is down are misses (same text,
  nothing raised in SGLang's threads); a store root that cannot be opened fails the launch
  with hicache's error, as README "Use with SGLang" documents.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
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


def file_store(root: Path, **kw: Any) -> dict[str, Any]:
    """A spec's store: hicache's ``file`` backend at ``root`` (``kw``: module/class of a
    storage subclass, more extra-config keys)."""
    return {"backend": "file", "options": {"root": str(root)}, **kw}


def start_engine(tmp: Path, name: str, model: Path, store: dict[str, Any] | None,
                 **spec_kw: Any) -> tuple[subprocess.CompletedProcess[bytes], Path]:
    """``engine_run.py`` on a spec of the tests' prompts; its exit and where its output is."""
    spec = {
        "model": str(model), "prompts": PROMPTS, "page_size": PAGE, "max_new_tokens": NEW_TOKENS,
        "store": store, "wait_pages": PAGES if store is not None else 0, "out": str(tmp / f"{name}.out.json"),
        **spec_kw,
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
    return proc, Path(spec["out"])


def run_engine(tmp: Path, name: str, model: Path, store: dict[str, Any] | None, **spec_kw: Any) -> dict[str, Any]:
    proc, out = start_engine(tmp, name, model, store, **spec_kw)
    assert proc.returncode == 0, f"engine {name} failed:\n{log_of(tmp, name)[-6000:]}"
    return json.loads(out.read_text())


def log_of(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def computed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Run 1: a fresh store; everything computed, and SGLang's write-through backs every full
    page up to the host pool and from there to hicache's store."""
    tmp = tmp_path_factory.mktemp("run1")
    store = tmp / "store"
    first = run_engine(tmp, "run1", tiny, file_store(store))
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
    second = run_engine(tmp_path, "run2", tiny, file_store(store))
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
    bad = run_engine(tmp_path, "corrupt", tiny, file_store(copy, module="corrupting_storage", **{"class": "CorruptingStorage"}))
    assert bad["cached"] == HITS
    changed = [a != b for a, b in zip(bad["outputs"], first["outputs"])]
    assert all(changed), changed


def test_s3_store_serves_a_new_engine_the_same_text_page_first(
    tiny: Path, computed: Any, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """The restore flow with hicache's ``s3`` backend against the tests' moto server (on
    loopback, reached from SGLang's scheduler process through the endpoint and credentials
    in the extra config), in SGLang's default host layout, ``page_first``, with the ``direct``
    I/O backend (which SGLang runs as ``page_first_direct``, a page-major pool with one
    contiguous run per page): engine 1 computes and stores every page in the bucket and is
    shut down; engine 2 on the same bucket serves the prompts from it. Both write the text of
    the ``layer_first`` file-store run (and so of SGLang without hierarchical cache): the
    page-major copies to and from the device and hicache's page-major adapter, both ways,
    move the right KV."""
    _, first = computed
    store = {"backend": "s3", "options": s3_options}
    one = run_engine(tmp_path, "s3_run1", tiny, store, layout="page_first")
    assert (one["layout"], one["io_backend"]) == ("page_first_direct", "direct")
    assert one["cached"] == [0, 0]
    assert one["outputs"] == first["outputs"]
    assert one["pages"] == PAGES, f"{one['pages']} pages in the bucket, {PAGES} expected"
    two = run_engine(tmp_path, "s3_run2", tiny, store, layout="page_first")
    assert two["cached"] == HITS
    assert [(d or {}).get("storage") for d in two["details"]] == HITS, two["details"]
    assert all(d["device"] == 0 and d["host"] == 0 for d in two["details"]), two["details"]
    assert two["outputs"] == first["outputs"]
    assert two["pages"] == PAGES


def test_pages_damaged_on_disk_are_recomputed_not_served(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """A copy of run 1's store with one payload byte flipped in every page file: the pages are
    still indexed (a lookup is not a read), so SGLang's scheduler finds them and prefetches,
    but every read fails hicache's checksum and is a miss. The engine answers with the text
    computed from scratch (no storage hit, nothing of the noise), SGLang's threads raise
    nothing, and the recomputed pages replace the damaged ones in the store."""
    store, first = computed
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    pages = sorted(damaged.rglob("*.page"))
    assert len(pages) == PAGES
    bad: dict[Path, bytes] = {}
    for p in pages:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF  # mid-payload: the header and its checksum stay intact
        p.write_bytes(bytes(data))
        bad[p] = bytes(data)
    out = run_engine(tmp_path, "damaged", tiny, file_store(damaged))
    assert out["outputs"] == first["outputs"]
    assert out["cached"] == [0, 0]
    assert [(d or {}).get("storage", 0) for d in out["details"]] == [0, 0], out["details"]
    log = log_of(tmp_path, "damaged")
    assert "failed verification" in log  # hicache said why: the page was a miss, not garbage
    assert "Traceback" not in log, log[-6000:]
    replaced = [p for p in pages if p.exists() and p.read_bytes() != bad[p]]
    assert len(replaced) == sum(HITS) // PAGE, (len(replaced), sum(HITS) // PAGE)


def test_s3_store_that_is_down_costs_only_recompute(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """An S3 endpoint nobody listens on (a server that stopped): as README says, the store
    still opens (an unreachable store misses and probes), every lookup and write of SGLang's
    controller fails fast and is a miss or a failed write, and the engine answers with the
    computed text, nothing cached, its threads raising nothing; its shutdown is not held up by
    the writes it could not make."""
    _, first = computed
    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = {
        "backend": "s3",
        "options": {
            "url": "s3://hicache-down/kv",
            "storage_options": {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
                                "client_kwargs": {"region_name": "us-east-1"}},
            "request_timeout": 1.0, "call_timeout": 3.0, "retries": 0,
        },
    }
    out = run_engine(tmp_path, "s3_down", tiny, down, wait_pages=0)
    assert out["outputs"] == first["outputs"]
    assert out["cached"] == [0, 0]
    assert out["pages"] == 0
    log = log_of(tmp_path, "s3_down")
    assert "hicache SGLang storage: backend 's3'" in log  # attached: the store opened
    assert "Traceback" not in log, log[-6000:]


def test_a_store_root_that_cannot_be_opened_fails_the_launch_naming_the_backend(
    tiny: Path, tmp_path: Path
) -> None:
    """The store's root is a regular file: the store cannot open, and (as README "Use with
    SGLang" says) the attach fails with the cause, so SGLang's launch fails, with hicache's
    ``SGLangAttachError`` naming the backend and the root, rather than a server without its
    store."""
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the store's directory should be\n")
    proc, out = start_engine(tmp_path, "unopenable", tiny, file_store(root))
    log = log_of(tmp_path, "unopenable")
    # SGLang's scheduler reports the failed start and the launcher takes its process tree down
    assert proc.returncode != 0 and not out.exists(), log[-6000:]
    assert "SGLangAttachError: hicache backend 'file' could not open its store" in log, log[-6000:]
    assert f"cannot use root {str(root)!r}" in log, log[-6000:]
