"""hicache's KV events read by vLLM's own classes, and vLLM's publisher read by our consumer.

Routers consume vLLM's ``KVEventBatch`` over ZMQ; these tests prove they read ours unchanged:
our bytes decode with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` into
vLLM's own event objects, our encoding of an event equals vLLM's byte for byte, and the framing
(topic, 8-byte sequence, payload) and replay protocol are vLLM's in both directions.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq
from vllm.distributed import kv_events as vk

from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from hicache.events.subscriber import EventSubscriber
from hicache.facade import HiCache

DECODER = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
H = [bytes([i]) * 32 for i in range(3)]


def test_vllm_decodes_our_bytes_into_its_own_classes() -> None:
    ours = KVEventBatch(ts=12.5, data_parallel_rank=1, events=[
        BlockStored(block_hashes=H[1:], parent_block_hash=H[0], token_ids=list(range(8)), block_size=4,
                    lora_id=None, medium="CPU", lora_name=None),
        BlockRemoved(block_hashes=[H[2]], medium="STORAGE"),
        AllBlocksCleared(medium="GPU"),
    ])
    theirs = DECODER.decode(encode_batch(ours))
    assert (theirs.ts, theirs.data_parallel_rank) == (12.5, 1)
    stored, removed, cleared = theirs.events
    assert type(stored) is vk.BlockStored and type(removed) is vk.BlockRemoved and type(cleared) is vk.AllBlocksCleared
    assert stored.block_hashes == H[1:] and stored.parent_block_hash == H[0] and stored.medium == "CPU"
    assert stored.token_ids == list(range(8)) and stored.block_size == 4
    assert removed.block_hashes == [H[2]] and removed.medium == vk.MEDIUM_STORAGE
    # byte for byte what vLLM itself encodes (a clear without a medium is vLLM's clear)
    same = vk.KVEventBatch(ts=12.5, data_parallel_rank=1, events=[
        vk.BlockStored(block_hashes=H[1:], parent_block_hash=H[0], token_ids=list(range(8)), block_size=4,
                       lora_id=None, medium="CPU", lora_name=None),
        vk.BlockRemoved(block_hashes=[H[2]], medium="STORAGE"),
        vk.AllBlocksCleared(),
    ])
    ours.events[2] = AllBlocksCleared()
    assert msgspec.msgpack.encode(same) == encode_batch(ours)


async def test_a_cache_runs_events_over_zmq_decode_with_vllms_classes(tmp_path: Path) -> None:
    pub_url, replay_url = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    cfg = {"device": {"device": "cpu", "size_tokens": 256, "page_size": 16}, "storage": {"backend": "memory"},
           "events": {"enabled": True, "endpoint": pub_url, "replay_endpoint": replay_url, "topic": "kv"}}
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    async with HiCache.from_config(cfg) as cache:
        sub.connect(pub_url)
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        h = await cache.begin("r", list(range(64)))
        await cache.commit(h)
        await cache.drain()
        frames = []
        while await asyncio.to_thread(sub.poll, 1000):
            frames.append(sub.recv_multipart())
    sub.close(0)
    assert frames and all(f[0] == b"kv" and len(f[1]) == 8 for f in frames)
    events = [e for f in frames for e in DECODER.decode(f[2]).events]
    media = {(type(e).__name__, e.medium) for e in events}
    assert {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockStored", "STORAGE")} <= media
    first = next(e for e in events if isinstance(e, vk.BlockStored))
    assert first.token_ids == list(range(64)) and first.block_size == 16 and len(first.block_hashes) == 4


def test_our_consumer_reads_and_replays_vllms_publisher(tmp_path: Path) -> None:
    pub = vk.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/vpub", replay_endpoint=f"ipc://{tmp_path}/vreplay",
                               buffer_steps=100, topic="t")
    try:
        for i in range(5):
            pub.publish(vk.KVEventBatch(ts=float(i), events=[vk.BlockRemoved(block_hashes=[i], medium="GPU")]))
        time.sleep(0.5)
        with EventSubscriber(f"ipc://{tmp_path}/vpub", f"ipc://{tmp_path}/vreplay", topic="t", start_seq=0) as sub:
            got = list(sub.receive(timeout_s=1.0))
        assert [g.seq for g in got] == list(range(5)) and all(g.replayed for g in got)
        assert [g.batch.events[0].block_hashes for g in got] == [[i] for i in range(5)]
    finally:
        pub.shutdown()


def apply_as_a_router(index: dict[bytes | int, set[str | None]], batch: vk.KVEventBatch) -> None:
    """A cache-aware router's view of one replica (what llm-d, Dynamo, sgl-router keep), fed
    vLLM's own event objects: block -> the media holding it. vLLM's ``AllBlocksCleared`` has no
    fields, so a router can only forget every block of the replica on one."""
    for event in batch.events:
        if isinstance(event, vk.AllBlocksCleared):
            index.clear()
        elif isinstance(event, vk.BlockStored):
            for h in event.block_hashes:
                index.setdefault(h, set()).add(event.medium)
        else:
            for h in event.block_hashes:
                index.get(h, set()).discard(event.medium)
                if not index.get(h, True):
                    del index[h]


async def test_a_reset_leaves_a_vllm_consumer_knowing_the_pages_storage_still_holds() -> None:
    """A reset (``flush_cache``, a weight update) drops device and host pages, not storage:
    a router must keep routing to this replica for the prefixes storage still serves. An
    ``AllBlocksCleared`` per tier made it forget them all (vLLM's class drops our medium)."""
    cfg = {"device": {"device": "cpu", "size_tokens": 256, "page_size": 16}, "storage": {"backend": "memory"}}
    async with HiCache.from_config(cfg) as cache:
        stream = cache.events()
        h = await cache.begin("r", list(range(64)))
        await cache.commit(h)
        await cache.drain()
        cache.cache.reset()
        await cache.drain()
        index: dict[bytes | int, set[str | None]] = {}
        seen = 0
        while True:
            try:
                _, batch = await asyncio.wait_for(stream.get(), 1.0)
            except TimeoutError:
                break
            apply_as_a_router(index, DECODER.decode(encode_batch(batch)))
            seen += len(batch.events)
    assert seen
    assert len(index) == 4 and all(media == {vk.MEDIUM_STORAGE} for media in index.values()), index


async def test_a_prompt_served_again_after_a_reset_is_counted_stored_once_by_a_vllm_consumer() -> None:
    """After a reset, serving the same prompt again wrote its pages to storage again, and each
    was announced stored a second time: a consumer counting vLLM's ``BlockStored`` against
    ``BlockRemoved`` (vLLM's contract allows it) then kept the page stored after its one
    eviction. Storage announces a page once while it holds it."""
    cfg = {"device": {"device": "cpu", "size_tokens": 256, "page_size": 16}, "storage": {"backend": "memory"}}
    counts: Counter[tuple[bytes | int, str | None]] = Counter()
    async with HiCache.from_config(cfg) as cache:
        stream = cache.events()
        for rid in ("r1", "r2"):
            h = await cache.begin(rid, list(range(64)))
            await cache.commit(h)
            await cache.drain()
            cache.cache.reset()
            await cache.drain()
        while True:
            try:
                _, batch = await asyncio.wait_for(stream.get(), 1.0)
            except TimeoutError:
                break
            for event in DECODER.decode(encode_batch(batch)).events:
                assert not isinstance(event, vk.AllBlocksCleared)
                step = 1 if isinstance(event, vk.BlockStored) else -1
                counts.update({(h, event.medium): step for h in event.block_hashes})
    stored = {key: n for key, n in counts.items() if n}
    assert len(stored) == 4 and set(stored.values()) == {1} and {m for _, m in stored} == {vk.MEDIUM_STORAGE}, stored
