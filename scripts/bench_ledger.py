#!/usr/bin/env python3
"""What the shared usage ledger costs a file-store write batch (``max_bytes`` across processes).

Two stores in one process, on one disk, write the same batches of fresh pages, interleaved
round by round: ``shared`` (the default: reserves in the ledger before writing, settles after)
and ``local`` (``shared=False``: counts only its own pages, no ledger). Prints one JSON document
with the median batch time of each and their ratio, per page size.

    python scripts/bench_ledger.py                 # 64 x 16 KiB and 16 x 4 MiB pages, 15 rounds
    python scripts/bench_ledger.py --rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import torch

from hicache.bench_args import positive_int
from hicache_backends.file import FileStorage


async def _batch_seconds(store: FileStorage, keys: list[str], value: torch.Tensor) -> float:
    t0 = time.perf_counter()
    assert await store.batch_set(keys, [value] * len(keys))
    return time.perf_counter() - t0


async def measure(pages: int, page_bytes: int, rounds: int, root: str) -> dict[str, float]:
    value = torch.randint(0, 255, (page_bytes,), dtype=torch.uint8)
    stores = {
        "shared": FileStorage(None, root=f"{root}/shared", max_bytes=None, min_free_bytes=0),
        "local": FileStorage(None, root=f"{root}/local", max_bytes=None, min_free_bytes=0, shared=False),
    }
    times: dict[str, list[float]] = {name: [] for name in stores}
    for store in stores.values():
        await store.__aenter__()
        await store.wait_index_ready(10)
    try:
        for r in range(rounds):
            order = list(stores) if r % 2 == 0 else list(reversed(stores))
            for name in order:
                keys = [f"{name}-{page_bytes}-{r}-{i}" for i in range(pages)]
                times[name].append(await _batch_seconds(stores[name], keys, value))
            for store in stores.values():  # keep the page cache small and the disk from filling
                await store.clear()
                await store.wait_background()
    finally:
        for store in stores.values():
            await store.aclose()
    shared, local = statistics.median(times["shared"]), statistics.median(times["local"])
    return {
        "pages": pages, "page_bytes": page_bytes, "rounds": rounds,
        "shared_ms": round(shared * 1e3, 3), "local_ms": round(local * 1e3, 3),
        "shared_over_local": round(shared / local, 3),
    }


async def main(rounds: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as root:
        return [await measure(64, 16 << 10, rounds, root), await measure(16, 4 << 20, rounds, root)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=15)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.rounds)), indent=1))
