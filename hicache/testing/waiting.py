"""``eventually``: wait for a condition that background work makes true, with a deadline.

Why a helper: fault tests wait for a health probe, a disconnect noticed by a server, a
background copy; each hand-written poll loop ended in a slightly different (or no) failure.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

__all__ = ["eventually"]


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0,
                     interval: float = 0.01) -> None:
    """Return once ``check()`` (sync or async) is true; ``AssertionError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition {getattr(check, '__name__', check)!r} not reached in {timeout} s")
        await asyncio.sleep(interval)
