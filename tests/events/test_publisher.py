"""The publisher with real ZMQ sockets and real consumers, in this process and in others:
sequence numbers without gaps, replay after a reconnect, and consumers that cannot slow the
cache down (drops are counted instead)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.errors import ConfigError
from hicache.events import BlockStored, KVEventBatch, encode_batch
from hicache.events.publisher import EventPublisher
from hicache.events.subscriber import EventSubscriber
from event_helpers import rebind
from hicache.facade import HiCache
from hicache.testing import eventually

LOOPBACK = "tcp://127.0.0.1:0"
REPO = Path(__file__).resolve().parents[2]


def stored(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i.to_bytes(32, "big")], parent_block_hash=None, token_ids=[i], block_size=1,
                       lora_id=None, medium="GPU", lora_name=None)


def config(root: Path, **events: Any) -> dict[str, Any]:
    ev = {"enabled": True, "endpoint": LOOPBACK, "replay_endpoint": LOOPBACK}
    ev.update(events)
    page = 16 * 2 * 4 * 2 * 32 * 4  # tokens x (K, V) x layers x heads x head_dim x float32
    return {
        "model": {"name": "tests/events-model", "num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "kv_dtype": "float32"},
        "device": {"device": "cpu", "size_tokens": 128, "page_size": 16, "max_context_len": 1024},
        "host": {"ratio": 1.0},
        "storage": {"backend": "file", "options": {"root": str(root), "max_bytes": 10 * (page + 512)}},
        "cache": {"prefetch": {"threshold_tokens": 16}},
        "events": ev,
    }


def consumer(*args: str) -> subprocess.Popen[str]:
    """``hicache events`` in another process (JSON lines on stdout)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "hicache.cli", "events", *args, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def lines_of(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{\"seq\"")]


def contiguous(seqs: list[int]) -> bool:
    distinct = sorted(set(seqs))
    return distinct == list(range(distinct[0], distinct[-1] + 1)) and seqs == sorted(seqs)


async def settled(pub: EventPublisher) -> int:
    """The publisher's next sequence once everything queued has been published."""
    last = -1
    while True:
        stats = pub.stats()
        if stats["queued"] == 0 and stats["next_seq"] == last:
            return last
        last = stats["next_seq"]
        await asyncio.sleep(0.2)


async def workload(cache: HiCache, n: int, base: int = 0) -> None:
    for i in range(n):
        h = await cache.begin(f"r{base + i}", list(range((base + i) * 1000, (base + i) * 1000 + 64)))
        await cache.commit(h)
        await cache.drain()


async def test_a_subscriber_in_another_process_gets_every_tiers_events(tmp_path: Path) -> None:
    async with HiCache.from_config(config(tmp_path / "store")) as cache:
        pub = cache._events.publisher
        proc = consumer(pub.endpoint, "--replay", pub.replay_endpoint, "--from", "0", "--timeout", "3")
        await workload(cache, 8)  # 32 pages through a device and a host of 8 and a store of ~10
        stack = cache._require_stack()
        assert await stack.controller._on_io(stack.storage.clear())
        total = await settled(pub)
        got = await asyncio.to_thread(lines_of, proc)
    seqs = [g["seq"] for g in got]
    assert seqs and seqs[0] == 0 and contiguous(seqs) and seqs[-1] == total - 1
    kinds = {(g["event"]["type"], g["event"]["medium"]) for g in got}
    for medium in ("GPU", "CPU", "STORAGE"):
        assert ("BlockStored", medium) in kinds and ("BlockRemoved", medium) in kinds, (medium, kinds)
    assert not any(g["event"]["type"] == "AllBlocksCleared" for g in got)  # the clear named its pages
    first = next(g["event"] for g in got if g["event"]["type"] == "BlockStored")
    assert len(first["block_hashes"][0]) == 64 and first["token_ids"] == list(range(64))[: 16 * len(first["block_hashes"])]


class Router:
    """What a vLLM-schema router believes a replica holds, by medium, from its events: an
    ``AllBlocksCleared`` forgets every block of the replica (vLLM's class has no medium)."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes | int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        self.next_seq = 0
        self.cleared = 0

    async def follow(self, stream: Any) -> None:
        from hicache.events import AllBlocksCleared, BlockRemoved

        async for seq, batch in stream:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.cleared += 1
                    for blocks in self.held.values():
                        blocks.clear()
                elif isinstance(event, BlockRemoved):
                    self.held[event.medium].difference_update(event.block_hashes)
                else:
                    self.held[event.medium].update(event.block_hashes)
            self.next_seq = seq + 1

    async def caught_up(self, pub: EventPublisher) -> None:
        total = await settled(pub)
        await eventually(lambda: self.next_seq == total, timeout=30.0)


@pytest.mark.parametrize("backend", ["memory", "file"])
async def test_a_store_clear_leaves_a_router_the_device_and_host_blocks(tmp_path: Path, backend: str) -> None:
    """A store's clear was published as ``AllBlocksCleared``: a vLLM-schema router then forgot
    every block of the replica, the device and host pages it still serves among them (nothing
    announces those again). A store that can name the pages it dropped publishes their
    ``BlockRemoved`` instead, as a reset of device and host does."""
    cfg = config(tmp_path / "store", endpoint=None, replay_endpoint=None)
    if backend == "memory":
        cfg["storage"] = {"backend": "memory", "options": {"max_bytes": cfg["storage"]["options"]["max_bytes"]}}
    async with HiCache.from_config(cfg) as cache:
        router = Router()
        reader = asyncio.create_task(router.follow(cache.events()))
        pub = cache._events.publisher
        await workload(cache, 4)
        await router.caught_up(pub)
        before = {medium: set(blocks) for medium, blocks in router.held.items()}
        assert before["GPU"] and before["CPU"] and before["STORAGE"], before
        stack = cache._require_stack()
        if backend == "file":  # its opening scan indexed the folder (a clear before it cannot name all)
            await stack.controller._on_io(stack.storage.wait_background())
        assert await stack.controller._on_io(stack.storage.clear())
        await router.caught_up(pub)
        assert router.cleared == 0
        assert router.held == {"GPU": before["GPU"], "CPU": before["CPU"], "STORAGE": set()}
    await asyncio.wait_for(reader, 5)


async def test_a_consumer_that_reconnects_catches_up_through_replay(tmp_path: Path) -> None:
    async with HiCache.from_config(config(tmp_path / "store")) as cache:
        pub = cache._events.publisher
        await workload(cache, 2)
        first = await asyncio.to_thread(lines_of, consumer(pub.endpoint, "--replay", pub.replay_endpoint,
                                                           "--from", "0", "--count", "3"))
        last = first[-1]["seq"]
        await workload(cache, 3, base=10)  # published while no consumer is connected
        total = await settled(pub)
        again = await asyncio.to_thread(lines_of, consumer(pub.endpoint, "--replay", pub.replay_endpoint,
                                                           "--from", str(last + 1), "--timeout", "2"))
        seqs = [g["seq"] for g in again]
        assert seqs[0] == last + 1 and seqs[-1] == total - 1 and contiguous(seqs), (last, total, seqs)
        assert all(g["replayed"] for g in again)

        # in-process: a live subscriber that loses its connection sees the gap and replays it
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=total - 1)
        got = [r.seq for r in await asyncio.to_thread(lambda: list(sub.receive(timeout_s=1.0)))]
        assert got == [total - 1]
        sub.reconnect()
        await workload(cache, 2, base=20)
        await asyncio.sleep(0.2)
        await workload(cache, 1, base=30)  # a live batch after the reconnect settled: shows the gap
        end = await settled(pub)
        got = [r.seq for r in await asyncio.to_thread(lambda: list(sub.receive(timeout_s=1.5)))]
        assert got == list(range(total, end)) and sub.lost == 0
        sub.close()


def test_live_batches_a_replay_already_gave_are_not_repeated_and_restarts_are_followed() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
    time.sleep(0.3)  # subscribed: every batch arrives live *and* through the replay below
    for i in range(5):
        pub.publish([stored(i)])
        time.sleep(0.02)  # one batch each
    time.sleep(0.3)
    got = [(r.seq, r.batch.events[0].token_ids[0]) for r in sub.receive(timeout_s=1.0)]
    assert got == [(i, i) for i in range(5)] and sub.restarts == 0
    for i in range(5, 100):  # the restarted publisher's numbers stay below these for 10 s
        pub.publish([stored(i)])
        time.sleep(0.01)
    time.sleep(0.3)
    assert sum(len(r.batch.events) for r in sub.receive(timeout_s=1.0)) == 95 and sub.next_seq >= 20
    pub.close()
    again = rebind(pub.endpoint, pub.replay_endpoint)  # a restarted publisher on the same addresses numbers from 0
    stop = threading.Event()

    def keep_publishing() -> None:  # until the subscriber has reconnected by itself
        while not stop.wait(0.1):
            again.publish([stored(7)])

    t = threading.Thread(target=keep_publishing)
    t.start()
    try:
        first = next(iter(sub.receive(timeout_s=10.0)))
    finally:
        stop.set()
        t.join()
    assert first.batch.events[0].token_ids == [7] and first.seq < 100 and sub.restarts == 1
    again.close()
    sub.close()


def test_absent_and_stuck_consumers_never_block_publishing() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK, hwm=4, max_queue_events=100_000)
    stuck = EventSubscriber(pub.endpoint)  # connected, never reads
    n = 5000
    for i in range(n):
        assert pub.publish([stored(i)])
    stats = pub.close(timeout=30)
    assert stats["published_events"] + stats["dropped_events"] == n
    assert stats["published_events"] == n and stats["errors"] == 0  # PUB drops for the stuck one
    stuck.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    pub = EventPublisher(None, max_queue_events=4)
    n, results = 20_000, []

    def flood() -> None:
        results.extend(pub.publish([stored(i)]) for i in range(n))

    t = threading.Thread(target=flood)
    t.start()
    t.join(60)
    assert not t.is_alive()
    stats = pub.close(timeout=30)
    assert stats["dropped_events"] == results.count(False) > 0
    assert stats["published_events"] == results.count(True)
    assert not pub.publish([stored(0)]) and pub.stats()["dropped_events"] == results.count(False) + 1


async def test_events_dropped_at_the_queue_bound_leave_a_gap_that_consumers_count_lost(monkeypatch: Any) -> None:
    """publish() dropped events at max_queue_events and only counted them; numbers were given to
    the queued batches alone, so they stayed consecutive and no consumer could tell: a router
    missed those removals and kept routing to prefixes the replica no longer held. The thread now
    skips a number for the drop (and for a batch that failed to publish): live and in-process
    consumers see the gap, the replay has nothing there, the subscriber counts it lost."""
    from hicache.events import BlockRemoved
    from hicache.events.stream import EventStream

    def removed(i: int) -> BlockRemoved:
        return BlockRemoved(block_hashes=[i.to_bytes(32, "big")], medium="GPU")

    gate = threading.Event()
    gate.set()
    offered: list[int] = []

    class Gated(EventStream):  # holds the publisher's thread in its offer while the gate is shut
        def offer(self, seq: int, batch: KVEventBatch) -> None:
            offered.append(seq)
            assert gate.wait(30)
            super().offer(seq, batch)

    pub = EventPublisher(LOOPBACK, LOOPBACK, max_queue_events=4)
    pub.add_stream(Gated(1024, on_close=pub.remove_stream))
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, idle_timeout_s=0.2)
    try:
        time.sleep(0.5)  # subscribed
        assert pub.publish([removed(0)])
        seqs = [next(iter(sub.receive(timeout_s=10))).seq]  # the router knows batch 0
        gate.clear()
        assert pub.publish([removed(1)])
        while pub.stats()["next_seq"] != 2:  # the thread is held in the stream's offer of batch 1
            await asyncio.sleep(0.01)
        results = [pub.publish([removed(i)]) for i in range(2, 12)]
        assert results == [True] * 4 + [False] * 6  # 4 queued, 6 dropped
        gate.set()
        received = list(sub.receive(timeout_s=1.0))
        seqs += [r.seq for r in received]
        assert seqs == [0, 1, 3] and sub.gaps == 1 and sub.lost == 1
        assert [e.block_hashes[0][-1] for e in received[-1].batch.events] == [2, 3, 4, 5]

        # a batch that fails to publish leaves a gap too (it was counted dropped, numbered
        # never). Nothing follows it here: consumers learned of it only when the cache next
        # published (maybe never, on an idle replica), so the thread marks the gap with an
        # empty batch once its queue is empty
        import hicache.events.publisher as publisher_module
        real = publisher_module.encode_batch
        failures = [ValueError("bad")]

        def encode_failing_once(batch: KVEventBatch) -> bytes:
            if failures:
                raise failures.pop()
            return real(batch)

        monkeypatch.setattr(publisher_module, "encode_batch", encode_failing_once)
        assert pub.publish([removed(20)])
        received = list(sub.receive(timeout_s=1.0))
        assert [(r.seq, r.batch.events) for r in received] == [(5, [])] and sub.gaps == 2 and sub.lost == 2
        assert pub.stats()["errors"] == 1
        assert pub.publish([removed(21)])
        received = list(sub.receive(timeout_s=1.0))
        assert [r.seq for r in received] == [6] and sub.gaps == 2 and sub.lost == 2
    finally:
        gate.set()
        stats = pub.close()
        sub.close()
    assert stats["dropped_events"] == 7 and stats["next_seq"] == 7
    assert offered == [0, 1, 3, 5, 6]  # in-process consumers see the same gaps


async def test_in_process_streams_are_bounded_per_consumer(tmp_path: Path) -> None:
    cfg = config(tmp_path / "store", endpoint=None, replay_endpoint=None)
    async with HiCache.from_config(cfg) as cache:
        slow = cache.events(maxsize=2)  # never read until the end
        fast = cache.events()
        seen: list[int] = []

        async def read() -> None:
            async for seq, _batch in fast:
                seen.append(seq)

        reader = asyncio.create_task(read())
        pub = cache._events.publisher
        for i in range(6):  # a batch or more each: a loaded publisher thread merges what it finds queued
            before = pub.stats()["next_seq"]
            await workload(cache, 1, base=i)
            await eventually(lambda before=before: pub.stats()["queued"] == 0 and pub.stats()["next_seq"] > before,
                             timeout=30.0)
        total = await settled(pub)
        assert total > 2
        # the last batches reach the streams' loop
        await eventually(lambda: len(seen) >= total and slow.dropped >= total - 2, timeout=30.0)
        assert seen == list(range(total))  # the fast one lost nothing
        assert slow.dropped == total - 2 and cache.metrics()["events"]["dropped_events"] == slow.dropped_events > 0
    await asyncio.wait_for(reader, 5)  # the close ends every iteration
    assert [s for s, _ in [await slow.get(), await slow.get()]] == [0, 1] and await slow.get() is None


async def test_events_off_by_default_and_bad_endpoints_fail_start(tmp_path: Path) -> None:
    cfg = config(tmp_path / "store")
    del cfg["events"]
    async with HiCache.from_config(cfg) as cache:
        assert cache._events is None and "events" not in cache.metrics()
        stream = cache.events()  # in-process events work with the section off, no socket opened
        assert cache._events.publisher.endpoint is None
        await workload(cache, 1)
        seq, batch = await asyncio.wait_for(stream.get(), 10)
        assert seq == 0 and isinstance(batch.events[0], BlockStored)
    bad = config(tmp_path / "store", endpoint="tcp://*:notaport")
    cache = None
    try:  # refused when the config is read (a TCP port is checked there), or at the bind
        cache = HiCache.from_config(bad)
        await cache.start()
    except ConfigError as exc:
        assert "notaport" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a bad endpoint must fail the start")
    if cache is not None:
        await cache.aclose()


def test_malformed_replay_requests_and_foreign_messages_are_survived() -> None:
    import zmq

    pub = EventPublisher(LOOPBACK, LOOPBACK)
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(pub.replay_endpoint)
    for frames in ([b"", b"short"], [b"x", b"y", b"z"], [b""]):
        bad.send_multipart(frames)
    assert bad.poll(5000)
    assert bad.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)  # an empty answer, not a hang
    bad.close(0)
    pub.publish([stored(1)])
    with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
        assert [r.seq for r in sub.receive(timeout_s=1.0)] == [0]  # the publisher goes on
    # a foreign publisher's garbage on the subscriber's socket is counted and skipped
    foreign = ctx.socket(zmq.PUB)
    foreign.bind(LOOPBACK)
    url = foreign.getsockopt_string(zmq.LAST_ENDPOINT)
    with EventSubscriber(url) as sub:
        time.sleep(0.3)
        foreign.send_multipart([b"", b"\x00" * 8, b"\xc1garbage"])
        foreign.send_multipart([b"only one frame"])
        foreign.send_multipart([b"", (3).to_bytes(8, "big"), encode_batch(KVEventBatch(ts=1.0, events=[stored(3)]))])
        got = [r.seq for r in sub.receive(timeout_s=1.0)]
        assert got == [3] and sub.bad_messages == 2
    foreign.close(0)
    assert pub.close()["errors"] == 0


def test_a_foreign_batchs_text_is_quoted_in_the_subscribers_log(caplog: pytest.LogCaptureFixture) -> None:
    """msgspec's error for a batch it cannot decode repeats the bad value as it came (an event
    tag nobody knows): the subscriber logged it raw, so whatever reaches its socket put a
    newline, a NUL or an ANSI escape into the log (a forged line) and a megabyte tag made a
    megabyte line. The error is quoted (``hicache.errors.quoted``)."""
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    foreign = ctx.socket(zmq.PUB)
    foreign.bind(LOOPBACK)
    url = foreign.getsockopt_string(zmq.LAST_ENDPOINT)
    evil = "x\nERROR forged\x00\x1b[31m\r" + "A" * 1_000_000
    caplog.set_level(logging.WARNING, logger="hicache.events")
    try:
        with EventSubscriber(url) as sub:
            time.sleep(0.3)
            foreign.send_multipart([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": evil}]])])
            foreign.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(KVEventBatch(ts=1.0, events=[stored(1)]))])
            assert [r.seq for r in sub.receive(timeout_s=1.0)] == [1] and sub.bad_messages == 1
    finally:
        foreign.close(0)
    logged = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(logged) == 1
    assert len(logged[0]) < 500 and not any(ord(c) < 32 or ord(c) == 127 for c in logged[0]), logged[0][:120]


def test_ipv6_endpoints_publish_and_replay() -> None:
    """An IPv6 address (``tcp://[::]:5557``, which the bind rule names) failed the start with
    "No such device", and a consumer could not connect to one: ZMQ takes IPv6 addresses only on
    sockets with its IPV6 option, which vLLM's publisher sets and ours did not."""
    import socket

    import pytest

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    pub = EventPublisher("tcp://[::1]:0", "tcp://[::1]:0")
    assert pub.endpoint.startswith("tcp://[::1]:")
    pub.publish([stored(1)])
    with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
        got = [r.seq for r in sub.receive(timeout_s=1.0)]
        assert got == [0] and sub.lost == 0 and sub.run_id == pub.run_id
    assert pub.close()["errors"] == 0

def test_the_cli_names_a_bad_endpoint() -> None:
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "events", "nonsense://x", "--timeout", "0.1"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert out.returncode == 2 and "nonsense://x" in out.stderr and "Traceback" not in out.stderr


async def test_an_in_process_stream_gets_every_batch_published_before_close() -> None:
    """The publisher's thread offers its last batches while close() runs on another thread;
    the stream dropped every batch that reached its loop after close() had begun, uncounted,
    so a consumer missed a closing cache's final removals."""
    from hicache.events.schema import AllBlocksCleared
    from hicache.events.stream import EventStream

    for in_executor in (False, True):
        pub = EventPublisher(None)
        stream = EventStream(1024, on_close=pub.remove_stream)
        pub.add_stream(stream)
        for _ in range(50):
            pub.publish([AllBlocksCleared(medium="GPU")])
        if in_executor:  # as KVEventService.aclose() closes it
            stats = await asyncio.get_running_loop().run_in_executor(None, pub.close)
        else:
            stats = pub.close()
        got = 0
        async for _seq, batch in stream:
            got += len(batch.events)
        assert got == stats["published_events"] == 50 and stream.dropped == 0, (in_executor, got, stats)


async def test_a_streams_dropped_batches_count_their_events_in_dropped_events() -> None:
    """``dropped_events`` counts events (what the publisher's queue drops), yet a stream's full
    queue added one per dropped batch: a slow in-process consumer losing batches of 10 events
    showed a tenth of its loss in ``hicache_events_dropped_events_total``."""
    from hicache.events.schema import AllBlocksCleared
    from hicache.events.stream import EventStream

    pub = EventPublisher(None)
    stream = EventStream(1, on_close=pub.remove_stream)  # never read: every batch after the first drops
    pub.add_stream(stream)
    for _ in range(5):
        pub.publish([AllBlocksCleared(medium="GPU")] * 10)
        await settled(pub)
    await asyncio.sleep(0.1)  # the last batch reaches the stream's loop
    assert pub.stats()["published_batches"] == 5 and stream.dropped == 4
    assert pub.stats()["dropped_events"] == 40 and stream.dropped_events == 40
    stream.close()  # the publisher keeps what the stream dropped
    assert (await asyncio.to_thread(pub.close))["dropped_events"] == 40

async def test_a_batch_offered_after_the_end_marker_is_counted_dropped() -> None:
    from hicache.events.schema import AllBlocksCleared
    from hicache.events.stream import EventStream

    stream = EventStream(8)
    batch = KVEventBatch(ts=0.0, events=[AllBlocksCleared(medium="GPU")])
    stream.close()
    await asyncio.sleep(0)  # the end marker is queued
    stream._put((0, batch))  # what a racing offer lands as
    assert [item async for item in stream] == [] and stream.dropped == 1


def test_the_cli_stopping_inside_a_batch_reports_a_position_that_resumes_the_rest() -> None:
    """``hicache events --count N`` stops after N events, and its counters give the position to
    resume from (``next_seq``, with ``run_id``). A stop inside a batch reported the number after
    that batch, so a resume skipped the batch's events not printed yet (a router resuming from
    it never learned of those stores and removals). The position is now that batch's own number:
    the resume prints it again from its start (applying a prefix again leaves the same state)."""
    import io

    from hicache.events.cli import run

    pub = EventPublisher(LOOPBACK, LOOPBACK)
    try:
        for n, events in enumerate(([stored(0)], [stored(1), stored(2), stored(3)])):
            assert pub.publish(events)  # a batch each
            while pub.stats()["next_seq"] == n:
                time.sleep(0.01)
        first = io.StringIO()
        stats = run(pub.endpoint, pub.replay_endpoint, start_seq=0, count=2, timeout_s=1.0,
                    out=first, err=io.StringIO())
        assert [line.split()[0] for line in first.getvalue().splitlines()] == ["seq=0", "seq=1"]
        assert stats["next_seq"] == 1, stats  # batch 1 was printed in part
        rest = io.StringIO()
        run(pub.endpoint, pub.replay_endpoint, start_seq=stats["next_seq"], timeout_s=1.0, as_json=True, out=rest, err=io.StringIO())
        seen = [json.loads(line)["event"]["token_ids"][0] for line in rest.getvalue().splitlines()]
        assert seen == [1, 2, 3]  # nothing of the batch is skipped
        stats = run(pub.endpoint, pub.replay_endpoint, start_seq=0, count=4, timeout_s=1.0,
                    out=io.StringIO(), err=io.StringIO())
        assert stats["next_seq"] == 2  # a count that ends with a batch resumes after it
    finally:
        pub.close()


def test_the_events_cli_quotes_a_medium_that_is_not_plain_text() -> None:
    """``hicache events`` prints one line an event; a publisher's medium with a newline in it
    (anything that reaches the socket can send one) printed as it came forged lines of its own.
    A plain medium keeps the documented ``seq=0 GPU stored ...`` shape."""
    import io

    from hicache.events.cli import run

    pub = EventPublisher(LOOPBACK, LOOPBACK)
    try:
        hostile = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1],
                              block_size=16, lora_id=None, medium="GPU\nseq=99 GPU removed forged\x1b[2J", lora_name=None)
        assert pub.publish([stored(0), hostile])
        while pub.stats()["next_seq"] == 0:
            time.sleep(0.01)
        out = io.StringIO()
        run(pub.endpoint, pub.replay_endpoint, start_seq=0, count=2, timeout_s=1.0, out=out, err=io.StringIO())
        lines = out.getvalue().splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith("seq=0 GPU stored ")
        assert lines[1].startswith("seq=0 'GPU\\nseq=99 GPU removed forged\\x1b[2J' stored ")
        assert all(ch.isprintable() for line in lines for ch in line)
    finally:
        pub.close()
