"""The KV events of hicache's vLLM tier: which chunks it holds, as vLLM's own tiers report them.

vLLM turns each tier's :class:`OffloadingEvent` (keys, medium, stored or removed) into the
``BlockStored``/``BlockRemoved`` events it publishes under ``--kv-events-config``
(``OffloadingEventsTracker``); a router that places requests by KV events sees what each
engine's tiers hold. vLLM's ``fs`` and ``obj`` tiers report a store job's keys once the job is
done and never remove anything. hicache's stores do remove: the ``file`` backend evicts to keep
``max_bytes``, a read deletes a corrupt page, another engine sharing the store evicts or clears,
an object vanishes. :class:`TierKVEvents` reports those too, from the backend's
:attr:`~hicache.storage.base.AsyncHiCacheStorage.tier_changes` hub, so the stream is exact:

* a key is announced stored once, and removed only after it was announced, once: a consumer that
  counts stores against removals (vLLM asks them to) never keeps a chunk the store dropped;
* a key that leaves the store while a store job of it runs is not announced by that job (the
  removal and the job's result come on different threads, in either order);
* stored events are announced with ``removal_expected`` so vLLM keeps each chunk's payload (its
  block hashes) until this tier's removal, which then names the same blocks as the store did;
* stored keys wait for vLLM's next ``take_events`` in a bounded queue: past ``max_queued`` keys
  a store is dropped, counted (:attr:`TierKVEvents.dropped_keys`) and not taken for announced,
  so no removal of it follows. Removals are never dropped: each is of a key whose store was
  announced (and not forgotten since), so they are bounded by what the tier remembers;
* the keys announced stored are remembered, to report their removal, up to ``max_held`` of
  them: a store that never evicts (a bucket without a lifecycle rule) would grow the set for the
  life of the engine. Past it the oldest announced key is forgotten, counted
  (:attr:`TierKVEvents.forgotten_keys`), and its later removal is not reported. That is the safe
  direction: a consumer then takes the chunk for held after it left the store, so a router may
  send a request here that misses it and recomputes (the tier's lookups ask the store, never the
  events: no wrong KV follows). Reporting the removal of a key the tier no longer knows it
  announced could report one it never announced (a dropped store), taking a
  reference-counting consumer's count below what the store holds. A forgotten key stored again
  is announced again (such a consumer counts it twice: held longer, the same direction). vLLM
  keeps a forgotten chunk's payload (``removal_expected``) as it does any chunk its ``fs``/``obj``
  tiers hold for good.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub

__all__ = ["DEFAULT_MAX_HELD_KEYS", "DEFAULT_MAX_QUEUED_KEYS", "TierKVEvents"]

logger = logging.getLogger("hicache.integrations.vllm.tier")

#: stored keys queued between two of vLLM's ``take_events`` calls (one a scheduler step)
DEFAULT_MAX_QUEUED_KEYS = 1 << 16
#: announced stored keys remembered to report their removal (some 175 bytes each: ~170 MiB)
DEFAULT_MAX_HELD_KEYS = 1 << 20

_WANTS = frozenset({(ChangeKind.REMOVED, Tier.STORAGE), (ChangeKind.CLEARED, Tier.STORAGE)})


class TierKVEvents:
    """One tier's event queue: stores from the scheduler thread, removals from the store's."""

    def __init__(self, medium: Medium, locality: Locality | None, max_queued: int = DEFAULT_MAX_QUEUED_KEYS,
                 max_held: int = DEFAULT_MAX_HELD_KEYS) -> None:
        self._medium = medium
        self._locality = locality
        self._max_queued = max_queued
        self._max_held = max_held
        self._lock = threading.Lock()
        self._queue: list[OffloadingEvent] = []
        self._queued_stored = 0  # keys of the stored events in the queue
        # announced stored, not removed (nor forgotten) since; oldest announced first
        self._held: OrderedDict[OffloadKey, None] = OrderedDict()
        self._storing: dict[OffloadKey, int] = {}  # keys of store jobs in flight -> jobs
        self._lost: set[OffloadKey] = set()  # of those, removed from the store meanwhile
        self._unsubscribe: Callable[[], None] | None = None
        self.dropped_keys = 0
        self.forgotten_keys = 0

    def subscribe(self, hub: TierChangeHub) -> None:
        """Hear the store's removals and clears (on whatever thread the backend reports them)."""
        self._unsubscribe = hub.subscribe(self._on_change, wants=_WANTS)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def watch(self, keys: Iterable[OffloadKey]) -> None:
        """A store job of ``keys`` starts: a removal of one of them from now on is remembered."""
        with self._lock:
            for key in keys:
                self._storing[key] = self._storing.get(key, 0) + 1

    def stored(self, keys: Sequence[OffloadKey], ok: Sequence[bool]) -> None:
        """The store job of ``keys`` (watched) ended; ``ok[i]``: key ``i`` is in the store."""
        with self._lock:
            new = [k for k, done in zip(keys, ok) if done and k not in self._lost and k not in self._held]
            for key in keys:
                left = self._storing.get(key, 0) - 1
                if left > 0:
                    self._storing[key] = left
                else:
                    self._storing.pop(key, None)
                    self._lost.discard(key)
            new = list(dict.fromkeys(new))  # a job naming a key twice announces it once
            if not new:
                return
            if self._queued_stored + len(new) > self._max_queued:
                self.dropped_keys += len(new)
                dropped = self.dropped_keys
            else:
                dropped = 0
                self._hold(new)
                self._queued_stored += len(new)
                self._queue.append(OffloadingEvent(keys=new, medium=self._medium, removed=False,
                                                   locality=self._locality, removal_expected=True))
        if dropped:
            logger.warning("hicache tier: KV event queue full (%d stored keys not taken); %d stored "
                           "keys not announced so far", self._max_queued, dropped)

    def _hold(self, keys: list[OffloadKey]) -> None:
        """Remember ``keys`` as announced, forgetting the oldest past ``max_held`` (lock held)."""
        self._held.update(dict.fromkeys(keys))
        excess = max(len(self._held) - self._max_held, 0)
        for _ in range(excess):
            self._held.popitem(last=False)
        if excess and not self.forgotten_keys:  # once: from then on it is the steady state
            logger.warning("hicache tier: %d stored keys remembered for KV events; the oldest are "
                           "forgotten from now on (their removals go unreported)", self._max_held)
        self.forgotten_keys += excess

    def take(self) -> list[OffloadingEvent]:
        """Every event queued since the last call, in order."""
        with self._lock:
            out, self._queue, self._queued_stored = self._queue, [], 0
        return out

    def _on_change(self, change: TierChange) -> None:
        with self._lock:
            if change.kind is ChangeKind.CLEARED:
                gone = list(self._held)
                self._lost.update(self._storing)
                self._held.clear()
            else:
                keys = [k for k in map(_offload_key, change.keys) if k is not None]
                self._lost.update(k for k in keys if k in self._storing)
                gone = [k for k in dict.fromkeys(keys) if k in self._held]
                for key in gone:
                    del self._held[key]
            if gone:
                self._queue.append(OffloadingEvent(keys=gone, medium=self._medium, removed=True,
                                                   locality=self._locality))


def _offload_key(page_key: str) -> OffloadKey | None:
    """The vLLM offload key of a page key (:func:`~hicache.integrations.vllm.tier_keys.page_key`)."""
    try:
        return OffloadKey(bytes.fromhex(page_key))
    except ValueError:
        return None
