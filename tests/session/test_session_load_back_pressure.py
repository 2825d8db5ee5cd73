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


async def test_admit_cancelled_while_making_room_leaves_nothing_locked() -> None:
    from hicache.prefix_cache import Req
    from hicache.replay import StackConfig, build_stack, serve_request

    stack = build_stack(StackConfig(page_size=PS, device_pages=8, host_pages=64, storage_backend=None))
    try:
        tokens = list(range(100, 100 + 4 * PS))
        await serve_request(stack, tokens, rid="a")
        await stack.cache.drain()
        await stack.cache.evict_async(1 << 20)  # its KV is on host only now
        held = stack.allocator.alloc(stack.allocator.available_size())  # the device is full
        waiting = asyncio.Event()

        async def never(tokens: int) -> bool:
            waiting.set()
            await asyncio.Event().wait()
            return False

        req = Req(rid="b", origin_input_ids=tokens + [1, 2, 3])
        stack.cache.match_req(req)
        task = asyncio.ensure_future(stack.cache.admit(req, make_room=never))
        await waiting.wait()  # admit found no room and is making some
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(n.lock_ref == 0 for n in stack.cache._nodes())
        stack.allocator.free(held)
        res = await stack.cache.admit(Req(rid="c", origin_input_ids=tokens + [4]))
        assert res.host_hit == 4 * PS  # with room, the same history loads back
        stack.cache.sanity_check()
    finally:
        await stack.aclose()
