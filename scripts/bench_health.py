#!/usr/bin/env python3
"""Request time against a storage backend that hangs, with and without the controller's health.

Two stacks in one process over the ``memory`` backend made to hang on every call; both use the
``timeout`` prefetch policy with SGLang's defaults (2.0 s + 0.1 s per 1Ki tokens). The baseline
has health switched off (no stall trip, no error trip: each request waits its prefetch timeout,
which is what every request paid before). Requests of 600 tokens are served in turn, the two
stacks interleaved; the report gives the median and maximum seconds per request after the
first (the first pays the stall that marks the store down).

Prints one JSON document (also written to ``--out``). Example::

    .venv/bin/python scripts/bench_health.py --requests 6
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_backends.memory import MemoryStorage  # noqa: E402

from hicache.bench_args import output_file  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402
from hicache.controller import ControllerConfig  # noqa: E402
from hicache.replay import StackConfig, build_stack, serve_request  # noqa: E402
from hicache.storage import PageKey  # noqa: E402

PS = 16


class HangingStorage(MemoryStorage):
    """Every call waits while ``hang`` is set (polled: calls run on the controller's I/O thread)."""

    backend_name = "hanging-memory"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hang = True

    async def _wait(self) -> None:
        while self.hang:
            await asyncio.sleep(0.01)

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        await self._wait()
        return await super()._exists(pages)


def make(health: bool) -> tuple[Any, HangingStorage]:
    store = HangingStorage(store_id=f"bench-health-{uuid.uuid4()}")
    extra: dict[str, Any] = {} if health else {"storage_stall_s": 0.0, "storage_health_errors": 1 << 30}
    cfg = StackConfig(page_size=PS, device_pages=512, host_pages=1024, storage_backend=None,
                      controller=ControllerConfig(prefetch_policy="timeout", prefetch_threshold=PS,
                                                  cancelled_io_grace_s=0.0, close_timeout_s=1.0, **extra))
    return build_stack(cfg, storage=store), store


async def main(requests: int) -> dict[str, Any]:
    stacks = {"baseline_no_health": make(False), "health": make(True)}
    times: dict[str, list[float]] = {name: [] for name in stacks}
    try:
        for i in range(requests):
            for name, (stack, _) in stacks.items():
                tokens = list(range(i * 1000, i * 1000 + 600))
                t0 = time.perf_counter()
                await serve_request(stack, tokens, rid=f"{name}-{i}")
                times[name].append(time.perf_counter() - t0)
    finally:
        for stack, store in stacks.values():
            store.hang = False
            await stack.aclose()
    out: dict[str, Any] = {"requests": requests, "tokens_per_request": 600, "seconds": {}}
    for name, ts in times.items():
        later = ts[1:]
        out["seconds"][name] = {"first": round(ts[0], 3), "median_after_first": round(statistics.median(later), 4),
                                "max_after_first": round(max(later), 4)}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--out", type=output_file, default=None)
    args = ap.parse_args()
    emit_report(asyncio.run(main(max(2, args.requests))), args.out)
