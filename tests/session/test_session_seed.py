"""The seed's behaviours (SGLang's SessionAwareCache), on our radix caches."""

from __future__ import annotations

import pytest
import torch

from hicache.prefix_cache import EvictParams, MatchPrefixParams, RadixKey, Req, Session
from hicache.session import SessionAwareCache, VirtualNode
from session_helpers import PS, Conversation, kv_matches, make_stack


@pytest.fixture(params=["radix", "hiradix"])
async def stack(request):
    s = make_stack(hier=request.param == "hiradix")
    yield s
    await s.aclose()


async def test_non_streaming_requests_pass_through(stack) -> None:
    conv = Conversation(stack, "plain", seed=1, streaming=False)
    r1 = await conv.turn(12, 3)
    assert not stack.cache.slots
    assert stack.req_pool.available_size() == stack.req_pool.size
    # the tree has the prompt: the second request hits it by an ordinary match
    r2 = await conv.turn(5, 2)
    assert r2.prefix_len == (len(r1.req.full_ids) - 1) // PS * PS
    assert not r2.restored
    # a request with a non-streaming session passes through too
    req = Req(rid="x", origin_input_ids=list(range(9)), session=Session("s", streaming=False))
    m = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), req=req))
    assert not isinstance(m.last_device_node, VirtualNode)
    assert not stack.cache.slots
    await stack.empty_everything()
    stack.assert_initial()


async def test_next_turn_restores_without_tree_match(stack, monkeypatch) -> None:
    conv = Conversation(stack, "s1", seed=2)
    await conv.turn(10, 4)
    slot = stack.cache.slots["s1"]
    assert slot.is_holding_kv and slot.kv_committed_len == 10 + 4 - 1
    calls = []
    real = stack.inner.match_prefix
    monkeypatch.setattr(stack.inner, "match_prefix", lambda p: calls.append(p) or real(p))
    if stack.hier:
        monkeypatch.setattr(stack.inner, "match_req", lambda *a, **k: calls.append(a) or None)
    req = conv.request(5)
    m = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), req=req))
    assert calls == []  # no tree walk
    assert isinstance(m.last_device_node, VirtualNode) and m.last_host_node is m.last_device_node
    assert m.device_indices.numel() == slot.kv_committed_len  # the committed length is reused
    assert req.req_pool_idx == slot.req_pool_idx
    assert m.cache_protected_len == slot.cache_protected_len
    assert kv_matches(stack.device_pool, m.device_indices, req.origin_input_ids[: slot.kv_committed_len])
    # locks on the virtual node are no-ops
    before = (stack.inner.evictable_size(), stack.inner.protected_size())
    assert stack.cache.inc_lock_ref(m.last_device_node).delta == 0
    assert stack.cache.dec_lock_ref(m.last_device_node).delta == 0
    assert stack.cache.dec_lock_ref(m.last_device_node).delta == 0
    assert (stack.inner.evictable_size(), stack.inner.protected_size()) == before
    monkeypatch.undo()
    stack.cache.abort_req(req)
    await stack.empty_everything()
    stack.assert_initial()


async def test_restore_is_idempotent_on_retry(stack) -> None:
    conv = Conversation(stack, "s", seed=3)
    await conv.turn(9, 3)
    slot = stack.cache.slots["s"]
    state = (slot.req_pool_idx, slot.kv_committed_len, slot.kv_allocated_len)
    req = conv.request(7)
    first = stack.cache.match_req(req)
    # rejected by the scheduler, retried: the same restore again, the slot untouched
    second = stack.cache.match_req(req)
    assert torch.equal(first.device_indices, second.device_indices)
    assert (slot.req_pool_idx, slot.kv_committed_len, slot.kv_allocated_len) == state
    # rejected after it reserved pages: a retry keeps them accounted to the request
    await stack.cache.admit(req)
    await stack.cache.alloc_extend(req, len(req.origin_input_ids))
    grown = req.kv_allocated_len
    stack.cache.match_req(req)
    assert req.kv_allocated_len == grown
    await conv.prefill(req)
    await conv.decode(req, 2)
    conv.finish(req)
    conv.check_slot()
    await conv.turn(4, 2, retries=2)
    await stack.empty_everything()
    stack.assert_initial()


async def test_a_restored_turn_is_counted_once_as_a_request_and_a_device_hit() -> None:
    """A turn restored from its slot is a request whose history hit on device: it is counted in
    the cache's request, prompt, computed and hit counters like any admitted request (it was
    left out: three chat turns counted as one request, with no hit), once per turn, even when
    the scheduler admits the same turn again; an aborted turn keeps its one count."""
    stack = make_stack(hier=True)
    try:
        metrics = stack.inner.metrics
        conv = Conversation(stack, "s", seed=21)
        await conv.turn(9, 3)  # the first turn: admitted (and counted) by the inner cache
        assert metrics.counters["requests"] == 1
        before = (dict(metrics.counters), dict(metrics.hit_tokens))
        req = conv.request(5)
        res = await conv.begin(req)
        assert res.restored
        await stack.cache.admit(req)  # the scheduler admits it again: counted once
        total, prefix = len(req.origin_input_ids), res.prefix_len
        assert metrics.counters["requests"] == before[0]["requests"] + 1
        assert metrics.counters["prompt_tokens"] == before[0]["prompt_tokens"] + total
        assert metrics.counters["computed_tokens"] == before[0]["computed_tokens"] + total - prefix
        assert metrics.hit_tokens["device"] == before[1]["device"] + prefix
        assert metrics.hit_tokens["host"] == before[1]["host"]
        assert req.pending_counts is None  # counted at admit: nothing left for count_admitted
        stack.cache.count_admitted(req)
        stack.cache.abort_req(req)
        assert metrics.counters["requests"] == before[0]["requests"] + 1
        await conv.turn(4, 2, retries=2)  # restored again after the abort: one more request
        assert metrics.counters["requests"] == before[0]["requests"] + 2
        await stack.empty_everything()
        stack.assert_initial()
    finally:
        await stack.aclose()


async def test_chunked_turns_touch_the_tree_only_on_the_first_turn(stack) -> None:
    conv = Conversation(stack, "c", seed=4)
    await conv.turn(23, 3, chunk=8)
    slot = stack.cache.slots["c"]
    # the first turn's chunks were inserted and are protected by the slot's lock
    assert slot.cache_protected_len == 16
    assert stack.inner.protected_size() >= 16
    tree_before = stack.inner.total_size()
    nodes_before = stack.inner.pretty_print()
    for _ in range(3):
        r = await conv.turn(19, 2, chunk=5)
        assert r.restored and r.computed == 19 + 1
    assert stack.inner.total_size() == tree_before  # later turns never inserted anything
    assert stack.inner.pretty_print() == nodes_before
    assert slot.cache_protected_len == 16
    await stack.empty_everything()
    stack.assert_initial()


async def test_release_frees_exactly_what_the_slot_held(stack) -> None:
    a = Conversation(stack, "a", seed=5)
    b = Conversation(stack, "b", seed=6)
    for _ in range(3):
        await a.turn(7, 3)
        await b.turn(5, 4, chunk=3)
    cache = stack.cache
    assert cache.session_held_req_count() == 2
    held = cache.session_held_tokens()
    expect = sum(
        -(-s.kv_allocated_len // PS) * PS - s.cache_protected_len for s in cache.slots.values()
    )
    assert held == expect > 0
    assert stack.accounted() == stack.allocator.capacity
    rows_before = stack.req_pool.available_size()
    free_before = stack.allocator.available_size()
    tree_before = stack.inner.total_size()
    slot = cache.slots["a"]
    a_held = slot.held_tokens(PS)
    cache.release_session("a")
    assert "a" not in cache.slots
    assert stack.req_pool.available_size() == rows_before + 1
    assert cache.session_held_tokens() == held - a_held
    # what the slot held is now either free or owned by the tree (its committed whole pages)
    gained = (stack.allocator.available_size() - free_before) + (stack.inner.total_size() - tree_before)
    assert gained == a_held
    assert stack.accounted() == stack.allocator.capacity
    assert cache.release_session("a") is False
    stack.inner.sanity_check()
    cache.sanity_check()
    await stack.empty_everything()
    stack.assert_initial()


async def test_seed_style_release_with_a_cache_that_is_not_a_tree() -> None:
    """Without a tree to hand KV to, release frees [cache_protected_len, allocated) like the seed."""
    s = make_stack(hier=False)
    s.inner.disable = True
    conv = Conversation(s, "d", seed=7)
    await conv.turn(10, 3)
    await conv.turn(6, 3)
    assert s.cache.session_held_tokens() == s.allocator.capacity - s.allocator.available_size()
    s.cache.release_session("d")
    s.assert_initial()
    await s.aclose()


async def test_evict_passes_through_when_no_session_is_idle(stack) -> None:
    conv = Conversation(stack, "p", seed=8, streaming=False)
    await conv.turn(16, 2)
    size = stack.inner.total_size()
    assert size > 0
    if stack.hier:
        await stack.inner.drain()
    freed = stack.cache.evict(EvictParams(num_tokens=size)).num_tokens_evicted
    assert freed == size
    await stack.empty_everything()
    stack.assert_initial()


def test_forwarded_attributes() -> None:
    s = make_stack(hier=False)
    cache = s.cache
    assert isinstance(cache, SessionAwareCache)
    assert cache.page_size == PS and cache.req_to_token_pool is s.req_pool
    assert cache.token_to_kv_pool_allocator is s.allocator
    assert cache.root_node is s.inner.root_node  # anything else is the inner cache's
    assert cache.is_tree_cache() and not cache.disable
    cache.disable = True
    assert s.inner.disable


async def test_turn_that_resends_only_the_committed_history(stack) -> None:
    """A "regenerate" turn sends exactly the committed history: one token is recomputed (for
    the logits) and the answer is generated anew."""
    conv = Conversation(stack, "regen", seed=9)
    await conv.turn(10, 4)
    slot = stack.cache.slots["regen"]
    committed = slot.kv_committed_len
    conv.history = conv.history[:committed]
    r = await conv.turn(0, 3)
    assert r.restored and r.prefix_len == committed - 1 and r.computed == 1
    await conv.turn(2, 2)
    await stack.empty_everything()
    stack.assert_initial()


def test_config_is_validated() -> None:
    from hicache.errors import ConfigError
    from hicache.session import SessionConfig

    with pytest.raises(ConfigError):
        SessionConfig(idle_offload_s=-1)
    with pytest.raises(ConfigError):
        SessionConfig(reap_interval_s=0)
    with pytest.raises(ConfigError, match="allowed"):
        SessionConfig.from_dict({"idle_offload": 3})
    assert SessionConfig.from_dict({"idle_offload_s": 3}).idle_offload_s == 3


@pytest.mark.parametrize("name", ["idle_offload_s", "session_timeout_s", "reap_interval_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_time_that_is_not_finite_is_refused(name: str, value: float) -> None:
    """NaN passed the ``< 0`` check: a reaper sleeping NaN seconds never woke (no session was
    ever offloaded or expired, without a word), and ``idle > nan`` is never true either."""
    from hicache.errors import ConfigError
    from hicache.session import SessionConfig

    with pytest.raises(ConfigError, match=name):
        SessionConfig(**{name: value})


@pytest.mark.parametrize("name, value", [
    ("writeback_max_attempts", True), ("writeback_max_attempts", 2.5), ("writeback_max_attempts", "4"),
    ("keep_closed_stats", 1.5), ("keep_closed_stats", False), ("keep_closed_stats", "10"),
    ("idle_offload_s", True), ("idle_offload_s", "5"), ("session_timeout_s", "600"),
    ("release_on_close", "false"), ("preempt_queued_turns", 1),
])
def test_a_value_of_the_wrong_type_is_a_config_error_naming_it(name: str, value: object) -> None:
    """``true`` and ``2.5`` were taken as counts (a keep_closed_stats of 1.5 reached the
    history's trimming as a float), ``"false"`` as a true flag, and a string failed with a raw
    ``TypeError`` from a comparison that named no field."""
    from hicache.errors import ConfigError
    from hicache.session import SessionConfig

    with pytest.raises(ConfigError, match=name):
        SessionConfig(**{name: value})


def test_whole_numbers_are_still_taken_for_seconds() -> None:
    from hicache.session import SessionConfig

    assert SessionConfig(idle_offload_s=5, session_timeout_s=None, reap_interval_s=1).idle_offload_s == 5


async def test_closed_cache_refuses_turns_and_closes_once() -> None:
    from hicache.errors import CacheClosedError

    s = make_stack(hier=True)
    conv = Conversation(s, "z", seed=10)
    await conv.turn(9, 2)
    report = await s.cache.aclose()  # releases the session and drains its write-back first
    assert not s.cache.slots and s.req_pool.available_size() == s.req_pool.size
    assert s.cache.metrics()["writeback_done"] == 1
    assert await s.cache.aclose() is report  # closed once; a later call gets the same report
    with pytest.raises(CacheClosedError):
        await s.cache.admit(conv.request(3))
    await s.engine.aclose()


async def test_a_match_after_the_close_is_refused_and_opens_no_session() -> None:
    """``match_req`` (and SGLang's ``match_prefix``) after the close still attached the
    request: a new slot per session id, never released (the reaper and the close were over),
    so ``sessions_open`` grew and ``metrics()`` listed sessions of a closed cache."""
    from hicache.errors import CacheClosedError

    s = make_stack(hier=True)
    conv = Conversation(s, "z", seed=10)
    await conv.turn(9, 2)
    await s.cache.aclose()
    opened = s.cache.session_metrics.counters["sessions_opened"]
    for sid in ("z", "new"):
        req = Conversation(s, sid, seed=3).request(5)
        with pytest.raises(CacheClosedError):
            s.cache.match_req(req)
        with pytest.raises(CacheClosedError):
            s.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), req=req))
    assert not s.cache.slots and s.cache.gauges()["sessions_open"] == 0
    assert s.cache.session_metrics.counters["sessions_opened"] == opened
    await s.engine.aclose()


async def test_a_restored_turn_the_scheduler_locked_is_never_preempted_by_eviction() -> None:
    """SGLang's flow: match_prefix, inc_lock_ref on the node it gave (the batch takes the
    request), then allocation, which evicts. The lock is the turn's admission: eviction must
    not hand the slot over and free the prefix pages the scheduler holds."""
    s = make_stack(hier=False, device_pages=16)
    conv = Conversation(s, "A", seed=1)
    await conv.turn(30, 3)  # the slot holds the session's history
    req = conv.request(4)
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), req=req))
    prefix = m.device_indices.clone()
    assert prefix.numel() > 0 and isinstance(m.last_device_node, VirtualNode)
    s.cache.inc_lock_ref(m.last_device_node)
    s.cache.evict(EvictParams(num_tokens=s.allocator.available_size() + 16))
    assert s.cache.metrics()["preempted_queued_turns"] == 0
    assert s.cache.slots["A"].is_holding_kv and req.req_pool_idx is not None
    pages = sorted(set((prefix // PS * PS).tolist()))
    assert all(bool(s.allocator.is_allocated(torch.arange(p, p + PS))) for p in pages)
    assert kv_matches(s.device_pool, prefix, req.origin_input_ids[: prefix.numel()])
    assert s.cache.session_metrics.session("A").turns >= 1


async def test_a_session_the_tree_refuses_is_freed_and_the_others_are_still_reaped() -> None:
    """A session whose history holds a token id the tree cannot key (no uint32): the tree
    refuses it before any change, so its KV is freed instead of kept (counted), and the reaper
    goes on to the other sessions; pressure relief for an unrelated request works too."""
    import asyncio

    from hicache.session import SessionConfig

    class Clock:
        t = 1000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    s = make_stack(clock=clock, config=SessionConfig(idle_offload_s=10, reap_interval_s=0.01))
    s.cache.start()
    try:
        bad = Conversation(s, "bad", seed=2)
        req = bad.request(2 * PS)
        await bad.begin(req)
        await bad.prefill(req)
        req.output_ids = [2**40] * PS  # a token id outside uint32 reaches the slot
        await s.cache.alloc_extend(req, len(req.full_ids))
        req.fill_ids = req.full_ids
        req.kv_committed_len = len(req.full_ids)
        bad.finish(req)
        good = Conversation(s, "good", seed=1)
        await good.turn(3 * PS, 2)
        free_before = s.allocator.available_size()
        clock.t += 100  # both idle past idle_offload_s
        await asyncio.sleep(0.2)
        m = s.cache.metrics()
        assert m["reaper_errors"] == 0
        assert m["release_errors"] == 1
        assert not s.cache.slots["bad"].is_holding_kv and not s.cache.slots["good"].is_holding_kv
        assert s.allocator.available_size() > free_before
    finally:
        await s.cache.aclose()


async def test_a_length_whose_last_page_passes_the_row_is_refused_before_any_allocation() -> None:
    """Rows narrower than whole pages (a stack built with a max_context_len that is no multiple
    of the page): a request whose last page would not fit is a ValueError, nothing leaked."""
    s = make_stack(hier=False, device_pages=16, max_context=4 * PS + 2)
    conv = Conversation(s, "A", seed=1)
    req = conv.request(4 * PS + 1)
    free = s.allocator.available_size()
    with pytest.raises(ValueError, match="whole pages"):
        await s.cache.alloc_extend(req, 4 * PS + 1)
    assert s.allocator.available_size() == free and req.req_pool_idx is None


@pytest.mark.parametrize("streaming", [True, False])
async def test_a_negative_length_is_refused_before_any_allocation(streaming: bool) -> None:
    """alloc_extend(req, -1) needed no page and returned row[:-1]: the row's 1023 other slots,
    mostly unallocated or another request's. A session turn restored from its slot and a plain
    request alike get a ValueError, nothing allocated, the request as it was."""
    s = make_stack(hier=False)
    conv = Conversation(s, "A", seed=1, streaming=streaming)
    await conv.turn(10, 2)
    req = conv.request(4)
    await conv.begin(req)
    free, rows = s.allocator.available_size(), s.req_pool.available_size()
    before = (req.req_pool_idx, int(req.kv_allocated_len))
    with pytest.raises(ValueError, match="negative"):
        await s.cache.alloc_extend(req, -1)
    assert s.allocator.available_size() == free and s.req_pool.available_size() == rows
    assert (req.req_pool_idx, int(req.kv_allocated_len)) == before
    await conv.prefill(req)  # the request goes on
    conv.finish(req)
    s.cache.sanity_check()
    await s.aclose()


@pytest.mark.parametrize("hier", [True, False])
async def test_max_prefix_len_is_honoured_for_a_session_turn(hier: bool) -> None:
    """admit/match_req(max_prefix_len=k) never returns more than k tokens of prefix (the inner
    cache never does): a restored slot's prefix used to be floored at its tree-protected part
    (16 tokens for max_prefix_len=4), and the caller's tokens 4-15 were silently skipped. A
    cap inside the tree-protected part gives the slot up (the tree matches with the cap); a cap
    past it restores the slot, clamped."""
    s = make_stack(hier=hier)
    c = Conversation(s, "s", seed=1)
    await c.turn(20, 3, chunk=8)  # chunked first turn: 16 tokens tree-protected
    assert s.cache.slots["s"].cache_protected_len == 16
    req = c.request(5)
    s.cache.match_req(req)  # matched (restored) while queued, then admitted with a cap
    res = await s.cache.admit(req, max_prefix_len=4)
    n = int(req.prefix_indices.numel())
    assert res.prefix_len == n <= 4 and not res.restored
    assert kv_matches(s.device_pool, req.prefix_indices, req.origin_input_ids[:n])
    await c.prefill(req)
    await c.decode(req, 2)
    c.finish(req)
    c.check_slot()
    s.cache.sanity_check()
    req = c.request(4)  # a cap past the tree-protected part restores in place, clamped
    res = await s.cache.admit(req, max_prefix_len=20)
    assert res.restored and res.prefix_len == int(req.prefix_indices.numel()) == 19
    assert kv_matches(s.device_pool, req.prefix_indices, req.origin_input_ids[:19])
    with pytest.raises(ValueError, match="tree-protected"):  # admitted: its restore cannot be taken back
        s.cache.match_req(req, 4)
    await c.prefill(req)
    await c.decode(req, 2)
    c.finish(req)
    c.check_slot()
    s.cache.sanity_check()
    assert s.cache.session_metrics.counters["offloads_mismatch"] == 1
    await s.aclose()


async def test_reset_moves_every_sessions_stats_to_the_bounded_history() -> None:
    """reset() (a server's cache flush) forgot the slots but left each session's stats open for
    good: metrics()["sessions"] grew with every reset and listed sessions that no longer
    existed. They go to the bounded closed history now, as a release's do."""
    from hicache.session import SessionConfig

    s = make_stack(hier=False, config=SessionConfig(keep_closed_stats=4))
    for r in range(3):
        for i in range(5):
            await Conversation(s, f"s{r}-{i}", seed=i).turn(6, 2)
        s.cache.reset()
        s.allocator.clear()
        s.req_pool.clear()
        m = s.cache.metrics()
        assert m["sessions_open"] == 0 and m["sessions"] == {}
        assert m["sessions_reset"] == 5 * (r + 1)
    assert len(s.cache.session_metrics._closed) == 4  # bounded
    await s.aclose()


@pytest.mark.parametrize("keep_closed", [1024, 0])
async def test_a_session_reopened_after_release_or_expiry_is_counted_opened_again(keep_closed: int) -> None:
    """``sessions_opened`` was counted when a session's stats were created, and the stats of
    a released or expired session are kept (``keep_closed_stats``) so that its id coming back
    counts as a resume: a conversation reopened under its id opened a new slot, and was
    counted released (or expired) again, but never opened again. A server whose clients
    reuse ids showed more sessions closed than ever opened (opened - released - expired
    negative), and the count depended on ``keep_closed_stats``. Every slot opened counts."""
    from hicache.session import SessionConfig

    now = [0.0]
    s = make_stack(hier=False, config=SessionConfig(keep_closed_stats=keep_closed, session_timeout_s=10.0),
                   clock=lambda: now[0])
    conv = Conversation(s, "chat", seed=3)
    await conv.turn(6, 2)
    s.cache.release_session("chat")
    await conv.turn(6, 2)  # the same id again: a new session
    now[0] += 60.0
    assert s.cache.reap_idle() == 1  # expired
    await conv.turn(6, 2)  # and again
    m = s.cache.metrics()
    assert m["sessions_released"] == 1 and m["sessions_expired"] == 1 and m["sessions_open"] == 1
    assert m["sessions_opened"] == m["sessions_released"] + m["sessions_expired"] + m["sessions_open"] == 3
    if keep_closed:  # the stats still follow the conversation across its sessions
        assert m["sessions"]["chat"]["turns"] == 3
    await s.aclose()
