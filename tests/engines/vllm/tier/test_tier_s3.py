"""hicache's tier behind vLLM's ``TieringOffloadingManager`` on the ``s3`` backend, against
moto's S3 server on port 0: a fresh engine finds the chunks, a tampered object is a miss, and
a store that is down costs nothing but recompute."""

from __future__ import annotations

import time

import botocore.session
from _tiering import BLOCK, Engine, block_keys, payload, tier_config
from s3_server import TEST_KEY, TEST_SECRET, free_port, s3_options
from vllm.v1.kv_offload.base import LookupResult

from hicache.integrations.vllm.tier_keys import page_key

TOKENS = list(range(7000, 7000 + 6 * BLOCK))


def _put(endpoint: str, path: str, data: bytes) -> None:
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
        region_name="us-east-1",
    )
    bucket, _, key = path.partition("/")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data)
    finally:
        client.close()


def test_fresh_engine_loads_from_the_bucket(s3_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config("s3", options=s3_tier_options, locality="REMOTE")]) as first:
        first.store(keys, jobs=2)
        assert first.tier.storage.get_stats()["write_ok"] == len(keys)
    with Engine([tier_config("s3", options=s3_tier_options, locality="REMOTE")]) as second:
        assert second.load(keys) == [payload(k, second.chunk_bytes) for k in keys]
        assert second.tier.storage.get_stats()["read_hits"] == len(keys)


def test_chunks_already_in_the_bucket_are_not_written_again(s3_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config("s3", options=s3_tier_options)]) as first:
        first.store(keys)
    with Engine([tier_config("s3", options=s3_tier_options)]) as second:
        second.store(keys)
        assert second.tier.storage.get_stats().get("write_pages", 0) == 0


def test_tampered_object_is_a_miss(s3_tier_options: dict, moto_endpoint: str) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config("s3", options=s3_tier_options)]) as first:
        first.store(keys)
        names = first.tier.storage.names
    victim = keys[2]
    # another writer's object of the right size under the victim's name: verification catches it
    _put(moto_endpoint, names.page(page_key(victim), "kv"), b"\x00" * (first.chunk_bytes + 512))
    with Engine([tier_config("s3", options=s3_tier_options)]) as second:
        got = second.load(keys)
        assert got[2] is None
        assert [g is not None for g in got] == [k != victim for k in keys]
        assert all(g == payload(k, second.chunk_bytes) for g, k in zip(got, keys) if g is not None)


def test_store_that_is_down_costs_only_recompute() -> None:
    """Nothing listens at the endpoint: start-up, stores and lookups go on without errors;
    every chunk is a miss (vLLM recomputes), and the engine's own work is not held up."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    options = {
        "url": "s3://nowhere/kv",
        "storage_options": s3_options(endpoint),
        "request_timeout": 0.5,
        "call_timeout": 2.0,
        "retries": 0,
    }
    keys = block_keys(TOKENS)
    t0 = time.monotonic()
    with Engine([tier_config("s3", options=options, open_timeout=1.0)]) as engine:
        engine.store(keys)  # the cascade fails; vLLM unpins the chunks and goes on
        stats = engine.tier.storage.get_stats()
        assert stats.get("write_ok", 0) == 0
        engine.manager.reset_cache()  # empty the primary tier: only the secondary tier is left
        _, results = engine.lookup(keys)
        assert results == [LookupResult.MISS] * len(keys)
        assert engine.load(keys) == [None] * len(keys)
    assert time.monotonic() - t0 < 30


def test_store_lost_between_lookup_and_load_is_recompute() -> None:
    """The server dies after the lookups found every chunk: the promotions fail, vLLM gets
    misses (no garbage, no exception), and the failed keys are not promoted again."""
    from s3_server import MotoProcess, create_bucket

    with MotoProcess() as server:
        create_bucket(server.endpoint, "lost")
        # the store happens while the server is up, on a loaded machine too: the backend's
        # default timeouts and retries; only the reader, which outlives the server, is tight
        healthy = {"url": "s3://lost/kv", "storage_options": s3_options(server.endpoint)}
        # a stopped server refuses connections at once; the timeouts only bound a slow machine
        tight = {**healthy, "request_timeout": 2.0, "call_timeout": 5.0, "retries": 0}
        keys = block_keys(TOKENS)
        with Engine([tier_config("s3", options=healthy)]) as first:
            first.store(keys)
            assert first.tier.storage.get_stats()["write_ok"] == len(keys)
        with Engine([tier_config("s3", options=tight)]) as second:
            ctx = second.begin(keys)
            assert {second.manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}
            second.step()
            deadline = time.monotonic() + 30
            lookups = second.tier._lookups  # vLLM's AsyncLookupManager: its answers land on drain
            while lookups.drain_results() or None in (found := [lookups.lookup(k, ctx) for k in keys]):
                assert time.monotonic() < deadline, "the lookup thread never answered"
                time.sleep(0.01)
            assert found == [True] * len(keys)  # every page exists, then the server goes
            server.stop()
            assert second.load(keys) == [None] * len(keys)
            _, results = second.lookup(keys)
            assert results == [LookupResult.MISS] * len(keys)
