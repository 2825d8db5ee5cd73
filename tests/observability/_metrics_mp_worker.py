"""A worker process for the multi-process metrics tests: one cache on a shared file store.

Run as ``python _metrics_mp_worker.py ROOT SEED REQUESTS``, with ``PROMETHEUS_MULTIPROC_DIR``
set. Serves ``REQUESTS`` prompts (the same prompts for the same seed, so a second worker finds
the first one's pages in the store), prints one JSON line with its own numbers, then waits for
a line on stdin and exits (its live gauges leave the scrape then).
"""

from __future__ import annotations

import asyncio
import json
import sys

from hicache.facade import HiCache

PS = 16


def config(root: str) -> dict:
    return {
        "model": {"name": "test/metrics-mp", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 64 * PS, "page_size": PS, "max_requests": 8, "max_context_len": 2048},
        "host": {"ratio": 4.0},
        "storage": {"backend": "file", "options": {"root": root}},
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "session": {"reap_interval_s": None},
    }


async def main(root: str, seed: int, requests: int) -> None:
    async with HiCache.from_config(config(root)) as cache:
        for i in range(requests):
            tokens = [seed * 100_000 + i * 1000 + j for j in range(6 * PS + 3)]
            h = await cache.begin(f"r{i}", tokens)
            for layer in range(cache.device_pool.layer_num):
                await h.wait_layer(layer)
            await cache.commit(h, finished=True)
        await cache.drain()
        cache.prometheus_text()  # what this worker's own /metrics would do: read its gauges now
        m = cache.metrics()
        print(json.dumps({"label": cache.metrics_label, "requests": m["controller"]["counters"]["requests"],
                          "storage_hits": m["controller"]["hit_tokens"]["storage"],
                          "host_size": m["host"]["size_tokens"]}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
