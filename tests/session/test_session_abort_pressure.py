"""Aborts, misuse, memory pressure, and a seeded random mix that must leak nothing."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from hicache.prefix_cache import EvictParams
from hicache.session import SessionConfig
from session_helpers import PS, Conversation, Stack, make_stack


@pytest.fixture(params=["radix", "hiradix"])
async def stack(request):
    s = make_stack(hier=request.param == "hiradix")
    yield s
    await s.aclose()


def _slot_state(stack: Stack, sid: str) -> tuple:
    s = stack.cache.slots[sid]
    return (s.req_pool_idx, s.kv_committed_len, s.kv_allocated_len, list(s.token_ids), s.cache_protected_len)


async def test_abort_before_run_keeps_the_slot(stack: Stack) -> None:
    conv = Conversation(stack, "a", seed=21)
    await conv.turn(10, 3)
    state = _slot_state(stack, "a")
    free = stack.allocator.available_size()
    req = conv.request(6)
    await conv.begin(req)
    stack.cache.abort_req(req)
    assert req.req_pool_idx is None  # the row stays the slot's: the server must not free it
    assert _slot_state(stack, "a") == state
    assert stack.allocator.available_size() == free
    assert stack.cache.slots["a"].attached_rid is None
    r = await conv.turn(4, 2)
    assert r.restored and r.computed == 4 + 1
    await stack.empty_everything()
    stack.assert_initial()


async def test_abort_before_the_admit_task_ran_keeps_the_session_usable(stack: Stack) -> None:
    """A turn whose ``admit`` runs as a task, aborted before the task's first step: the abort
    rolled the slot back and detached it, then the admit restored the slot again for the
    aborted request and returned normally. The slot stayed attached to a request the server
    had dropped: the session could never be offloaded, and its release waited for a turn that
    never ends. The admit now raises RequestAbortedError and leaves the slot idle."""
    from hicache.errors import RequestAbortedError

    conv = Conversation(stack, "t", seed=25)
    await conv.turn(10, 3)
    state = _slot_state(stack, "t")
    req = conv.request(6)
    stack.cache.match_req(req)
    task = asyncio.ensure_future(stack.cache.admit(req))
    stack.cache.abort_req(req)  # before the task ran
    with pytest.raises(RequestAbortedError):
        await task
    assert stack.cache.slots["t"].attached_rid is None and _slot_state(stack, "t") == state
    r = await conv.turn(4, 2)  # the client's retry, a new request
    assert r.restored
    await stack.empty_everything()
    stack.assert_initial()


@pytest.mark.parametrize("where", ["after_prefill", "mid_chunks", "mid_decode"])
async def test_abort_mid_turn_frees_the_turn_and_keeps_the_session(stack: Stack, where: str) -> None:
    conv = Conversation(stack, "m", seed=22)
    await conv.turn(9, 3)
    await conv.turn(5, 2)
    state = _slot_state(stack, "m")
    free = stack.allocator.available_size()
    req = conv.request(30)
    await conv.begin(req)
    if where == "after_prefill":
        await conv.prefill(req)
    elif where == "mid_chunks":
        await conv.prefill(req, chunk=8, upto=int(req.prefix_indices.numel()) + 16)
        stack.cache.cache_unfinished_req(req, chunked=True)
    else:
        await conv.prefill(req)
        await conv.decode(req, 5)
    assert stack.allocator.available_size() < free
    stack.cache.abort_req(req)
    assert stack.allocator.available_size() == free
    assert _slot_state(stack, "m") == state
    assert stack.accounted() == stack.allocator.capacity
    # the client retries the turn (the history did not change) and goes on
    conv.turns += 1
    r = await conv.turn(7, 2)
    assert r.restored
    await stack.empty_everything()
    stack.assert_initial()


async def test_abort_of_a_first_turn(stack: Stack) -> None:
    conv = Conversation(stack, "f", seed=23)
    req = conv.request(21)
    await conv.begin(req)
    await conv.prefill(req, chunk=8, upto=16)
    stack.cache.cache_unfinished_req(req, chunked=True)
    stack.cache.abort_req(req)
    assert req.req_pool_idx is None
    assert not stack.cache.slots["f"].is_holding_kv
    assert stack.cache.slots["f"].attached_rid is None
    conv.history = []
    await conv.turn(21, 3)
    assert stack.cache.slots["f"].is_holding_kv
    await stack.empty_everything()
    stack.assert_initial()


async def test_second_request_of_a_busy_session_passes_through(stack: Stack) -> None:
    conv = Conversation(stack, "busy", seed=24)
    await conv.turn(10, 3)
    state = _slot_state(stack, "busy")
    r1 = conv.request(5)
    await conv.begin(r1)
    r2 = conv.request(4)  # the client misbehaves: a second turn while the first runs
    await conv.begin(r2)
    assert r2.req_pool_idx is None or r2.req_pool_idx != r1.req_pool_idx
    await conv.prefill(r2)
    await conv.decode(r2, 2)
    stack.cache.release_req(r2)  # a plain request: its KV went to the tree, its row freed
    assert stack.cache.metrics()["busy_bypass"] == 1
    await conv.prefill(r1)
    await conv.decode(r1, 2)
    conv.finish(r1)
    assert _slot_state(stack, "busy")[0] == state[0]
    conv.check_slot()
    await stack.empty_everything()
    stack.assert_initial()


async def test_diverging_history_flushes_the_slot(stack: Stack) -> None:
    conv = Conversation(stack, "d", seed=25)
    await conv.turn(16, 3)
    await conv.turn(8, 3)
    conv.history = conv.history[:12] + [7, 7, 7, 7, 7]  # the client edited the conversation
    r = await conv.turn(3, 2)
    assert not r.restored and r.prefix_len == 12  # the common whole pages, from the tree
    assert stack.cache.metrics()["offloads_mismatch"] == 1
    assert (await conv.turn(3, 2)).restored
    await stack.empty_everything()
    stack.assert_initial()


async def test_release_during_a_turn_happens_when_it_ends(stack: Stack) -> None:
    conv = Conversation(stack, "late", seed=26)
    await conv.turn(10, 3)
    req = conv.request(5)
    await conv.begin(req)
    assert stack.cache.release_session("late")
    assert "late" in stack.cache.slots
    await conv.prefill(req)
    await conv.decode(req, 2)
    conv.finish(req)
    assert "late" not in stack.cache.slots
    assert stack.req_pool.available_size() == stack.req_pool.size
    await stack.empty_everything()
    stack.assert_initial()


async def test_sync_evict_offloads_idle_sessions_lru() -> None:
    stack = make_stack(hier=False, device_pages=32)
    convs = [Conversation(stack, f"s{i}", seed=30 + i) for i in range(3)]
    for c in convs:
        await c.turn(14, 3)
    assert stack.inner.evictable_size() == 0
    held = stack.cache.session_held_tokens()
    freed = stack.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted
    assert freed > 0
    # the least recently used session went first; the others keep their slots
    assert not stack.cache.slots["s0"].is_holding_kv
    assert stack.cache.slots["s1"].is_holding_kv and stack.cache.slots["s2"].is_holding_kv
    assert stack.cache.session_held_tokens() < held
    assert stack.cache.metrics()["offloads_pressure"] == 1
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


@pytest.mark.parametrize("hier", [True, False])
async def test_more_sessions_than_the_device_holds_all_make_progress(hier: bool) -> None:
    # 24 pages (96 tokens) and 6 rows; 10 sessions reach ~45 tokens each
    stack = make_stack(hier=hier, device_pages=24, req_slots=6, host_pages=512)
    convs = [Conversation(stack, f"p{i}", seed=40 + i) for i in range(10)]
    running = asyncio.Semaphore(2)  # the scheduler's batch: two turns at once
    done = {c.sid: 0 for c in convs}

    async def client(c: Conversation) -> None:
        for t in range(4):
            async with running:
                await c.turn(9 if t == 0 else 6, 3)
            done[c.sid] += 1
            await asyncio.sleep(0)

    async with asyncio.timeout(60):
        await asyncio.gather(*(client(c) for c in convs))
    assert all(n == 4 for n in done.values())
    m = stack.cache.metrics()
    assert m["offloads_pressure"] > 0
    assert m["turns"] == 40
    assert stack.accounted() == stack.allocator.capacity
    stack.cache.sanity_check()
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def _random_client(stack: Stack, c: Conversation, rng: random.Random, steps: int,
                         running: asyncio.Semaphore) -> None:
    """One client doing a seeded random mix of turns, retries, aborts, edits and releases."""
    cache = stack.cache
    for _ in range(steps):
        await asyncio.sleep(0)
        action = rng.random()
        if action < 0.06 or len(c.history) > 90:
            cache.release_session(c.sid)
            if rng.random() < 0.5 or len(c.history) > 90:
                c.history = []  # a new conversation under the old id
            continue
        if action < 0.09:
            cache.reap_idle(time.monotonic() + 1e9) if rng.random() < 0.3 else cache.writeback.pump()
            continue
        if action < 0.12 and len(c.history) > 8:
            cut = rng.randrange(1, len(c.history))
            c.history = c.history[:cut] + c.new_tokens(rng.randint(0, 3))  # the client edits
        req = c.request(rng.randint(1, 9))
        cache.match_req(req)  # arrival: matched (restored) while it waits for the scheduler
        cache.start_prefetch(req)
        async with running:
            await c.begin(req, retries=rng.randint(0, 2))
            kind = rng.random()
            if kind < 0.12:
                cache.abort_req(req)  # before it ran
                continue
            chunk = rng.choice([None, 3, 5])
            n = len(req.origin_input_ids)
            start = int(req.prefix_indices.numel())
            if kind < 0.25:
                await c.prefill(req, chunk=chunk, upto=start + (n - start) // 2)
                cache.abort_req(req)  # mid-prefill
                continue
            if kind < 0.35 and cache._turns.restored(req) is not None:
                # it reserved pages, was rejected by the scheduler and is retried
                await cache.alloc_extend(req, n)
                await c.begin(req)
            await c.prefill(req, chunk=chunk)
            await c.decode(req, rng.randint(1, 4))
            if kind < 0.42:
                cache.abort_req(req)  # mid-decode
                continue
            c.finish(req)
            c.check_slot()
        if stack.hier and rng.random() < 0.1:
            await stack.inner.drain()


@pytest.mark.parametrize("hier,seed,storage", [
    (True, 1, False), (True, 2, False), (True, 3, True), (False, 4, False), (False, 5, False),
])
async def test_random_mix_leaks_nothing(hier: bool, seed: int, storage: bool) -> None:
    m = await run_random_mix(hier, seed, storage=storage)
    assert m["aborts"] > 0 and m["turns"] > 0 and m["offloads_pressure"] > 0


async def run_random_mix(hier: bool, seed: int, *, storage: bool = False) -> dict:
    """Seven concurrent clients, two running turns at a time, a small device pool: a seeded
    random mix; then every pool must be back to its initial free size."""
    rng = random.Random(seed)
    stack = make_stack(hier=hier, device_pages=64, req_slots=5, host_pages=96,
                       storage_id=f"mix-{uuid.uuid4().hex}" if storage else None,
                       config=SessionConfig(idle_offload_s=1.0))
    convs = [Conversation(stack, f"r{i}", seed=seed * 100 + i) for i in range(7)]
    running = asyncio.Semaphore(2)
    async with asyncio.timeout(60):
        await asyncio.gather(*(_random_client(stack, c, random.Random(rng.random()), 30, running)
                               for c in convs))
    cache = stack.cache
    assert stack.accounted() == stack.allocator.capacity
    cache.sanity_check()
    stack.inner.sanity_check()
    await stack.empty_everything()
    stack.assert_initial()
    assert len(cache.writeback) == 0
    m = cache.metrics()
    await stack.aclose()
    return m


async def test_running_turns_that_hold_everything_fail_cleanly() -> None:
    """Only a running request's own memory cannot be reclaimed: the allocation then fails
    (``None``) without leaking, and after the request is aborted everything returns."""
    stack = make_stack(hier=True, device_pages=8)
    idle = Conversation(stack, "idle", seed=90)
    await idle.turn(10, 3)  # an idle session: offloaded to make room, never a deadlock
    conv = Conversation(stack, "big", seed=91)
    req = conv.request(24)
    await conv.begin(req)
    assert await stack.cache.alloc_extend(req, 24) is not None
    assert not stack.cache.slots["idle"].is_holding_kv
    rows = stack.req_pool.available_size()
    other = Conversation(stack, "other", seed=92).request(40)
    await stack.cache.admit(other)
    assert await stack.cache.alloc_extend(other, 40) is None
    assert other.req_pool_idx is None and stack.req_pool.available_size() == rows
    stack.cache.abort_req(other)
    stack.cache.abort_req(req)
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_sync_evict_frees_offloaded_pages_once_their_copy_is_done() -> None:
    stack = make_stack(hier=True, device_pages=32)
    conv = Conversation(stack, "e", seed=93)
    await conv.turn(30, 3)
    held = stack.cache.session_held_tokens()
    stack.cache.evict(EvictParams(num_tokens=held))  # offloads; the copy to host is queued
    assert not stack.cache.slots["e"].is_holding_kv
    await stack.inner.drain()
    freed = stack.cache.evict(EvictParams(num_tokens=held)).num_tokens_evicted
    assert freed >= held - PS  # the committed whole pages, demoted to host
    assert (await conv.turn(2, 2)).admit.host_hit > 0
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_evict_async_offloads_and_waits_for_the_copies() -> None:
    stack = make_stack(hier=True, device_pages=32)
    for i in range(3):
        await Conversation(stack, f"ea{i}", seed=94 + i).turn(20, 3)
    held = stack.cache.session_held_tokens()
    free = stack.allocator.available_size()
    res = await stack.cache.evict_async(EvictParams(num_tokens=held // 2))
    assert res.num_tokens_evicted >= held // 2
    assert stack.allocator.available_size() - free == res.num_tokens_evicted
    assert stack.cache.metrics()["offloads_pressure"] >= 1
    await stack.cache.drain()
    assert len(stack.cache.writeback) == 0
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


@pytest.mark.parametrize("hier", [True, False])
async def test_queued_turns_do_not_pin_memory(hier: bool) -> None:
    """A server matches requests on arrival; sessions whose next turn waits in the queue must
    not pin their KV while the running request needs the memory (SGLang #27024)."""
    stack = make_stack(hier=hier, device_pages=24, req_slots=6)
    convs = [Conversation(stack, f"w{i}", seed=110 + i) for i in range(4)]
    for c in convs:
        await c.turn(14, 4)  # 4 sessions hold ~17 tokens each
    queued = [c.request(3) for c in convs]
    for c, req in zip(convs, queued):
        stack.cache.match_req(req)  # arrival: restored, waiting for the scheduler
        stack.cache.start_prefetch(req)
    assert all(stack.cache.slots[c.sid].attached_rid for c in convs)
    big = Conversation(stack, "big", seed=120)
    r = await big.turn(60, 2)  # needs more than what is free: queued sessions give theirs up
    assert r.computed == 60
    m = stack.cache.metrics()
    assert m["preempted_queued_turns"] > 0
    # the queued turns run afterwards, resuming from the tree, with exact KV
    for c, req in zip(convs, queued):
        await c.begin(req)
        await c.prefill(req)
        await c.decode(req, 2)
        c.finish(req)
        c.check_slot()
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_turns_queued_with_preemption_off_keep_their_slots() -> None:
    stack = make_stack(hier=False, device_pages=24, config=SessionConfig(preempt_queued_turns=False))
    c = Conversation(stack, "keep", seed=130)
    await c.turn(30, 4)
    req = c.request(3)
    stack.cache.match_req(req)
    assert await stack.cache.ensure_free(stack.allocator.capacity) is False
    assert stack.cache.slots["keep"].is_holding_kv
    stack.cache.abort_req(req)
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_an_aborted_turns_error_quotes_the_callers_ids(stack: Stack) -> None:
    """The ids are the caller's text: a session and request id with a newline, a NUL and an
    ANSI escape, a megabyte long, went raw into RequestAbortedError's message (and from there
    into a server's log). The message quotes them (``hicache.errors.quoted``)."""
    from hicache.errors import RequestAbortedError

    evil = "x\nERROR forged\x00\x1b[31m\r" + "A" * 1_000_000
    conv = Conversation(stack, evil, seed=26)
    await conv.turn(10, 3)
    req = conv.request(6)
    stack.cache.match_req(req)
    task = asyncio.ensure_future(stack.cache.admit(req))
    stack.cache.abort_req(req)
    with pytest.raises(RequestAbortedError) as aborted:
        await task
    message = str(aborted.value)
    assert "aborted" in message and len(message) < 500
    assert not any(ord(c) < 32 or ord(c) == 127 for c in message), message[:120]
    stack.cache.release_session(evil)
    await stack.empty_everything()
    stack.assert_initial()
