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
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["copy_bytes", "run_to_completion", "OFFLOAD_MIN_BYTES"]

T = TypeVar("T")

#: Below this many bytes a copy is cheaper than a hop to a thread (~20-50 us); above it the
#: event loop would stall for longer than one scheduling slice.
OFFLOAD_MIN_BYTES = 1 << 20


async def run_to_completion(fn: Callable[..., T], /, *args: Any, executor: Any = None) -> T:
    """Run ``fn(*args)`` on a thread; if the caller is cancelled, wait for it, then re-raise."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except Exception:  # noqa: BLE001 - we are cancelled anyway
                break
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: no "exception was never retrieved" noise
        raise


def copy_bytes(dst: memoryview, src: memoryview | bytes | bytearray) -> None:
    """``dst[:] = src`` through numpy, which releases the GIL for a large copy (a memoryview
    slice assignment holds it, stalling the event loop thread as well)."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into a buffer of {len(dst)}")
    if not len(dst):
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
