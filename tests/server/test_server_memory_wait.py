"""A request that finds the device full behind a running request, on the real parts: the
scheduler over a real :class:`Engine`, model and :class:`HiCache` (device pool, host pool,
controller), no stand-in for any of them.

The demo's rare "1 of 40 answers differed" was this situation: a last-turn request that found
the device full while other conversations ran lost every race for the memory they freed to
requests admitted after it, gave up after its retries with ``OutOfKVSlotsError``, and its
missing answer was counted as a different one (the prompt-token total was short by exactly
one last-turn prompt; no answer was wrong). Here the running request is held mid-decode by
the test (a forward that waits on a gate jumps its next decode step on the engine's worker), so the full
device is certain, not a matter of timing; the retry budget is zero, so the request must get
through by waiting, never by retrying.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

from server_helpers import requires_facade, small_config
from hicache.engine.model import ModelSpec, TinyTransformer
from hicache.engine.runner import Engine, reference_generate
from hicache.engine.worker import PREFILL
from hicache.server.protocol import GenerateRequest
from hicache.server.scheduler import Scheduler

#: 32 pages of 16: the running request (9 pages, growing) and the big one (26 pages) cannot
#: both hold their pages, each fits alone
DEVICE_TOKENS = 512


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def _until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition()`` holds (only a hang fails on the clock)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.005)


@requires_facade
async def test_a_request_behind_a_full_device_waits_for_the_memory_and_answers_right() -> None:
    from hicache.facade import HiCache

    cfg = small_config(device={"size_tokens": DEVICE_TOKENS})
    model = TinyTransformer(ModelSpec.from_model_config(cfg.model, max_positions=cfg.device.max_context_len))
    gate = threading.Event()
    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        sched = Scheduler(engine, max_active=4, queue_size=8, max_memory_retries=0)
        await sched.start()
        try:
            running_prompt, big_prompt = _prompt(1, 128), _prompt(2, 400)
            newcomer_prompts = [_prompt(3 + i, 48) for i in range(2)]

            held = asyncio.Event()
            holds: list[asyncio.Task[bool]] = []

            def hold_after_first_token(_token: int) -> None:
                # a prefill-priority forward jumps the request's queued decode steps: the worker
                # stops there within a step, and the request keeps its pages until the gate opens
                if not held.is_set():
                    held.set()
                    holds.append(asyncio.ensure_future(engine.run(gate.wait, priority=PREFILL)))

            running = sched.submit(GenerateRequest(rid="running", tokens=running_prompt, max_new_tokens=24),
                                   on_token=hold_after_first_token)
            await held.wait()
            big = sched.submit(GenerateRequest(rid="big", tokens=big_prompt, max_new_tokens=4))
            await _until(lambda: sched.metrics.memory_retries >= 1 or big.future.done())
            assert not big.future.done(), "a request behind a running one must wait, not fail"

            newcomers = [sched.submit(GenerateRequest(rid=f"new{i}", tokens=p, max_new_tokens=4))
                         for i, p in enumerate(newcomer_prompts)]
            for _ in range(20):
                await asyncio.sleep(0)
            # while big waits for memory nobody queued after it is admitted (it cannot starve)
            assert all(job.queued for job in newcomers) and sched.metrics.active == 2

            gate.set()
            results = await asyncio.gather(running.future, big.future, *(j.future for j in newcomers))
        finally:
            gate.set()
            await asyncio.gather(*holds)
            await sched.aclose()
            await engine.aclose()

    prompts = [running_prompt, big_prompt, *newcomer_prompts]
    for result, prompt in zip(results, prompts, strict=True):
        assert result.tokens == reference_generate(model, prompt, len(result.tokens))
    assert sched.metrics.requests["ok"] == 4 and sched.metrics.requests["error"] == 0
    assert sched.metrics.memory_retries >= 1


@requires_facade
async def test_a_turn_that_can_never_fit_is_not_kept_waiting_by_its_own_next_turn() -> None:
    """Two turns of one session, each longer than the device: the second waits for the session
    lock, holding no memory. It must not count as a running request the first could wait
    for: the first gives up after its own retries, not after the total wait (600 s here, so
    the bug shows as a hang), and an unrelated request behind them is served."""
    from hicache.facade import HiCache
    from hicache.errors import OutOfKVSlotsError

    cfg = small_config(device={"size_tokens": 256})
    model = TinyTransformer(ModelSpec.from_model_config(cfg.model, max_positions=cfg.device.max_context_len))
    async with HiCache.from_config(cfg) as cache:
        engine = Engine(cache, model)
        sched = Scheduler(engine, max_active=4, queue_size=8, memory_wait_total_s=600)
        await sched.start()
        try:
            turns = [sched.submit(GenerateRequest(rid=f"turn{i}", tokens=[7] * 400, max_new_tokens=2, session_id="s"))
                     for i in range(2)]
            tiny = sched.submit(GenerateRequest(rid="tiny", tokens=[1, 2, 3], max_new_tokens=2))
            async with asyncio.timeout(60):
                await asyncio.wait([t.future for t in turns] + [tiny.future])
            assert all(isinstance(t.future.exception(), OutOfKVSlotsError) for t in turns)
            assert tiny.future.exception() is None and tiny.future.result().tokens
        finally:
            await sched.aclose()
            await engine.aclose()
