"""Model-based random testing of the whole hierarchical cache (see ``_fuzz.py``).

A few fixed seeds over tier sizes and policies run in the suite; the long variant runs many
more seeds by hand: ``HICACHE_FUZZ_SEEDS=200 pytest tests/cache/test_fuzz_model.py -k long``
(``HICACHE_FUZZ_BASE``: the first seed, default 1000; ``HICACHE_FUZZ_STEPS``: steps per seed,
default 400). A failing seed may depend on timing (copies run on threads): rerun it a few times.
"""

from __future__ import annotations

import os
import random

import pytest

from _fuzz import Fuzz, FuzzCase

CASES = [
    FuzzCase(seed=1),
    FuzzCase(seed=2, device_pages=8, host_pages=10, storage_pages=16, placement="tiered"),
    FuzzCase(seed=3, device_pages=12, host_pages=16, placement="reuse", prefetch_policy="best_effort"),
    FuzzCase(seed=4, device_pages=10, host_pages=12, write_policy="write_back", prefetch_policy="timeout"),
    FuzzCase(seed=5, page_size=1, device_pages=40, host_pages=48, write_policy="write_through_selective"),
    FuzzCase(seed=6, device_pages=10, host_pages=8, storage_pages=12, placement="tiered", busy_close=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c.seed}-{c.placement}-{c.write_policy}" + ("-busy-close" if c.busy_close else ""))
async def test_fuzz_fixed_seeds(case: FuzzCase) -> None:
    await Fuzz(case).run()


def _long_cases() -> list[FuzzCase]:
    n = int(os.environ.get("HICACHE_FUZZ_SEEDS", "0"))
    base = int(os.environ.get("HICACHE_FUZZ_BASE", "1000"))
    steps = int(os.environ.get("HICACHE_FUZZ_STEPS", "400"))
    out = []
    for seed in range(base, base + n):
        r = random.Random(seed)
        out.append(FuzzCase(
            seed=seed, steps=steps, page_size=r.choice([1, 2, 4, 8]),
            device_pages=r.choice([6, 8, 12, 24, 48]), host_pages=r.choice([6, 10, 16, 32, 64]),
            storage_pages=r.choice([8, 16, 64, 256]), placement=r.choice(["lru", "reuse", "tiered"]),
            write_policy=r.choice(["write_through", "write_through_selective", "write_back"]),
            prefetch_policy=r.choice(["best_effort", "wait_complete", "timeout"]),
            req_slots=r.choice([2, 4, 6]), busy_close=r.random() < 0.3,
        ))
    return out


@pytest.mark.skipif(not os.environ.get("HICACHE_FUZZ_SEEDS"), reason="long fuzz: set HICACHE_FUZZ_SEEDS=<n>")
@pytest.mark.parametrize("case", _long_cases() or [None], ids=lambda c: f"seed{getattr(c, 'seed', 0)}")
async def test_fuzz_long(case: FuzzCase) -> None:
    await Fuzz(case).run()
