"""A private event loop on its own thread where storage calls run.

Why: a backend may do real work inside its coroutines before the first ``await`` (the memory
backend copies every page inline, a file backend may hash or stat), and on the server's loop
that work delays everything else. Running each storage coroutine on this loop keeps the server's
loop free; the controller awaits the result through ``asyncio.wrap_future``. Cancelling the
awaiting task cancels the coroutine on the I/O loop too.

A backend used through the controller must only be used from this loop while the controller
runs (backends bind locks to the loop that first opens them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["IoThread"]

logger = logging.getLogger("hicache.controller")

T = TypeVar("T")


class IoThread:
    """Runs coroutines on a dedicated loop thread (started lazily, stopped by :meth:`stop`)."""

    def __init__(self, name: str = "hicache-storage-io") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` executed on the I/O loop."""
        if not self.running:
            self.start()
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wrap_future(fut)

    async def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop (cancelling what still runs there) and join the thread off-loop, for
        at most ``timeout`` seconds (``None``: no limit). A coroutine that blocks the I/O loop
        (a backend stuck in a synchronous call) would otherwise make this wait forever; the
        thread is a daemon, so it is left behind with a warning. Returns whether it ended."""
        if self._loop is None or self._thread is None:
            return True
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed meanwhile
                pass
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():
            logger.warning("%s: the storage I/O loop is blocked; its thread is left behind", self.name)
            return False
        return True
