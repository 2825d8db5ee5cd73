"""hicache's tier behind vLLM's own ``TieringOffloadingManager`` on the ``file`` backend: a
restart and another process find the chunks, bytes come back exact, a damaged page is a miss
for that chunk only, the disk stays bounded, and engines that must not share KV do not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _tiering import BLOCK, Engine, block_keys, payload, tier_config
from vllm.v1.kv_offload.base import LookupResult

from hicache.integrations.vllm.tier_keys import page_key
from hicache_backends.file.layout import page_id

HERE = Path(__file__).resolve().parent
TOKENS = list(range(1000, 1000 + 8 * BLOCK))


def test_fresh_engine_loads_exact_bytes(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys, jobs=3)
        stats = first.tier.storage.get_stats()
        assert stats["write_ok"] == len(keys) and stats["stored_pages"] == len(keys)
    # a new engine (new primary tier, nothing in memory) over the same store: a restart
    with Engine([tier_config(options=file_tier_options)]) as second:
        got = second.load(keys)
        assert got == [payload(k, second.chunk_bytes) for k in keys]
        assert second.tier.storage.get_stats()["read_hits"] == len(keys)
        # promoted chunks are primary hits now: no second read
        assert second.load(keys) == got
        assert second.tier.storage.get_stats()["read_hits"] == len(keys)


def test_another_process_shares_the_store(file_tier_options: dict, tmp_path: Path) -> None:
    """Keys are vLLM's sha256 block hashes from its fixed default seed: the same in a process
    whose Python string hashes differ (PYTHONHASHSEED unset: vLLM would take it as its seed,
    and every engine sharing a store must then set the same value)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    # the child imports the hicache this process does (a checkout on PYTHONPATH included)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    subprocess.run(
        [sys.executable, str(HERE / "_store_worker.py"), file_tier_options["root"], ",".join(map(str, TOKENS))],
        check=True, env=env, timeout=300,
    )
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as engine:
        assert engine.load(keys) == [payload(k, engine.chunk_bytes) for k in keys]


def test_prefix_of_a_longer_prompt_hits_and_the_rest_misses(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    longer = block_keys(TOKENS + list(range(5000, 5000 + 3 * BLOCK)))
    assert longer[: len(keys)] == keys
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys)
    with Engine([tier_config(options=file_tier_options)]) as second:
        got = second.load(longer)
        assert got[: len(keys)] == [payload(k, second.chunk_bytes) for k in keys]
        assert got[len(keys):] == [None] * 3


def test_damaged_page_fails_its_chunk_only(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys)
        layout = first.tier.storage.layout
    victim = keys[3]
    path = layout.path(page_id(page_key(victim), "kv"))
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip inside the payload
    Path(path).write_bytes(bytes(data))
    with Engine([tier_config(options=file_tier_options)]) as second:
        got = second.load(keys)
        expect = [payload(k, second.chunk_bytes) for k in keys]
        assert [g == e for g, e in zip(got, expect)] == [k != victim for k in keys]
        assert got[3] is None  # a miss (recompute), never the flipped bytes
        assert second.tier.storage.get_stats()["corrupt_pages"] == 1
        # the failed promotion is remembered as a miss: no retry loop on the next lookup
        _, results = second.lookup([victim])
        assert results == [LookupResult.MISS]


def test_page_deleted_after_lookup_fails_only_that_chunk(file_tier_options: dict) -> None:
    """A page evicted (or removed by another process) between its lookup and its load."""
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys)
    with Engine([tier_config(options=file_tier_options)]) as second:
        # one request asks; the tier's lookup thread finds every page and remembers it
        ctx = second.begin(keys)
        assert {second.manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}
        second.step()
        time.sleep(0.5)
        os.unlink(second.tier.storage.layout.path(page_id(page_key(keys[5]), "kv")))
        got = second.load(keys)  # a second request: hits from the remembered answers
        assert got[5] is None
        assert all(g == payload(k, second.chunk_bytes) for g, k in zip(got, keys) if k != keys[5])
        assert second.tier.storage.get_stats()["read_misses"] == 1


def test_chunks_stored_while_a_request_that_missed_them_runs_are_hits(file_tier_options: dict) -> None:
    """vLLM's lookup manager remembers a verdict while any request that asked is alive. The
    request that missed a prompt computes it and the tier stores it; once the primary tier
    evicts it, a request with the same prompt was told "miss" from that stale verdict (for as
    long as the first request decoded, or any later one that asked kept it alive)."""
    keys = block_keys(TOKENS[: 4 * BLOCK])
    with Engine([tier_config(options=file_tier_options)], chunks=8) as engine:
        first, results = engine.lookup(keys)  # a miss everywhere; the request keeps running
        assert results == [LookupResult.MISS] * len(keys)
        out = engine.manager.prepare_store(keys, first)
        assert out is not None
        for key, chunk_id in zip(out.keys_to_store, out.store_spec.chunk_ids):
            engine.chunk(int(chunk_id))[:] = np.frombuffer(payload(key, engine.chunk_bytes), dtype=np.uint8)
        engine.manager.complete_store(keys, first)
        engine.settle()  # the cascade wrote every chunk
        assert engine.tier.storage.get_stats()["write_ok"] == len(keys)
        engine.store(block_keys(TOKENS[4 * BLOCK :] + list(range(9000, 9000 + 4 * BLOCK))))  # evicts them
        assert {engine.manager.primary_tier.lookup(k, first) for k in keys} == {LookupResult.MISS}
        got = engine.load(keys)  # a second request with the same prompt, while the first runs
        assert got == [payload(k, engine.chunk_bytes) for k in keys]
        engine.manager.on_request_finished(first)


def test_a_chunk_a_failed_load_marked_a_miss_stays_one_when_a_store_finds_it_stored(file_tier_options: dict) -> None:
    """A store job answers ok for a chunk it finds stored already, without writing it; every ok
    chunk was made a hit, so a chunk a failed load had marked a miss (an object the store
    keeps though it cannot be read back) was a hit again for every request sharing the prompt,
    each paying the failed load. Only chunks the job wrote are made hits."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    keys = block_keys(TOKENS[: 4 * BLOCK])
    with Engine([tier_config(options=file_tier_options)], chunks=8) as engine:
        engine.store(keys)
        tier, ctx = engine.tier, ReqContext("asks")
        lookups = tier._lookups
        assert {lookups.lookup(k, ctx) for k in keys} == {None}  # asked
        deadline = time.monotonic() + 30
        while any(lookups.lookup(k, ctx) is None for k in keys):
            assert time.monotonic() < deadline
            lookups.flush()  # as vLLM does at each step's end: posts the keys, takes the answers
            time.sleep(0.01)
        assert {lookups.lookup(k, ctx) for k in keys} == {True}
        lookups.mark_miss(keys)  # what the tier does when their load fails
        writes = tier.storage.get_stats()["write_ok"]
        tier.submit_store(TransferJob(999, keys, np.arange(len(keys)), False, ctx))  # the recompute's cascade
        finished: list = []
        while not any(r.job_id == 999 for r in finished):
            assert time.monotonic() < deadline
            finished += list(tier.get_finished_jobs())
            time.sleep(0.01)
        assert tier.storage.get_stats()["write_ok"] == writes  # found stored, nothing written
        assert {lookups.lookup(k, ctx) for k in keys} == {False}  # still a miss
        lookups.cleanup(ctx.req_id)


def test_disk_stays_bounded_and_evicts_tails_first(tmp_path: Path) -> None:
    pages = 10
    root = str(tmp_path / "store")
    with Engine([tier_config(options={"root": root, "min_free_bytes": 0})]) as probe:
        probe.store(block_keys(TOKENS[:BLOCK]))
        page_file = probe.tier.storage.get_stats()["stored_bytes"]
    options = {"root": root, "min_free_bytes": 0, "max_bytes": pages * page_file}
    prompts = [list(range(p * 10_000, p * 10_000 + 6 * BLOCK)) for p in range(4)]
    with Engine([tier_config(options=options)], chunks=64) as engine:
        for prompt in prompts:
            engine.store(block_keys(prompt))
        stats = engine.tier.storage.get_stats()
        assert stats["stored_bytes"] <= options["max_bytes"]
        assert stats["evicted_pages"] > 0
    with Engine([tier_config(options=options)]) as after:
        for prompt in prompts:
            got = after.load(block_keys(prompt))
            found = [g is not None for g in got]
            # what survives of each prompt is a prefix: eviction took tails before heads
            assert found == sorted(found, reverse=True), found
            for g, k in zip(got, block_keys(prompt)):
                assert g is None or g == payload(k, after.chunk_bytes)


def test_parent_links_follow_the_prompt_across_jobs(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as engine:
        engine.store(keys, jobs=4)  # four cascades; each later one starts mid-prompt
        index = engine.tier.storage.index
        parents = [index.get(page_id(page_key(k), "kv")).parent for k in keys]
    assert parents == [None] + [page_id(page_key(k), "kv") for k in keys[:-1]]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other/model"},
        {"dtype": "float16"},
        {"tp_size": 2},
        {"block_bytes": 8192},
        {"layout": "BLNHC"},
        {"canonical": True, "agnostic": True},
    ],
    ids=["model", "dtype", "tp", "geometry", "kv-layout", "canonical"],
)
def test_incompatible_engine_never_reads_the_pages(file_tier_options: dict, change: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys)
    with Engine([tier_config(options=file_tier_options)], **change) as other:
        assert other.load(keys) == [None] * len(keys)
        assert other.tier.storage.get_stats().get("read_pages", 0) == 0


def test_salts_separate_tenants(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options, namespace_salt="tenant-a")]) as a:
        a.store(keys)
    with Engine([tier_config(options=file_tier_options, namespace_salt="tenant-b")]) as b:
        assert b.load(keys) == [None] * len(keys)
    with Engine([tier_config(options=file_tier_options, namespace_salt="tenant-a")]) as a2:
        assert a2.load(keys) == [payload(k, a2.chunk_bytes) for k in keys]


def test_cache_salt_changes_vllm_keys() -> None:
    """vLLM folds a request's cache_salt into its first block hash, so every key changes."""
    plain, salted = block_keys(TOKENS), block_keys(TOKENS, salt="s1")
    assert not set(plain) & set(salted)
    assert block_keys(TOKENS, salt="s1") == salted


def test_reset_cache_drains_jobs_in_flight(file_tier_options: dict) -> None:
    """vLLM's reset_cache drains every tier and asserts no job is left: stores just submitted
    must have finished and been reported by the time drain_jobs returns."""
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as engine:
        engine.store(keys, jobs=4, settle=False)
        engine.manager.reset_cache()
        assert not engine.manager.has_pending_work()
        assert engine.tier.storage.get_stats()["write_ok"] == len(keys)


def test_shutdown_releases_the_primary_view(file_tier_options: dict) -> None:
    engine = Engine([tier_config(options=file_tier_options)])
    engine.store(block_keys(TOKENS))
    view = engine.view
    del engine.view
    engine.close()  # vLLM releases the view and closes the mmap: no export of ours may remain
    with pytest.raises(ValueError):
        view.tobytes()


def test_shutdown_finishes_stores_in_flight(file_tier_options: dict) -> None:
    """vLLM shuts the tier down right after the last request: queued cascades still land."""
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options)]) as first:
        first.store(keys, jobs=4, settle=False)
    with Engine([tier_config(options=file_tier_options)]) as second:
        assert second.load(keys) == [payload(k, second.chunk_bytes) for k in keys]
