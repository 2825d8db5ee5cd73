"""KV events of hicache's tier, as vLLM publishes them under ``--kv-events-config``.

A router that places requests by KV events must see what the tier holds: chunks it stores
(as vLLM's own ``fs`` and ``obj`` tiers report them) and chunks the store drops (evicted for
``max_bytes``, corrupt, evicted or cleared by another engine sharing the store, vanished from a
bucket). The events go through vLLM's own code: a real ``Scheduler`` with its
``OffloadingConnector`` and publisher where a whole engine's stream matters, vLLM's
``OffloadingEventsTracker`` (the connector's conversion) over the tiering manager elsewhere.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import botocore.session
import pytest
import torch
from _tiering import BLOCK, TIER_MODULE, Engine, block_keys, tier_config
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import get_offload_block_hash, make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from s3_server import TEST_KEY, TEST_SECRET

from hicache.errors import ConfigError
from hicache.integrations.vllm.tier_keys import page_key
from hicache_backends.file.layout import page_id

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TOKENS = list(range(1000, 1000 + 8 * BLOCK))


# ---------------------------------------------------------------------------- a real vLLM scheduler

class Serving:
    """vLLM's ``Scheduler`` with ``OffloadingConnector`` and KV events on; the workers' copies
    complete as soon as they are asked for. ``events`` is everything its publisher published."""

    def __init__(self, model_dir: str, tier: dict[str, Any], *, cpu_chunks: int = 32, blocks_per_chunk: int = 2) -> None:
        chunk_bytes = blocks_per_chunk * len(LAYERS) * 2 * BLOCK * 2 * 16 * 2  # K and V, 2 heads of 16 bf16
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
            cache_config=CacheConfig(block_size=BLOCK),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config={
                    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * chunk_bytes,
                    "blocks_per_chunk": blocks_per_chunk, "self_describing_kv_events": True,
                    "secondary_tiers": [tier],
                },
            ),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        config.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves with VLLM_KV_CACHE_LAYOUT=NHD
        config.cache_config.num_gpu_blocks = 64
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        with set_current_vllm_config(config):
            self.scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)
        self.manager = self.scheduler.connector.connector_scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        self.chunk_bytes = self.manager.primary_tier.get_kv_memoryview().strides[0]
        assert self.chunk_bytes == chunk_bytes
        self.events: list[KVCacheEvent] = []
        publish = self.scheduler.kv_event_publisher.publish
        self.scheduler.kv_event_publisher.publish = lambda batch: (self.events.extend(batch.events), publish(batch))[1]
        self._n = 0

    def serve(self, prompt: list[int]) -> Request:
        """Run one request to its end, then step until every tier job is done."""
        init_none_hash(sha256)
        self._n += 1
        req = Request(f"r{self._n}", list(prompt), SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        deadline = time.monotonic() + 30
        while self.scheduler.has_requests() or self.manager.has_pending_work():
            assert time.monotonic() < deadline, "the engine did not settle"
            self.step()
            time.sleep(0.005)
        self.step()
        return req

    def step(self) -> None:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        for job_id in [*meta.store_jobs, *meta.load_jobs]:
            done.mark_completed(job_id)
        ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[5] for _ in ids],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=done)))

    def close(self) -> None:
        self.scheduler.shutdown()


def storage_events(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    return [e for e in events if e.medium == "STORAGE"]


def chunk_keys(req: Request, blocks_per_chunk: int = 2) -> list[bytes]:
    """The offload key of each full chunk of ``req`` (its last block's hash)."""
    hashes = req.block_hashes
    return [make_offload_key(hashes[i], 0) for i in range(blocks_per_chunk - 1, len(hashes), blocks_per_chunk)]


def test_stored_chunks_are_published_as_vllms_fs_tier_publishes_them(model_dir: str, tmp_path: Path) -> None:
    """The same request through vLLM's ``fs`` tier and through hicache's gives the same KV event
    stream: BlockStored of each chunk's blocks (hashes, tokens, parent), medium STORAGE, in the
    same order, once; without the option, hicache's tier (like ``fs``) publishes nothing."""
    prompt = list(range(300, 300 + 5 * BLOCK))
    streams = {}
    for name, tier in {
        "fs": {"type": "fs", "root_dir": str(tmp_path / "fs"), "enable_kv_events": True},
        "hicache": {"type": "HiCacheTier", "module_path": TIER_MODULE, "enable_kv_events": True,
                    "options": {"root": str(tmp_path / "hicache"), "min_free_bytes": 0}},
        "hicache-off": {"type": "HiCacheTier", "module_path": TIER_MODULE,
                        "options": {"root": str(tmp_path / "hicache-off"), "min_free_bytes": 0}},
    }.items():
        serving = Serving(model_dir, tier)
        try:
            req = serving.serve(prompt)
            streams[name] = serving.events
        finally:
            serving.close()
    ours = storage_events(streams["hicache"])
    assert len(ours) == 2 and all(isinstance(e, BlockStored) for e in ours)
    # self-describing: each chunk event names its two blocks, as vLLM's GPU events do (chunks
    # cascade in jobs of their own, announced as each ends, in either order: as the fs tier's)
    assert sorted(e.block_hashes for e in ours) == sorted(
        [maybe_convert_block_hash(h) for h in req.block_hashes[i:i + 2]] for i in (0, 2))
    assert Counter(ours) == Counter(storage_events(streams["fs"]))
    others = [[e for e in streams[name] if e.medium != "STORAGE"] for name in ("hicache", "fs")]
    assert others[0] == others[1] and others[0]
    assert storage_events(streams["hicache-off"]) == []


def test_store_evictions_are_published_as_removals_of_the_blocks_stored(model_dir: str, tmp_path: Path) -> None:
    """The ``file`` backend evicts for ``max_bytes``: every chunk it drops is a BlockRemoved of
    the same blocks its BlockStored named (also after vLLM's CPU tier dropped the chunk first),
    each block's STORAGE events alternate stored/removed, and what the stream leaves standing is
    what the store holds."""
    root = str(tmp_path / "store")
    tier = {"type": "HiCacheTier", "module_path": TIER_MODULE, "enable_kv_events": True,
            "options": {"root": root, "min_free_bytes": 0}}
    serving = Serving(model_dir, tier)
    try:
        serving.serve(list(range(50, 50 + 2 * BLOCK)))
        page_file = serving.tier.storage.get_stats()["stored_bytes"]
    finally:
        serving.close()
    tier["options"] = {"root": str(tmp_path / "bounded"), "min_free_bytes": 0, "max_bytes": 5 * page_file}
    serving = Serving(model_dir, tier, cpu_chunks=3)
    try:
        reqs = [serving.serve(list(range(p * 1000, p * 1000 + 6 * BLOCK))) for p in range(1, 5)]
        events = storage_events(serving.events)
        assert serving.tier.storage.get_stats()["evicted_pages"] > 0
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert removed
        cpu_removed = {h for e in serving.events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}
        # the blocks of a chunk the CPU tier dropped before the store did are still named in full
        assert any(set(e.block_hashes) <= cpu_removed for e in removed)
        stored_chunks = {tuple(e.block_hashes) for e in events if isinstance(e, BlockStored)}
        for event in removed:  # one event per eviction pass: whole chunks, as stored
            pairs = zip(event.block_hashes[::2], event.block_hashes[1::2], strict=True)
            assert all(pair in stored_chunks for pair in pairs)
        held: Counter[int] = Counter()
        for event in events:
            for h in event.block_hashes:
                held[h] += 1 if isinstance(event, BlockStored) else -1
                assert held[h] in (0, 1), "a block announced twice, or removed unannounced"
        keys = [k for r in reqs for k in chunk_keys(r)]
        present = serving.tier._runner.exists([page_key(k) for k in keys])
        standing = {maybe_convert_block_hash(get_offload_block_hash(k)) for k, here in zip(keys, present) if here}
        assert standing and standing == {h for h, n in held.items() if n} & {
            maybe_convert_block_hash(get_offload_block_hash(k)) for k in keys}
    finally:
        serving.close()


# ---------------------------------------------------------------------------- the tiering manager

def events_of(engine: Engine, tracker: OffloadingEventsTracker) -> list[KVCacheEvent]:
    """What vLLM's connector publishes of the manager's events (placeholder payloads: the
    tracker has no request to describe them with here)."""
    return [e for e in tracker.take_events(engine.manager.take_events()) if e.medium == "STORAGE"]


def hashes(keys: list[bytes]) -> list[int]:
    return [maybe_convert_block_hash(get_offload_block_hash(k)) for k in keys]


def removed_hashes(events: list[KVCacheEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def stored_hashes(events: list[KVCacheEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def wait_for(engine: Engine, tracker: OffloadingEventsTracker, n_removed: int, timeout: float = 10.0) -> list[KVCacheEvent]:
    got: list[KVCacheEvent] = []
    deadline = time.monotonic() + timeout
    while len(removed_hashes(got)) < n_removed:
        assert time.monotonic() < deadline, f"only {removed_hashes(got)} removed"
        engine.step()
        got += events_of(engine, tracker)
        time.sleep(0.05)
    return got


def test_a_corrupt_page_a_read_deletes_is_a_removal(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options, enable_kv_events=True)], kv_events=True) as engine:
        tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
        engine.store(keys, jobs=2)
        events = events_of(engine, tracker)
        assert sorted(stored_hashes(events)) == sorted(hashes(keys)) and not removed_hashes(events)
        assert all(e.locality is None and e.ownership is None for e in events)
        path = engine.tier.storage.layout.path(page_id(page_key(keys[3]), "kv"))
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(path).write_bytes(bytes(data))
        engine.manager.reset_cache()
        engine.load(keys)
        events = events_of(engine, tracker)
        assert removed_hashes(events) == hashes([keys[3]])
        assert engine.tier.kv_events_dropped == 0


def test_another_engines_removals_and_clear_are_removals(file_tier_options: dict) -> None:
    """Engines sharing a root: what another one removes or clears is gone for this one too
    (the file store's removal journal)."""
    keys = block_keys(TOKENS)
    options = {**file_tier_options, "journal_poll_s": 0.05}
    with Engine([tier_config(options=options, enable_kv_events=True, locality="LOCAL")], kv_events=True) as first, \
         Engine([tier_config(options=options)]) as second:
        tracker = OffloadingEventsTracker(first.spec.kv_events_config)
        first.store(keys)
        events = events_of(first, tracker)
        assert stored_hashes(events) == hashes(keys)
        assert {e.locality for e in events} == {"LOCAL"}
        flags = second.tier._runner._loop_thread.call(second.tier.storage.batch_delete([page_key(k) for k in keys[6:]]), 30)
        assert flags == [True, True]
        assert removed_hashes(wait_for(first, tracker, 2)) == hashes(keys[6:])
        assert second.tier._runner._loop_thread.call(second.tier.storage.clear(), 30)
        got = wait_for(first, tracker, 6)
        assert sorted(removed_hashes(got)) == sorted(hashes(keys[:6]))  # each once: the rest were gone


def test_a_page_removed_while_its_store_job_ran_is_not_announced(file_tier_options: dict) -> None:
    """The removal and the job's result reach the tier on different threads; a chunk that left
    the store before vLLM heard of its job must not be announced as held."""
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options, enable_kv_events=True)], kv_events=True) as engine:
        tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
        engine.store(keys, settle=False)
        engine.step()  # the cascade is submitted to the tier
        assert engine.tier._runner.drain(30)  # the job is done, its result not taken yet
        runner = engine.tier._runner
        assert runner._loop_thread.call(engine.tier.storage.batch_delete([page_key(keys[2])]), 30) == [True]
        engine.settle()
        events = events_of(engine, tracker)
        assert stored_hashes(events) == hashes(keys[:2] + keys[3:]) and not removed_hashes(events)
        # stored again (the CPU tier dropped it), it is announced then
        engine.manager.reset_cache()
        engine.store(keys)
        assert stored_hashes(events_of(engine, tracker)) == hashes([keys[2]])


def test_the_event_queue_is_bounded_and_counts_what_it_drops(file_tier_options: dict) -> None:
    keys = block_keys(TOKENS)
    tier = tier_config(options=file_tier_options, enable_kv_events=True, kv_events_queue_size=4)
    with Engine([tier], kv_events=True) as engine:
        tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
        engine.store(keys[:3])
        engine.store(keys[3:])  # 5 more before vLLM took the first 3: dropped, counted
        assert engine.tier.kv_events_dropped == 5
        assert stored_hashes(events_of(engine, tracker)) == hashes(keys[:3])
        # a dropped store is not taken for announced: its removal is not published either
        runner = engine.tier._runner
        assert runner._loop_thread.call(engine.tier.storage.batch_delete([page_key(k) for k in keys[2:4]]), 30) == [True] * 2
        assert removed_hashes(events_of(engine, tracker)) == hashes(keys[2:3])


def test_the_keys_remembered_for_removals_are_bounded_oldest_forgotten_first(file_tier_options: dict) -> None:
    """A store that never evicts must not grow the tier's memory of announced keys for the
    engine's life: past ``kv_events_held_keys`` the oldest are forgotten and counted, a forgotten
    key's removal goes unreported, a remembered one's still is, and a forgotten key stored again
    is announced (and remembered) again."""
    keys = block_keys(TOKENS)
    tier = tier_config(options=file_tier_options, enable_kv_events=True, kv_events_held_keys=3)
    with Engine([tier], kv_events=True) as engine:
        tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
        for key in keys:  # one chunk a request, oldest first
            engine.store([key])
        assert sorted(stored_hashes(events_of(engine, tracker))) == sorted(hashes(keys))
        assert len(engine.tier._events._held) == 3
        assert engine.tier.kv_events_forgotten == len(keys) - 3 and engine.tier.kv_events_dropped == 0
        runner = engine.tier._runner
        gone = [keys[0], keys[-1]]  # the oldest (forgotten) and the newest (remembered)
        assert runner._loop_thread.call(engine.tier.storage.batch_delete([page_key(k) for k in gone]), 30) == [True] * 2
        assert removed_hashes(events_of(engine, tracker)) == hashes([keys[-1]])
        engine.manager.reset_cache()
        engine.store([keys[0]])
        assert stored_hashes(events_of(engine, tracker)) == hashes([keys[0]])
        assert runner._loop_thread.call(engine.tier.storage.batch_delete([page_key(keys[0])]), 30) == [True]
        assert removed_hashes(events_of(engine, tracker)) == hashes([keys[0]])


def test_events_need_vllms_kv_events_and_the_option(file_tier_options: dict, caplog: pytest.LogCaptureFixture) -> None:
    keys = block_keys(TOKENS)
    with Engine([tier_config(options=file_tier_options, enable_kv_events=True)]) as engine:
        engine.store(keys)
        assert list(engine.manager.take_events()) == []
        assert "KV cache events are disabled globally" in caplog.text
    with Engine([tier_config(options=file_tier_options)], kv_events=True) as engine:
        engine.store(keys)
        assert [e for e in engine.manager.take_events() if e.medium.value == "STORAGE"] == []
        assert not engine.tier.storage.tier_changes.active


@pytest.mark.parametrize("bad", [{"enable_kv_events": "yes"}, {"kv_events_queue_size": 0},
                                 {"kv_events_queue_size": True}, {"kv_events_queue_size": 1.5},
                                 {"kv_events_held_keys": 0}, {"kv_events_held_keys": "many"}])
def test_bad_event_options_fail_engine_start(file_tier_options: dict, bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Engine([tier_config(options=file_tier_options, **bad)], kv_events=True)


def test_an_object_gone_from_the_bucket_is_a_removal(s3_tier_options: dict, moto_endpoint: str) -> None:
    """An object deleted behind the tier's back (a bucket lifecycle rule, another engine) is
    found gone by the read that wanted it, and published removed."""
    keys = block_keys(TOKENS)
    tier = tier_config("s3", options=s3_tier_options, enable_kv_events=True, locality="REMOTE")
    with Engine([tier], kv_events=True) as engine:
        tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
        engine.store(keys)
        events = events_of(engine, tracker)
        assert stored_hashes(events) == hashes(keys) and {e.locality for e in events} == {"REMOTE"}
        storage = engine.tier.storage
        victim = storage.names.page(page_key(keys[4]), "kv")
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=moto_endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
            region_name="us-east-1")
        bucket, _, key = victim.partition("/")
        client.delete_object(Bucket=bucket, Key=key)
        client.close()
        engine.manager.reset_cache()
        engine.load(keys)
        assert removed_hashes(events_of(engine, tracker)) == hashes([keys[4]])


def test_another_engines_writes_deletes_and_clear_on_a_shared_memory_store_are_removals() -> None:
    """Engines sharing a ``memory`` medium (one ``store_id``): another engine's writes evicting
    this one's chunks, its deletes and its clear are gone for this one too. The memory store
    told only the store that acted, so this engine's router went on placing requests by chunks
    the medium no longer held."""
    import uuid

    from hicache_backends.memory import MemoryMedium

    keys = block_keys(TOKENS)
    sid = f"engines-{uuid.uuid4().hex}"
    try:
        with Engine([tier_config(backend="memory", options={"store_id": sid}, enable_kv_events=True)], kv_events=True) as first, \
             Engine([tier_config(backend="memory", options={"store_id": sid})]) as second:
            tracker = OffloadingEventsTracker(first.spec.kv_events_config)
            first.store(keys)
            assert stored_hashes(events_of(first, tracker)) == hashes(keys)
            call = second.tier._runner._loop_thread.call
            assert call(second.tier.storage.batch_delete([page_key(k) for k in keys[6:]]), 30) == [True, True]
            assert removed_hashes(wait_for(first, tracker, 2)) == hashes(keys[6:])
            assert call(second.tier.storage.clear(), 30)
            assert sorted(removed_hashes(wait_for(first, tracker, 6))) == sorted(hashes(keys[:6]))
            first.manager.reset_cache()
            first.store(keys)  # stored again; then the other engine's writes need the whole medium
            assert sorted(stored_hashes(events_of(first, tracker))) == sorted(hashes(keys))
            medium = MemoryMedium.shared(sid, None)
            size = medium.max_bytes // 4
            pages = [torch.full((size,), i, dtype=torch.uint8) for i in range(4)]
            assert call(second.tier.storage.batch_set([f"other-{i}" for i in range(4)], pages), 60)
            assert sorted(removed_hashes(wait_for(first, tracker, len(keys)))) == sorted(hashes(keys))
    finally:
        MemoryMedium.drop_shared(sid)
