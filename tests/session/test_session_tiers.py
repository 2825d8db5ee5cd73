"""Multi-turn conversations, write-back on release and idle, and resumes from host and storage."""

from __future__ import annotations

import uuid

import pytest

from session_helpers import PS, Conversation, Stack, kv_matches, make_stack
from hicache.session import SessionConfig


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def hstack():
    s = make_stack(hier=True)
    yield s
    await s.aclose()


async def _evict_device(stack: Stack) -> None:
    await stack.inner.drain()
    await stack.inner.evict_async(1 << 30)
    assert stack.inner.total_size() == 0


async def _evict_host(stack: Stack) -> None:
    await stack.inner.drain()
    stack.inner.evict_host(1 << 30)
    assert stack.inner.host_size() == 0


@pytest.mark.parametrize("hier", [True, False])
async def test_many_turns_prefill_only_new_tokens_and_kv_is_exact(hier: bool) -> None:
    stack = make_stack(hier=hier, device_pages=96)
    conv = Conversation(stack, "chat", seed=11)
    first = await conv.turn(13, 4)
    assert first.computed == 13 and not first.restored
    for i in range(14):
        n_in = 3 + i % 5
        before = len(conv.history)
        r = await conv.turn(n_in, 2 + i % 3, chunk=4 if i % 4 == 3 else None)
        assert r.restored
        # only the new tokens and the last sampled token (whose KV no turn computed yet)
        assert r.prefix_len == before - 1
        assert r.computed == n_in + 1
        assert stack.accounted() == stack.allocator.capacity
    slot = stack.cache.slots["chat"]
    row = stack.req_pool.req_to_token[slot.req_pool_idx][: slot.kv_committed_len]
    assert kv_matches(stack.device_pool, row, conv.history[: slot.kv_committed_len])
    m = stack.cache.metrics()
    assert m["turns"] == 15 and m["resumes_slot"] == 14
    assert m["sessions"]["chat"]["resumes"]["slot"] == 14
    assert m["sessions"]["chat"]["held_tokens"] == stack.cache.session_held_tokens()
    stack.cache.sanity_check()
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_release_then_resume_from_host(hstack: Stack) -> None:
    conv = Conversation(hstack, "s", seed=12)
    for _ in range(4):
        await conv.turn(9, 3)
    committed = hstack.cache.slots["s"].kv_committed_len
    hstack.cache.release_session("s")
    assert len(hstack.cache.writeback) >= 0
    await hstack.cache.drain_writeback()
    assert len(hstack.cache.writeback) == 0
    m = hstack.cache.metrics()
    assert m["writeback_queued"] == 1 and m["writeback_done"] == 1
    await _evict_device(hstack)  # the session's pages now live on host only
    assert hstack.inner.host_size() >= committed // PS * PS
    # the conversation comes back (same session id): its history loads from host
    r = await conv.turn(5, 2)
    assert not r.restored
    assert r.admit.host_hit == committed // PS * PS and r.admit.device_hit == 0
    assert r.prefix_len == committed // PS * PS
    m = hstack.cache.metrics()
    assert m["resumes_host"] == 1
    # and the session continues from its slot afterwards
    r = await conv.turn(4, 2)
    assert r.restored
    await hstack.empty_everything()
    hstack.assert_initial()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
async def test_release_writes_back_whatever_the_write_policy(policy: str) -> None:
    stack = make_stack(hier=True, write_policy=policy)
    conv = Conversation(stack, "wb", seed=13)
    await conv.turn(17, 3)
    await conv.turn(6, 3)
    stack.cache.release_session("wb")
    await stack.cache.drain_writeback()
    assert stack.cache.metrics()["writeback_done"] == 1
    await _evict_device(stack)
    r = await conv.turn(3, 2)
    assert r.admit.host_hit > 0
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_release_then_resume_from_storage() -> None:
    stack = make_stack(hier=True, storage_id=f"session-{uuid.uuid4().hex}")
    conv = Conversation(stack, "st", seed=14)
    for _ in range(3):
        await conv.turn(11, 3)
    committed = stack.cache.slots["st"].kv_committed_len
    stack.cache.release_session("st")
    await stack.cache.drain_writeback()
    await stack.inner.drain()  # host -> storage
    await _evict_device(stack)
    await _evict_host(stack)
    assert stack.inner.total_size() == 0 and not stack.inner.root_node.children
    r = await conv.turn(4, 2)
    assert r.admit.storage_hit == committed // PS * PS
    assert r.prefix_len == committed // PS * PS
    assert stack.cache.metrics()["resumes_storage"] == 1
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_resume_after_restart_from_shared_storage() -> None:
    store = f"session-{uuid.uuid4().hex}"
    a = make_stack(hier=True, storage_id=store)
    conv = Conversation(a, "r", seed=15)
    for _ in range(3):
        await conv.turn(8, 3)
    committed = a.cache.slots["r"].kv_committed_len
    await a.aclose()  # releases the session, drains write-back and storage writes
    b = make_stack(hier=True, storage_id=store)
    conv.stack = b
    r = await conv.turn(4, 2)
    assert r.admit.storage_hit == committed // PS * PS
    await b.empty_everything()
    b.assert_initial()
    await b.aclose()


async def test_resume_while_write_back_is_in_flight(hstack: Stack) -> None:
    conv = Conversation(hstack, "f", seed=16)
    await conv.turn(12, 3)
    await conv.turn(9, 3)
    hstack.cache.release_session("f")
    assert len(hstack.cache.writeback) == 1  # copy queued, not done: nothing awaited yet
    r = await conv.turn(4, 2)  # the KV is still on device: a device hit, correct (checked)
    assert r.admit.device_hit > 0
    await hstack.cache.drain_writeback()
    await hstack.empty_everything()
    hstack.assert_initial()


async def test_idle_sessions_are_offloaded_and_expired_by_reap() -> None:
    clock = FakeClock()
    stack = make_stack(hier=True, clock=clock, config=SessionConfig(idle_offload_s=10, session_timeout_s=100))
    a = Conversation(stack, "a", seed=17)
    b = Conversation(stack, "b", seed=18)
    await a.turn(10, 3)
    await b.turn(10, 3)
    clock.t += 5
    await b.turn(3, 2)
    clock.t += 7  # a idle 12 s, b idle 7 s
    assert stack.cache.reap_idle() == 1
    assert not stack.cache.slots["a"].is_holding_kv and stack.cache.slots["b"].is_holding_kv
    assert stack.cache.metrics()["offloads_idle"] == 1
    await stack.cache.drain_writeback()
    r = await a.turn(3, 2)  # resumes from the tree (device pages still cached)
    assert r.admit.device_hit > 0 and not r.restored
    assert stack.cache.metrics()["resumes_device"] == 1
    clock.t += 200
    assert stack.cache.reap_idle() == 2
    assert not stack.cache.slots
    assert stack.cache.metrics()["sessions_expired"] == 2
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_reaper_task_survives_errors_and_stops_on_close() -> None:
    import asyncio

    stack = make_stack(hier=True, config=SessionConfig(idle_offload_s=0.0, reap_interval_s=0.01))
    async with stack.cache as cache:
        conv = Conversation(stack, "bg", seed=19)
        await conv.turn(9, 3)
        calls = {"n": 0}
        real = cache.reap_idle

        def flaky(now=None):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return real(now)

        cache._lifecycle.reaper._tick = flaky
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not cache.slots["bg"].is_holding_kv:
                break
        assert not cache.slots["bg"].is_holding_kv  # offloaded by the task after its error
        assert cache.metrics()["reaper_errors"] == 1
        reaper = cache._lifecycle.reaper
        assert reaper.running
    assert not reaper.running
    await stack.engine.aclose()


async def test_refused_write_backs_are_retried_until_the_queue_drains() -> None:
    # a backup queue of one job: most submissions are refused at first
    stack = make_stack(hier=True, write_policy="write_back", controller={"backup_queue_size": 1})
    convs = [Conversation(stack, f"q{i}", seed=60 + i) for i in range(4)]
    for c in convs:
        await c.turn(14, 3)
    for c in convs:
        stack.cache.release_session(c.sid)
    assert len(stack.cache.writeback) > 1
    await stack.cache.drain_writeback()
    m = stack.cache.metrics()
    assert len(stack.cache.writeback) == 0
    assert m["writeback_done"] == 4 and m["writeback_dropped"] == 0
    assert m["writeback_attempts"] > 4  # some were refused, then retried
    await _evict_device(stack)
    for c in convs:
        assert (await c.turn(2, 2)).admit.host_hit > 0
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_a_write_back_the_tree_started_itself_is_not_counted_lost() -> None:
    # the host is full when the session is released: its backup is deferred (the tree keeps
    # the KV on device until it starts). Room frees and the tree starts the copy itself; the
    # pages are then evicted from device and host before the queue looks again. Their host
    # copy was made: that is a finished write-back, not a lost one.
    stack = make_stack(hier=True, write_policy="write_back")
    conv = Conversation(stack, "deferred", seed=75)
    await conv.turn(14, 3)
    taken = stack.host_pool.alloc(stack.host_pool.available_size())
    stack.cache.release_session("deferred")
    assert len(stack.cache.writeback) == 1  # refused for host room, kept on device
    stack.host_pool.free(taken)
    await stack.inner.drain()  # the tree starts its deferred backup (not the queue)
    assert stack.inner.host_size() > 0
    await _evict_device(stack)
    await _evict_host(stack)
    stack.cache.writeback.pump()
    m = stack.cache.metrics()
    assert len(stack.cache.writeback) == 0
    assert m["writeback_lost"] == 0 and m["writeback_done"] == 1, m
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_write_back_gives_up_without_host_room_and_leaks_nothing(policy: str) -> None:
    stack = make_stack(hier=True, host_pages=2, write_policy=policy)
    conv = Conversation(stack, "nohost", seed=70)
    await conv.turn(30, 3)
    stack.cache.release_session("nohost")
    await stack.cache.drain_writeback()
    m = stack.cache.metrics()
    assert m["writeback_dropped"] + m["writeback_done"] == 1
    assert len(stack.cache.writeback) == 0
    # the KV stays usable from the device tree until evicted
    assert (await conv.turn(2, 2)).admit.device_hit > 0
    await stack.empty_everything()
    stack.assert_initial()
    await stack.aclose()


async def test_shared_system_prompt_is_protected_and_deduplicated(hstack: Stack) -> None:
    system = list(range(500, 516))
    sys_conv = Conversation(hstack, "sys", seed=80, streaming=False)
    sys_conv.history = list(system)
    await sys_conv.turn(0, 1)  # the 16-token system prompt lands in the tree
    # two sessions with the same conversation (same token stream)
    a = Conversation(hstack, "a", seed=81)
    b = Conversation(hstack, "b", seed=81)
    for c in (a, b):
        c.history = list(system)
        r = await c.turn(6, 3)
        assert r.prefix_len == 16 and hstack.cache.slots[c.sid].cache_protected_len == 16
        await c.turn(5, 2)
    assert a.history == b.history
    hstack.cache.release_session("a")
    tree = hstack.inner.total_size()
    b_held = hstack.cache.slots["b"].held_tokens(PS)
    free = hstack.allocator.available_size()
    hstack.cache.release_session("b")  # b's pages duplicate a's, now in the tree: all freed
    assert hstack.inner.total_size() == tree
    assert hstack.allocator.available_size() == free + b_held
    assert hstack.accounted() == hstack.allocator.capacity
    hstack.inner.sanity_check()
    # a third client continues the same conversation from the tree
    c = Conversation(hstack, "c", seed=0)
    c.history = list(a.history)
    r = await c.turn(2, 2)
    assert r.prefix_len == (len(a.history) - 1) // PS * PS
    await hstack.empty_everything()
    hstack.assert_initial()


async def test_close_goes_on_when_one_session_cannot_be_released() -> None:
    # a caller of the session cache itself (not the facade, which refuses such ids) left a
    # token id outside uint32 in a session's KV: handing it to the tree raises. Before, the
    # close raised there: the other sessions were not released and the controller never closed
    stack = make_stack(storage_id=f"close-{uuid.uuid4().hex}")
    good = Conversation(stack, "good", seed=1)
    await good.turn(n_in=3 * PS, n_out=1)
    bad = Conversation(stack, "bad", seed=2)
    req = bad.request(2 * PS)
    await bad.begin(req)
    await bad.prefill(req)
    req.output_ids = [2**40] * PS  # decoded "tokens" no vocabulary has
    slots = await stack.cache.alloc_extend(req, len(req.full_ids))
    assert slots is not None
    req.fill_ids = req.full_ids
    req.kv_committed_len = len(req.full_ids)
    bad.finish(req)  # kept in the session's slot; the tree sees it only at release
    await stack.cache.aclose()
    assert stack.cache.session_metrics.counters["release_errors"] == 1
    # both released: the tree refuses the bad one's history before any change, so its KV is
    # freed, not kept (the release error above), and the good one's goes to the tree
    assert stack.cache.session_metrics.counters["sessions_released"] == 2
    assert not stack.cache.slots
    assert stack.controller is not None and stack.controller.state.value == "closed"
    await stack.aclose()


async def test_a_release_counts_no_second_hit_on_the_history_its_first_turn_matched_or_chunked(hstack: Stack) -> None:
    """Handing a session over inserted its whole history counting a hit on every node the tree
    had, also those its own first turn had matched (hit counted then) or inserted chunk by chunk
    (its own prompt, no reuse): a conversation nobody reused reached ``hit_count`` 2, so the
    reuse placement wrote it to storage and SLRU kept it as reused. A release now counts hits
    only past the part the session already counted, as a plain request's finish does."""
    system = list(range(500, 516))
    plain = Conversation(hstack, "plain", seed=90, streaming=False)
    plain.history = list(system)
    await plain.turn(0, 1)  # a 16-token prompt lands in the tree (one hit: its insert)

    def hits() -> dict[tuple[int, ...], int]:
        return {tuple(n.key): n.hit_count for n in hstack.inner._nodes() if n is not hstack.inner.root_node}

    s = Conversation(hstack, "s", seed=91)
    s.history = list(system)
    await s.turn(5 * PS, 1, chunk=2 * PS)  # matches the prompt (a hit), then inserts its own chunks
    before = hits()
    assert before[tuple(system)] == 2
    assert hstack.cache.release_session("s")
    after = hits()
    for key, count in before.items():  # a node a first turn counted is not counted again
        assert after.get(key, count) == count, (key, count, after)
    assert all(count == 1 for key, count in after.items() if key not in before)
    await hstack.empty_everything()
    hstack.assert_initial()
