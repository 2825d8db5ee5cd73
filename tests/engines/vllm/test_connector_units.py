"""The connector's engine-free halves against a real file store and real torch tensors shaped
like vLLM's CPU KV cache (blocks x heads x block_size x (K|V content))."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hicache.errors import ConfigError
from hicache.integrations.vllm.naming import KVGeometry, PageKeyChain, deployment_namespace
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.scheduler_side import SchedulerSide
from hicache.integrations.vllm.store_io import StoreIO
from hicache.integrations.vllm.worker_side import PageTransfer, WorkerSide

BS = 32
GEOM = KVGeometry(block_size=BS, num_layers=2, num_kv_heads=1, head_size=64, dtype="bfloat16", block_nbytes=BS * 128 * 2)
TOKENS = [(i * 37 + 11) % 500 for i in range(5 * BS + 3)]


def namespace(**kw: object):
    args = dict(model="m", revision=None, geometry=GEOM, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    args.update(kw)
    return deployment_namespace(**args)  # type: ignore[arg-type]


def kv_layers(seed: int | None, blocks: int = 16) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(blocks, 1, BS, 128, dtype=torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 1, BS, 128, generator=g).to(torch.bfloat16) for _ in range(2)]


def worker(root: Path, layers: list[torch.Tensor], host_pages: int = 64) -> WorkerSide:
    w = WorkerSide(GEOM, StoreIO("file", {"root": str(root)}, [namespace()], name="t-worker"),
                   host_pages=host_pages, load_timeout_s=10.0)
    w.register([(f"layer.{i}", t) for i, t in enumerate(layers)])
    return w


def stored(root: Path, seed: int, num_pages: int) -> tuple[list[torch.Tensor], list[str]]:
    """KV layers from ``seed`` whose blocks 0..num_pages-1 a worker saved under ``root``, and
    their keys (the worker is closed: every write reached the store)."""
    src = kv_layers(seed)
    keys = PageKeyChain(BS).extend(TOKENS, num_pages)
    w = worker(root, src)
    w.save([PageTransfer("r", tuple(keys), tuple(range(num_pages)))])
    assert w.close(timeout=30) == 0
    return src, keys


def load(w: WorkerSide, transfers: list[PageTransfer]) -> set[int]:
    w.start(transfers)
    for i in range(GEOM.num_layers):
        w.wait_layer(f"layer.{i}")
    w.finish_step()
    return w.take_failed_blocks()


# ---------------------------------------------------------------- keys and namespace
def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    mine = PageKeyChain(BS, "tenant-a").extend(TOKENS, 5)
    code = (
        "from hicache.integrations.vllm.naming import PageKeyChain;"
        f"print(','.join(PageKeyChain({BS}, 'tenant-a').extend({TOKENS!r}, 5)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().split(",") == mine


def test_salt_and_tokens_change_keys_and_chains_extend_consistently() -> None:
    plain = PageKeyChain(BS).extend(TOKENS, 5)
    assert PageKeyChain(BS, "").extend(TOKENS, 5) == plain
    salted = PageKeyChain(BS, "s").extend(TOKENS, 5)
    assert not set(plain) & set(salted)
    chain = PageKeyChain(BS)
    assert chain.extend(TOKENS, 2) == plain[:2]
    assert chain.extend(TOKENS, 99) == plain  # no more than the tokens fill
    other = list(TOKENS)
    other[BS] += 1  # second block differs: first key equal, the rest differ
    changed = PageKeyChain(BS).extend(other, 5)
    assert changed[0] == plain[0] and not set(changed[1:]) & set(plain)


def test_namespace_changes_with_what_makes_kv_incompatible() -> None:
    base = namespace().digest
    variants = [
        namespace(model="other"), namespace(revision="r2"), namespace(tp_rank=1, tp_size=2), namespace(pp_size=2),
        namespace(salt="deploy-b"),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "dtype": "float16"})),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "block_size": 64})),
        namespace(geometry=KVGeometry(**{**GEOM.__dict__, "num_layers": 3})),
    ]
    digests = {v.digest for v in variants}
    assert base not in digests and len(digests) == len(variants)
    assert namespace().digest == base


def test_options_refuse_unknown_keys_and_bad_values() -> None:
    assert ConnectorOptions.from_extra_config(None) == ConnectorOptions()
    with pytest.raises(ConfigError, match="host_page"):
        ConnectorOptions.from_extra_config({"host_page": 3})
    for bad in ({"host_pages": 0}, {"host_pages": True}, {"load_timeout_s": -1}, {"lookup_wait_s": float("nan")},
                {"backend": ""}, {"backend_options": []}):
        with pytest.raises(ConfigError):
            ConnectorOptions.from_extra_config(bad)
    with pytest.raises(ConfigError, match="no option"):
        StoreIO("file", {"rooot": "/nonexistent"}, [namespace()], name="t")


# ---------------------------------------------------------------- worker: save, load
def test_saved_pages_load_back_bit_exact_in_a_new_worker(tmp_path: Path) -> None:
    src = kv_layers(seed=1)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    w1 = worker(tmp_path, src)
    w1.save([PageTransfer("r", tuple(keys[:3]), (4, 9, 2)), PageTransfer("q", tuple(keys[3:5]), (11, 0))])
    assert w1.close(timeout=30) == 0
    assert w1.stats["pages_saved"] == 5

    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        failed = load(w2, [PageTransfer("r", tuple(keys[:5]), (1, 2, 3, 4, 5))])
        assert failed == set()
        for layer_src, layer_dst in zip(src, dst):
            for s, d in zip((4, 9, 2, 11, 0), (1, 2, 3, 4, 5)):
                assert torch.equal(layer_src[s], layer_dst[d])
        assert w2.stats["pages_loaded"] == 5
        # the second time the pages come from the host pool, not from storage
        assert load(w2, [PageTransfer("r", tuple(keys[:2]), (6, 7))]) == set()
        assert w2.stats["pages_from_host"] == 2
        assert torch.equal(dst[1][6], src[1][4])
    finally:
        w2.close(timeout=10)


def test_a_damaged_page_fails_with_the_pages_after_it_and_writes_nothing(tmp_path: Path) -> None:
    src, keys = stored(tmp_path, seed=2, num_pages=4)
    pages = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > GEOM.page_nbytes)
    assert len(pages) == 4
    # damage the page of keys[1]: find its file by the payload it holds, flip one payload byte
    payload = torch.cat([t[1].reshape(-1).view(torch.uint8) for t in src]).numpy().tobytes()
    target = next(p for p in pages if payload in p.read_bytes())
    data = bytearray(target.read_bytes())
    data[data.find(payload) + 100] ^= 0x55
    target.write_bytes(bytes(data))

    dst = kv_layers(seed=None)
    w2 = worker(tmp_path, dst)
    try:
        failed = load(w2, [PageTransfer("r", tuple(keys), (8, 9, 10, 11)), PageTransfer("x", ("missing-key",), (12,))])
        assert failed == {9, 10, 11, 12}
        assert torch.equal(dst[0][8], src[0][0])
        for b in (9, 10, 11, 12):
            assert not dst[0][b].any() and not dst[1][b].any()  # nothing written into failed blocks
    finally:
        w2.close(timeout=10)


def test_saves_never_block_when_the_host_pool_is_pinned_full(tmp_path: Path) -> None:
    src = kv_layers(seed=3)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    w = worker(tmp_path, src, host_pages=2)
    pinned = [w.pool.alloc_pin(), w.pool.alloc_pin()]
    t = time.monotonic()
    w.save([PageTransfer("r", tuple(keys), (0, 1, 2, 3, 4))])
    assert time.monotonic() - t < 1.0
    assert w.stats["saves_dropped"] == 5
    for slot in pinned:
        w.pool.unpin(slot)
    w.save([PageTransfer("r", tuple(keys[:2]), (0, 1))])
    assert w.close(timeout=30) == 0
    assert w.stats["pages_saved"] == 2


# ---------------------------------------------------------------- scheduler
def scheduler(backend: str, options: dict, **kw: float) -> SchedulerSide:
    return SchedulerSide(StoreIO(backend, options, [namespace()], name="t-sched"), block_size=BS,
                         lookup_wait_s=kw.get("wait", 5.0), lookup_timeout_s=kw.get("timeout", 5.0))


def test_scheduler_hits_stored_pages_and_plans_loads_and_saves(tmp_path: Path) -> None:
    _, keys = stored(tmp_path, seed=4, num_pages=3)
    keys = PageKeyChain(BS).extend(TOKENS, 5)
    s = scheduler("file", {"root": str(tmp_path)})
    try:
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS
        assert s.matched_tokens("a", TOKENS, None, 0) == 3 * BS  # asked again: same answer
        assert s.matched_tokens("b", TOKENS, "other-tenant", 0) == 0  # salted: other keys
        assert s.matched_tokens("c", TOKENS[: 3 * BS], None, 0) == 2 * BS  # one token is computed
        assert s.matched_tokens("d", TOKENS, None, BS) == 2 * BS  # vLLM holds block 0 already
        blocks = list(range(100, 106))
        s.allocated("d", blocks, 2 * BS)
        plan = s.plan_step([("d", 3 * BS, len(TOKENS), TOKENS, blocks)])
        assert plan.loads == [PageTransfer("d", tuple(keys[1:3]), (101, 102))]
        # blocks 3 and 4 became full this step and were not loaded: they are saved
        assert plan.saves == [PageTransfer("d", tuple(keys[3:5]), (103, 104))]
        assert s.plan_step([("d", len(TOKENS), len(TOKENS) + 1, TOKENS, blocks)]).saves == []
        # vLLM recomputes from block 2 on (its load failed): blocks 2.. are saved again
        again = s.plan_step([("d", 2 * BS, len(TOKENS), TOKENS, blocks)]).saves
        assert again == [PageTransfer("d", tuple(keys[2:5]), (102, 103, 104))]
        s.finished("d")
        assert s.plan_step([("d", 0, len(TOKENS), TOKENS, blocks)]).saves == []
    finally:
        s.close(timeout=10)


def test_scheduler_with_a_store_that_is_down_answers_miss_without_raising() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scheduler("s3", {"url": "s3://nobody/kv", "storage_options": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                                          "key": "k", "secret": "s"},
                          "request_timeout": 1.0, "call_timeout": 2.0, "retries": 0}, wait=0.001, timeout=10.0)
    try:
        answers = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            a = s.matched_tokens("a", TOKENS, None, 0)
            answers.append(a)
            if a is not None:
                break
            time.sleep(0.05)
        assert answers[-1] == 0
        assert all(a is None for a in answers[:-1])
    finally:
        s.close(timeout=10)


def test_scheduler_lookup_past_its_timeout_is_a_miss(tmp_path: Path) -> None:
    s = scheduler("file", {"root": str(tmp_path)}, wait=0.0, timeout=0.0)
    try:
        # the lookup is submitted; with no time to wait and no time allowed it is a miss or an
        # immediate answer, never "ask again" forever
        first = s.matched_tokens("a", TOKENS, None, 0)
        assert first in (0, None)
        assert s.matched_tokens("a", TOKENS, None, 0) == 0
    finally:
        s.close(timeout=10)


def test_a_read_slower_than_the_load_timeout_fails_its_blocks_and_writes_nothing(tmp_path: Path) -> None:
    import asyncio

    _, keys = stored(tmp_path, seed=5, num_pages=2)

    dst = kv_layers(seed=None)
    w2 = WorkerSide(GEOM, StoreIO("file", {"root": str(tmp_path)}, [namespace()], name="t-slow"),
                    host_pages=8, load_timeout_s=0.5)
    w2.register([(f"layer.{i}", t) for i, t in enumerate(dst)])
    backend = w2.store.primary
    real_read = backend._read

    async def slow_read(pages, buffers):  # type: ignore[no-untyped-def]
        await asyncio.sleep(3.0)
        return await real_read(pages, buffers)

    backend._read = slow_read  # type: ignore[method-assign]
    try:
        t = time.monotonic()
        assert load(w2, [PageTransfer("r", tuple(keys), (3, 4))]) == {3, 4}
        assert time.monotonic() - t < 2.5
        assert not dst[0][3:5].any() and not dst[1][3:5].any()
        assert w2.pool.stats()["pinned"] == 0  # nothing left pinned by the failed load
    finally:
        w2.close(timeout=10)


def test_a_closed_worker_ignores_further_steps(tmp_path: Path) -> None:
    src, keys = stored(tmp_path, seed=6, num_pages=1)
    w = worker(tmp_path, src)
    assert w.close(timeout=10) == 0
    assert w.close(timeout=10) == 0  # twice is fine
    w.start([PageTransfer("r", tuple(keys), (3,))])
    w.wait_layer("layer.0")
    w.save([PageTransfer("r", tuple(keys), (3,))])
    w.finish_step()
    assert w.take_failed_blocks() == set()


def test_kv_first_layers_round_trip_block_by_block(tmp_path: Path) -> None:
    """FlashAttention's per-layer tensors are [2, blocks, block_size, heads, dim]: a block is
    then two pieces, K and V, and still moves as one page."""
    g = torch.Generator().manual_seed(7)
    src = [torch.randn(2, 16, BS, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    keys = PageKeyChain(BS).extend(TOKENS, 3)
    w1 = worker(tmp_path, src)
    w1.save([PageTransfer("r", tuple(keys), (5, 0, 9))])
    assert w1.close(timeout=30) == 0
    dst = [torch.zeros(2, 16, BS, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    w2 = worker(tmp_path, dst)
    try:
        assert load(w2, [PageTransfer("r", tuple(keys), (1, 2, 3))]) == set()
        for a, b in zip(src, dst):
            for s, d in zip((5, 0, 9), (1, 2, 3)):
                assert torch.equal(a[:, s], b[:, d])
        assert torch.count_nonzero(dst[0][:, 4]) == 0
    finally:
        w2.close(timeout=10)
    with pytest.raises(ValueError, match="holds no block"):
        worker(tmp_path, [torch.zeros(3, 16, BS, 64, dtype=torch.bfloat16) for _ in range(2)])


def test_lora_and_multimodal_inputs_root_their_own_key_chains() -> None:
    """Same tokens under another LoRA adapter or with another image are other KV."""
    from types import SimpleNamespace as NS

    from hicache.integrations.vllm.connector import request_salt

    def req(salt=None, lora=None, images=()):
        feats = [NS(identifier=i, mm_position=NS(offset=4, length=8)) for i in images]
        return NS(cache_salt=salt, lora_request=lora, mm_features=feats)

    assert request_salt(req()) is None and request_salt(req("s")) == "s"  # keys kept as they were
    a, b = NS(lora_name="a", lora_path="/a"), NS(lora_name="b", lora_path="/b")
    salts = [request_salt(r) for r in (req(), req("s"), req(lora=a), req(lora=b), req(images=["x"]),
                                       req(images=["y"]), req("s", lora=a, images=["x"]))]
    assert len(set(salts)) == len(salts)
    chains = {tuple(PageKeyChain(BS, s).extend(TOKENS, 2)) for s in salts}
    assert len(chains) == len(salts)
