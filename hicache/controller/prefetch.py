"""Storage->host prefetch: the controller's per-request background fetch and its stop policies.

When a request arrives, the cache asks storage how far the chain of page keys after the host
hit extends, allocates host pages for that many and fetches them in batches, counting complete
pages as they land. The request then stops waiting as its policy says (``best_effort``: now;
``wait_complete``: when done, or when a storage call of it was given up on, since one that
timed out may not return for long; ``timeout``: at most ``min(max, base + per_ki_token * tokens /
1024)`` seconds after the prefetch started, and, once the engine's prefill rate is known
(configured or reported), no longer than the missing pages would take to recompute: see
:mod:`hicache.controller.recompute`), takes the complete pages, and the op frees the rest.
Abort cancels the op; the op ends only once a read it had in flight has really returned (the
controller's storage call waits it out), so its host pages are freed when nothing can write
into them any more.

Why a collaborator and not a part of the controller class: the prefetcher needs only a few of
the controller's services (spawn an owned task, run a storage call under the I/O timeout, free
host pages), passed in as callables, so it neither imports the controller nor sees its queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import torch

from hicache.controller.config import ControllerConfig
from hicache.controller.jobs import PrefetchOp, PrefetchResult
from hicache.controller.metrics import ControllerMetrics
from hicache.controller.recompute import PrefillCost, ReadPace, give_up_at
from hicache.controller.transfers import all_pools_ok, slice_transfer, trailing_at
from hicache.errors import quoted
from hicache.observability import tracing
from hicache.storage import AsyncHiCacheStorage, PoolHitPolicy, PoolName, PoolTransfer
from hicache.storage.hit_policy import leading_run
from hicache.storage.stats import counting_call

__all__ = ["Prefetcher"]


def _has_trailing(op: PrefetchOp) -> bool:
    return any(t.hit_policy is PoolHitPolicy.TRAILING_PAGES for t in op.extra)


def _restorable_pages(op: PrefetchOp) -> int:
    """The completed pages a request may take: all of them, but with a ``TRAILING_PAGES``
    pool none until the last page landed. Its state is read with the batch that holds the
    last page and restores the prefix there only: the pages before it, handed over on their
    own (a stop policy's cut, a later read that failed), come with a state slot nobody wrote."""
    done = op.completed_pages
    return 0 if done < op.room_pages and _has_trailing(op) else done

#: ``spawn(coro, name) -> task``: start a task its owner keeps and drains on close
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]
#: ``storage_call(coro, what) -> result | None``: a storage call under the I/O timeout
class StorageCall(Protocol):
    """The controller's storage call: ``coro`` under its I/O timeout and health rules (``None``:
    a failed call); ``landed()`` runs on the I/O loop once ``coro`` has returned there;
    ``gave_up()`` runs as soon as the call is given up on (it may still run for a while)."""

    def __call__(self, coro: Coroutine[Any, Any, Any], what: str, *,
                 landed: Callable[[], None] | None = None, promised: bool = False,
                 gave_up: Callable[[], None] | None = None) -> Coroutine[Any, Any, Any]: ...

logger = logging.getLogger("hicache.controller")

#: while no prefill rate is known, a waiting request looks this often whether one is now
_RATE_POLL_S = 0.05


class Prefetcher:
    """The storage->host prefetches of one controller: their ops, tasks and host pages.

    Args:
        storage: the backend prefetches read from.
        config, metrics: the controller's.
        page_size, page_nbytes: of the host pool.
        spawn: starts a task the controller owns (and cancels and awaits on close).
        storage_call: runs a storage coroutine under the controller's I/O timeout and health
            rules; ``None`` is a failed call.
        free_host: gives host pages back (looked up on every call: the cache may reroute it).
    """

    def __init__(
        self,
        *,
        storage: AsyncHiCacheStorage,
        config: ControllerConfig,
        metrics: ControllerMetrics,
        page_size: int,
        page_nbytes: int,
        spawn: Spawn,
        storage_call: StorageCall,
        free_host: Callable[[torch.Tensor], None],
    ) -> None:
        self.storage = storage
        self.config = config
        self.metrics = metrics
        self.page_size = page_size
        self.page_nbytes = page_nbytes
        self._spawn = spawn
        self._storage_call = storage_call
        self._free_host = free_host
        self._sem = asyncio.Semaphore(config.max_concurrent_prefetches)
        self._prefetches: dict[str, PrefetchOp] = {}
        self._inflight_tokens = 0
        #: the engine's prefill cost (configured or reported) and the store's pace: together
        #: they bound the ``timeout`` policy's wait (a hit never slower than recomputing)
        self.prefill = PrefillCost(config.prefetch_recompute_tokens_per_s)
        self.pace = ReadPace()
        #: ops with a read in flight (taken or not): how slow the store is right now
        self._reading: set[PrefetchOp] = set()
        #: seconds an ``exists`` call takes: a read call takes at least as long (one round trip)
        self.round_trip = ReadPace()

    @property
    def inflight(self) -> int:
        """Prefetch ops not yet taken or aborted."""
        return len(self._prefetches)

    @property
    def inflight_tokens(self) -> int:
        """Tokens of the ops counted against ``max_inflight_prefetch_tokens``."""
        return self._inflight_tokens

    def abort_all(self) -> int:
        """Abort every op (close); returns how many."""
        ops = list(self._prefetches.values())
        for op in ops:
            self._abort_op(op)
        return len(ops)

    def start(
        self,
        rid: str,
        keys: list[str],
        *,
        alloc_host: Callable[[int], torch.Tensor | None],
        extra: list[PoolTransfer] | None = None,
        promised: bool = False,
    ) -> PrefetchOp | None:
        """Start fetching the pages under ``keys`` (a chain continuing the host hit) into host
        memory in the background. ``alloc_host(max_tokens)`` returns up to that many host
        slots (whole pages) or ``None``. Returns ``None`` when not started (no storage, closed,
        below threshold, rate limited, or ``rid`` already prefetching). ``promised`` (see
        :meth:`HiCacheController.start_prefetch`): neither the threshold nor the in-flight
        budget applies (its tokens still count in the budget)."""
        if not keys:
            return None
        tokens = len(keys) * self.page_size
        if tokens < self.config.prefetch_threshold and not promised:
            self.metrics.incr("prefetch_skipped_threshold")
            return None
        if rid in self._prefetches:
            return None
        if self._inflight_tokens + tokens > self.config.max_inflight_prefetch_tokens and not promised:
            self.metrics.incr("prefetch_rate_limited")
            return None
        op = PrefetchOp(rid=rid, keys=list(keys), page_size=self.page_size, extra=list(extra or ()), promised=promised)
        # waiting for its turn (max_concurrent_prefetches) counts as a call of no pages: a
        # request queued behind a busy store sees its prefetch run late, as a stalled call does
        op.inflight_since = op.started
        self._prefetches[rid] = op
        self._inflight_tokens += tokens
        self.metrics.incr("prefetch_started")
        op.task = self._spawn(self._run_prefetch(op, alloc_host), f"hicache-prefetch-{rid}")
        # a task cancelled before its first step never runs its body, nor the body's finally:
        # the op is finished here then, or its tokens would hold the in-flight budget for good
        op.task.add_done_callback(lambda _task: None if op.finished else self._finish_op(op))
        return op

    async def _run_prefetch(self, op: PrefetchOp, alloc_host: Callable[[int], torch.Tensor | None]) -> None:
        ps = self.page_size
        t0 = time.perf_counter()
        traced = tracing.span("hicache.prefetch")  # entered and left by hand: the body is long
        span = traced.__enter__()
        failure: Exception | None = None  # handed to the span's exit: it records it, status ERROR
        try:
            async with self._sem:
                if op.stop_requested:
                    return
                op.inflight_since = time.monotonic()
                with counting_call() as call:
                    hit = await self._storage_call(self.storage.batch_exists_v2(op.keys, op.extra or None), "exists",
                                                   promised=op.promised, gave_up=lambda: self._give_up(op))
                if hit is not None:
                    self.round_trip.observe(1, time.monotonic() - op.inflight_since)
                found = min(len(op.keys), hit.kv_hit_pages if hit is not None else 0)
                op.found_pages = found
                # an exists the backend answered with misses after an error is no answer
                op.exists_answered = hit is not None and not call.errors
                op.progress.set()
                if not op.exists_answered:
                    op.stop = op.stop or "exists_failed"
                if found == 0 or op.stop_requested or self._below_threshold(op, found * ps):
                    return
                host = alloc_host(found * ps)
                if host is None or host.numel() == 0:
                    op.stop = op.stop or "no_host_room"
                    return
                if _has_trailing(op):
                    host = self._cut_to_restorable(op, host, getattr(hit, "restorable_prefix_pages", None), found)
                    if host is None:
                        op.stop = op.stop or "no_host_room"
                        return
                if self._below_threshold(op, host.numel()):
                    self._free_host(host)
                    return
                op.host_indices = host
                pages = op.room_pages = host.numel() // ps
                while op.completed_pages < pages and not op.stop_requested:
                    a = op.completed_pages
                    n = min(self.config.prefetch_batch_pages, pages - a)
                    keys = op.keys[a : a + n]
                    transfers = [PoolTransfer(PoolName.KV, host[a * ps : (a + n) * ps], keys=keys)]
                    for extra in op.extra:  # a trailing pool ends at ``pages`` (_cut_to_restorable)
                        transfers.append(slice_transfer(extra, a, n, pages))
                    op.inflight_start, op.inflight_end = a, a + n
                    op.inflight_since = time.monotonic()
                    self._reading.add(op)
                    batch_t0 = time.perf_counter()  # t0 stays the whole prefetch's start
                    with counting_call() as call:
                        result = await self._storage_call(self.storage.batch_get_v2(transfers), "read",
                                                          landed=op.note_read_landed, promised=op.promised,
                                                          gave_up=lambda: self._give_up(op))
                    self._reading.discard(op)
                    # the store's time ends where the read landed on the I/O loop: a blocked
                    # loop (a forward pass) that took its answer late is not a slow store
                    took = (op.landed_at if op.read_landed else time.monotonic()) - op.inflight_since
                    op.inflight_start = op.inflight_end = 0
                    op.read_landed = False
                    got = leading_run(all_pools_ok(result, n, transfers))
                    if got:
                        op.completed_pages += got
                        self.metrics.incr("prefetch_pages_done", got)
                        self.metrics.transfer("s2h", got, got * self.page_nbytes, time.perf_counter() - batch_t0)
                        if got == n:
                            self.pace.observe(n, took)
                        op.progress.set()
                    if got < n:  # a failed call was counted by the storage call (storage_read_failures)
                        op.stop = op.stop or ("read_failed" if result is None else
                                   "backend_error" if call.errors else "page_failed")
                        break
        except asyncio.CancelledError:
            pass  # abort: the finally block gives the pages back
        except Exception as exc:  # noqa: BLE001
            failure = exc
            op.stop = op.stop or "error"
            self.metrics.incr("worker_errors")
            logger.exception("prefetch %s failed", quoted(op.rid))
        finally:
            self._reading.discard(op)
            if op.completed_pages:
                self.metrics.observe("prefetch", "storage", time.perf_counter() - t0)
            span.set_attribute("hicache.pages", op.completed_pages)
            if op.stop:
                span.set_attribute("hicache.stop", op.stop)
            # the exception it raised (already handled here), so the span is not a clean one
            if failure is None:
                traced.__exit__(None, None, None)
            else:
                traced.__exit__(type(failure), failure, failure.__traceback__)
            self._finish_op(op)

    def _below_threshold(self, op: PrefetchOp, tokens: int) -> bool:
        """Whether ``tokens`` (what storage holds of the chain, then what host room was found
        for) are too few to read under ``prefetch_threshold`` (a ``promised`` op reads them
        all: an engine counted them as hits); counted, and the op stops reading nothing.

        Why after the lookup too, not only on the tokens asked for: a long request whose store
        holds a page or two of it (or whose host had room for a page or two) read them, and
        under ``wait_complete`` or ``timeout`` waited a storage round trip for fewer tokens
        than the threshold says are worth one. SGLang revokes such a hit after its lookup and
        takes no host room below the threshold either."""
        if op.promised or tokens >= self.config.prefetch_threshold:
            return False
        self.metrics.incr("prefetch_skipped_threshold")
        op.stop = op.stop or "below_threshold"
        return True

    def _cut_to_restorable(self, op: PrefetchOp, host: torch.Tensor, restorable: object,
                           found: int) -> torch.Tensor | None:
        """The host pages of a prefetch with a ``TRAILING_PAGES`` pool (a hybrid model's Mamba
        or SWA state) cut to the longest prefix its state restores; ``None`` (pages freed) when
        none fits in them. Its keys are moved there (:func:`trailing_at`): the storage's usable
        hit may end before the chain asked for (an earlier, shorter request stored the state
        there), and host room may cut it shorter, where a state exists only if storage listed
        that length as restorable (``restorable``: the lengths it listed; none listed, only the
        hit itself is known to be). Read with the chain's own state keys, such a prefetch read
        no state at all and handed over pages whose state slot nobody wrote."""
        ps = self.page_size
        room = host.numel() // ps
        listed = [p for p in restorable if type(p) is int] if isinstance(restorable, list) else []
        fits = [p for p in (listed or [found]) if 0 < p <= min(room, found)]
        end = max(fits, default=0)
        if end * ps < host.numel():
            self._free_host(host[end * ps :])
            host = host[: end * ps]
        if end == 0:
            return None
        op.extra = [trailing_at(t, op.keys, end) for t in op.extra]
        return host

    def _give_up(self, op: PrefetchOp) -> None:
        """The controller gave up on the op's storage call in flight (timed out, or interrupted
        as the store went down), which may still run: a stuck read returns when it returns (a
        hung mount). The op lands nothing more then, so its waiter is let go at once and takes
        the pages that completed, as the ``timeout`` policy's would; the pages the call was
        given stay the op's until it has returned (:meth:`_finish_op` frees them)."""
        if op.settled.is_set():  # finished, or given up on already
            return
        # nor does it tell the store's pace any more (:meth:`_seconds_per_page`): stuck, it
        # looked slower with every second, and once a probe took the store back every wait
        # for a fast read was cut at once, for as long as this one stayed stuck
        self._reading.discard(op)
        op.stop = op.stop or ("read_failed" if op.exists_answered else "exists_failed")
        op.settled.set()
        op.progress.set()

    def _finish_op(self, op: PrefetchOp) -> None:
        op.finished = True
        op.done.set()
        op.settled.set()
        op.progress.set()
        if self._prefetches.get(op.rid) is op and op.taken_pages is not None:
            del self._prefetches[op.rid]
        if not op.released:
            op.released = True
            self._inflight_tokens -= op.num_tokens
        if op.taken_pages is not None:
            self._release_untaken(op)

    def _release_untaken(self, op: PrefetchOp) -> None:
        """Free the op's host pages the request did not take (no read is in flight now)."""
        if op.host_indices is None:
            return
        ps = self.page_size
        start = (op.taken_pages or 0) * ps
        rest = op.host_indices[start:]
        op.host_indices = op.host_indices[:start]
        if rest.numel() == 0:
            return
        self._free_host(rest)

    def op(self, rid: str) -> PrefetchOp | None:
        return self._prefetches.get(rid)

    def ready(self, rid: str) -> bool:
        """Non-blocking: may the request stop waiting for its prefetch, under the policy?"""
        op = self._prefetches.get(rid)
        if op is None or op.settled.is_set():  # finished, or its call given up on (_give_up)
            return True
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        if op.read_landed:
            # a read that ended in time while this loop was blocked (a poller runs between
            # synchronous forward passes): its pages are in host memory, only its answer is
            # late (a few loop turns); cutting it now would drop them, as :meth:`wait` knows
            return False
        now = time.monotonic()
        if now - op.started >= self.config.prefetch_timeout(op.num_tokens):
            return True
        # polled (SGLang's scheduler): the wait is counted from the prefetch's start, and the
        # cap is recomputing every token it was started for
        spt = self.prefill.seconds_per_token
        return spt is not None and self._cut_for_recompute(op, now, op.started, op.num_tokens * spt, spt)

    async def wait(self, rid: str, policy: str | None = None) -> PrefetchResult | None:
        """Wait as long as the stop policy allows, then take what completed (see
        :meth:`take`). ``None`` when ``rid`` has no prefetch."""
        op = self._prefetches.get(rid)
        if op is None:
            return None
        policy = policy or self.config.prefetch_policy
        t0 = time.monotonic()
        if not op.settled.is_set() and policy != "best_effort":
            if policy == "wait_complete":
                await op.settled.wait()  # not op.done: a call given up on may never return
            else:
                remaining = self.config.prefetch_timeout(op.num_tokens) - (t0 - op.started)
                if remaining > 0:
                    await self._wait_for_rate(op, t0, t0 + remaining)
                # a read that ended in time while this loop was blocked: its pages are in host
                # memory, only its answer is late (a few loop turns); cutting it would drop them
                while policy == "timeout" and op.read_landed and not op.settled.is_set():
                    await asyncio.sleep(0)
        if self._prefetches.get(rid) is not op:
            return None  # aborted while we waited (and perhaps started again: not ours to cut)
        result = self.take(rid)
        if result is not None:
            result.waited_s = time.monotonic() - t0
        return result

    def _missing_pages(self, op: PrefetchOp) -> int:
        """Pages the op may still land: all its keys until storage answered, then the found
        ones, then those host room was found for."""
        target = op.room_pages if op.host_indices is not None else op.found_pages if op.exists_answered else len(op.keys)
        return max(0, target - op.completed_pages)

    def _give_up_at(self, op: PrefetchOp, now: float, wait_start: float, cap: float, spt: float) -> float:
        """When the recompute bound ends the wait if the op does not move before."""
        return give_up_at(
            now=now,
            missing_pages=self._missing_pages(op),
            inflight_pages=op.inflight_end - op.inflight_start,
            call_since=op.inflight_since,
            wait_start=wait_start,
            cap_s=cap,
            page_tokens=self.page_size,
            seconds_per_token=spt,
            seconds_per_page=self._seconds_per_page(now),
        )

    def _seconds_per_page(self, now: float) -> float | None:
        """The store's pace: what its reads took lately, or more if a read in flight has
        already taken longer a page (a store that slowed down, or one no read has finished on
        yet: the first requests after a start learn from the reads still running). Until a
        read has finished, an ``exists`` round trip per batch of pages stands in for it (a slow
        remote store is known to be slow before the first page was read from it); not after:
        a lookup's time grows with the keys it checks (S3: a round trip per wave of HEADs),
        and a measured read already holds its own round trip, so a slow lookup must not
        outvote reads known to be fast (every wait on such a store was cut at once)."""
        spp = self.pace.seconds_per_page
        trip = self.round_trip.seconds_per_page
        if spp is None and trip is not None:
            spp = trip / self.config.prefetch_batch_pages
        for op in self._reading:
            pages = op.inflight_end - op.inflight_start
            if pages > 0:
                so_far = ((op.landed_at if op.read_landed else now) - op.inflight_since) / pages
                if spp is None or so_far > spp:
                    spp = so_far
        return spp

    def _cut_for_recompute(self, op: PrefetchOp, now: float, wait_start: float, cap: float, spt: float) -> bool:
        """Whether the recompute bound ends the wait now (counted once per op)."""
        if self._give_up_at(op, now, wait_start, cap, spt) > now:
            return False
        if not op.recompute_cut:
            op.recompute_cut = True
            self.metrics.incr("prefetch_cut_recompute")
        return True

    async def _wait_for_rate(self, op: PrefetchOp, t0: float, deadline: float) -> None:
        """Wait for ``op`` until it ends or the policy's ``deadline`` passes; as soon as a
        prefill rate is known (at once, or when the engine's reports of other requests'
        prefills make one known meanwhile) the rest of the wait is weighed against the
        recompute (:meth:`_wait_worth_it`)."""
        while not op.settled.is_set():
            now = time.monotonic()
            if now >= deadline:
                return
            spt = self.prefill.seconds_per_token
            if spt is not None:
                await self._wait_worth_it(op, t0, deadline, spt)
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(deadline - now, _RATE_POLL_S)):
                    await op.settled.wait()

    async def _wait_worth_it(self, op: PrefetchOp, t0: float, deadline: float, spt: float) -> None:
        """Wait for ``op`` until it ends, the policy's ``deadline`` passes, or the pages it
        still lacks would be recomputed sooner than fetched (re-decided whenever it moves,
        and when a call in flight runs late enough to lose)."""
        cap = self._missing_pages(op) * self.page_size * spt  # recomputing what is missing now
        while not op.settled.is_set():
            now = time.monotonic()
            if now >= deadline or self._cut_for_recompute(op, now, t0, cap, spt):
                return
            op.progress.clear()
            # re-decided at least every eighth of the recompute: the pace of reads still in
            # flight (see _seconds_per_page) grows while nothing lands
            wake = min(deadline, self._give_up_at(op, now, t0, cap, spt), now + max(cap / 8, 0.001))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake - now)):
                    await op.progress.wait()

    def take(self, rid: str) -> PrefetchResult | None:
        """Stop ``rid``'s prefetch and hand over the pages completed so far (the caller owns
        them now; with a ``TRAILING_PAGES`` pool, all of them with the state at their end, or
        none: :func:`_restorable_pages`); the op frees the rest when its task ends."""
        op = self._prefetches.pop(rid, None)
        if op is None:
            return None
        op.stop_requested = True
        if not op.finished and op.stop is None:
            op.stop = "cut"  # the stop policy ended the wait before the fetch did
        taken = _restorable_pages(op)
        op.taken_pages = taken
        ps = self.page_size
        host = op.host_indices[: taken * ps] if op.host_indices is not None else torch.empty(0, dtype=torch.int64)
        if op.finished:
            self._release_untaken(op)
        self.metrics.incr("prefetch_pages_used", taken)
        return PrefetchResult(pages=taken, host_indices=host, found_pages=op.found_pages)

    def abort(self, rid: str) -> bool:
        """Cancel ``rid``'s prefetch; its host pages are freed when its task has ended (after a
        read in flight has really returned). Returns whether there was one."""
        op = self._prefetches.pop(rid, None)
        if op is None:
            return False
        self._abort_op(op)
        return True

    def _abort_op(self, op: PrefetchOp) -> None:
        self._prefetches.pop(op.rid, None)
        self.metrics.incr("prefetch_aborted")
        op.stop_requested = True
        op.taken_pages = 0
        # a request waiting for the op (another task awaits it under its policy) is let go now:
        # the op lands nothing for anyone any more, and its task may outlive the cancel for as
        # long as a read in flight is stuck (a hung mount), which held the waiter that long
        op.settled.set()
        op.progress.set()
        self._reading.discard(op)  # a read cancelled and stuck tells no pace (see _give_up)
        if op.finished:
            self._release_untaken(op)
        elif op.task is not None:
            op.task.cancel()
