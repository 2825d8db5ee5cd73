"""Storage for the scheduler half: hicache backends on a private event-loop thread.

vLLM's scheduler is a synchronous loop that must never wait on I/O. The scheduler half
therefore owns one :class:`StoreIO` for its existence lookups: its backends (one per parallel
rank) live on a loop thread, and the connector hands them coroutines and gets
``concurrent.futures.Future`` objects back at once. (The worker half moves pages through
hicache's controller instead, see :mod:`.worker_side`.)
Backends turn their own failures into misses; a future that still raises (a bug, a closed
store) is logged by its consumer, never propagated into vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from hicache.keys import Namespace
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, create_async_storage
from hicache.storage.sync import LoopThread

__all__ = ["StoreIO", "make_backend", "open_at_start"]

logger = logging.getLogger("hicache.integrations.vllm")

T = TypeVar("T")


def make_backend(backend: str, options: dict[str, Any], namespace: Namespace) -> AsyncHiCacheStorage:
    """The backend ``backend`` for pages of ``namespace``; option errors are ``ConfigError``."""
    return create_async_storage(backend, HiCacheStorageConfig(model_name=namespace.model), namespace=namespace, **options)


def open_at_start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float, who: str) -> None:
    """Open a store on ``loop`` at engine start: an unusable one (a root that cannot be made,
    an option the backend refuses only when it opens) fails start-up with its error; one still
    opening after ``timeout`` s is left to go on opening (calls meanwhile wait for it), and
    start-up goes on. The open is not cancelled: a backend's cancelled open may still wait for
    a thread it cannot cut (a folder made on a hung network mount), and start-up would wait
    with it."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        fut.result(timeout)
    except concurrent.futures.TimeoutError:
        logger.warning("%s: the store is still opening after %.1f s; start-up goes on, calls wait for it", who, timeout)
        fut.add_done_callback(lambda f: _log_late_open(f, who))


def _log_late_open(fut: concurrent.futures.Future[Any], who: str) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is None:
        logger.info("%s: the store is open", who)
    else:
        logger.warning("%s: opening the store failed: %r (calls try again)", who, exc)


class StoreIO:
    """Backends of one or more namespaces (one per parallel rank the caller needs) and the loop
    thread they run on. :meth:`close` drains what was submitted, then closes everything."""

    def __init__(self, backend: str, options: dict[str, Any], namespaces: list[Namespace], *, name: str) -> None:
        if not namespaces:
            raise ValueError("StoreIO needs at least one namespace")
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        # built here (not on the loop): option errors reach the caller as ConfigError at start-up
        self.backends: list[AsyncHiCacheStorage] = [make_backend(backend, options, ns) for ns in namespaces]
        self._loop = LoopThread(name=name)

    @property
    def primary(self) -> AsyncHiCacheStorage:
        """The backend of this process's own rank (the first namespace)."""
        return self.backends[0]

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop thread; the future is tracked until it completes."""
        with self._lock:
            if self._closed:
                coro.close()
                fut: concurrent.futures.Future[T] = concurrent.futures.Future()
                fut.set_exception(RuntimeError("the connector's storage is closed"))
                return fut
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop.loop)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` and wait for it; on timeout it is cancelled *and waited for* before
        ``TimeoutError`` is raised (it may be filling host pages the caller reuses)."""
        return self._loop.call(coro, timeout)

    def open(self, timeout: float) -> None:
        """Open every backend now, so that an unusable store (a root that cannot be made, an
        option the backend refuses only when it opens) fails engine start-up with its error
        instead of every lookup logging it while the cache never hits. A store slow to answer
        (an object store that is down) is not an error: after ``timeout`` s it is left to open,
        and calls wait for it (see :func:`open_at_start`)."""
        open_at_start(self._loop.loop, self._open_all(), timeout, "hicache")

    async def _open_all(self) -> None:
        await asyncio.gather(*(backend.open() for backend in self.backends))

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def close(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for submitted work, then close the backends (all together,
        up to ``timeout`` s: one per rank, each waited for in turn, made a close as long as the
        ranks) and the loop. Returns how many submitted operations had not finished (they are
        cancelled). The loop's stop keeps ``timeout`` too: a lookup stuck in a thread call (a
        hung mount) is left to end on its own, not waited for 10 s more (lookups fill no buffer
        of the caller's)."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            pending = list(self._pending)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        for fut in not_done:
            fut.cancel()
        if not_done:
            logger.warning("hicache: %d storage operation(s) still queued at close were cancelled", len(not_done))
        try:
            self._loop.call(self._close_all(), timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - closing must not raise into vLLM
            logger.warning("hicache: closing storage failed: %r", exc)
        self._loop.stop(timeout)
        return len(not_done)

    async def _close_all(self) -> None:
        results = await asyncio.gather(*(backend.aclose() for backend in self.backends), return_exceptions=True)
        for backend, result in zip(self.backends, results):
            if isinstance(result, BaseException):
                logger.warning("hicache: closing storage %s failed: %r", backend.backend_name, result)
