#!/usr/bin/env python3
"""What KV events cost the cache: the same request stream with events off and on.

Each run builds a stack (device, host, memory store, small enough that every tier evicts) and
serves the same prompts (a few shared system prompts, distinct turns) through
``serve_request``. Three variants, interleaved run by run in one process:

* ``off`` - nobody subscribed to the tier-change hub (the tiers build no change);
* ``zmq`` - a publisher with bound PUB and replay sockets and no consumer (what a deployment
  pays before a router connects);
* ``zmq+consumer`` - the same with a live subscriber on a thread that decodes every batch.

Also measured in isolation (less noisy than whole requests on a shared machine): the time a
tier pays per change it reports (convert a 4-page ``STORED`` change to a vLLM event and queue
it), and the publisher's end-to-end rate to a live ZMQ consumer.

Reports requests/s per variant (median of ``--repeats``), the ratio to ``off`` per run, the
events published, and what the consumer received. Example::

    .venv/bin/python scripts/bench_events.py --requests 300 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.bench_args import output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402
from hicache.controller import ControllerConfig  # noqa: E402
from hicache.events.publisher import EventPublisher  # noqa: E402
from hicache.events.service import KVEventService  # noqa: E402
from hicache.events.subscriber import EventSubscriber  # noqa: E402
from hicache.replay import StackConfig, build_stack, serve_request  # noqa: E402

PS = 16


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1 << 20) for _ in range(8 * PS)] for _ in range(4)]
    return [systems[i % 4] + [rng.randrange(1 << 20) for _ in range(4 * PS)] for i in range(n)]


async def one_run(variant: str, reqs: list[list[int]]) -> dict[str, Any]:
    stack = build_stack(StackConfig(page_size=PS, device_pages=64, host_pages=128, storage_backend="memory",
                                    storage_pages=256, controller=ControllerConfig(prefetch_threshold=PS)))
    service = consumer = None
    received = [0]
    if variant != "off":
        pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        service = KVEventService(stack.tier_changes, pub)
        if variant == "zmq+consumer":
            sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)

            def consume() -> None:
                for got in sub.receive(timeout_s=2.0):
                    received[0] += len(got.batch.events)
                sub.close()

            consumer = threading.Thread(target=consume)
            consumer.start()
    t0 = time.perf_counter()
    for i, tokens in enumerate(reqs):
        await serve_request(stack, tokens, rid=f"r{i}", verify=False)
    await stack.cache.drain()
    elapsed = time.perf_counter() - t0
    await stack.aclose()
    stats = await service.aclose() if service is not None else {}
    if consumer is not None:
        await asyncio.to_thread(consumer.join, 30)
    return {"rps": len(reqs) / elapsed, "events": stats.get("published_events", 0),
            "dropped": stats.get("dropped_events", 0), "received": received[0]}


def per_change_us(n: int = 20_000) -> float:
    """Median over 5 rounds of the microseconds one 4-page stored change costs its tier."""
    from hicache.keys import page_hashes
    from hicache.observability import ChangeKind, Tier, TierChange, TierChangeHub

    tokens = list(range(4 * PS))
    change = TierChange(ChangeKind.STORED, Tier.DEVICE, tuple(page_hashes(tokens, PS)), token_ids=tuple(tokens),
                        page_size=PS)
    hub = TierChangeHub()
    pub = EventPublisher(None, max_queue_events=1 << 30)
    service = KVEventService(hub, pub)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            hub.emit(change)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    pub.close(timeout=60)
    del service
    return round(statistics.median(rounds), 2)


def zmq_rate(n: int = 20_000) -> dict[str, Any]:
    """Events/s from ``publish`` to a live consumer's decoded batches, over loopback TCP."""
    from hicache.events.schema import BlockStored

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
    got = [0]

    def consume() -> None:
        for r in sub.receive(timeout_s=2.0):
            got[0] += len(r.batch.events)
            if got[0] >= n:
                return

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    ev = BlockStored(block_hashes=[bytes(32)] * 4, parent_block_hash=None, token_ids=list(range(4 * PS)),
                     block_size=PS, lora_id=None, medium="GPU", lora_name=None)
    t0 = time.perf_counter()
    for _ in range(n):
        pub.publish([ev])
    t.join(120)
    elapsed = time.perf_counter() - t0
    sub.close()
    stats = pub.close()
    return {"events_per_s": round(got[0] / elapsed), "received": got[0], "dropped": stats["dropped_events"],
            "lost": sub.lost}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    reqs = prompts(args.requests, args.seed)
    variants = ["off", "zmq", "zmq+consumer"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    await one_run("off", reqs[: max(10, args.requests // 10)])  # warm-up: imports, allocator pages
    for rep in range(args.repeats):
        order = variants if rep % 2 == 0 else list(reversed(variants))
        for v in order:
            runs[v].append(await one_run(v, reqs))
    off = [r["rps"] for r in runs["off"]]
    return {
        "requests": args.requests,
        "repeats": args.repeats,
        "median_rps": {v: round(statistics.median(r["rps"] for r in runs[v]), 1) for v in variants},
        "median_ratio_to_off": {
            v: round(statistics.median(r["rps"] / o for r, o in zip(runs[v], off)), 3) for v in variants[1:]
        },
        "events_per_run": runs["zmq"][0]["events"],
        "dropped": sum(r["dropped"] for v in variants for r in runs[v]),
        "consumer_received_all": all(r["received"] == r["events"] for r in runs["zmq+consumer"]),
        "per_change_us": per_change_us(),
        "zmq_to_consumer": zmq_rate(),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=300)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=output_file, default=None)
    emit_report(asyncio.run(main(ap.parse_args())), ap.parse_args().out)
