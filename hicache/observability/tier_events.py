"""One in-process fan-out for "a tier stored, removed or cleared pages".

Why a hub rather than direct calls: the device tree, the host pool and every storage backend
change what they hold on different threads (the event loop, I/O threads, other processes seen
through a shared store), and several consumers want to know (KV events for cache-aware routers,
miss attribution, metrics). Each tier reports once, here; consumers subscribe without the tier
knowing them.

Contract for subscribers: a callback runs synchronously on the emitting thread (possibly an I/O
thread, never assume the event loop), must be thread-safe and cheap (append to a bounded buffer,
bump a counter), and must not block. An exception in a subscriber is counted, never propagated
into the tier that emitted, and logged: its first with the traceback, then at most once a minute
per subscriber, as a count (a consumer's bug fails on every change, thousands a minute).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hicache.observability.throttle import Throttle

__all__ = ["ChangeKind", "Tier", "TierChange", "TierChangeHub"]

log = logging.getLogger(__name__)


class Tier(str, Enum):
    """Where a page lives: device (GPU) pages, pinned host pages, shared storage."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class ChangeKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class TierChange:
    """Pages that one tier started or stopped holding.

    ``keys`` are hicache's chained page hashes (the storage keys), in prefix order for
    ``STORED``. A ``CLEARED`` change lists the pages the tier dropped when it knows them all
    (``keys_complete``: the tree's reset of device and host, a store that lists what it
    dropped); otherwise its keys are empty and any page may have gone. ``token_ids`` and
    ``parent_key`` are filled when the tier knows them (the tree does, a storage deletion
    does not). ``backend`` names the storage
    backend (``"file"``, ``"s3"``...) for storage changes. ``origin`` is ``"local"`` for changes
    this process made and ``"peer"`` for ones another process sharing the store made and this
    process observed.
    """

    kind: ChangeKind
    tier: Tier
    keys: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    parent_key: str | None = None
    page_size: int = 0
    backend: str | None = None
    origin: str = "local"
    reason: str | None = None
    #: ``CLEARED`` only: ``keys`` is every page the tier dropped (an empty tuple: none)
    keys_complete: bool = False


Subscriber = Callable[[TierChange], None]
#: which changes a subscriber wants: ``(kind, tier)`` pairs; ``None`` means every change
Wants = frozenset[tuple[ChangeKind, Tier]] | None
EVERY: frozenset[tuple[ChangeKind, Tier]] = frozenset((k, t) for k in ChangeKind for t in Tier)


class TierChangeHub:
    """Thread-safe fan-out of :class:`TierChange` to subscribers; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (callback, what it wants, the throttle of its failure log)
        self._subscribers: tuple[tuple[Subscriber, frozenset[tuple[ChangeKind, Tier]], Throttle], ...] = ()
        self._wanted: frozenset[tuple[ChangeKind, Tier]] = frozenset()
        self.subscriber_errors = 0

    def subscribe(self, callback: Subscriber, *, wants: Wants = None) -> Callable[[], None]:
        """Add ``callback`` for the changes in ``wants`` (every change by default); returns a
        function that removes it again (idempotent).

        Why ``wants``: some changes cost the tier work to describe (the tree hashes a new
        node's pages lazily, only when someone needs its keys), so a consumer that never reads
        device stores should say so and keep that work off the request path."""
        wanted = EVERY if wants is None else frozenset(wants)
        with self._lock:
            self._subscribers = (*self._subscribers, (callback, wanted, Throttle()))
            self._refresh()

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s[0] is not callback)
                self._refresh()

        return unsubscribe

    def _refresh(self) -> None:
        self._wanted = frozenset().union(*(w for _, w, _ in self._subscribers))

    @property
    def active(self) -> bool:
        """True when anyone listens: tiers may skip building a change nobody reads."""
        return bool(self._subscribers)

    def wants(self, kind: ChangeKind, tier: Tier) -> bool:
        """Whether any subscriber reads ``kind`` changes of ``tier``."""
        return (kind, tier) in self._wanted

    def emit(self, change: TierChange) -> None:
        key = (change.kind, change.tier)
        for callback, wanted, throttle in self._subscribers:  # a tuple snapshot: never races (un)subscribe
            if key not in wanted:
                continue
            try:
                callback(change)
            except Exception:  # noqa: BLE001 - a consumer's bug must never break a tier
                with self._lock:
                    self.subscriber_errors += 1
                count = throttle.due()
                if count:
                    log.exception("tier change subscriber %r failed on %s (%d failure(s) since its last report)",
                                  callback, change.kind.value, count)
