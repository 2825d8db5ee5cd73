"""Blocking work off the event loop, without abandoning it on cancellation.

``asyncio.to_thread`` lets a cancelled caller return at once while the thread keeps running. When
that thread writes into memory the caller owns (a host-pool page, a target tensor), the caller
may hand the memory back - and the thread then writes into memory that belongs to someone else
by now. :func:`run_to_completion` waits for the thread before the cancellation unwinds (as
anyio's ``to_thread`` does for writes), so once the coroutine has returned or raised, nothing
of ours touches the buffers any more.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["copy_bytes", "run_to_completion", "wait_out", "OFFLOAD_MIN_BYTES"]

T = TypeVar("T")

#: Below this many bytes a copy is cheaper than a hop to a thread (~20-50 us); above it the
#: event loop would stall for longer than one scheduling slice.
OFFLOAD_MIN_BYTES = 1 << 20


async def run_to_completion(fn: Callable[..., T], /, *args: Any, executor: Any = None) -> T:
    """Run ``fn(*args)`` on a thread; if the caller is cancelled, wait for it, then re-raise.

    ``fn`` runs in a copy of the caller's context, as a task would: a backend's counters go to
    the call counting them (:func:`~hicache.storage.stats.counting_call`), where
    ``run_in_executor`` alone dropped what a thread counted (a memory store's big-page write
    refused for room was retried as a failure, the refusal never seen)."""
    context = contextvars.copy_context()
    fut = asyncio.get_running_loop().run_in_executor(executor, context.run, fn, *args)
    if await wait_out(fut):
        if not fut.cancelled():
            fut.exception()  # retrieved: no "exception was never retrieved" noise
        raise asyncio.CancelledError
    return fut.result()


async def wait_out(
    fut: asyncio.Future[Any], *, slow_after: float | None = None, on_slow: Callable[[], None] | None = None
) -> bool:
    """Wait until ``fut`` is done, through any cancellation of the caller; return whether the
    caller was cancelled meanwhile (it re-raises once the work has really ended).

    ``on_slow`` is called once if ``fut`` is still running ``slow_after`` seconds in: work that
    cannot be abandoned can at least be reported (a hung mount holds its buffers until it
    returns)."""
    cancelled = False
    loop = asyncio.get_running_loop()
    deadline = None if slow_after is None or on_slow is None else loop.time() + slow_after
    while not fut.done():
        try:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait({fut}, timeout=timeout)  # never cancels fut
        except asyncio.CancelledError:
            cancelled = True
            continue
        if deadline is not None and not fut.done() and loop.time() >= deadline:
            deadline = None
            assert on_slow is not None
            on_slow()
    return cancelled


def copy_bytes(dst: memoryview, src: memoryview | bytes | bytearray) -> None:
    """``dst[:] = src`` through numpy, which releases the GIL for a large copy (a memoryview
    slice assignment holds it, stalling the event loop thread as well)."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into a buffer of {len(dst)}")
    if not len(dst):
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
