"""The page ledger: bounded per-key flags fed by tier changes."""

from __future__ import annotations

import threading

import pytest

from hicache.observability.page_ledger import CORRUPT, IN_STORAGE, LOST_HOST, LOST_STORAGE, PageLedger
from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub


def stored(tier: Tier, *keys: str) -> TierChange:
    return TierChange(ChangeKind.STORED, tier, keys)


def removed(tier: Tier, *keys: str, reason: str | None = None) -> TierChange:
    return TierChange(ChangeKind.REMOVED, tier, keys, reason=reason)


def test_last_removal_wins_and_storage_flag_survives_other_tiers() -> None:
    hub = TierChangeHub()
    ledger = PageLedger(capacity=16)
    ledger.attach(hub)
    hub.emit(stored(Tier.STORAGE, "a", "b"))
    hub.emit(removed(Tier.HOST, "a"))
    hub.emit(removed(Tier.STORAGE, "b", reason="corrupt"))
    assert ledger.flags(["a", "b", "c"]) == [IN_STORAGE | LOST_HOST, LOST_STORAGE | CORRUPT, None]
    hub.emit(stored(Tier.STORAGE, "b"))  # written again: the loss is history
    assert ledger.flags(["b"]) == [IN_STORAGE]
    hub.emit(stored(Tier.DEVICE, "c"))  # device/host stores need no record
    assert ledger.flags(["c"]) == [None]
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.STORAGE))
    assert ledger.flags(["a", "b"]) == [LOST_STORAGE, LOST_STORAGE]
    ledger.detach()
    hub.emit(removed(Tier.HOST, "z"))
    assert ledger.flags(["z"]) == [None] and not hub.active


def test_capacity_forgets_oldest_and_remembers_that_it_did() -> None:
    ledger = PageLedger(capacity=2, forgotten_bits=1 << 16)
    ledger.observe(removed(Tier.HOST, "k1", "k2", "k3"))
    assert len(ledger) == 2 and ledger.forgotten == 1
    assert ledger.flags(["k1"]) == [None]
    assert ledger.maybe_forgotten("k1")
    assert not ledger.maybe_forgotten("never-seen-key")  # with 65k bits, a collision is unlikely


def test_zero_capacity_forgets_everything() -> None:
    ledger = PageLedger(capacity=0)
    ledger.observe(removed(Tier.HOST, "k"))
    assert ledger.flags(["k"]) == [None] and ledger.maybe_forgotten("k")


def test_bad_sizes_are_errors() -> None:
    with pytest.raises(ValueError, match="capacity"):
        PageLedger(capacity=-1)
    with pytest.raises(ValueError, match="forgotten_bits"):
        PageLedger(forgotten_bits=0)


def test_threads_feed_it_at_once() -> None:
    ledger = PageLedger(capacity=1000)

    def feed(t: int) -> None:
        for i in range(500):
            ledger.observe(removed(Tier.HOST, f"{t}-{i}"))
            ledger.flags([f"{t}-{i}"])

    threads = [threading.Thread(target=feed, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(ledger) == 1000 and ledger.forgotten == 1000
