"""``Reaper``: the one background task of the session cache.

Why a task of its own: idle sessions must give their device memory up even when no request
arrives to trigger it. The task only calls a synchronous, non-blocking function now and then,
so it can be cancelled at any await (the sleep) without leaving anything half done. An
exception in that function is logged and counted; the task keeps running (a reaper that dies
on the first error would silently pin memory forever, like SGLang's backup thread, #38428).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

__all__ = ["Reaper"]

logger = logging.getLogger("hicache.session")


class Reaper:
    """Calls ``tick()`` every ``interval_s`` seconds on the running loop until :meth:`aclose`.

    ``on_error()`` is called (after logging) whenever ``tick`` raises.
    """

    def __init__(self, tick: Callable[[], object], interval_s: float, *,
                 on_error: Callable[[], None] | None = None, name: str = "hicache-session-reaper") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._tick = tick
        self._interval = interval_s
        self._on_error = on_error
        self._name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the task on the running loop (idempotent)."""
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - never die; see the module docstring
                logger.exception("session reaper: tick failed")
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error()

    async def aclose(self) -> None:
        """Cancel the task and wait for it (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])  # a cancellation of the caller itself still propagates
