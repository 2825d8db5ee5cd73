"""The one-pass miss-ratio curve, the infinite cache and Belady against brute force, on small
traces of shapes nobody tuned them for: random prefix trees, one shared system prompt, agent
turns over shared prefixes, all-unique requests, one request repeated, prefixes that diverge,
blocks seen at several lengths, duplicate and unsorted timestamps.

Each reference is counted by the rule the tools state (:func:`~hicache.replay.trace.block_references`):
a hit is worth what earlier requests had of the block, at most this reference's length."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.replay import ReplayConfig, TraceRequest, load_trace
from hicache.replay.bounds import belady, infinite_cache
from hicache.replay.compare import compare_policies
from hicache.replay.sizing import lru_miss_ratio_curve

B = 512


def _req(ids: list[int], tail: int = B, ts: int = 0) -> dict:
    return {"timestamp": ts, "input_length": (len(ids) - 1) * B + tail, "output_length": 1, "hash_ids": ids}


def _tree(rng: random.Random) -> list[dict]:
    out = []
    for i in range(30):
        path, node = [], 0
        for _ in range(rng.randint(1, 5)):
            node = node * 3 + 1 + rng.randrange(3)
            path.append(node)
        out.append(_req(path, rng.randint(1, B), i))
    return out


def _system_prompt(rng: random.Random) -> list[dict]:
    return [_req(list(range(1, 9)) + [100 + i], rng.randint(1, B), i) for i in range(30)]


def _agents(rng: random.Random) -> list[dict]:
    sessions: list[list[int]] = []
    out, fresh = [], 1000
    for i in range(30):
        if not sessions or rng.random() < 0.3:
            sessions.append(list(rng.choice([[1, 2, 3, 4], [5, 6, 7, 8, 9]])))
        s = rng.choice(sessions)
        s += range(fresh, fresh + rng.randint(1, 2))
        fresh += 2
        out.append(_req(list(s), rng.randint(1, B), i))
    return out


def _unique(rng: random.Random) -> list[dict]:
    return [_req(list(range(10 * i, 10 * i + rng.randint(1, 4))), rng.randint(1, B), i) for i in range(25)]


def _repeated(rng: random.Random) -> list[dict]:
    return [_req([7, 8, 9], 300, i) for i in range(15)]


def _diverging(rng: random.Random) -> list[dict]:
    return [_req(list(range(1, 1 + rng.randint(0, 4))) + [100 + i], rng.randint(1, B), i) for i in range(25)]


def _lengths(rng: random.Random) -> list[dict]:
    """The same blocks at many lengths: a tail grows, shrinks, is completed."""
    return [_req(list(range(1, rng.randint(1, 5) + 1)), rng.randint(1, B), i) for i in range(30)]


def _timestamps(rng: random.Random) -> list[dict]:
    """Duplicate and out-of-order timestamps: requests are served in file order."""
    return [{**r, "timestamp": rng.choice([0, 5, 5, 3])} for r in _tree(rng)]


SHAPES: dict[str, Callable[[random.Random], list[dict]]] = {
    "tree": _tree, "system_prompt": _system_prompt, "agents": _agents, "unique": _unique,
    "repeated": _repeated, "diverging": _diverging, "lengths": _lengths, "timestamps": _timestamps,
}


def _load(tmp_path: Path, name: str, seed: int) -> list[TraceRequest]:
    path = tmp_path / f"{name}-{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SHAPES[name](random.Random(seed))))
    return load_trace(path)


def _references(requests: list[TraceRequest]) -> list[tuple[int, int]]:
    """(block, worth of a hit on it), written out from the rule, not through block_references."""
    out, longest = [], {}
    for r in requests:
        for i, h in enumerate(r.hash_ids):
            length = min(B, r.input_length - i * B)
            out.append((h, min(length, longest.get(h, 0))))
            longest[h] = max(longest.get(h, 0), length)
    return out


def _lru(refs: list[tuple[int, int]], capacity: int) -> tuple[int, int]:
    cache: OrderedDict[int, None] = OrderedDict()
    blocks = tokens = 0
    for h, worth in refs:
        if h in cache:
            blocks, tokens = blocks + 1, tokens + worth
            cache.move_to_end(h)
        elif capacity:
            cache[h] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return blocks, tokens


def _optimum(refs: list[tuple[int, int]], capacity: int, tokens: bool) -> int:
    """The most hits (blocks, or tokens) of any schedule of a cache of ``capacity`` blocks:
    after each reference it may keep any ``capacity`` of what it held and the block referenced."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for h, worth in refs:
        nxt: dict[frozenset[int], int] = {}
        for held, value in best.items():
            value += (worth if tokens else 1) if h in held else 0
            pool = sorted(held | {h})
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    nxt[key] = max(nxt.get(key, -1), value)
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_curve_and_infinite_cache_equal_brute_force(tmp_path, name) -> None:
    for seed in range(3):
        requests = _load(tmp_path, name, seed)
        refs = _references(requests)
        mrc = lru_miss_ratio_curve(requests)
        total = sum(min(B, r.input_length - i * B) for r in requests for i in range(len(r.hash_ids)))
        assert (mrc.references, mrc.total_tokens, mrc.unique_blocks) == (len(refs), total, len({h for h, _ in refs}))
        for cap in sorted({0, 1, 2, 3, 5, 8, mrc.unique_blocks // 2, mrc.unique_blocks, mrc.unique_blocks + 7}):
            blocks, tokens = _lru(refs, cap)
            assert round(mrc.hit_ratio(cap, tokens=False) * len(refs)) == blocks, (seed, cap)
            assert round(mrc.hit_ratio(cap) * total) == tokens, (seed, cap)
        seen: set[int] = set()
        hits = sum(h in seen or seen.add(h) is not None for h, _ in refs)  # type: ignore[func-returns-value]
        ideal = infinite_cache(requests)
        assert (ideal["hit_blocks"], ideal["hit_tokens"]) == (hits, sum(w for _, w in refs))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_belady_is_the_block_optimum_and_a_token_bound(tmp_path, name) -> None:
    for seed in range(3):
        requests = _load(tmp_path, name, seed)
        requests = requests[:max(1, next(i for i in range(len(requests), 0, -1)
                                        if sum(len(r.hash_ids) for r in requests[:i]) <= 14))]
        refs = _references(requests)
        for cap in (0, 1, 2, 3):
            b = belady(requests, cap)
            assert b["hit_blocks"] == _optimum(refs, cap, tokens=False), (seed, cap)
            assert _optimum(refs, cap, tokens=True) <= b["hit_tokens"] <= infinite_cache(requests)["hit_tokens"]


def test_belady_tokens_bound_what_the_real_cache_hits(tmp_path) -> None:
    """A whole block used again after a prompt's short tail used twice: MIN kept the tail (used
    sooner), so Belady said 10 tokens of 1,044 where every policy replayed hits 512."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(_req(ids, tail)) + "\n" for ids, tail in
                             (([1], B), ([2], 10), ([2], 10), ([1], B))))
    requests = load_trace(trace)
    b = belady(requests, 1)
    assert (b["hit_blocks"], b["hit_tokens"]) == (1, 512)  # the optimum here: the bound is tight
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 1, "host_blocks": 1, "storage_blocks": 1}})
    report = asyncio.run(compare_policies(cfg, requests, ["lru", "tiered"]))
    bound = report["bounds"]["belady_at_1_blocks"]
    assert all(0 < row["total_hit"] <= bound for row in report["policies"].values())
