"""A bounded memory of what happened to pages: written to storage, and the tier each was last lost from.

Why: when a request misses a page, the cache no longer has it, so the only way to say *why*
is to have remembered its last change. The ledger subscribes to the stack's
:class:`~hicache.observability.tier_events.TierChangeHub` and keeps, per page key, one small
int of flags (no KV, no token ids): whether this process wrote the page to storage and saw no
removal since, the tier it was last removed from, and whether that removal was a failed
verification.

Bounded: at most ``capacity`` keys (oldest change forgotten first). A key pushed out sets a
bit in a fixed-size "forgotten" bitmap, so a later miss on a key with no record can still tell
"never seen by this process" (bit clear: certain) from "maybe forgotten" (bit set: unknown).
Collisions only turn a certain "never stored" into an honest "unknown". The bit comes from a hash
of the key that is the same in every process (xxh3), not Python's ``hash``, which changes with
each process's ``PYTHONHASHSEED``: a replay must attribute its misses the same way every run.

Clears: a storage clear marks every page this process wrote as lost from storage. A device or
host clear that lists its pages (the tree's ``reset()``, SGLang's ``flush_cache``: the tree knows
what it held) records each as lost from that tier, as a removal would. One that names no pages
leaves the ledger unable to tell which went (it has no record of device and host stores, see
``LEDGER_WANTS``): from then on every key without a record is "maybe forgotten" (``unknown``),
not "never stored". One flag, no walk over the records.

Thread-safe: tiers emit on the event loop and on I/O threads; every method takes one lock for
O(keys) dict operations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import repeat

import xxhash

from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub

__all__ = ["CORRUPT", "IN_STORAGE", "LOST_DEVICE", "LOST_HOST", "LOST_STORAGE", "PageLedger"]


def _bit_of(key: str) -> int:
    """The key's hash, the same in every process (Python's ``hash`` of a str is seeded per process)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


#: this process wrote the page to storage and has seen no removal since
IN_STORAGE = 1
LOST_DEVICE = 2
LOST_HOST = 4
LOST_STORAGE = 8
#: the last removal was a page that failed verification (checksum, header, length)
CORRUPT = 16

_LOST = {Tier.DEVICE: LOST_DEVICE, Tier.HOST: LOST_HOST, Tier.STORAGE: LOST_STORAGE}
#: the changes the ledger reads: every removal and clear, and stores only to storage (a device
#: or host store needs no memory, and asking for it would make the tree hash every new node)
LEDGER_WANTS = frozenset(
    {(ChangeKind.STORED, Tier.STORAGE)}
    | {(kind, tier) for kind in (ChangeKind.REMOVED, ChangeKind.CLEARED) for tier in Tier}
)
_LOST_MASK = LOST_DEVICE | LOST_HOST | LOST_STORAGE | CORRUPT
#: every flag a key can hold
_ALL = IN_STORAGE | _LOST_MASK
#: removal reasons a tier gives for a page that failed verification
CORRUPT_REASONS = frozenset({"corrupt", "verification_failed", "verification"})


class PageLedger:
    """Per-key flags of the last changes seen (see the module docstring).

    Args:
        capacity: keys remembered at most (0 remembers nothing: every miss is "unknown" once
            anything was seen, "never stored" before).
        forgotten_bits: size of the bitmap of keys pushed out (rounded up to a multiple of 8).
    """

    def __init__(self, capacity: int = 1 << 17, forgotten_bits: int = 1 << 22) -> None:
        if capacity < 0:
            raise ValueError(f"ledger capacity must not be negative, got {capacity}")
        if forgotten_bits <= 0:
            raise ValueError(f"forgotten_bits must be positive, got {forgotten_bits}")
        self.capacity = capacity
        self._bits = bytearray((forgotten_bits + 7) // 8)
        self._nbits = len(self._bits) * 8
        self._flags: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        #: keys pushed out by the capacity
        self.forgotten = 0
        #: a device or host clear that named no pages was seen: any key may have been held
        #: unrecorded (module docstring)
        self.tiers_cleared = False
        self._unsubscribe: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._flags)

    def attach(self, hub: TierChangeHub) -> None:
        """Follow ``hub`` (once; :meth:`detach` stops)."""
        if self._unsubscribe is None:
            self._unsubscribe = hub.subscribe(self.observe, wants=LEDGER_WANTS)

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # ------------------------------------------------------------------ feeding

    def observe(self, change: TierChange) -> None:
        """A hub subscriber: cheap, thread-safe, never raises on a well-formed change."""
        if change.kind is ChangeKind.STORED:
            if change.tier is Tier.STORAGE:
                self._update(change.keys, IN_STORAGE, _LOST_MASK)
            return  # device/host stores: a later removal says all a miss needs
        if change.kind is ChangeKind.REMOVED:
            lost = _LOST[change.tier]
            if change.reason in CORRUPT_REASONS:
                lost |= CORRUPT
            clear = _LOST_MASK | (IN_STORAGE if change.tier is Tier.STORAGE else 0)
            self._update(change.keys, lost, clear)
            return
        if change.kind is ChangeKind.CLEARED:
            if change.tier is Tier.STORAGE:
                self._storage_cleared()
            elif change.keys_complete:  # the pages it held, each lost from that tier
                self._update(change.keys, _LOST[change.tier], _LOST_MASK)
            else:  # pages the ledger has no record of went too: no key is surely "never stored" now
                self.tiers_cleared = True

    def _update(self, keys: Sequence[str], set_bits: int, clear_bits: int) -> None:
        if not keys or self.capacity == 0:
            if keys and self.capacity == 0:
                with self._lock:
                    for key in keys:
                        self._forget(key)
            return
        keep = ~clear_bits
        with self._lock:
            flags = self._flags
            if not keep & _ALL & ~set_bits:
                # every flag is either set or cleared: the new value is set_bits whatever the
                # old one (a store to storage, a removal from it), so the batch is two C loops
                # instead of a Python iteration per key; order as below (last occurrence last)
                flags.update(zip(keys, repeat(set_bits)))
                deque(map(flags.move_to_end, keys), maxlen=0)
            else:
                for key in keys:
                    flags[key] = (flags.get(key, 0) & keep) | set_bits
                    flags.move_to_end(key)
            while len(flags) > self.capacity:
                old, _ = flags.popitem(last=False)
                self._forget(old)

    def _forget(self, key: str) -> None:
        bit = _bit_of(key) % self._nbits
        self._bits[bit >> 3] |= 1 << (bit & 7)
        self.forgotten += 1

    def _storage_cleared(self) -> None:
        """Every page this process wrote is gone from storage: O(remembered keys), once per clear."""
        with self._lock:
            for key, f in self._flags.items():
                if f & IN_STORAGE:
                    self._flags[key] = (f & ~(IN_STORAGE | _LOST_MASK)) | LOST_STORAGE

    # ------------------------------------------------------------------ reading

    def flags(self, keys: Sequence[str]) -> list[int | None]:
        """Flags per key; ``None`` for a key with no record (see :meth:`maybe_forgotten`)."""
        with self._lock:
            get = self._flags.get
            return [get(k) for k in keys]

    def maybe_forgotten(self, key: str) -> bool:
        """Whether a key with no record may have had one: the capacity pushed it out, or a device
        or host clear dropped it unrecorded (see the module docstring)."""
        if self.tiers_cleared:
            return True
        bit = _bit_of(key) % self._nbits
        return bool(self._bits[bit >> 3] & (1 << (bit & 7)))
