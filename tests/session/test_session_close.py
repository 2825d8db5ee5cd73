"""Closing a session-aware cache with turns still attached to their sessions: a running turn
is aborted back to the history committed before it, which is written back like any released
session's; nothing handed over after the close is lost without being counted."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from session_helpers import Conversation, make_stack

from hicache.session import SessionConfig
from hicache.session.writeback import WriteBackQueue


async def test_close_with_a_turn_running_writes_back_the_history_before_it() -> None:
    st = make_stack(storage_id=uuid.uuid4().hex, config=SessionConfig())
    a = Conversation(st, "A", seed=1)
    await a.turn(n_in=20, n_out=3)  # the slot holds A's history
    req = a.request(6)
    await a.begin(req)
    await a.prefill(req)  # A's next turn is running when the server shuts down
    report = await st.cache.aclose()
    counters = st.cache.session_metrics.counters
    assert report is not None and report.drained and not report.unwritten
    assert not st.cache.slots and len(st.cache.writeback) == 0
    assert counters["turns_aborted_at_close"] == 1 and counters["sessions_released"] == 1
    assert counters["writeback_done"] == counters["writeback_queued"] == 1 and counters["writeback_lost"] == 0
    assert st.storage.get_stats()["write_pages"] > 0  # the history reached storage
    st.cache.abort_req(req)  # what the server does with the turn it can no longer run: harmless now


async def _released_with_its_next_turn_queued() -> tuple[Any, Conversation, Any]:
    """A stack whose session "A" is released (``closing``) while its next turn is matched,
    only queued; with the conversation and that turn's request."""
    st = make_stack(device_pages=16, config=SessionConfig())
    a = Conversation(st, "A", seed=1)
    await a.turn(n_in=20, n_out=3)
    req = a.request(4)
    st.cache.match_req(req)  # the next turn is matched, only queued
    assert st.cache.release_session("A") and st.cache.slots["A"].closing
    return st, a, req


async def test_a_session_released_while_its_turn_is_queued_closes_when_pressure_preempts_it() -> None:
    """Preempting the queued turn used to leave the releasing slot open for good: no KV, no
    turn, ``closing`` set, every later turn of the id served without it."""
    st, _, _ = await _released_with_its_next_turn_queued()
    st.cache.ensure_req_slots(st.req_pool.size)  # pressure: offloads idle and queued slots
    assert "A" not in st.cache.slots
    assert st.cache.session_metrics.counters["sessions_released"] == 1
    await st.aclose()


async def test_a_second_aclose_waits_for_the_close_under_way_and_gets_its_report() -> None:
    """A second aclose() used to return None at once while the first still drained the
    write-backs; its caller then closed the copy engine and every session's history was
    dropped while the first close reported drained=True."""
    st = make_stack(storage_id=uuid.uuid4().hex)
    for i in range(4):
        await Conversation(st, f"s{i}", seed=i).turn(40, 3)
    first = asyncio.ensure_future(st.cache.aclose())
    await asyncio.sleep(0)  # the first close has begun
    second = await asyncio.wait_for(st.cache.aclose(), 30)
    assert len(st.cache.writeback) == 0 and st.controller.state.name == "CLOSED"
    await st.engine.aclose()  # the second caller's shutdown goes on
    report = await asyncio.wait_for(first, 30)
    counters = st.cache.session_metrics.counters
    assert second is report and report.drained and not report.unwritten
    assert counters["writeback_done"] == counters["writeback_queued"] == 4 and counters["writeback_dropped"] == 0
    assert await st.cache.aclose() is report  # and after it ended


async def test_a_cancelled_aclose_caller_leaves_the_close_to_the_others_and_a_cut_close_hurries_it() -> None:
    st = make_stack(storage_id=uuid.uuid4().hex)
    for i in range(3):
        await Conversation(st, f"s{i}", seed=i).turn(40, 3)
    first = asyncio.ensure_future(st.cache.aclose())
    await asyncio.sleep(0)
    first.cancel()  # this caller goes; the close does not
    waiter = asyncio.ensure_future(st.cache.aclose())
    await asyncio.sleep(0)
    assert not waiter.done()
    # a cut close (HiCache's close task cancelled) hurries the one close under way: one report
    cut = await asyncio.wait_for(st.cache.finish_cut_close(), 30)
    assert await asyncio.wait_for(waiter, 30) is cut and await st.cache.aclose() is cut
    assert first.cancelled() and cut is not None
    assert not st.cache.slots and st.controller.state.name == "CLOSED"
    await st.engine.aclose()


def test_a_handover_after_the_close_is_counted_lost() -> None:
    class Tree:
        root_node = object()

        def write_backup(self, node: object) -> bool:  # pragma: no cover - never reached
            raise AssertionError("nothing may be copied after the close")

    counts: dict[str, int] = {}
    queue = WriteBackQueue(Tree(), count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))
    queue.seal()
    queue.enqueue("late", object(), 64)
    assert counts == {"writeback_queued": 1, "writeback_queued_tokens": 64, "writeback_lost": 1}
    assert len(queue) == 0


def _every_write_back_counted(st: Any, queued: int) -> None:
    """The queue is empty, its gauge back to 0, and each of the ``queued`` write-backs ended
    counted (done, lost or dropped)."""
    c = st.cache.session_metrics.counters
    assert len(st.cache.writeback) == 0 and st.cache.gauges()["writeback_pending"] == 0
    assert c["writeback_queued"] == queued
    assert c["writeback_done"] + c["writeback_lost"] + c["writeback_dropped"] == queued, c


async def test_a_cancelled_close_counts_every_queued_write_back_and_the_gauge_returns_to_zero() -> None:
    """The close task cancelled while it waited for the write-backs (a shutdown sweep): the
    cut close sealed the queue with its entries still in it, so they were never counted
    (queued > done + lost + dropped for good) and ``writeback_pending`` stayed above 0."""
    st = make_stack(controller={"close_timeout_s": 30.0})
    gate = st.hold_backups()
    for i in range(2):
        await Conversation(st, f"s{i}", seed=i).turn(20, 3)  # their copies hang
    closing = asyncio.ensure_future(st.cache.aclose())
    for _ in range(5):
        await asyncio.sleep(0)  # the close waits for the write-backs now
    assert len(st.cache.writeback) == 2
    task = st.cache._close_task
    assert task is not None
    task.cancel()  # the shutdown sweep cancels the close task itself
    try:
        await asyncio.wait_for(closing, 10)
    finally:
        gate.set()
    _every_write_back_counted(st, 2)
    await st.engine.aclose()


async def test_reset_counts_the_queued_write_backs_it_forgets() -> None:
    """``reset()`` forgot the queued write-backs without counting them: queued stayed above
    done + lost + dropped for good."""
    st = make_stack()
    gate = st.hold_backups()
    await Conversation(st, "A", seed=1).turn(20, 3)
    st.cache.release_session("A")
    assert len(st.cache.writeback) == 1
    gate.set()
    await st.inner.drain()  # the copy lands before the server flushes
    st.cache.reset()
    _every_write_back_counted(st, 1)
    await st.engine.aclose()


async def test_a_released_sessions_queued_turn_whose_hand_over_fails_closes_the_session() -> None:
    """Pressure preempted the queued turn of a session being released and the hand-over raised
    something other than ValueError: the session stayed ``closing`` for good (no KV, no turn),
    and every later turn of the id was served without it until ``session_timeout_s``."""
    st, a, req = await _released_with_its_next_turn_queued()
    real_insert = st.inner.insert

    def broken_insert(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the tree failed mid-insert")

    st.inner.insert = broken_insert  # type: ignore[method-assign]
    st.cache.ensure_req_slots(st.req_pool.size)  # pressure preempts the queued turn: hand-over fails
    st.inner.insert = real_insert  # type: ignore[method-assign]
    c = st.cache.session_metrics.counters
    assert "A" not in st.cache.slots
    assert c["sessions_released"] == 1 and c["release_errors"] == 1
    st.cache.abort_req(req)  # the server gives the preempted turn up
    later = await a.turn(n_in=6, n_out=2)  # the id opens a new session, not bypassed
    assert st.cache.slots["A"].is_holding_kv and c["busy_bypass"] == 0, later
    await st.aclose()
