"""The scheduler on its own (a scripted engine): admission bound, backpressure, per-session
ordering, failures that do not stop it, and a drain that finishes queued work."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hicache.engine.runner import GenerateResult
from hicache.errors import OutOfKVSlotsError
from hicache.server.protocol import GenerateRequest
from hicache.server.scheduler import QueueFullError, Scheduler, SchedulerClosedError


class ScriptedEngine:
    """Sleeps ``delay`` per request, records order and concurrency; fails on ``fail`` rids."""

    def __init__(self, delay: float = 0.02, fail: set[str] | None = None) -> None:
        self.delay = delay
        self.fail = fail or set()
        self.active = 0
        self.peak = 0
        self.log: list[tuple[str, str]] = []
        self.released: list[str] = []
        self.cache = self

    async def generate(self, rid: str, tokens: list[int], n: int, session_id: str | None = None, **kw: Any) -> GenerateResult:
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.log.append(("start", rid))
        try:
            await asyncio.sleep(self.delay)
            if rid in self.fail:
                raise RuntimeError(f"boom {rid}")
            return GenerateResult(rid=rid, tokens=[1] * n, prompt_tokens=len(tokens), prefill_tokens=len(tokens),
                                  cached_tokens=0, hits={}, ttft_s=0.001, latency_s=0.002)
        finally:
            self.log.append(("end", rid))
            self.active -= 1

    async def release_session(self, sid: str) -> None:
        self.released.append(sid)


def req(rid: str, session: str | None = None, end: bool = False) -> GenerateRequest:
    return GenerateRequest(rid=rid, tokens=[1, 2, 3], max_new_tokens=2, session_id=session, end_session=end)


async def test_at_most_max_active_requests_run_at_once() -> None:
    engine = ScriptedEngine()
    sched = Scheduler(engine, max_active=3, queue_size=100)  # type: ignore[arg-type]
    await sched.start()
    jobs = [sched.submit(req(f"r{i}")) for i in range(10)]
    results = await asyncio.gather(*(j.future for j in jobs))
    await sched.aclose()
    assert engine.peak == 3 and [r.rid for r in results] == [f"r{i}" for i in range(10)]
    assert sched.metrics.requests["ok"] == 10 and sched.metrics.active == 0


async def test_a_full_queue_refuses_instead_of_waiting() -> None:
    engine = ScriptedEngine(delay=0.1)
    sched = Scheduler(engine, max_active=1, queue_size=2)  # type: ignore[arg-type]
    await sched.start()
    accepted = [sched.submit(req("a"))]
    await asyncio.sleep(0.02)  # "a" admitted, queue empty again
    accepted += [sched.submit(req("b")), sched.submit(req("c"))]
    with pytest.raises(QueueFullError):
        sched.submit(req("d"))
    await asyncio.gather(*(j.future for j in accepted))
    await sched.aclose()


async def test_turns_of_one_session_run_in_order_other_sessions_overlap() -> None:
    engine = ScriptedEngine()
    sched = Scheduler(engine, max_active=4, queue_size=100)  # type: ignore[arg-type]
    await sched.start()
    jobs = [sched.submit(req("s1-t0", "s1")), sched.submit(req("s1-t1", "s1", end=True)), sched.submit(req("s2-t0", "s2"))]
    await asyncio.gather(*(j.future for j in jobs))
    await sched.aclose()
    log = engine.log
    assert log.index(("end", "s1-t0")) < log.index(("start", "s1-t1"))
    assert log.index(("start", "s2-t0")) < log.index(("end", "s1-t0"))
    assert engine.released == ["s1"]


async def test_a_failing_request_fails_alone() -> None:
    engine = ScriptedEngine(fail={"bad"})
    sched = Scheduler(engine, max_active=2, queue_size=10)  # type: ignore[arg-type]
    await sched.start()
    bad, good = sched.submit(req("bad")), sched.submit(req("good"))
    with pytest.raises(RuntimeError, match="boom"):
        await bad.future
    assert (await good.future).rid == "good"
    await sched.aclose()
    assert sched.metrics.requests == {"ok": 1, "error": 1}


async def test_aclose_drains_queued_work_then_refuses() -> None:
    engine = ScriptedEngine(delay=0.03)
    sched = Scheduler(engine, max_active=1, queue_size=10)  # type: ignore[arg-type]
    await sched.start()
    jobs = [sched.submit(req(f"r{i}")) for i in range(4)]
    await sched.aclose()
    assert all(j.future.done() and not j.future.exception() for j in jobs)
    with pytest.raises(SchedulerClosedError):
        sched.submit(req("late"))
    await sched.aclose()  # idempotent


class MemoryTightEngine(ScriptedEngine):
    """Request "mem" streams two tokens then finds the device full while "hog" runs."""

    def __init__(self) -> None:
        super().__init__(delay=0.05)
        self.attempts = 0

    async def generate(self, rid, tokens, n, session_id=None, *, on_token=None, **kw):
        if rid != "mem":
            return await super().generate(rid, tokens, n, session_id)
        self.attempts += 1
        for tok in range(n):
            if self.attempts == 1 and tok == 2:
                raise OutOfKVSlotsError("device full")
            on_token(tok)
            await asyncio.sleep(0)
        return GenerateResult(rid=rid, tokens=list(range(n)), prompt_tokens=3, prefill_tokens=3, cached_tokens=0,
                              hits={}, ttft_s=0.0, latency_s=0.0)


async def test_device_full_waits_for_a_running_request_and_resumes_the_stream() -> None:
    engine = MemoryTightEngine()
    sched = Scheduler(engine, max_active=2, queue_size=10)  # type: ignore[arg-type]
    await sched.start()
    streamed: list[int] = []
    hog = sched.submit(req("hog"))
    mem = sched.submit(GenerateRequest(rid="mem", tokens=[1, 2, 3], max_new_tokens=5), on_token=streamed.append)
    assert (await mem.future).tokens == [0, 1, 2, 3, 4]
    await hog.future
    await sched.aclose()
    assert engine.attempts == 2 and sched.metrics.memory_retries == 1
    assert streamed == [0, 1, 2, 3, 4]  # the restart did not resend tokens 0 and 1


async def test_device_full_alone_backs_off_then_gives_up() -> None:
    engine = MemoryTightEngine()

    async def always_full(rid, tokens, n, session_id=None, **kw):
        engine.attempts += 1
        raise OutOfKVSlotsError("device full")

    engine.generate = always_full  # type: ignore[method-assign]
    sched = Scheduler(engine, max_active=2, queue_size=10, max_memory_retries=2)  # type: ignore[arg-type]
    await sched.start()
    job = sched.submit(GenerateRequest(rid="mem", tokens=[1], max_new_tokens=5))
    with pytest.raises(OutOfKVSlotsError):
        await job.future
    await sched.aclose()
    assert engine.attempts == 3 and sched.metrics.memory_retries == 2


class ContendedEngine(ScriptedEngine):
    """"big" needs the whole device: it finds it full whenever any other request is running."""

    def __init__(self) -> None:
        super().__init__(delay=0.02)
        self.big_attempts = 0

    async def generate(self, rid, tokens, n, session_id=None, **kw):
        if rid != "big":
            return await super().generate(rid, tokens, n, session_id)
        self.big_attempts += 1
        if self.active > 0:
            raise OutOfKVSlotsError("device full")
        self.log.append(("start", rid))
        self.log.append(("end", rid))
        return GenerateResult(rid=rid, tokens=[1] * n, prompt_tokens=len(tokens), prefill_tokens=len(tokens),
                              cached_tokens=0, hits={}, ttft_s=0.001, latency_s=0.002)


async def test_a_request_waiting_for_memory_is_served_before_newcomers_and_does_not_fail() -> None:
    """A busy server is not a full one: a request that finds the device full behind running
    requests waits, however many times it loses (no retry budget is spent while others run), and
    requests queued after it are not admitted until it got its memory, so it cannot starve."""
    engine = ContendedEngine()
    sched = Scheduler(engine, max_active=2, queue_size=20, max_memory_retries=0)  # type: ignore[arg-type]
    await sched.start()
    first = sched.submit(req("s0"))
    while not engine.active:  # s0 is running (a fixed sleep could outlast its 20 ms on a busy machine)
        await asyncio.sleep(0)
    big = sched.submit(req("big"))
    later = [sched.submit(req(f"s{i}")) for i in range(1, 6)]
    assert (await big.future).rid == "big"
    await asyncio.gather(first.future, *(j.future for j in later))
    await sched.aclose()
    starts = [rid for ev, rid in engine.log if ev == "start"]
    assert starts[:2] == ["s0", "big"]  # no newcomer slipped in while big waited
    assert engine.big_attempts >= 2 and sched.metrics.memory_retries == engine.big_attempts - 1
    assert sched.metrics.requests["ok"] == 7


async def test_waiting_behind_running_requests_is_bounded_in_time() -> None:
    engine = ContendedEngine()
    engine.delay = 0.5  # s0 runs longer than big may wait
    sched = Scheduler(engine, max_active=2, queue_size=20, max_memory_retries=0, memory_wait_s=0.02, memory_wait_total_s=0.1)  # type: ignore[arg-type]
    await sched.start()
    first = sched.submit(req("s0"))
    while not engine.active:  # s0 is running
        await asyncio.sleep(0)
    big = sched.submit(req("big"))
    after = sched.submit(req("s1"))
    with pytest.raises(OutOfKVSlotsError):
        await big.future
    await asyncio.gather(first.future, after.future)  # the gate reopened once big gave up
    await sched.aclose()
    # answered 503 (device full): counted as the rejection it is, not as an error
    assert sched.metrics.requests == {"rejected": 1, "ok": 2}


async def test_a_client_that_hangs_up_while_queued_gives_its_place_back_at_once() -> None:
    """Long requests hold every slot; clients that connect and hang up while queued must not
    fill the queue: their places come back when they leave, not when the scheduler gets there."""
    eng = ScriptedEngine(delay=0.5)
    s = Scheduler(eng, max_active=1, queue_size=4)
    await s.start()
    try:
        running = s.submit(req("long"))
        await asyncio.sleep(0.05)
        gone = [s.submit(req(f"gone{i}")) for i in range(4)]
        with pytest.raises(QueueFullError):
            s.submit(req("too-many"))
        for job in gone:
            s.abandon(job)
        assert s.metrics.queue_depth == 0
        fresh = s.submit(req("new"))  # accepted
        await running.future
        assert (await fresh.future).tokens
        assert [rid for what, rid in eng.log if what == "start"] == ["long", "new"]
    finally:
        await s.aclose()


async def test_turns_waiting_for_their_session_hold_no_active_slot() -> None:
    """One client sends several turns of one session at once: they run one after the other,
    and while they wait they hold no slot, so another session's request runs at once."""
    eng = ScriptedEngine(delay=0.3)
    s = Scheduler(eng, max_active=4, queue_size=16)
    await s.start()
    try:
        turns = [s.submit(req(f"s-t{i}", session="s")) for i in range(4)]
        await asyncio.sleep(0.05)
        other = s.submit(req("other"))
        t0 = asyncio.get_running_loop().time()
        await other.future
        assert asyncio.get_running_loop().time() - t0 < 0.5  # not behind a turn of "s"
        for job in turns:
            await job.future
        starts = [rid for what, rid in eng.log if what == "start" and rid.startswith("s-")]
        assert starts == [f"s-t{i}" for i in range(4)]  # one session's turns stay in order
        assert s.metrics.queue_depth == 0 and s.metrics.active == 0
    finally:
        await s.aclose()
