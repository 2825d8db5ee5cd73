"""Storage jobs of the vLLM tier, run on a private event loop beside vLLM's scheduler.

vLLM calls a secondary tier from its scheduler thread and requires every call to return at
once: a store or load is submitted, and its result is polled for in a later step. hicache's
backends are asyncio code, so :class:`TierRunner` runs them on an event loop in a thread of its
own (:class:`~hicache.storage.sync.LoopThread`) and turns each job into one task on it:

* every task is owned: it is tracked from submission until its result is queued, and
  :meth:`TierRunner.drain` / :meth:`TierRunner.close` wait for all of them, so no transfer is
  abandoned mid-copy while vLLM reuses the primary tier's memory;
* no task dies on an exception: a job catches everything, and a failure is a result with the
  pages marked failed (vLLM then recomputes them), never an error in vLLM's loop;
* nothing blocks the scheduler: the only blocking call, :meth:`TierRunner.exists`, runs on
  vLLM's lookup thread and is bounded by a timeout.

Nothing here imports vLLM; :mod:`hicache.integrations.vllm.tier` adapts it to vLLM's interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.errors import ConfigError, StorageStateError
from hicache.integrations.vllm.store_io import open_at_start
from hicache.integrations.vllm.tier_pool import ChunkPool
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageExtraInfo, PoolName, PoolTransfer
from hicache.storage.sync import STOP_WAIT_S, LoopThread

__all__ = ["JobOutcome", "TierRunner"]

logger = logging.getLogger("hicache.integrations.vllm.tier")

# how long close() waits for jobs in flight before it gives up on them (and says so)
CLOSE_DRAIN_TIMEOUT_S = 60.0

KV = PoolName.KV.value


@dataclass(frozen=True)
class JobOutcome:
    """What became of one job: a flag per page (in the job's order), time and bytes moved."""

    job_id: int
    is_load: bool
    ok: tuple[bool, ...]
    seconds: float
    nbytes: int
    #: a store job's pages it wrote itself (``ok`` also holds pages it found stored already)
    wrote: tuple[bool, ...] = ()

    @property
    def success(self) -> bool:
        return all(self.ok)


def parent_runs(indices: Sequence[int], keys: Sequence[str], parents: Sequence[str | None]) -> list[list[int]]:
    """Split ``indices`` into runs in which each page's parent is the page before it.

    hicache writes a batch as a chain (the parent of page ``i`` is page ``i - 1``, the first
    page's parent is given), so each run is one write call with exact parent links.
    """
    runs: list[list[int]] = []
    for i in indices:
        if runs and parents[i] is not None and parents[i] == keys[runs[-1][-1]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class TierRunner:
    """Runs store/load jobs between a :class:`ChunkPool` and one hicache storage backend."""

    def __init__(
        self,
        storage: AsyncHiCacheStorage,
        pool: ChunkPool,
        *,
        name: str = "hicache-vllm-tier",
        lookup_timeout: float = 5.0,
        open_timeout: float = 5.0,
    ) -> None:
        for what, value in (("lookup_timeout", lookup_timeout), ("open_timeout", open_timeout)):
            # bounded by what a thread can wait: past it (inf, 1e12) every wait raises
            # OverflowError, which made every lookup a miss and start-up fail unclearly
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= threading.TIMEOUT_MAX:
                pool.close()  # vLLM releases its view when start-up fails: hold no export of it
                raise ConfigError(
                    f"{what} must be a positive number of seconds up to {threading.TIMEOUT_MAX:.0f}, got {value!r}"
                )
        self.storage = storage
        self.pool = pool
        self.lookup_timeout = float(lookup_timeout)
        self._finished: queue.SimpleQueue[JobOutcome] = queue.SimpleQueue()
        self._inflight: dict[int, concurrent.futures.Future[JobOutcome]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a job's outcome is queued
        self._closed = False
        storage.register_mem_pool_host(pool)
        self._loop_thread = LoopThread(name=name)
        # Open now so a bad option (an unusable root) fails engine start-up with a clear error;
        # a store that is slow to answer (an object store that is down) opens in the background.
        try:
            open_at_start(self._loop_thread.loop, storage.open(), open_timeout, name)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ scheduler-thread API

    def submit_store(
        self, job_id: int, keys: Sequence[str], chunk_ids: Sequence[int], parents: Sequence[str | None]
    ) -> None:
        """Store chunk ``chunk_ids[i]`` as page ``keys[i]`` (parent ``parents[i]``); non-blocking."""
        if not len(keys) == len(chunk_ids) == len(parents):
            self.fail(job_id, False, len(keys), f"{len(keys)} keys, {len(chunk_ids)} chunks, {len(parents)} parents")
            return
        self._submit(job_id, False, len(keys), self._store(job_id, list(keys), list(chunk_ids), list(parents)))

    def submit_load(self, job_id: int, keys: Sequence[str], chunk_ids: Sequence[int]) -> None:
        """Load page ``keys[i]`` into chunk ``chunk_ids[i]``; non-blocking."""
        if len(keys) != len(chunk_ids):
            self.fail(job_id, True, len(keys), f"{len(keys)} keys but {len(chunk_ids)} chunks")
            return
        self._submit(job_id, True, len(keys), self._load(job_id, list(keys), list(chunk_ids)))

    def fail(self, job_id: int, is_load: bool, n: int, why: str) -> None:
        """Report job ``job_id`` of ``n`` pages as failed without running it (a malformed job)."""
        logger.error("hicache tier: job %d rejected (%s); its pages fail", job_id, why)
        self._finished.put(JobOutcome(job_id, is_load, (False,) * n, 0.0, 0))

    def finished(self) -> list[JobOutcome]:
        """Every outcome queued since the last call."""
        out: list[JobOutcome] = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        with self._lock:
            return len(self._inflight)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (its outcome queued); ``False`` on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which pages are stored; blocks up to ``lookup_timeout`` (call it off the scheduler
        thread). A timeout or failure is all misses."""
        if self._closed or not keys:
            return [False] * len(keys)
        try:
            # cancelled at the timeout, not waited for: a lookup fills no buffer, and one stuck
            # in a thread that cannot be cut (a disk probe on a hung mount) would hold vLLM's
            # lookup thread, and every request asking the tier, for as long
            return self._loop_thread.call(self.storage.exists_pages(list(keys)), self.lookup_timeout,
                                          wait_cancelled=False)
        except Exception as exc:  # noqa: BLE001 - a lookup that fails (or the loop is gone) is a miss
            logger.warning("hicache tier lookup of %d pages failed: %s: %s", len(keys), type(exc).__name__, exc)
            return [False] * len(keys)

    def close(self, timeout: float = CLOSE_DRAIN_TIMEOUT_S) -> int:
        """Finish every job (up to ``timeout`` s), close the storage (as long again, at least
        1 s), stop the loop, drop the view (idempotent). Returns how many jobs had not finished
        (logged: their chunks are lost). vLLM kills the engine core a few seconds after asking
        it to stop: the tier passes a timeout that ends the whole close inside that grace."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        stuck = 0
        try:
            if not self.drain(timeout):
                # a job stuck in the backend (a hung mount) must not hang vLLM's shutdown
                with self._lock:
                    stuck = len(self._inflight)
                logger.error("hicache tier: %d job(s) still running after %.1f s at close; their "
                             "chunks are lost", stuck, timeout)
            try:
                self._loop_thread.call(self.storage.aclose(), timeout=max(1.0, timeout))
            except Exception:  # noqa: BLE001 - closing must not raise into vLLM's shutdown
                logger.exception("hicache tier: closing the storage failed")
        finally:
            self._loop_thread.stop(min(timeout, STOP_WAIT_S))
            self.pool.close()
        return stuck

    # ------------------------------------------------------------------ internals

    def _submit(self, job_id: int, is_load: bool, n: int, coro: Coroutine[Any, Any, JobOutcome]) -> None:
        with self._lock:
            if self._closed or job_id in self._inflight:
                coro.close()
                why = "tier closed" if self._closed else "job id already in flight"
                self.fail(job_id, is_load, n, why)
                return
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop_thread.loop)
            self._inflight[job_id] = fut
        fut.add_done_callback(lambda f: self._done(job_id, is_load, n, f))

    def _done(self, job_id: int, is_load: bool, n: int, fut: concurrent.futures.Future[JobOutcome]) -> None:
        if fut.cancelled() or fut.exception() is not None:  # the loop stopped under the job
            outcome = JobOutcome(job_id, is_load, (False,) * n, 0.0, 0)
        else:
            outcome = fut.result()
        # Queue first, then forget: drain() returns once nothing is in flight, and by then every
        # outcome must be visible to the next finished() call.
        self._finished.put(outcome)
        with self._idle:
            self._inflight.pop(job_id, None)
            self._idle.notify_all()

    async def _store(self, job_id: int, keys: list[str], chunk_ids: list[int], parents: list[str | None]) -> JobOutcome:
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        wrote = [False] * len(keys)
        try:
            present = await self.storage.exists_pages(keys)
            ok = list(present)
            todo = [i for i, here in enumerate(present) if not here]
            for run in parent_runs(todo, keys, parents):
                parent = parents[run[0]]
                result = await self.storage.batch_set_v2(
                    [PoolTransfer(KV, _indices(chunk_ids, run), keys=[keys[i] for i in run])],
                    HiCacheStorageExtraInfo(prefix_keys=[parent] if parent else None),
                )
                for i, flag in zip(run, result.get(KV, ())):
                    ok[i] = wrote[i] = bool(flag)
        except Exception:  # noqa: BLE001 - a failed store is a result, never a dead task
            logger.exception("hicache tier: store job %d failed", job_id)
            ok = wrote = [False] * len(keys)
        return JobOutcome(job_id, False, tuple(ok), time.perf_counter() - t0, sum(wrote) * self.pool.page_nbytes,
                          tuple(wrote))

    async def _load(self, job_id: int, keys: list[str], chunk_ids: list[int]) -> JobOutcome:
        t0 = time.perf_counter()
        try:
            result = await self.storage.batch_get_v2(
                [PoolTransfer(KV, _indices(chunk_ids, range(len(keys))), keys=keys)]
            )
            ok = [bool(f) for f in result.get(KV, ())]
            if len(ok) != len(keys):
                raise StorageStateError(f"{len(ok)} results for {len(keys)} pages")
        except Exception:  # noqa: BLE001
            logger.exception("hicache tier: load job %d failed", job_id)
            ok = [False] * len(keys)
        return JobOutcome(job_id, True, tuple(ok), time.perf_counter() - t0, sum(ok) * self.pool.page_nbytes)


def _indices(chunk_ids: Sequence[int], picks: Sequence[int] | range) -> torch.Tensor:
    return torch.tensor([int(chunk_ids[i]) for i in picks], dtype=torch.int64)
