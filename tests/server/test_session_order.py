"""A session's order of turns: one at a time, in reservation order, and a place kept (with the
work it owes run in it) when its turn is cancelled while waiting or holding."""

from __future__ import annotations

import asyncio

import pytest

from hicache.server.session_order import SessionOrder, SessionTurn


async def test_turns_hold_the_session_one_at_a_time_in_reservation_order() -> None:
    order, log = SessionOrder(), list[str]()

    async def turn(name: str, t: SessionTurn) -> None:
        await t.wait()
        log.append(f"{name}+")
        await asyncio.sleep(0.01)
        log.append(f"{name}-")
        t.leave()

    turns = [order.reserve("s") for _ in range(3)]
    other = order.reserve("o")
    await asyncio.gather(*(turn(n, t) for n, t in zip("cba", reversed(turns))), turn("o", other))
    assert [e for e in log if e != "o+" and e != "o-"] == ["a+", "a-", "b+", "b-", "c+", "c-"]
    assert log.index("o+") < log.index("a-")  # another session does not wait
    assert len(order) == 0


async def test_a_turn_cancelled_while_waiting_runs_what_it_owes_in_its_place() -> None:
    order, log = SessionOrder(), list[str]()

    async def release() -> None:
        log.append("release")

    first = order.reserve("s")
    final = order.reserve("s", after=release)
    later = order.reserve("s")
    waiting = asyncio.ensure_future(final.wait())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    final.leave()
    final.leave()  # idempotent
    got_later = asyncio.ensure_future(later.wait())
    await asyncio.sleep(0.01)
    assert log == [] and not got_later.done()  # the first turn still holds the session
    first.leave()
    await got_later
    assert log == ["release"]  # before the later turn got the session
    later.leave()
    await order.aclose()
    assert len(order) == 0


async def test_work_owed_that_fails_is_logged_and_the_order_moves_on(caplog: pytest.LogCaptureFixture) -> None:
    order = SessionOrder()

    async def broken() -> None:
        raise RuntimeError("release failed")

    order.reserve("s", after=broken).leave()
    nxt = order.reserve("s")
    await asyncio.wait_for(nxt.wait(), 1)
    nxt.leave()
    assert "release failed" in caplog.text


async def test_aclose_waits_for_work_owed_started_by_earlier_work() -> None:
    order, log = SessionOrder(), list[str]()
    gate = asyncio.Event()

    async def slow() -> None:
        await gate.wait()
        log.append("first")

    async def quick() -> None:
        log.append("second")

    order.reserve("s", after=slow).leave()
    order.reserve("s", after=quick).leave()  # starts only once the first has run
    closing = asyncio.ensure_future(order.aclose())
    await asyncio.sleep(0.01)
    assert not closing.done()
    gate.set()
    await asyncio.wait_for(closing, 1)
    assert log == ["first", "second"]


async def test_aclose_waits_for_work_owed_behind_a_chain_of_left_turns() -> None:
    """Each left turn of a chain passes the session on one loop turn after the one before it,
    and only the owing turn's own turn starts a task: an ``aclose`` that waited for the tasks
    it saw returned before the release a dropped final turn at the end of a long chain owed."""
    order, log = SessionOrder(), list[str]()

    async def release() -> None:
        log.append("released")

    holder = order.reserve("s")
    dropped = [order.reserve("s") for _ in range(8)]
    final = order.reserve("s", after=release)
    for turn in (*dropped, final):
        turn.leave()
    holder.leave()
    await asyncio.wait_for(order.aclose(), 1)
    assert log == ["released"] and len(order) == 0
