"""``Room``: device memory (and ``req_to_token`` rows) made free for a turn under pressure.

Why sessions are offloaded here rather than failing a request: a slot pins its session's KV on
device between turns, and bursts of idle sessions would otherwise deadlock the device pool
(SGLang #27024). Under pressure the tree's evictable pages go first, then idle sessions least
recently used first (their KV goes to the tree with its write-back started, so nothing is lost),
then sessions whose next turn is only queued. What cannot be reclaimed is the memory of
*running* turns: only then does a caller get ``False``.
"""

from __future__ import annotations

import logging

from hicache.errors import quoted
from hicache.prefix_cache.base import BasePrefixCache
from hicache.prefix_cache.types import EvictParams, EvictResult
from hicache.session.config import SessionConfig
from hicache.session.metrics import SessionMetrics
from hicache.session.offload import Offloader
from hicache.session.slot import SessionSlot, take_restore_back
from hicache.session.turns import Turns
from hicache.session.writeback import WriteBackQueue

logger = logging.getLogger("hicache.session")

__all__ = ["Room"]


class Room:
    """Makes device room: evicts the inner cache, offloads sessions LRU, waits for write-backs.

    Args:
        inner: the wrapped prefix cache (its allocator, pools, ``evict`` and ``evict_async``).
        slots: the session cache's slots by session id.
        config: ``preempt_queued_turns`` is read from it.
        metrics: where preempted queued turns are counted.
        offloader: gives the chosen sessions' KV up.
        turns: detaches a preempted queued turn from its slot.
        writeback: pumped after a wait, so copies that finished meanwhile unpin their pages.
    """

    def __init__(self, inner: BasePrefixCache, slots: dict[str, SessionSlot], config: SessionConfig,
                 metrics: SessionMetrics, offloader: Offloader, turns: Turns,
                 writeback: WriteBackQueue) -> None:
        self._inner = inner
        self._slots = slots
        self._config = config
        self._metrics = metrics
        self._offloader = offloader
        self._turns = turns
        self._writeback = writeback

    def queued(self, slot: SessionSlot) -> bool:
        """Restored for a request that is only queued: matched, not admitted, nothing
        reserved yet. Its KV can be handed to the tree as safely as an idle slot's, because
        ``admit`` matches again (and then finds the KV in the tree)."""
        req = slot.attached_req
        return (
            self._config.preempt_queued_turns
            and slot.is_holding_kv
            and req is not None
            and not slot.admitted
            and req.req_pool_idx == slot.req_pool_idx
            and int(req.kv_allocated_len) <= slot.kv_allocated_len
        )

    def candidates(self) -> list[SessionSlot]:
        """Idle slots, least recently used first; then slots of merely queued turns."""
        idle = sorted((s for s in self._slots.values() if s.is_idle), key=lambda s: s.last_used)
        queued = sorted((s for s in self._slots.values() if self.queued(s)), key=lambda s: s.last_used)
        return idle + queued

    def _preempt(self, slot: SessionSlot) -> None:
        """Take a queued turn's restored state back from its request (it re-attaches, and
        matches the tree, when it is admitted)."""
        req = slot.attached_req
        assert req is not None
        take_restore_back(req)
        self._metrics.incr("preempted_queued_turns")
        self._turns.detach(slot, fire=False)

    def _close_if_released(self, slot: SessionSlot) -> None:
        """A preempted turn's session released meanwhile closes even though giving its KV up
        failed (counted and logged already): left ``closing`` with no turn, it was never closed
        and every later turn of the id was served without it until ``session_timeout_s``. The
        failed hand-over let go of what it could (see :func:`~hicache.session.handover.hand_over`);
        the close forgets the session whatever a second try of it raises."""
        try:
            self._turns.after_detach(slot)
        except Exception:  # noqa: BLE001 - the same failure, counted and logged above
            logger.debug("session %s: closing it after its failed hand-over raised again", quoted(slot.session_id),
                         exc_info=True)

    def offload_lru(self, *, tokens: int = 0, rows: int = 0) -> int:
        """Offload sessions until their held tokens cover ``tokens`` and ``rows`` rows were
        returned: idle ones least recently used first, then those whose next turn is only
        queued. Returns sessions offloaded."""
        done = 0
        for slot in self.candidates():
            if tokens <= 0 and rows <= 0:
                break
            held = slot.held_tokens(self._inner.page_size)
            preempted = slot.attached_rid is not None
            try:
                if preempted:
                    self._preempt(slot)
                self._offloader.give_up(slot, reason="pressure")
                if preempted:
                    self._turns.after_detach(slot)  # a session released while its turn was queued closes now
            except Exception:  # noqa: BLE001 - the request that needed room is not this session's
                self._metrics.incr("release_errors")
                logger.exception("session %s: giving its KV up under pressure failed", quoted(slot.session_id))
                if preempted:
                    self._close_if_released(slot)
                continue
            tokens -= held
            rows -= 1
            done += 1
        return done

    def evict(self, params: EvictParams | int) -> EvictResult:
        """Free device memory: the tree's evictable pages first, then idle sessions LRU (their
        KV goes to the tree with its write-back started; pages whose copy is still running are
        freed by a later eviction, once the copy is done)."""
        need = params if isinstance(params, int) else params.num_tokens
        alloc = self._inner.token_to_kv_pool_allocator
        before = alloc.available_size()
        self._inner.evict(EvictParams(num_tokens=need))
        short = need - (alloc.available_size() - before)
        if short > 0 and self.offload_lru(tokens=short):
            short = need - (alloc.available_size() - before)
            if short > 0:
                self._inner.evict(EvictParams(num_tokens=short))
        return EvictResult(num_tokens_evicted=max(0, alloc.available_size() - before))

    async def ensure_free(self, num_tokens: int) -> bool:
        """Make ``num_tokens`` device slots free if at all possible: evict the tree, offload
        idle sessions LRU, and wait for write-backs that still pin pages; as a last resort,
        give up the write-backs the tree keeps on device because host has no room for them
        (a released session's history must not hold the device for as long as host stays
        full). ``False`` only when running requests hold the memory."""
        if await self._make_room(num_tokens):
            return True
        return bool(self._writeback.release_kept()) and await self._make_room(num_tokens)

    async def _make_room(self, num_tokens: int) -> bool:
        """:meth:`ensure_free` short of giving write-backs up."""
        alloc = self._inner.token_to_kv_pool_allocator
        evict_async = getattr(self._inner, "evict_async", None)
        for _ in range(8):
            short = num_tokens - alloc.available_size()
            if short <= 0:
                return True
            self._inner.evict(EvictParams(num_tokens=short))
            short = num_tokens - alloc.available_size()
            if short <= 0:
                return True
            offloaded = self.offload_lru(tokens=short)
            if offloaded:
                self._inner.evict(EvictParams(num_tokens=max(0, num_tokens - alloc.available_size())))
            short = num_tokens - alloc.available_size()
            if short <= 0:
                return True
            if evict_async is None:
                if not offloaded:
                    return False
                continue
            before = alloc.available_size()
            evicted = (await evict_async(short)).num_tokens_evicted
            self._writeback.pump()
            # other turns ran meanwhile: some sessions may have become idle since, and the room
            # this eviction freed may be theirs already (as many free slots as before is then
            # no sign that nothing can be freed: the device may be full of evictable pages)
            if not evicted and alloc.available_size() == before and not offloaded and not self.candidates():
                return alloc.available_size() >= num_tokens
        return alloc.available_size() >= num_tokens

    async def evict_async(self, params: EvictParams | int) -> EvictResult:
        """:meth:`evict`, waiting for the write-backs that pin pages (the inner cache's
        ``evict_async`` would not offload sessions)."""
        need = params if isinstance(params, int) else params.num_tokens
        alloc = self._inner.token_to_kv_pool_allocator
        before = alloc.available_size()
        await self.ensure_free(before + need)
        return EvictResult(num_tokens_evicted=max(0, alloc.available_size() - before))

    def ensure_req_slots(self, n: int = 1) -> bool:
        """Make ``n`` ``req_to_token`` rows free, offloading idle sessions LRU if needed."""
        pool = self._inner.req_to_token_pool
        short = n - pool.available_size()
        if short > 0:
            self.offload_lru(rows=short)
        return pool.available_size() >= n
