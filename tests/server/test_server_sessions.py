"""Ending and releasing sessions over real HTTP: a session whose close fails is closed anyway
(its KV given up as far as possible, the failure answered and counted), and releasing a
session the server does not have is a 404."""

from __future__ import annotations

from typing import Any

import aiohttp

from server_helpers import requires_facade, small_config
from hicache.server import running_server

TURN = {"tokens": list(range(50)), "max_new_tokens": 3, "session_id": "s"}


def _nothing_held(sessions: Any) -> None:
    """No session open, no row or page held for one (the tree's pages are the tree's)."""
    assert "s" not in sessions.slots and sessions.session_held_tokens() == 0
    pool = sessions.inner.req_to_token_pool
    assert pool.available_size() == pool.size
    sessions.sanity_check()


class _FailMidTurn:
    """Wraps the engine's ``generate``: the real turn runs and fails at its first token (the
    engine aborts it, as on any failure)."""

    def __init__(self, engine: Any) -> None:
        self._generate = engine.generate
        engine.generate = self

    async def __call__(self, *args: Any, on_token: Any = None, **kwargs: Any) -> Any:
        def fail(token: int) -> None:
            raise RuntimeError("injected failure mid-turn")

        return await self._generate(*args, on_token=fail, **kwargs)


@requires_facade
async def test_a_final_turn_that_fails_still_ends_its_session() -> None:
    """``end_session`` was honoured only when the turn succeeded: a final turn that failed
    left its session open, holding its row and pages, until ``session_timeout_s`` (for good
    with none set)."""
    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert "s" in sessions.slots and sessions.session_held_tokens() > 0
        _FailMidTurn(srv.state.engine)
        last = {**TURN, "tokens": TURN["tokens"] + out["tokens"] + [7, 8, 9], "end_session": True}
        async with http.post(f"{srv.url}/v1/generate", json=last) as resp:
            assert resp.status == 500 and "RuntimeError" in (await resp.json())["error"]
        _nothing_held(sessions)
        assert sessions.session_metrics.counters["sessions_released"] == 1


@requires_facade
async def test_a_release_whose_write_back_raises_closes_the_session_and_says_so() -> None:
    """The hand-over raised (queueing the history's write-back failed): the session
    stayed open with its row and tail pages until ``session_timeout_s``, and the client got
    aiohttp's bare 500 page. It is closed, counted, and answered with a JSON 500."""
    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            assert resp.status == 200
        queue = sessions.writeback
        real = queue.enqueue

        def enqueue(*args: Any) -> None:  # the history is in the tree; following its copy fails
            queue.enqueue = real
            raise RuntimeError("injected write-back failure")

        queue.enqueue = enqueue
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 500 and resp.content_type == "application/json"
            assert "RuntimeError" in (await resp.json())["error"]
        _nothing_held(sessions)
        counters = sessions.session_metrics.counters
        assert counters["release_errors"] == 1 and counters["sessions_released"] == 1
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 404  # closed: a second release finds nothing


@requires_facade
async def test_releasing_an_unknown_session_is_a_404() -> None:
    """A release of an id the server has no session for (never opened, released already,
    expired) answered 200 ``{"released": id}``, so a client's typo or a double release looked
    like success."""
    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        async with http.post(f"{srv.url}/v1/sessions/nope/release") as resp:
            assert resp.status == 404 and resp.content_type == "application/json"
            assert (await resp.json()) == {"error": "no session 'nope' (never opened, released, or expired)"}
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            assert resp.status == 200
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 200 and (await resp.json()) == {"released": "s"}
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 404


@requires_facade
async def test_a_final_turn_dropped_while_it_waits_for_a_slot_still_ends_its_session() -> None:
    """The client of an ``end_session`` turn hangs up while the turn waits for the only slot
    (a slow request holds it): the job is dropped before it runs, and its session ends all
    the same, instead of holding its row and pages until ``session_timeout_s``."""
    import asyncio

    cfg = small_config(server={"max_batch": 1})
    async with running_server(cfg, mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert "s" in sessions.slots
        engine = srv.state.engine
        real = engine.generate
        gate = asyncio.Event()

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await real(*args, **kwargs)

        engine.generate = slow
        blocker = asyncio.create_task(http.post(f"{srv.url}/v1/generate",
                                                json={"tokens": list(range(100, 140)), "max_new_tokens": 2}))
        await asyncio.sleep(0.3)  # the blocker holds the only slot
        last = {**TURN, "tokens": TURN["tokens"] + out["tokens"] + [7, 8, 9], "end_session": True}
        try:
            async with http.post(f"{srv.url}/v1/generate", json=last, timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        except asyncio.TimeoutError:
            pass  # hung up while the final turn waited for the slot
        for _ in range(100):  # the server notices the hang-up and drops the job
            if "s" not in sessions.slots:
                break
            await asyncio.sleep(0.02)
        engine.generate = real
        gate.set()
        (await blocker).release()
        _nothing_held(sessions)


class _HoldTheSlot:
    """With ``max_batch`` 1, a request parked in ``engine.generate`` until :meth:`open` holds
    the only slot: every request after it waits in the scheduler."""

    def __init__(self, srv: Any, http: aiohttp.ClientSession) -> None:
        import asyncio

        self._srv, self._http, self._gate = srv, http, asyncio.Event()
        self.task: Any = None

    async def __aenter__(self) -> "_HoldTheSlot":
        import asyncio

        engine = self._srv.state.engine
        real, gate = engine.generate, self._gate

        async def held(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await real(*args, **kwargs)

        engine.generate = held
        self.task = asyncio.ensure_future(self._http.post(f"{self._srv.url}/v1/generate",
                                                          json={"tokens": list(range(100, 140)), "max_new_tokens": 2}))
        await asyncio.sleep(0.2)  # the held request has the slot
        engine.generate = real
        return self

    def open(self) -> None:
        self._gate.set()

    async def __aexit__(self, *exc: Any) -> None:
        self.open()
        async with await self.task as resp:
            assert resp.status == 200


@requires_facade
async def test_a_release_while_a_turn_of_the_session_is_queued_waits_for_that_turn() -> None:
    """Turn 2 of ``s`` waits for the only slot when ``s`` is released: the release closed the
    session and answered 200, then turn 2 ran and re-opened it, holding its row and pages
    though the client was told it was released. The release is deferred to the queued turn
    (and says so), and applied when it ends; a turn sent after the release runs after it."""
    import asyncio

    async with running_server(small_config(server={"max_batch": 1}), mode="hicache", port=0) as srv, \
            aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            out = await resp.json()
        async with _HoldTheSlot(srv, http) as hold:
            turn2 = {**TURN, "tokens": TURN["tokens"] + out["tokens"] + [7, 8, 9]}
            t2 = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=turn2))
            await asyncio.sleep(0.2)  # turn 2 is queued behind the held request
            async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
                assert resp.status == 200 and (await resp.json()) == {"released": "s", "deferred": True}
            hold.open()
            async with await t2 as resp:
                assert resp.status == 200
        for _ in range(50):  # the deferred release runs just after turn 2
            if "s" not in sessions.slots:
                break
            await asyncio.sleep(0.02)
        _nothing_held(sessions)
        assert sessions.session_metrics.counters["sessions_released"] == 1


@requires_facade
async def test_a_release_of_a_session_whose_first_turn_is_queued_is_not_a_404() -> None:
    """The first turn of ``s`` is queued when ``s`` is released: the cache had no session yet,
    so the release answered 404, and the turn then opened a session nobody would release. The
    release is deferred to that turn; a turn sent after it starts a fresh session."""
    import asyncio

    async with running_server(small_config(server={"max_batch": 1}), mode="hicache", port=0) as srv, \
            aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with _HoldTheSlot(srv, http) as hold:
            t1 = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=TURN))
            await asyncio.sleep(0.2)
            async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
                assert resp.status == 200 and (await resp.json()) == {"released": "s", "deferred": True}
            t_after = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=TURN))
            await asyncio.sleep(0.1)
            hold.open()
            async with await t1 as resp:
                assert resp.status == 200
            async with await t_after as resp:
                assert resp.status == 200
        # the release came between the two turns: the first's session closed, the second's open
        assert sessions.session_metrics.counters["sessions_released"] == 1
        assert "s" in sessions.slots
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 200 and (await resp.json()) == {"released": "s"}
        _nothing_held(sessions)


def _out_of_memory_once(engine: Any) -> tuple[Any, Any]:
    """The engine's next turn fails for device memory once it is let go (``gate``), after
    telling it started (``failing``); its retry runs the real engine. Between the two attempts
    the turn holds its session but no request: what a release or a final turn meets then."""
    import asyncio

    from hicache.errors import OutOfKVSlotsError

    real = engine.generate
    failing, gate = asyncio.Event(), asyncio.Event()

    async def out_of_memory_once(*args: Any, **kwargs: Any) -> Any:
        engine.generate = real  # the retry is the real one
        failing.set()
        await gate.wait()
        raise OutOfKVSlotsError("injected: device full")

    engine.generate = out_of_memory_once
    return failing, gate


@requires_facade
async def test_a_release_during_a_memory_retry_is_not_undone_by_the_retry() -> None:
    """A turn's first attempt fails for device memory and the session is released while the
    turn waits to retry: the release closed the idle session at once, then the retry re-opened
    it. The release waits for the turn, retries included."""
    import asyncio

    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
            out = await resp.json()
        failing, gate = _out_of_memory_once(srv.state.engine)
        turn2 = {**TURN, "tokens": TURN["tokens"] + out["tokens"] + [7, 8, 9]}
        t2 = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=turn2))
        await failing.wait()
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 200 and (await resp.json()) == {"released": "s", "deferred": True}
        gate.set()
        async with await t2 as resp:
            assert resp.status == 200
        assert srv.state.metrics.memory_retries == 1
        for _ in range(50):
            if "s" not in sessions.slots:
                break
            await asyncio.sleep(0.02)
        _nothing_held(sessions)


async def _second_turn_between_memory_attempts(srv: Any, http: aiohttp.ClientSession) -> tuple[Any, list[int], Any]:
    """Session ``s``'s first turn served, its second sent and between two memory attempts (its
    retry waits for ``gate``): ``(gate, the history so far, the second turn's response future)``."""
    import asyncio

    async with http.post(f"{srv.url}/v1/generate", json=TURN) as resp:
        out = await resp.json()
    failing, gate = _out_of_memory_once(srv.state.engine)
    history = TURN["tokens"] + out["tokens"]
    t2 = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json={**TURN, "tokens": history + [7, 8, 9]}))
    await failing.wait()
    return gate, history, t2


@requires_facade
async def test_a_dropped_final_turn_ends_its_session_after_a_turn_between_memory_attempts() -> None:
    """An ``end_session`` turn whose client hangs up while it waits for its session (an earlier
    turn of it is between two memory attempts): the session ends after that turn, not at the
    hang-up, when the earlier turn's retry re-opened it and it held its row and pages."""
    import asyncio

    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        gate, history, t2 = await _second_turn_between_memory_attempts(srv, http)
        last = {**TURN, "tokens": history + [5, 6], "end_session": True}
        try:
            async with http.post(f"{srv.url}/v1/generate", json=last, timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        except asyncio.TimeoutError:
            pass  # hung up while the final turn waited for its session
        await asyncio.sleep(0.3)  # the server notices the hang-up and drops the job
        gate.set()
        async with await t2 as resp:
            assert resp.status == 200
        for _ in range(100):
            if "s" not in sessions.slots:
                break
            await asyncio.sleep(0.02)
        _nothing_held(sessions)


@requires_facade
async def test_a_dropped_final_turn_ends_its_session_before_a_later_turn_not_after_it() -> None:
    """An ``end_session`` turn dropped while it waits for its session (an earlier turn is
    between two memory attempts), with a later turn of the same session sent after it: the
    release ran behind the later turn (a dropped turn lost its place in the session's lock),
    and closed the fresh session that turn had opened. It now runs in the dropped turn's place:
    after the earlier turn, before the later one, which keeps its session."""
    import asyncio

    async with running_server(small_config(), mode="hicache", port=0) as srv, aiohttp.ClientSession() as http:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        gate, history, t2 = await _second_turn_between_memory_attempts(srv, http)
        last = {**TURN, "tokens": history + [5, 6], "end_session": True}
        dropped = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=last,
                                                  timeout=aiohttp.ClientTimeout(total=0.5)))
        await asyncio.sleep(0.1)  # the final turn is queued on the session before the next one
        fresh = {**TURN, "tokens": list(range(200, 240))}
        t4 = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json=fresh))
        try:
            async with await dropped:
                pass
        except asyncio.TimeoutError:
            pass  # hung up while the final turn waited for its session
        await asyncio.sleep(0.3)  # the server notices the hang-up and drops the job
        gate.set()
        async with await t2 as resp:
            assert resp.status == 200
        async with await t4 as resp:
            assert resp.status == 200
        await asyncio.sleep(0.2)  # nothing left to run: a misplaced release would have run by now
        assert sessions.session_metrics.counters["sessions_released"] == 1
        assert "s" in sessions.slots and sessions.session_held_tokens() > 0  # the later turn's session
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert resp.status == 200 and (await resp.json()) == {"released": "s"}
        _nothing_held(sessions)


@requires_facade
async def test_loadgen_releases_the_session_of_a_conversation_cut_short() -> None:
    """loadgen sent ``end_session`` only on a conversation's last turn: one stopped by a failed
    turn (here a 500, and a client timeout while the server still runs the turn) left its
    session open, holding its row and pages until ``session_timeout_s``, so the next load run
    measured a server filled by this one's leftovers. It now releases the session; the release
    after the timeout is queued behind the turn still running and applies after it."""
    import asyncio

    from hicache.server.loadgen import Workload, run_load
    from hicache.testing import eventually

    async with running_server(small_config(), mode="hicache", port=0) as srv:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        engine = srv.state.engine
        real = engine.generate

        async def second_turns_fail(rid: str, *args: Any, **kwargs: Any) -> Any:
            if rid == "cut-c0-t1":
                raise RuntimeError("injected: turn 1 fails")
            if rid == "cut-c1-t1":
                await asyncio.sleep(3.0)  # past the client's timeout: it gives up, the server runs on
            return await real(rid, *args, **kwargs)

        engine.generate = second_turns_fail
        w = Workload(clients=3, turns=3, system_tokens=32, user_tokens=8, max_new_tokens=2, warmup=False)
        report = await run_load(srv.url, w, run_tag="cut", timeout_s=1.0)
        await eventually(lambda: not sessions.slots and not srv.state.metrics.active)
        assert sessions.session_held_tokens() == 0
        sessions.sanity_check()
        s = report["summary"]
        assert (s["requests"], s["errors"], s["session_release_failures"]) == (2 + 2 + 3, 2, 0), s
        assert [r["session_released"] for r in report["records"] if r["error"]] == [True, True]


@requires_facade
async def test_loadgen_releases_a_session_whose_id_is_no_plain_path_segment() -> None:
    """loadgen put the session id into the release URL as it was: a run tag with ``/``, ``?``,
    ``#`` or a space (``run_load(run_tag=...)``) sent the release to another path, whose 404
    loadgen takes for "already ended", so the session stayed open while its record said it was
    released. The id is quoted as one path segment now."""
    from hicache.server.loadgen import Workload, run_load

    # the second turn (66 tokens with its answer) passes the 64-token context: a real 400
    async with running_server(small_config(device={"max_context_len": 64}), mode="hicache", port=0) as srv:
        sessions = srv.state.cache.cache  # type: ignore[attr-defined]
        w = Workload(clients=1, turns=3, system_tokens=32, user_tokens=16, max_new_tokens=2, warmup=False)
        report = await run_load(srv.url, w, run_tag="team/a b?x#1")
        assert [r["error"] is not None for r in report["records"]] == [False, True]
        assert report["records"][1]["session_released"] is True
        _nothing_held(sessions)


async def test_repeated_releases_behind_a_running_turn_queue_one_release() -> None:
    """A release behind a pending turn of its session is deferred; each one was queued, so a
    client retrying (or a hostile one looping) on ``/release`` while a long turn ran piled up
    one queue item, one place in the session's order and one release call per request, past
    any bound (``queue_size`` bounds the turns only). A release already pending and not
    followed by a turn is the same release: answered ``deferred`` again, queued once."""
    import asyncio

    from hicache.testing import eventually

    async with running_server(small_config(server={"max_batch": 1}), mode="recompute", port=0) as srv, \
            aiohttp.ClientSession() as http:
        engine, cache = srv.state.engine, srv.state.cache
        opened, generate, released = asyncio.Event(), engine.generate, []

        async def held(*args: Any, **kwargs: Any) -> Any:
            await opened.wait()
            return await generate(*args, **kwargs)

        async def count_release(session_id: str) -> Any:
            released.append(session_id)

        engine.generate, cache.release_session = held, count_release  # type: ignore[method-assign]
        turn = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json={"tokens": [1, 2], "session_id": "s"}))
        try:
            await eventually(lambda: srv.state.metrics.active == 1)
            for _ in range(20):
                async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
                    assert (resp.status, await resp.json()) == (200, {"released": "s", "deferred": True})
        finally:
            opened.set()
        async with await turn as resp:
            assert resp.status == 200
        await eventually(lambda: released == ["s"])
        # a turn after the release, then a release again: queued behind that turn, as ever
        opened.clear()
        turn = asyncio.ensure_future(http.post(f"{srv.url}/v1/generate", json={"tokens": [3, 4], "session_id": "s"}))
        await eventually(lambda: srv.state.metrics.active == 1)
        async with http.post(f"{srv.url}/v1/sessions/s/release") as resp:
            assert (await resp.json()) == {"released": "s", "deferred": True}
        opened.set()
        async with await turn as resp:
            assert resp.status == 200
        await eventually(lambda: released == ["s", "s"])
