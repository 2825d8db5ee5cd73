"""Resumed turns under device pressure: concurrent turns of many sessions get their history
back from some tier (>= 95% of it), and no offloaded session KV is freed before it is written."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from session_helpers import PS, Conversation, make_stack


async def run_sessions(*, sessions: int, at_once: int, rounds: int, device_pages: int,
                       host_pages: int, storage: bool) -> tuple[int, int, dict]:  # type: ignore[type-arg]
    stack = make_stack(device_pages=device_pages, host_pages=host_pages, req_slots=at_once + 2,
                       storage_id=f"lb-{uuid.uuid4()}" if storage else None)
    convs = [Conversation(stack, f"s{i}", seed=100 + i) for i in range(sessions)]
    running = asyncio.Semaphore(at_once)
    history = got = 0

    async def client(c: Conversation) -> None:
        nonlocal history, got
        for t in range(rounds):
            async with running:
                before = len(c.history)
                r = await c.turn(12 if t == 0 else 8, 4)
                if t and not r.restored:  # resumed from the tree: how much came back?
                    # what the tree can have: the committed whole pages (the last sampled
                    # token's KV is computed by the next turn)
                    kept = (before - 1) // PS * PS
                    history += kept
                    got += min(kept, r.prefix_len)
            await asyncio.sleep(0)

    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(client(c) for c in convs))
        m = stack.cache.metrics()
        stack.cache.sanity_check()
        assert stack.accounted() == stack.allocator.capacity
    finally:
        await stack.aclose()
    return history, got, m


@pytest.mark.parametrize("storage", [False, True])
async def test_concurrent_resumed_turns_get_their_history_back(storage: bool) -> None:
    history, got, m = await run_sessions(sessions=10, at_once=4, rounds=4, device_pages=40,
                                         host_pages=400, storage=storage)
    assert history > 0 and m["offloads_pressure"] > 0
    assert got >= 0.95 * history, (got, history, m.get("resume_tokens_recompute"))


async def test_no_session_kv_is_freed_before_it_is_written() -> None:
    _, _, m = await run_sessions(sessions=10, at_once=4, rounds=4, device_pages=40, host_pages=80,
                                 storage=True)
    assert m["offloads_pressure"] > 0
    assert m["writeback_lost"] == 0, m
