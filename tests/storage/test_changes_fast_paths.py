"""Fast paths of per-page bookkeeping on the storage thread must answer what the page-by-page
loops answer: a write's stored-page reports (``report_written``) and a write's per-page
success across pools (``all_pools_ok``)."""

from __future__ import annotations

import random

from hicache.controller.transfers import all_pools_ok
from hicache.observability.tier_events import TierChange, TierChangeHub
from hicache.storage import changes
from hicache.storage.types import PageKey


def _runs_page_by_page(pages: list[PageKey], parents: list[PageKey | None], ok: list[bool]) -> list[tuple]:
    """The reference: the loop ``report_written`` runs when the batch is not one chained run."""
    out: list[tuple] = []
    run: list[str] = []
    run_parent = None
    for page, parent, done in zip(pages, parents, ok):
        if not done or page.pool != "kv":
            if run:
                out.append((tuple(run), run_parent))
            run = []
            continue
        key = parent.key if parent is not None else None
        if run and key != run[-1]:
            out.append((tuple(run), run_parent))
            run = []
        if not run:
            run_parent = key
        run.append(page.key)
    if run:
        out.append((tuple(run), run_parent))
    return out


def _reported(pages: list[PageKey], parents: list[PageKey | None], ok: list[bool]) -> list[tuple]:
    hub = TierChangeHub()
    got: list[TierChange] = []
    hub.subscribe(got.append)
    changes.report_written(hub, "test", 4, pages, parents, ok)
    return [(c.keys, c.parent_key) for c in got]


def test_report_written_matches_the_page_by_page_runs() -> None:
    rng = random.Random(3)
    for case in range(400):
        n = rng.randrange(0, 12)
        pages = [PageKey(f"k{case}-{i}", "kv" if rng.random() < 0.9 else "mamba") for i in range(n)]
        first = PageKey(f"p{case}") if rng.random() < 0.5 else None
        parents: list[PageKey | None] = [first, *pages[:-1]] if n else []
        if n and rng.random() < 0.3:  # a chain broken somewhere
            parents[rng.randrange(n)] = PageKey(f"x{case}")
        ok = [rng.random() < 0.9 for _ in range(n)]
        if rng.random() < 0.5:  # often the usual batch: all landed, all KV, chained
            ok = [True] * n
            pages = [PageKey(p.key) for p in pages]
            parents = [first, *pages[:-1]] if n else []
        assert _reported(pages, parents, ok) == _runs_page_by_page(pages, parents, ok), case


def test_report_written_sends_one_event_for_a_chained_batch() -> None:
    pages = [PageKey(f"k{i}") for i in range(5)]
    assert _reported(pages, [PageKey("root"), *pages[:-1]], [True] * 5) == [
        (tuple(p.key for p in pages), "root")
    ]


def test_all_pools_ok_matches_the_page_by_page_answer() -> None:
    rng = random.Random(4)
    for case in range(500):
        n = rng.randrange(0, 9)
        result = {
            f"pool{j}": [rng.random() < 0.85 for _ in range(n + rng.choice((-2, -1, 0, 0, 0, 1)))]
            for j in range(rng.randrange(1, 4))
        }
        want = [all(i < len(f) and f[i] for f in result.values()) for i in range(n)]
        assert all_pools_ok(result, n) == want, (case, result, n)
    assert all_pools_ok(None, 3) == [False] * 3
    assert all_pools_ok({"kv": [True, True, True]}, 2) == [True, True]
    assert all_pools_ok({"kv": [1, 0, 2]}, 3) == [True, False, True]  # truthy flags count as landed
