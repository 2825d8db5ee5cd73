"""End to end with a real vLLM (the CPU build): engines in their own processes generate text
from KV that hicache stored and restored.

Every engine is a subprocess running ``engine_run.py`` with a tiny local Llama (seeded
weights, no download) and greedy sampling, so equal KV means equal tokens (but at a tied step,
``assert_computed_text``). One engine start costs 20-60 s on two cores, so engines are shared:
``computed`` (the first run, which stores) is made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.testing.tiny_model import make_tiny_llama

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BLOCK = 32
ENGINE_TIMEOUT = 420

# three prompts: 3, 2 and 4 full blocks that hicache can serve (one token is always computed)
PROMPTS = [
    [(i * 7919 + 13) % 500 + 3 for i in range(3 * BLOCK + 5)],
    [(i * 104729 + 7) % 500 + 3 for i in range(2 * BLOCK + 1)],
    [(i * 31 + 101) % 500 + 3 for i in range(4 * BLOCK + 20)],
]
HITS = [3 * BLOCK, 2 * BLOCK, 4 * BLOCK]
TOP = 5  # logprobs the computed run records per step


def assert_computed_text(got: list[list[int]], computed: dict[str, Any], prompts: list[int] | None = None) -> None:
    """``got`` (the outputs of ``prompts``, all by default) is the text computed from scratch.

    Greedy sampling over equal KV gives equal tokens, except at a step where the computed run's
    two most likely tokens were tied: their bf16 logits were equal (the first 12 tokens of
    ``PROMPTS`` have two such steps), so a difference of one rounding step anywhere in the
    forward picks the other one, and the texts part there. A prompt may part from the computed
    text only at such a step, with a token exactly as likely as the computed one there; after
    it the texts are not comparable (another context). Wrong KV does not get through: a single
    block of one layer holding another page's KV, or zeros, changes this model's second token
    of the first prompt, not only a tied one."""
    prompts = list(range(len(computed["outputs"]))) if prompts is None else prompts
    assert len(got) == len(prompts), (got, prompts)
    for i, out in zip(prompts, got):
        want, steps = computed["outputs"][i], computed["logprobs"][i]
        assert len(out) == len(want), f"prompt {i}: {len(out)} tokens, computed {len(want)}"
        at = next((k for k, (a, b) in enumerate(zip(out, want)) if a != b), None)
        if at is None:
            continue
        step = steps[at]
        assert step.get(str(out[at])) == step[str(want[at])], (
            f"prompt {i} parts from the computed text at token {at}, where the computed run's "
            f"choice was not tied with it: {out} != {want} (computed logprobs there: {step})")


def connector(extra: dict[str, Any], cls: str = "HiCacheConnector", module: str = "hicache.integrations.vllm") -> dict[str, Any]:
    return {
        "kv_connector": cls,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def file_store(root: Path) -> dict[str, Any]:
    return {"backend": "file", "backend_options": {"root": str(root)}}


def engine_cmd(tmp: Path, name: str, spec: dict[str, Any]) -> tuple[list[str], Path, Path, dict[str, str]]:
    spec = dict(spec, out=str(tmp / f"{name}.out.json"), sys_path=[str(REPO), str(HERE)])
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    if not spec.get("multiprocess"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process per engine: faster to start
    return [sys.executable, str(HERE / "engine_run.py"), str(spec_path)], Path(spec["out"]), tmp / f"{name}.log", env


def run_engine(tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    cmd, out, log, env = engine_cmd(tmp, name, spec)
    with log.open("wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT, cwd=tmp)
    assert proc.returncode == 0, f"engine {name} failed:\n{log.read_text(errors='replace')[-6000:]}"
    return json.loads(out.read_text())


def spec_for(model: Path, store: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    return {"model": str(model), "connector": None if store is None else connector(store), "prompts": PROMPTS,
            "block_size": BLOCK, "max_tokens": 12, **kw}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def computed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Run 1: a fresh store, everything computed and stored."""
    tmp = tmp_path_factory.mktemp("run1")
    store = tmp / "store"
    # with the logprobs, to tell a tied step from a wrong token (assert_computed_text)
    result = run_engine(tmp, "run1", spec_for(tiny, file_store(store), logprobs=TOP))
    phase = result["phases"][0]
    assert phase["cached"] == [0, 0, 0]
    assert all(len(o) == 12 for o in phase["outputs"])
    return store, phase


def test_fresh_engine_restores_from_hicache_and_writes_the_same_text(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """Run 2, a new engine process (scheduler and worker in separate processes here) on the
    same store: every full block but the last token's comes from hicache, same text."""
    store, first = computed
    result = run_engine(tmp_path, "run2", spec_for(tiny, file_store(store), multiprocess=True))
    phase = result["phases"][0]
    assert phase["cached"] == HITS
    assert_computed_text(phase["outputs"], first)


def test_negative_control_corrupted_restore_changes_the_text(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """The same restore, with the restored KV overwritten by noise: the text must change, or
    the test above could not tell restored KV from recomputed KV."""
    store, first = computed
    spec = spec_for(tiny, None)
    spec["connector"] = connector(file_store(store), "CorruptingConnector", "corrupting_connector")
    phase = run_engine(tmp_path, "corrupt", spec)["phases"][0]
    assert phase["cached"] == HITS
    changed = [a != b for a, b in zip(phase["outputs"], first["outputs"])]
    assert all(changed), changed


def test_pages_damaged_on_disk_are_recomputed_not_served(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """Every stored page with one payload byte flipped. The lookup still finds them (existence
    is not a read), but every read fails hicache's checksum: the worker reports the blocks,
    vLLM recomputes them, the text is the computed one, and the recomputed pages replace the
    bad ones in the store."""
    store, first = computed
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    pages = [p for p in damaged.rglob("*") if p.is_file() and p.name != "manifest.json" and p.stat().st_size > 4096]
    assert pages
    bad: dict[Path, bytes] = {}
    for p in pages:
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF
        p.write_bytes(bytes(data))
        bad[p] = bytes(data)
    phase = run_engine(tmp_path, "damaged", spec_for(tiny, file_store(damaged)))["phases"][0]
    assert_computed_text(phase["outputs"], first)
    assert "Recovered from KV load failure" in (tmp_path / "damaged.log").read_text(errors="replace")
    # every page that was read failed verification, was dropped, recomputed and saved again
    # (the one page past the prompts, made of generated tokens, was never asked for)
    replaced = [p for p in pages if p.exists() and p.read_bytes() != bad[p]]
    assert len(replaced) == sum(HITS) // BLOCK


def test_a_store_slower_than_recomputing_is_not_waited_for(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """A store whose calls take 0.3 s (``slow_store_connector``) against an engine that
    recomputes a page in microseconds: the first request, before any read was seen, is
    claimed and read; once the workers reported that read, the scheduler claims no more
    storage hits (``hit_pages_cut_recompute``) and vLLM computes the next prompts, with the
    same text as computed from scratch."""
    store, first = computed
    slow_root = tmp_path / "store"
    shutil.copytree(store, slow_root)
    slow = {"backend": "slow-file", "backend_options": {"root": str(slow_root), "latency_ms": 300},
            "recompute_tokens_per_s": 1e6}
    spec = spec_for(tiny, None, phases=[{"prompts": PROMPTS[:1]}, {"prompts": PROMPTS[1:]}])
    spec["connector"] = connector(slow, module="slow_store_connector")
    one, two = run_engine(tmp_path, "slow", spec)["phases"]
    assert one["cached"] == HITS[:1]
    assert two["cached"] == [0, 0]
    assert_computed_text(one["outputs"] + two["outputs"], first)


def test_store_that_is_down_costs_only_recompute(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """An S3 store nobody listens on: every lookup and write fails fast, requests succeed with
    the computed text and nothing cached."""
    _, first = computed
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = {
        "backend": "s3",
        "backend_options": {
            "url": "s3://hicache-down/kv",
            "storage_options": {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
            "request_timeout": 1.0, "call_timeout": 3.0, "retries": 0,
        },
    }
    phase = run_engine(tmp_path, "down", spec_for(tiny, down))["phases"][0]
    assert phase["cached"] == [0, 0, 0]
    assert_computed_text(phase["outputs"], first)


def test_two_engines_share_one_store(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """Two engine processes at once on one store: each computes its own prompts, then serves
    the other's from hicache with the other's text."""
    _, first = computed
    store = file_store(tmp_path / "shared")
    a_done, b_done = str(tmp_path / "a.done"), str(tmp_path / "b.done")
    specs = {
        "a": spec_for(tiny, store, phases=[{"prompts": PROMPTS[:2], "signal": a_done},
                                           {"prompts": [PROMPTS[2]], "wait_for": b_done}]),
        "b": spec_for(tiny, store, phases=[{"prompts": [PROMPTS[2]], "signal": b_done},
                                           {"prompts": PROMPTS[:2], "wait_for": a_done}]),
    }
    procs = {}
    for name, spec in specs.items():
        cmd, out, log, env = engine_cmd(tmp_path, name, spec)
        procs[name] = (subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path), out, log)
    try:
        for name, (proc, _, log) in procs.items():
            rc = proc.wait(timeout=ENGINE_TIMEOUT)
            assert rc == 0, f"engine {name} failed:\n{log.read_text(errors='replace')[-6000:]}"
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    a = json.loads(procs["a"][1].read_text())["phases"]
    b = json.loads(procs["b"][1].read_text())["phases"]
    assert a[0]["cached"] == [0, 0] and b[0]["cached"] == [0]
    assert a[1]["cached"] == [HITS[2]] and b[1]["cached"] == HITS[:2]
    for got, prompts in ((a[0], [0, 1]), (a[1], [2]), (b[0], [2]), (b[1], [0, 1])):
        assert_computed_text(got["outputs"], first, prompts)


def test_an_engine_that_splits_its_blocks_into_kernel_blocks_is_refused_at_start(tmp_path: Path) -> None:
    """vLLM splits each 64-token block into 32-token kernel blocks when its attention backend
    takes only those (here the CPU backend made to, as FlashInfer does to ``--block-size 128``
    on a GPU). Such an engine's pages are not an unsplit engine's (served across, they gave
    other text), and the scheduler cannot tell them apart: the engine stops at start with
    the connector's reason, not with a KV size "the namespace says"."""
    model = make_tiny_llama(tmp_path / "tiny-2kv", kv_heads=2)
    cmd, _, log, env = engine_cmd(tmp_path, "split", spec_for(model, file_store(tmp_path / "store"), block_size=64,
                                                             kernel_block_size=32))
    with log.open("wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT, cwd=tmp_path)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0
    assert "does not support vLLM's kernel blocks" in text and "--block-size 32" in text, text[-6000:]


def test_host_tier_serves_a_prompt_after_vllm_freed_its_blocks(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """One engine without vLLM's own prefix cache (its blocks are freed when a request ends):
    the prompts computed once are asked again after the store was emptied, so the cached
    tokens can only come from hicache's host pool, and the text is the computed one."""
    _, first = computed
    root = tmp_path / "store"
    stored, go = str(tmp_path / "stored"), str(tmp_path / "go")
    spec = spec_for(tiny, file_store(root), prefix_caching=False,
                    phases=[{"prompts": PROMPTS, "signal": stored}, {"prompts": PROMPTS, "wait_for": go}])
    cmd, out, log, env = engine_cmd(tmp_path, "host", spec)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not os.path.exists(stored) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the last storage writes of phase 1 land
        pages = [p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json" and p.stat().st_size > 4096]
        assert pages, f"nothing was stored:\n{log.read_text(errors='replace')[-4000:]}"
        for p in pages:
            p.unlink()
        Path(go).write_text("go")
        rc = proc.wait(timeout=ENGINE_TIMEOUT)
        assert rc == 0, f"engine failed:\n{log.read_text(errors='replace')[-6000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    phases = json.loads(out.read_text())["phases"]
    assert phases[0]["cached"] == [0, 0, 0]
    assert_computed_text(phases[0]["outputs"], first)
    assert phases[1]["cached"] == HITS
    assert_computed_text(phases[1]["outputs"], first)


def test_reset_connector_cache_forgets_what_hicache_holds(tiny: Path, computed: Any, tmp_path: Path) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (what a weight update does): the
    prompts computed before the reset are computed again after it, none of their tokens comes
    from hicache's host tier or store (their KV would be of the old weights)."""
    _, first = computed
    spec = spec_for(tiny, file_store(tmp_path / "store"),
                    phases=[{"prompts": PROMPTS}, {"prompts": PROMPTS, "reset_before": True}])
    before, after = run_engine(tmp_path, "reset", spec)["phases"]
    assert before["cached"] == [0, 0, 0]
    assert_computed_text(before["outputs"], first)
    assert after["reset"] is True
    assert after["cached"] == [0, 0, 0]
    assert_computed_text(after["outputs"], first)
