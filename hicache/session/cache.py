"""``SessionAwareCache``: streaming sessions keep their KV between turns, without pinning it.

Behaviour kept from SGLang's session-aware cache (seed ``000``), re-implemented on our caches:

* A decorator around any :class:`~hicache.prefix_cache.BasePrefixCache`. Requests that are not
  part of a streaming session pass straight through.
* When a streaming turn finishes, its ``req_to_token`` row and pages stay in a
  :class:`~hicache.session.slot.SessionSlot`; the next turn restores them without a tree match
  and reuses the committed length. Restoring is idempotent (a turn rejected by the scheduler
  and retried restores again). Chunked prefill of a restored turn does not touch the tree.
  Locks on the session's virtual node are no-ops. ``release_session`` frees exactly what the
  slot held beyond the tree-protected part and returns the row.

Beyond the seed (its known flaw is that slots pin device memory until the client closes the
session, so bursts of idle sessions deadlock the device pool, SGLang #27024):

* Giving KV up never throws it away: the session's committed, page-aligned KV is inserted into
  the inner tree, which then owns it, and its host (and storage) copy is started through the
  :class:`~hicache.session.writeback.WriteBackQueue`. The next turn of the conversation (or a
  restart, with storage) finds it with an ordinary match, from whichever tier it is on.
* That happens on ``release_session``, after ``idle_offload_s`` of inactivity
  (:meth:`reap_idle`, or the owned reaper task), and under memory pressure: :meth:`evict`,
  :meth:`ensure_free` and :meth:`ensure_req_slots` offload idle sessions in LRU order before
  anything fails.
* Aborts leave the session consistent: the aborted turn's new pages are freed and the slot goes
  back to its state before the turn.

A server drives it per turn (all calls on one event loop)::

    cache.match_req(req)                # restore the slot, or match the tree
    cache.start_prefetch(req)           # storage prefetch (no-op for a restored turn)
    await cache.admit(req)              # load host KV back, lock; req.prefix_indices is the prefix
    await cache.alloc_extend(req, n)    # row + pages for tokens [0, n) (prefill, then each decode)
    cache.cache_unfinished_req(req, chunked=True)   # between prefill chunks
    cache.release_req(req)              # turn done: the slot keeps the KV (others: the tree)
    cache.abort_req(req)                # instead, on abort
    cache.release_session(sid)          # conversation over: KV written back, memory returned

and around the turns: ``start()`` (owned reaper task) or ``reap_idle()`` from the server's own
loop; ``ensure_free(n)`` / ``evict_async(n)`` / ``evict(params)`` under memory pressure (the
facade's own allocator calls; ``alloc_extend`` already does it); ``metrics()``; ``aclose()``.

What cannot be reclaimed is the memory of *running* turns: when they hold everything,
``alloc_extend`` returns ``None`` and the server must abort or requeue a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hicache.controller.close_task import CLOSE_CUT, close_with, start_close_task, wait_for_close
from hicache.prefix_cache.base import BasePrefixCache
from hicache.errors import RequestAbortedError, quoted
from hicache.prefix_cache.facade import AdmitResult, remember_aborted
from hicache.prefix_cache.req import Req
from hicache.prefix_cache.types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)
from hicache.session.config import SessionConfig
from hicache.session.extend import RowExtender
from hicache.session.forward import ForwardingCache
from hicache.session.handover import free_row
from hicache.session.lifecycle import Lifecycle
from hicache.session.metrics import SessionMetrics, gauges, resume_tier
from hicache.session.offload import Offloader
from hicache.session.room import Room
from hicache.session.slot import SessionSlot, VirtualNode, ceil_align
from hicache.session.turns import Turns, session_id_of
from hicache.session.writeback import WriteBackQueue
from hicache.storage.base import time_share

__all__ = ["SessionAwareCache", "TurnAdmit"]

logger = logging.getLogger("hicache.session")


@dataclasses.dataclass
class TurnAdmit(AdmitResult):
    """``HiRadixCache.admit``'s result plus ``restored``: the prefix came from the session
    slot (no lookup, nothing loaded)."""

    restored: bool = False


class SessionAwareCache(ForwardingCache):
    """Decorator around a prefix cache that keeps streaming sessions' KV between turns.

    The coordinator of the package: it owns the slots, the counters and the write-back queue
    and sequences the per-turn calls and the close; each job is a collaborator handed exactly
    what it uses: :class:`~hicache.session.turns.Turns` (attach and restore),
    :class:`~hicache.session.offload.Offloader` (giving KV up, closing),
    :class:`~hicache.session.room.Room` (memory pressure),
    :class:`~hicache.session.extend.RowExtender` (``alloc_extend``) and
    :class:`~hicache.session.lifecycle.Lifecycle` (open/closed, the idle reaper).

    Args:
        inner: the prefix cache to wrap (``RadixCache``, ``HiRadixCache`` or any
            ``BasePrefixCache``; without ``insert`` KV given up is freed instead of kept).
        config: :class:`SessionConfig`.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, inner: BasePrefixCache, config: SessionConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(inner)
        self.config = config or SessionConfig()
        self.slots: dict[str, SessionSlot] = {}
        #: requests aborted here, whose admit (a task that had not run yet) must refuse them
        self._aborted: weakref.WeakSet[Req] = weakref.WeakSet()
        self.session_metrics = SessionMetrics(self.config.keep_closed_stats)
        self.writeback = WriteBackQueue(inner, max_attempts=self.config.writeback_max_attempts,
                                        count=self.session_metrics.incr)
        self._offloader = Offloader(inner, self.slots, self.session_metrics, self.writeback)
        self._turns = Turns(inner, self.slots, self.session_metrics, self._offloader, clock)
        self._room = Room(inner, self.slots, self.config, self.session_metrics, self._offloader, self._turns,
                          self.writeback)
        self._lifecycle = Lifecycle(self.slots, self.config, self._offloader, self.writeback, self.session_metrics,
                                    clock)
        self._extender = RowExtender(self, self._lifecycle)
        # the one close every aclose() caller waits for (see aclose); set by the first call
        self._close_task: asyncio.Task[Any] | None = None
        self._close_hurried = False  # the close task took a cancellation and closes without draining

    # ------------------------------------------------------------------ helpers

    def _row(self, idx: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[idx]

    def _free_row(self, idx: int) -> None:
        free_row(self.req_to_token_pool, idx)

    # ------------------------------------------------------------------ match / restore

    def match_prefix(self, params: MatchPrefixParams, **kwargs: Any) -> MatchResult:
        """Restore a streaming session's slot (no tree walk), else the inner cache's match.
        Refused once the cache is closed (see :meth:`match_req`)."""
        self._lifecycle.check_open()
        slot = self._turns.restorable(params.req, len(params.key))
        if slot is None:
            return self.inner.match_prefix(params, **kwargs)
        assert params.req is not None
        return self._turns.restore(params.req, slot, len(params.key))

    def match_req(self, req: Req, max_prefix_len: int | None = None) -> MatchResult:
        """``HiRadixCache.match_req`` made session-aware: restore the slot, or let the inner
        cache match; the result is recorded in ``req``'s fields; no lock is taken.

        Refused once the cache is closed (:class:`~hicache.errors.CacheClosedError`, as ``admit`` and the
        facade refuse): a match after the close attached the request to a new slot that
        nobody would ever release (the close and its reaper were over)."""
        self._lifecycle.check_open()
        tokens = req.fill_ids or req.origin_input_ids
        if max_prefix_len is not None:
            tokens = tokens[:max_prefix_len]
        slot = self._turns.restorable(req, len(tokens))
        if slot is None:
            inner_match_req = getattr(self.inner, "match_req", None)
            if inner_match_req is not None:
                return inner_match_req(req, max_prefix_len)
            m = self.inner.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), req.extra_key), req=req))
        else:
            m = self._turns.restore(req, slot, len(tokens))
        req.record_match(m)
        return m

    def start_prefetch(self, req: Req, max_prefix_len: int | None = None) -> bool:
        """Storage prefetch past the host hit (never for a turn restored from its slot)."""
        if self._turns.restored(req) is not None:
            return False
        fn = getattr(self.inner, "start_prefetch", None)
        return bool(fn(req, max_prefix_len)) if fn is not None else False

    async def admit(self, req: Req, *, mem_quota: int | None = None, wait_load: bool = True,
                    max_prefix_len: int | None = None) -> TurnAdmit:
        """The scheduler picked ``req``. A restored turn is ready at once (its prefix is the
        slot's committed KV). Otherwise the inner cache admits it (prefetch wait, host load,
        lock), after room for the host part was made, idle sessions offloaded first if needed.

        On return ``req.prefix_indices`` are the device slots of the reusable prefix and
        ``req.cache_protected_len`` is set (as ``HiRadixCache.admit`` leaves them).
        """
        self._lifecycle.check_open()
        if req in self._aborted:
            # before its match: matched again, the aborted turn took its session's slot back
            # (restored or attached) and kept it from every later turn, offload and release
            raise RequestAbortedError(f"request {quoted(req.rid)} was aborted before it was admitted")
        self.writeback.pump()
        sid = session_id_of(req)
        m = self.match_req(req, max_prefix_len)
        slot = self._turns.restored(req)
        if slot is not None:
            req.cache_protected_len = slot.cache_protected_len
            if not slot.admitted:  # a retried admit of the same turn is not counted again
                self._admit_restored(slot, req)
                self._count_restored(req, slot.turn_prefix_len)
            return TurnAdmit(slot.turn_prefix_len, 0, 0, slot.turn_prefix_len, restored=True,
                             attribution=req.attribution)
        inner_admit = getattr(self.inner, "admit", None)
        if inner_admit is None:
            node = m.last_device_node
            self.inner.inc_lock_ref(node)
            req.last_node = node
            req.cache_protected_len = int(req.prefix_indices.numel())
            res = TurnAdmit(req.cache_protected_len, 0, 0, req.cache_protected_len)
        else:
            # room for the host part is made inside admit, between its match and its load,
            # so that no other turn can take it in between (see RequestFlow.admit)
            r = await inner_admit(req, mem_quota=mem_quota, wait_load=wait_load, max_prefix_len=max_prefix_len,
                                  make_room=self.ensure_free)
            res = TurnAdmit(r.device_hit, r.host_hit, r.storage_hit, r.prefix_len, r.load_handle, r.attribution)
        slot = self._turns.slot_for(req)  # None without a session id
        if slot is not None and not slot.admitted:
            slot.admitted = True
            slot.turn_prefix_len = res.prefix_len
            stats = self.session_metrics.session(slot.session_id)
            # the session had history: where did it come back from?
            tier = (resume_tier(device_hit=res.device_hit, host_hit=res.host_hit, storage_hit=res.storage_hit)
                    if stats.turns else None)
            self._count_turn(slot, req, res.prefix_len, tier)
        return res

    def count_admitted(self, req: Req) -> None:
        """Count a turn whose admit deferred its counts (see ``Req.defer_counts``): the inner
        cache's request counts and the session's resume counts."""
        slot = self._turns.slot_for(req)
        if slot is not None and slot.uncounted is not None:
            (prefix_len, tier), slot.uncounted = slot.uncounted, None
            self.session_metrics.admitted(slot.session_id, prefix_len, tier)
        fn = getattr(self.inner, "count_admitted", None)
        if fn is not None:
            fn(req)

    def _count_turn(self, slot: SessionSlot, req: Req, prefix_len: int, tier: str | None) -> None:
        """Count an admitted turn in the session counters, or (``req.defer_counts``) leave it
        on the slot for :meth:`count_admitted`, as the inner cache leaves its request counts.

        Why: a caller that defers its counts may still give the turn up for want of device
        room and retry it (the server does, up to 8 times); counted here, every refused
        attempt was one more resume of the history and its tokens once more restored."""
        if getattr(req, "defer_counts", False):  # (an engine's own request type has no such field)
            slot.uncounted = (prefix_len, tier)
        else:
            self.session_metrics.admitted(slot.session_id, prefix_len, tier)

    def _admit_restored(self, slot: SessionSlot, req: Req) -> None:
        """A restored turn is admitted: from now on pressure never takes its slot back (the
        server holds the match's prefix indices), and it is counted once."""
        if slot.admitted:
            return
        slot.admitted = True
        self._count_turn(slot, req, slot.turn_prefix_len, "slot")
        self._attribute_restored(req, slot.turn_prefix_len)

    def _count_restored(self, req: Req, prefix_len: int) -> None:
        """Count a restored turn in the inner cache's request and hit counters (requests,
        prompt, computed and per-tier hit tokens), its history as a device hit.

        Why: the inner cache's admit counts every other request, but a restored turn never
        reaches it; left out, ``hicache stats`` undercounted chat requests and hit rates while
        the turn's attribution reported the hit. Counted where the inner cache counts, in
        ``admit`` (not in ``inc_lock_ref``: a scheduler that never calls ``admit`` has no
        request counted), the same way: left in ``req.pending_counts`` for the caller's
        ``count_admitted`` when it defers (a turn given up for room is then not counted), else
        at once."""
        total = len(req.fill_ids or req.origin_input_ids)
        req.pending_counts = (total, total - prefix_len, prefix_len, 0, 0)
        if not req.defer_counts:
            self.count_admitted(req)

    def _attribute_restored(self, req: Req, prefix_len: int) -> None:
        """A turn restored from its slot: its history hit on device (miss attribution)."""
        explain = getattr(self.inner, "explain_admit", None)
        if explain is not None:
            tokens = req.fill_ids or req.origin_input_ids
            req.attribution = explain.attributor.restored(req.rid, len(tokens), prefix_len,
                                                          record=not req.explain_misses)

    # ------------------------------------------------------------------ allocation

    async def alloc_extend(self, req: Req, seq_len: int) -> torch.Tensor | None:
        """Make ``req``'s row cover token positions ``[0, seq_len)`` and return those slots,
        making room first (see :meth:`RowExtender.alloc_extend
        <hicache.session.extend.RowExtender.alloc_extend>`). ``None`` when the memory cannot be
        found even so (nothing of this call stays allocated; the request keeps what it had)."""
        return await self._extender.alloc_extend(req, seq_len)

    # ------------------------------------------------------------------ finish / chunk / abort

    def cache_finished_req(self, req: Req, is_insert: bool = True, **kwargs: Any) -> None:
        """A streaming turn's row goes to (or back to) its slot; everything else to the inner
        cache. After this ``req.req_pool_idx`` is ``None`` for a session turn: the slot owns
        the row, and the server must not free it."""
        sid = session_id_of(req)
        if sid is not None and req.rid in self._turns.bypass:
            self._turns.bypass.discard(req.rid)
            return self.inner.cache_finished_req(req, is_insert=is_insert, **kwargs)
        slot = self._turns.slot_for(req)
        if slot is None and sid is not None and req.req_pool_idx is not None:
            # finished without a match through us: adopt it only as a first turn of a free session
            existing = self.slots.get(sid)
            if existing is None or (existing.attached_rid is None and not existing.is_holding_kv):
                slot = self._turns.attach(req, sid)
        if slot is None or req.req_pool_idx is None:
            if slot is not None:
                self._turns.detach(slot)
            return self.inner.cache_finished_req(req, is_insert=is_insert, **kwargs)
        is_first = not slot.is_holding_kv
        before = slot.kv_committed_len
        slot.save_from_req(req, is_first=is_first)
        # the slot owns the turn's row and (first turn) its tree lock now: the inner cache must
        # forget the request, or a later request reusing its rid would be taken for it
        forget = getattr(self.inner, "forget_req", None)
        if forget is not None:
            forget(req)
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.session_metrics.turn_saved(slot.session_id, max(0, slot.kv_committed_len - slot.turn_prefix_len))
        if logger.isEnabledFor(logging.DEBUG):  # quoted only when logged: this runs every turn
            logger.debug("session %s: turn %s saved (%d committed, %d before)", quoted(sid), quoted(req.rid),
                         slot.kv_committed_len, before)
        self._turns.detach(slot)

    def release_req(self, req: Req, is_insert: bool = True) -> None:
        """:meth:`cache_finished_req`, then free the request's row unless a slot took it."""
        self.cache_finished_req(req, is_insert=is_insert)
        if req.req_pool_idx is not None:
            self._free_row(req.req_pool_idx)
            req.req_pool_idx = None

    def cache_unfinished_req(self, req: Req, **kwargs: Any) -> None:
        """Between prefill chunks. A restored turn never touches the tree (its prefix indices
        are its own row); the first turn of a session goes to the inner cache, so its prompt is
        inserted and protected chunk by chunk like any request's."""
        slot = self._turns.restored(req)
        if slot is None:
            return self.inner.cache_unfinished_req(req, **kwargs)
        if kwargs.get("chunked", False):
            assert req.req_pool_idx is not None
            n = len(req.fill_ids)
            req.prefix_indices = self._row(req.req_pool_idx)[:n].to(torch.int64, copy=True)

    def abort_req(self, req: Req) -> None:
        """Abort ``req``. A session turn restored from its slot frees only the pages this turn
        added and returns the slot to its state before the turn (an abort before the turn ran
        frees nothing); the session stays usable. Anything else is aborted by the inner cache
        (prefetch cancelled, lock dropped, its own KV freed, row returned)."""
        sid = session_id_of(req)
        remember_aborted(self._aborted, req)
        self._turns.bypass.discard(req.rid)
        slot = self._turns.slot_for(req)
        if slot is not None and slot.is_holding_kv and req.req_pool_idx == slot.req_pool_idx:
            self._turns.roll_back(req, slot)
            self.session_metrics.aborted(slot.session_id)
            self._turns.detach(slot)
            return
        if slot is not None:
            self._turns.detach(slot, fire=False)
            self.session_metrics.aborted(slot.session_id)
        self._inner_abort(req)
        if slot is not None:
            self._turns.after_detach(slot)

    def _inner_abort(self, req: Req) -> None:
        fn = getattr(self.inner, "abort_req", None)
        if fn is not None:
            fn(req)
            return
        if req.req_pool_idx is not None:
            self.inner.cache_finished_req(req, is_insert=False)
            self._free_row(req.req_pool_idx)
            req.req_pool_idx = None
        elif req.last_node is not None and req.cache_protected_len:
            self.inner.dec_lock_ref(req.last_node)
            req.last_node = None

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock a matched node. On a restored turn's node (its KV is the slot's, nothing to
        lock) this is the turn's admission: SGLang's scheduler locks the node a match gave it
        when it takes the request into a batch and never calls :meth:`admit`, then allocates,
        which may evict; a turn still taken for merely queued there had its slot handed over
        and its prefix pages freed while the scheduler held their indices."""
        if isinstance(node, VirtualNode):
            slot = self.slots.get(node.session_id)
            if slot is not None and slot.attached_req is not None:
                self._admit_restored(slot, slot.attached_req)
            return IncLockRefResult(delta=0)
        return self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if isinstance(node, VirtualNode):
            return DecLockRefResult(delta=0)
        return self.inner.dec_lock_ref(node, params)

    # ------------------------------------------------------------------ giving KV up

    def offload_session(self, session_id: str, *, reason: str = "idle") -> bool:
        """Give an idle session's KV to the tree now (write-back started); the session stays
        open and its next turn resumes from whichever tier holds the KV then. ``False`` when
        the session holds no KV or a turn is running on it."""
        return self._offloader.offload(session_id, reason=reason)

    def release_session(self, session_id: str) -> bool:
        """The conversation is over: its KV goes to the tree (write-back started), its pages
        beyond the tree-protected part and its row are returned. With a turn running, the
        release happens when the turn finishes or aborts. Returns whether the session existed.
        A release that fails closes the session anyway (see :meth:`Offloader.close`), counted
        in ``release_errors``, and raises."""
        try:
            return self._offloader.release(session_id)
        except Exception:
            self.session_metrics.incr("release_errors")
            raise

    # ------------------------------------------------------------------ pressure

    def evict(self, params: EvictParams | int) -> EvictResult:
        """Free device memory: the tree's evictable pages first, then idle sessions LRU (see
        :meth:`Room.evict <hicache.session.room.Room.evict>`)."""
        return self._room.evict(params)

    async def ensure_free(self, num_tokens: int) -> bool:
        """Make ``num_tokens`` device slots free if at all possible (see
        :meth:`Room.ensure_free <hicache.session.room.Room.ensure_free>`). ``False`` only when
        running requests hold the memory."""
        return await self._room.ensure_free(num_tokens)

    async def evict_async(self, params: EvictParams | int) -> EvictResult:
        """:meth:`evict`, waiting for the write-backs that pin pages."""
        return await self._room.evict_async(params)

    def ensure_req_slots(self, n: int = 1) -> bool:
        """Make ``n`` ``req_to_token`` rows free, offloading idle sessions LRU if needed."""
        return self._room.ensure_req_slots(n)

    # ------------------------------------------------------------------ reaping

    def reap_idle(self, now: float | None = None) -> int:
        """Offload sessions idle longer than ``idle_offload_s`` and release those idle longer
        than ``session_timeout_s``; restart refused write-backs. Returns sessions acted on.
        Call it from the server's loop, or let :meth:`start` run it periodically."""
        return self._lifecycle.reap_idle(now)

    def start(self) -> None:
        """Start the owned reaper task (when ``reap_interval_s`` is set) on the running loop."""
        self._lifecycle.start()

    async def drain_writeback(self) -> None:
        """Wait until every queued write-back finished (copies done, or given up)."""
        await self.writeback.drain()

    async def drain(self) -> None:
        """Wait for the write-backs, then for everything the inner cache's controller still
        moves (host copies on to storage, loads)."""
        await self.writeback.drain()
        fn = getattr(self.inner, "drain", None)
        if fn is not None:
            await fn()

    async def aclose(self, *, close_inner: bool = True, deadline: float | None = None) -> Any:
        """Stop the reaper, release every session (when ``release_on_close``), wait for the
        write-backs, then close the inner cache (its controller drains to storage) and return
        its close report. Idempotent: every call waits for the one close (the first call's
        ``close_inner`` decides) and returns the same report.

        Why one shared close task: a second caller used to be told "closed" (``None``) at once
        while the first was still draining the write-backs; a caller that then went on with its
        shutdown (the copy engine, the storage) made every queued write-back fail. As with
        ``HiCache.aclose``, a cancelled caller leaves, the close goes on; the close task itself
        cancelled (a shutdown sweep) closes without draining (see :meth:`finish_cut_close`).

        ``deadline`` (``time.monotonic()``): when the whole close must end, the inner cache's
        included (a server's drain budget); ``None``: the close timeout bounds it."""
        task = self._close_task
        if task is None:
            # a CloseTask: cancelled before its first step, it still closes (hurried)
            task = self._close_task = start_close_task(self._close(close_inner, deadline),
                                                       name="hicache-session-close")
        report = await wait_for_close(task)
        # CLOSE_CUT: the close task was cancelled even during its hurried end: finish it here
        return await self.finish_cut_close() if report is CLOSE_CUT else report

    async def _close(self, close_inner: bool, by: float | None = None) -> Any:
        """The close task's body; a cancellation hurries it to :meth:`_cut_close` (the
        write-backs not waited for, the inner cache closed without draining): a half-done
        close would leave the controller running and the queued writes unreported."""
        try:
            # one deadline for the whole close: the write-backs' waits for host room and then
            # the inner cache's drain share the close timeout (each taking all of it, a close
            # with storage writes slow to land took twice the timeout)
            loop = asyncio.get_running_loop()
            # (the caller's deadline is on the monotonic clock: this loop's may differ)
            deadline = loop.time() + time_share(self.writeback.close_budget(), by)
            await self._lifecycle.close()
            self._let_go()
            # the write-backs take half of what is left, the inner cache the rest. Why: a copy
            # that never landed (a wedged copy stream) held the drain to the deadline, and the
            # inner cache was then closed with no time at all: its controller hurried, its
            # store handed nothing to end its own close with (a flush, an S3 store's aborts)
            await self.writeback.drain(loop.time() + 0.5 * max(0.0, deadline - loop.time()))
            self.writeback.seal()
            return await self._close_inner(close_inner, max(0.0, deadline - loop.time()), by)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._close_hurried = True
            logger.warning("session cache: the close was cancelled; closing without draining")
            return await self._cut_close(close_inner)

    async def finish_cut_close(self) -> Any:
        """The rest of an :meth:`aclose` a cancellation cut short, waiting for nothing: the
        sessions still held are released, the write-backs sealed (what they never copied is
        reported by the inner cache's close), and the inner cache closed without draining;
        returns its close report.

        Why: a cancelled close (asyncio.run's shutdown sweep) is hurried, not abandoned. A
        close task still running is hurried (cancelled: it takes that back and ends this way)
        and its report returned, so there is still one close and one report; one that finished
        before returns its report."""
        task = self._close_task
        if task is not None and not task.done():
            if not self._close_hurried and task.cancelling() == 0:
                task.cancel()
            report = await wait_for_close(task)
            if report is not CLOSE_CUT:
                return report
        elif task is not None and not task.cancelled() and task.exception() is None:
            return task.result()
        return await self._cut_close()

    async def _cut_close(self, close_inner: bool = True) -> Any:
        self._let_go()
        self.writeback.seal()
        return await self._close_inner(close_inner, 0.0)

    async def _close_inner(self, close_inner: bool, timeout: float, deadline: float | None = None) -> Any:
        """Close the inner cache within ``timeout`` (0: without draining), the whole of it by
        ``deadline`` where it takes one, and return its report; an inner cache whose close
        takes no timeout is closed as it closes."""
        fn = getattr(self.inner, "aclose", None)
        if not close_inner or fn is None:
            return None
        return await close_with(fn, timeout=timeout, deadline=deadline)

    def _let_go(self) -> None:
        """Abort each running turn and release every session (``release_on_close``); once
        done, a second call finds nothing left."""
        # A turn still running cannot finish on a closed cache, and a release waiting for it
        # would hand its session's KV over after the write-backs were drained (lost without a
        # word): abort it now, back to the history committed before it, which is then kept.
        for slot in list(self.slots.values()):
            req = slot.attached_req
            if req is None:
                continue
            try:
                self.abort_req(req)
                self.session_metrics.incr("turns_aborted_at_close")
            except Exception:  # noqa: BLE001 - one bad session must not stop the close
                self.session_metrics.incr("release_errors")
                logger.exception("session %s: aborting its running turn at close failed", quoted(slot.session_id))
        if self.config.release_on_close:
            for sid in list(self.slots):
                try:
                    self.release_session(sid)  # counts its failure, and forgets the session
                except Exception:  # noqa: BLE001 - one bad session must not stop the close
                    # (the others' KV and the inner cache's queued writes still have to drain)
                    self.slots.pop(sid, None)
                    logger.exception("session %s: releasing it at close failed; its KV is not kept", quoted(sid))

    async def __aenter__(self) -> SessionAwareCache:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ accounting

    def session_held_tokens(self) -> int:
        """Device tokens held by session slots and not by the tree (whole pages). A running
        turn's new pages count once the turn finished (until then they are the request's)."""
        return sum(s.held_tokens(self.page_size) for s in self.slots.values())

    def session_held_full_tokens(self) -> int:
        return self.session_held_tokens()

    def session_held_swa_tokens(self) -> int:
        return 0

    def session_held_req_count(self) -> int:
        """``req_to_token`` rows held by session slots."""
        return sum(1 for s in self.slots.values() if s.is_holding_kv)

    def gauges(self) -> dict[str, int]:
        """The current gauges alone, safe to read from another thread (see
        :func:`~hicache.session.metrics.gauges`)."""
        return gauges(self.slots.values(), self.page_size, self.writeback)

    def metrics(self) -> dict[str, Any]:
        """Aggregate counters plus current gauges and every open session's stats (on the
        loop; :meth:`gauges` is the part another thread may read)."""
        return self.session_metrics.report(self.slots, self.page_size, self.writeback)

    # ------------------------------------------------------------------ pass-through

    def reset(self) -> None:
        """Forget every slot and reset the inner cache. Like the inner cache, memory is not
        freed here: the server resets its pools together with the cache.

        Every session's stats go to the bounded closed history, as a release's do (counted in
        ``sessions_reset``): left open, they grew with every reset (a server's flush) and
        ``metrics()["sessions"]`` listed sessions that no longer existed."""
        self.session_metrics.incr("sessions_reset", len(self.slots))
        for sid in list(self.session_metrics.sessions):
            self.session_metrics.close(sid)
        self.slots.clear()
        self._turns.bypass.clear()
        self.writeback.discard_all()
        self.inner.reset()

    def available_and_evictable_str(self) -> str:
        return (f"{self.inner.available_and_evictable_str()}, "
                f"session_held={self.session_held_tokens()}")

    def sanity_check(self) -> None:
        """The inner cache's check (ours counts sizes, not idle locks, so it holds with
        sessions open), plus the slots' own invariants."""
        self.inner.sanity_check()
        alloc = self.token_to_kv_pool_allocator
        ps = self.page_size
        rows: set[int] = set()
        for slot in self.slots.values():
            if not slot.is_holding_kv:
                assert slot.attached_rid is None or slot.kv_committed_len == 0, slot
                continue
            assert slot.req_pool_idx not in rows, f"two slots share row {slot.req_pool_idx}"
            rows.add(slot.req_pool_idx)  # type: ignore[arg-type]
            assert slot.cache_protected_len <= slot.kv_committed_len <= slot.kv_allocated_len, slot
            assert slot.cache_protected_len % ps == 0, slot
            assert len(slot.token_ids) == slot.kv_committed_len, slot
            end = ceil_align(slot.kv_allocated_len, ps)
            owned = self._row(slot.req_pool_idx)[slot.cache_protected_len:end]  # type: ignore[arg-type]
            if owned.numel() and callable(getattr(alloc, "is_allocated", None)):
                assert alloc.is_allocated(owned.cpu()), f"slot {slot.session_id} lists free pages"
