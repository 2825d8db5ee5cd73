"""``HiCacheStorage``: the blocking facade, with exactly SGLang's method names and signatures.

For callers without an event loop (SGLang's storage threads, scripts). The async backend runs on
a private event loop in a daemon thread owned by the facade; each call is submitted there and
waited for. Calling the facade from a thread that already runs an event loop would block that
loop, so it raises :class:`~hicache.errors.LoopMisuseError` pointing at the async interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - its exit hook first (see _close_at_exit)
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from hicache.errors import LoopMisuseError, StorageStateError
from hicache.storage.base import AsyncHiCacheStorage, StorageState
from hicache.storage.stats import Throttle
from hicache.storage.key_screen import first_unstorable, is_storable, page_indices, storable_runs
from hicache.storage.pages import checked_starts
from hicache.storage.pool_pages import clashing_reads
from hicache.storage.types import (
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    pool_name_str,
)

__all__ = ["HiCacheStorage", "LoopThread"]

T = TypeVar("T")

_logger = logging.getLogger("hicache.storage")
TransferCall = Callable[[list[PoolTransfer], HiCacheStorageExtraInfo | None], Coroutine[Any, Any, dict[str, list[bool]]]]


def _is_batch(keys: object) -> bool:
    """A list or tuple of keys: what the facade screens key by key (anything else goes to the
    backend unchanged, whose error names the caller's mistake)."""
    return isinstance(keys, (list, tuple))


#: How long :meth:`LoopThread.stop` waits for the loop's thread when its caller gives no limit.
STOP_WAIT_S = 10.0
#: The least it waits: the loop's last turns (cancelled calls ending, their callers answered).
STOP_GRACE_S = 0.1


class LoopThread:
    """An event loop running forever in a daemon thread, for blocking callers."""

    def __init__(self, name: str = "hicache-storage-loop") -> None:
        self.loop = asyncio.new_event_loop()
        #: calls waited for (result -> coroutine); the ones the stopped loop never settles fail
        #: at its end. Guarded by ``_lock`` with ``_stopped``: no call registers after the stop
        self._waiting: dict[concurrent.futures.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        #: the tasks the stopped loop cancelled and waits for (what a stop may leave running)
        self._ending: list[asyncio.Task[Any]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                self._end_calls()
            finally:
                # closed here, not by stop(): a stop that gave up at its deadline (a call stuck
                # in a thread) left the loop running; it is closed once that call has ended
                self.loop.close()

    def _end_calls(self) -> None:
        """The loop stopped (a close, or the facade collected) while other threads may still be
        in a call: their coroutines are cancelled and waited for (one may be reading into the
        caller's host pool), and every caller gets :class:`StorageStateError` now, instead of
        waiting for a result no one would set (until ``call_timeout``, or for ever)."""
        with self._lock:
            self._stopped = True
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        self._ending = pending
        for task in pending:
            task.cancel()
        # at least one more turn, pending tasks or not: a call that ended in the loop's last
        # turn has its result (finish) still queued; run it, or the call would fail although
        # it completed
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        for result, coro in list(self._waiting.items()):  # handed over, never started
            if not result.done():
                coro.close()
                result.set_exception(_stopped_error())

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, *, wait_cancelled: bool = True) -> T:
        """Run ``coro`` on the loop and wait for its result.

        If the wait ends early (``timeout``, ``KeyboardInterrupt``...), the coroutine is
        cancelled and *waited for* before the exception reaches the caller: it may be reading
        into the caller's host pool, which the caller is free to reuse once we return.
        ``wait_cancelled=False`` (a lookup, which fills no buffer): cancelled, not waited for;
        one stuck in a thread that cannot be cut (a disk probe on a hung mount) would otherwise
        hold its caller for as long, past ``timeout``.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise LoopMisuseError(
                "HiCacheStorage (the blocking facade) was called from inside a running event "
                "loop, which it would block; await the AsyncHiCacheStorage methods instead "
                "(create_async_storage(...))"
            )
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopped or not self._thread.is_alive() or self.loop.is_closed():
                coro.close()
                raise StorageStateError("the storage loop thread is stopped (facade closed)")
            self._waiting[result] = coro
        result.add_done_callback(lambda r: self._waiting.pop(r, None))
        tasks: list[asyncio.Task[T]] = []

        def finish(task: asyncio.Task[T]) -> None:
            if task.cancelled() and self._stopped:
                result.set_exception(_stopped_error())
            elif task.cancelled():
                result.set_exception(concurrent.futures.CancelledError())
            elif task.exception() is not None:
                result.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                result.set_result(task.result())

        def start() -> None:
            if self._stopped:  # run by the stopping loop's last turns: the call is refused
                coro.close()
                if not result.done():
                    result.set_exception(_stopped_error())
                return
            task = self.loop.create_task(coro)
            tasks.append(task)
            task.add_done_callback(finish)

        def cancel() -> None:
            for task in tasks:
                task.cancel()

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed in between
            self._waiting.pop(result, None)
            coro.close()
            raise StorageStateError("the storage loop thread is stopped (facade closed)") from None
        try:
            return result.result(timeout)
        except BaseException:
            if not result.done():
                try:
                    self.loop.call_soon_threadsafe(cancel)  # runs after start(): FIFO
                    # wait until the task has really ended (or the loop died under it)
                    while wait_cancelled and not result.done() and self._thread.is_alive():
                        concurrent.futures.wait([result], timeout=0.5)
                except BaseException:  # noqa: BLE001 - loop closed, or a second interrupt
                    pass
            raise

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the loop and wait up to ``timeout`` s (the caller's remaining close time; at
        least :data:`STOP_GRACE_S`) for its thread to end: its calls cancelled and waited for,
        every waiting caller answered, the loop closed.

        A call stuck in a thread call that cannot be cut (a folder made on a hung mount: a
        cancelled backend call waits for its thread) keeps the thread past that; it is logged
        and left to end on its own (its caller still gets its answer, the loop closes then),
        instead of holding up the caller's shutdown."""
        if threading.current_thread() is self._thread:
            # Called on the loop thread itself (a finalizer run by the collector there): it
            # cannot join itself; stopping the loop ends the thread, which closes the loop.
            self.loop.stop()
            return
        if self._thread.is_alive():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                pass
            self._thread.join(timeout=max(timeout, STOP_GRACE_S))
        if self._thread.is_alive():
            self._log_left_running(timeout)
        elif not self.loop.is_closed():  # the thread died before its loop ran
            self.loop.close()

    def _log_left_running(self, waited: float) -> None:
        stuck = [t for t in self._ending if not t.done()]
        what = ", ".join(sorted({_task_name(t) for t in stuck})) or "a call blocking the loop thread"
        _logger.warning(
            "%s: %d task(s) still running %.1f s after the loop was stopped (%s); left to end on "
            "their own (their callers get their answers, the loop closes then)",
            self._thread.name, len(stuck), max(waited, STOP_GRACE_S), what,
        )


def _task_name(task: asyncio.Task[Any]) -> str:
    """What a task runs, for a log line: its coroutine's name (a task's own name is a number)."""
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()


def _in_running_loop() -> bool:
    """Whether the calling thread is running an event loop (which a blocking call would stall)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _stopped_error() -> StorageStateError:
    return StorageStateError("the storage loop stopped (facade closed) during the call")


def _stop_loop(loop_thread: LoopThread, backend: AsyncHiCacheStorage | None = None,
               deadline: float | None = None) -> None:
    """Finalizer of a facade: close the backend it owns (file executors, HTTP sessions), then
    stop its loop, both by ``deadline`` (``time.monotonic()``; default: :data:`CLOSE_TIMEOUT_S`
    from now). Runs on ``close()``, when the facade is collected, or at interpreter exit."""
    if deadline is None:
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
    if (
        backend is not None
        and backend.state is not StorageState.CLOSED
        and threading.current_thread() is not loop_thread._thread
        and loop_thread._thread.is_alive()
    ):
        try:
            loop_thread.call(backend.aclose(), timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # noqa: BLE001 - a finalizer must not raise
            pass
    loop_thread.stop(timeout=deadline - time.monotonic())


#: How long closing a facade may take. Not ``call_timeout`` (one I/O's limit): stores bound
#: their own close waits (the file store waits up to 30 s for calls in progress and 30 s for
#: reads on callers' threads, then for its threads), and a close cut short leaves files and
#: locks open; this only keeps a hung close from hanging its caller for good.
CLOSE_TIMEOUT_S = 120.0

#: How long opening a store through a facade (:meth:`HiCacheStorage.open`) may take. Not
#: ``call_timeout`` either: a store's first touch (an automounted NFS root being mounted, an
#: S3 bucket's first connection) may take longer than one I/O may, and an open cut there
#: failed an engine's launch; this only keeps a hung open from hanging its caller for good.
OPEN_TIMEOUT_S = 120.0

#: How long a clear through a facade (:meth:`HiCacheStorage.clear`) may take. Not
#: ``call_timeout`` either: a clear removes a whole namespace (many list and delete calls on an
#: object store, which the S3 store bounds at 300 s), and one cut at one I/O's limit left part
#: of the namespace stored; this only keeps a hung clear from hanging its caller for good.
CLEAR_TIMEOUT_S = 300.0

#: Facades not closed yet, closed at interpreter exit by :func:`_close_at_exit`.
_open_facades: weakref.WeakSet[HiCacheStorage] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Close the facades still open when the interpreter exits, before ``concurrent.futures``
    stops taking work: ``weakref.finalize`` runs later (at ``atexit``), when a store's close
    found every executor refusing it and left its files open."""
    for facade in list(_open_facades):
        facade._finalizer()


# Registered where threading runs the hooks that come before its executors stop (CPython's
# ``threading._register_atexit``, the one ``concurrent.futures.thread`` uses; hooks run last
# registered first, so that module's hook is registered before this one). Without it, the
# facades' finalizers still run at ``atexit``.
_register_atexit = getattr(threading, "_register_atexit", None)
if _register_atexit is not None:
    _register_atexit(_close_at_exit)


class HiCacheStorage:
    """Blocking view of an :class:`AsyncHiCacheStorage` (SGLang's ``HiCacheStorage`` surface)."""

    def __init__(self, backend: AsyncHiCacheStorage, *, call_timeout: float | None = None) -> None:
        self.backend = backend
        self.call_timeout = call_timeout
        self._loop_thread = LoopThread()
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop_thread, backend)
        self._closed = False
        self._timeout_log = Throttle()
        _open_facades.add(self)

    def call_deadline(self) -> float | None:
        """When a call started now must have answered (``time.monotonic()``), ``None`` without a
        ``call_timeout``: for a caller that composes one call of several steps (a lookup on its
        own thread, then one on the loop), each given what is left of it (see :meth:`run`)."""
        return None if self.call_timeout is None else time.monotonic() + self.call_timeout

    def _timeout_by(self, deadline: float | None) -> float | None:
        """The wait a call may take: ``call_timeout``, or what is left until ``deadline``."""
        return self.call_timeout if deadline is None else max(0.0, deadline - time.monotonic())

    def _call(self, coro: Coroutine[Any, Any, T], *, lookup: bool = False, deadline: float | None = None) -> T:
        """``coro`` on the loop, under ``call_timeout`` (or until ``deadline``, from
        :meth:`call_deadline`); a ``lookup`` (it fills no buffer) past it is cancelled and not
        waited for (see :meth:`LoopThread.call`)."""
        if self._closed:
            coro.close()
            raise StorageStateError("HiCacheStorage is closed")
        try:
            return self._loop_thread.call(coro, self._timeout_by(deadline), wait_cancelled=not lookup)
        except TimeoutError:
            # counted where every other failure of the store is (an engine adapter turns the
            # exception into misses, so without this a slow store would look merely quiet)
            self.backend.stats.incr("call_timeouts")
            count = self._timeout_log.due()
            if count:
                _logger.warning("%s: %d call(s) took longer than call_timeout=%ss; cancelled",
                                type(self.backend).__name__, count, self.call_timeout)
            raise

    def _blocking_caller(self) -> bool:
        """Whether a call may be answered on the calling thread: the facade open, and the caller
        not inside a running event loop (that misuse is the loop call's to report)."""
        return not self._closed and not _in_running_loop()

    def run(self, coro: Coroutine[Any, Any, T], *, lookup: bool = False, deadline: float | None = None) -> T:
        """Run a coroutine of the caller's on the facade's loop (where the backend lives) and
        wait for it, under ``call_timeout``: for engine adapters that compose several backend
        calls into one blocking call. A timeout cancels the coroutine and waits for it, unless
        it is a ``lookup`` (it fills no buffer: then its caller's timeout is kept).
        ``deadline`` (:meth:`call_deadline`, taken before an earlier step of the same call):
        the wait ends then instead, so that the steps together keep one ``call_timeout``."""
        return self._call(coro, lookup=lookup, deadline=deadline)

    # lifecycle
    def open(self) -> None:
        """Open the backend (idempotent), waiting up to :data:`OPEN_TIMEOUT_S` (or
        ``call_timeout`` where that is longer), not ``call_timeout``: that bounds one I/O."""
        if self._closed:
            raise StorageStateError("HiCacheStorage is closed")
        limit = max(OPEN_TIMEOUT_S, self.call_timeout or 0.0)
        try:
            self._loop_thread.call(self.backend.open(), limit)
        except TimeoutError:
            raise TimeoutError(f"opening the store took longer than {limit:g} s") from None

    def close(self) -> None:
        """Close the backend and stop the private loop (idempotent)."""
        if self._closed:
            return
        if _in_running_loop():
            # refused before anything changes: marked closed, the facade's later close (from a
            # thread, or at exit) did nothing, and the backend's threads and files stayed open
            raise LoopMisuseError(
                "HiCacheStorage.close() was called from inside a running event loop, which it "
                "would block; call it from a thread (asyncio.to_thread(store.close)) or use "
                "create_async_storage(...) and await aclose()"
            )
        limit = max(CLOSE_TIMEOUT_S, self.call_timeout or 0.0)
        deadline = time.monotonic() + limit
        try:
            self._loop_thread.call(self.backend.aclose(), limit)
        finally:
            self._closed = True
            _open_facades.discard(self)
            if self._finalizer.detach() is not None:  # its stop keeps this close's deadline
                _stop_loop(self._loop_thread, self.backend, deadline)

    def __enter__(self) -> HiCacheStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.backend.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: PoolName | str) -> None:
        self.backend.register_mem_host_pool_v2(host_pool, host_pool_name)

    @property
    def registered_pools(self) -> dict[str, Any]:
        return self.backend.registered_pools

    # screening: one bad key is a miss for that key alone (see hicache.storage.key_screen)
    def _count_unstorable(self, keys: Sequence[object]) -> int:
        bad = sum(not is_storable(k) for k in keys)
        if bad:
            self.backend.stats.incr("invalid_requests", bad)
        return bad

    def storable_prefix(self, keys: list[str]) -> list[str]:
        """``keys`` up to its first unstorable key (counted): a prefix lookup stops at a miss
        anyway, so a bad key is a miss there, not an error of the whole batch (also for a
        lookup an engine adapter composes itself)."""
        if not _is_batch(keys):
            return keys
        cut = first_unstorable(keys)
        if cut is None:
            return keys
        self._count_unstorable(keys)
        return list(keys[:cut])

    def _transfers(
        self, call: TransferCall, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None,
        *, reads: bool = False, deadline: float | None = None,
    ) -> dict[str, list[bool]]:
        """A v2 get (``reads``) or set with every unstorable key failed alone: each run of good
        keys of a transfer goes to the backend with its own pages (a run after a bad key has no
        parent). ``deadline``: see :meth:`run`."""
        if all(not _is_batch(t.keys) or first_unstorable(t.keys or []) is None for t in transfers):
            return self._call(call(transfers, extra_info), deadline=deadline)

        async def screened() -> dict[str, list[bool]]:
            results: dict[str, list[bool]] = {}
            for t in transfers:
                keys = list(t.keys or [])
                flags = [False] * len(keys)
                self._count_unstorable(keys)
                runs_of: list[object] = list(keys)
                if reads:  # a page clashing with another run's target fails as a bad key does
                    for i in self._clashing_reads(t, keys):
                        runs_of[i] = None
                for start, end in storable_runs(runs_of):
                    indices = page_indices(t.host_indices, len(keys), start, end)
                    if indices is None:  # indices that do not split into pages: the whole transfer fails
                        self.backend.stats.incr("invalid_requests")
                        break
                    info = extra_info
                    if start > 0:
                        info = replace(extra_info or HiCacheStorageExtraInfo(), prefix_keys=[])
                    part = replace(t, host_indices=indices, keys=list(keys[start:end]))
                    flags[start:end] = (await call([part], info))[pool_name_str(t.name)]
                results[pool_name_str(t.name)] = flags
            return results

        return self._call(screened(), deadline=deadline)

    def _clashing_reads(self, transfer: PoolTransfer, keys: Sequence[object]) -> set[int]:
        """Positions of the storable pages of a read ``transfer`` whose host memory another
        storable page of it is read into (the first kept; counted and logged).

        Why here: the screened runs go to the backend one by one, and the backend drops such
        pages only within one run; two pages either side of a bad key were both read into the
        same memory and both reported hits, the first's host page holding the second's KV."""
        name = pool_name_str(transfer.name)
        pool = self.backend.registered_pools.get(name)
        if pool is None:
            return set()  # the backend's call refuses the transfer
        starts, bad = checked_starts(transfer.host_indices, len(keys), pool.page_size)
        if starts is None:
            return set()  # not whole pages: the whole transfer fails (see screened())
        usable: list[int | None] = [st if is_storable(k) else None for st, k in zip(starts, keys)]
        for i in bad:
            usable[i] = None
        return clashing_reads(self.backend, name, usable, pool.page_size, "those pages fail")

    # v2
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        return self._call(self.backend.batch_exists_v2(self.storable_prefix(keys), pool_transfers, extra_info),
                          lookup=True)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None,
        *, deadline: float | None = None,
    ) -> dict[str, list[bool]]:
        """``deadline``: see :meth:`run` (an engine call of several pools keeps one timeout)."""
        return self._transfers(self.backend.batch_get_v2, transfers, extra_info, reads=True, deadline=deadline)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None,
        *, deadline: float | None = None,
    ) -> dict[str, list[bool]]:
        """``deadline``: see :meth:`run` (an engine call of several pools keeps one timeout)."""
        return self._transfers(self.backend.batch_set_v2, transfers, extra_info, deadline=deadline)

    # v1
    def _v1(self, call: TransferCall, keys: list[str], host_indices: torch.Tensor, extra_info: Any,
            *, reads: bool = False, deadline: float | None = None) -> list[bool]:
        if PoolName.KV.value not in self.backend.registered_pools:
            raise StorageStateError("the v1 calls need register_mem_pool_host(host_pool) first")
        transfer = [PoolTransfer(PoolName.KV, host_indices, keys=keys)]
        return self._transfers(call, transfer, extra_info, reads=reads, deadline=deadline)[PoolName.KV.value]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None,
        *, deadline: float | None = None,
    ) -> list[bool]:
        """Read KV pages into the registered host pool: on the calling thread where the store
        can (``batch_get_v1_now``: small pages straight into pool memory, bounded by
        ``call_timeout``), else on the facade's loop. Why: each hand-off to the loop, its I/O
        thread and back waits for the GIL, which a busy engine's threads hold; those waits
        cost more than reading small pages. ``deadline``: see :meth:`run`."""
        if not _is_batch(keys) or first_unstorable(keys) is None:
            if self._blocking_caller():
                now = self.backend.batch_get_v1_now(keys, host_indices, self._timeout_by(deadline))
                if now is not None:
                    return now
            return self._call(self.backend.batch_get_v1(keys, host_indices, extra_info), deadline=deadline)
        return self._v1(self.backend.batch_get_v2, keys, host_indices, extra_info, reads=True, deadline=deadline)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None,
        *, deadline: float | None = None,
    ) -> list[bool]:
        """``deadline``: see :meth:`run`."""
        if not _is_batch(keys) or first_unstorable(keys) is None:
            return self._call(self.backend.batch_set_v1(keys, host_indices, extra_info), deadline=deadline)
        return self._v1(self.backend.batch_set_v2, keys, host_indices, extra_info, deadline=deadline)

    # v0
    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        if not is_storable(key):
            self._count_unstorable([key])
            return None
        return self._call(self.backend.get(key, target_location, target_sizes))

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        if not _is_batch(keys) or first_unstorable(keys) is None:
            return self._call(self.backend.batch_get(keys, target_locations, target_sizes))
        self._count_unstorable(keys)
        good = [i for i, k in enumerate(keys) if is_storable(k)]
        out: list[torch.Tensor | None] = [None] * len(keys)
        if target_locations is not None and len(target_locations) != len(keys):
            self.backend.stats.incr("invalid_requests")
            return out
        targets = [target_locations[i] for i in good] if target_locations is not None else None
        got = self._call(self.backend.batch_get([keys[i] for i in good], targets, target_sizes))
        for i, tensor in zip(good, got):
            out[i] = tensor
        return out

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        if not is_storable(key):
            self._count_unstorable([key])
            return False
        return self._call(self.backend.set(key, value, target_location, target_sizes))

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """True only if every key was stored; a bad key fails, the good keys are still stored."""
        if not _is_batch(keys) or first_unstorable(keys) is None:
            return self._call(self.backend.batch_set(keys, values, target_locations, target_sizes))
        self._count_unstorable(keys)
        vals = values if values is not None else target_locations
        if vals is None or len(vals) != len(keys):
            self.backend.stats.incr("invalid_requests")
            return False

        async def runs() -> None:
            for start, end in storable_runs(keys):
                await self.backend.batch_set(list(keys[start:end]), list(vals[start:end]))

        self._call(runs())
        return False

    def exists(self, key: str) -> bool:
        if not is_storable(key):
            self._count_unstorable([key])
            return False
        return self._call(self.backend.exists(key), lookup=True)

    def exists_prefix(self, keys: list[str], pool: PoolName | str = PoolName.KV) -> int:
        """How many of ``keys``' pages in ``pool`` exist from the first: on the calling thread
        where the store can answer from memory (``exists_prefix_now``), else on the loop (see
        :meth:`batch_get_v1` for why). An unstorable key is a miss (the prefix stops there)."""
        keys = self.storable_prefix(keys)
        deadline = self.call_deadline()  # one call_timeout for both tries: each its own took twice it
        now = self.exists_prefix_now(keys, pool, screened=True, deadline=deadline)
        return now if now is not None else self._call(self.backend.exists_prefix(keys, pool), lookup=True,
                                                      deadline=deadline)

    def exists_prefix_now(self, keys: list[str], pool: PoolName | str = PoolName.KV, *,
                          screened: bool = False, deadline: float | None = None) -> int | None:
        """:meth:`exists_prefix` answered on the calling thread, or ``None`` where the store
        cannot (or the caller is inside a running loop, or the facade closed): for an engine
        adapter that composes the rest of a lookup itself. ``screened``: ``keys`` went through
        :meth:`storable_prefix` already. Bounded by ``call_timeout`` (or ``deadline``, see
        :meth:`run`): a look at the store's medium not answered by then is a miss."""
        if not self._blocking_caller():
            return None
        return self.backend.exists_prefix_now(keys if screened else self.storable_prefix(keys), pool,
                                              self._timeout_by(deadline))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._call(self.backend.batch_exists(self.storable_prefix(keys), extra_info), lookup=True)

    def clear(self) -> bool:
        """Remove every page of this namespace, waiting up to :data:`CLEAR_TIMEOUT_S` (or
        ``call_timeout`` where that is longer; no limit without one), not ``call_timeout``:
        that bounds one I/O."""
        if self.call_timeout is None:
            return self._call(self.backend.clear())
        limit = max(CLEAR_TIMEOUT_S, self.call_timeout)
        return self._call(self.backend.clear(), deadline=time.monotonic() + limit)

    def get_stats(self) -> dict[str, Any]:
        return self.backend.get_stats()
