"""The page ledger: bounded per-key flags fed by tier changes."""

from __future__ import annotations

import threading

import pytest

from hicache.observability.page_ledger import CORRUPT, IN_STORAGE, LOST_DEVICE, LOST_HOST, LOST_STORAGE, PageLedger
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


def test_a_device_or_host_clear_makes_every_unrecorded_key_maybe_forgotten() -> None:
    """The tree's reset() emits CLEARED for device and host, naming no pages; the ledger ignored
    it, so a page the tiers held until then was still 'never seen' (attributed never_stored)."""
    for tier in (Tier.DEVICE, Tier.HOST):
        hub = TierChangeHub()
        ledger = PageLedger(capacity=16, forgotten_bits=1 << 16)
        ledger.attach(hub)
        hub.emit(removed(Tier.HOST, "evicted"))
        assert not ledger.maybe_forgotten("held-until-the-reset")
        hub.emit(TierChange(ChangeKind.CLEARED, tier))
        assert ledger.maybe_forgotten("held-until-the-reset") and ledger.tiers_cleared
        assert ledger.flags(["evicted", "held-until-the-reset"]) == [LOST_HOST, None]  # records stay


def test_a_clear_that_lists_its_pages_records_each_lost_and_leaves_other_keys_never_seen() -> None:
    """The tree's reset() lists what device and host held; the ledger records those pages as
    lost from the tier, and a key it never saw stays certain (``never_stored``), where a clear
    naming no pages made every unrecorded key ``unknown`` for good."""
    hub = TierChangeHub()
    ledger = PageLedger(capacity=16, forgotten_bits=1 << 16)
    ledger.attach(hub)
    hub.emit(TierChange(ChangeKind.STORED, Tier.STORAGE, ("stored",)))
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.DEVICE, ("on-device", "stored"), keys_complete=True))
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.HOST, ("on-host",), keys_complete=True))
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.HOST, (), keys_complete=True))  # an empty tier
    assert not ledger.tiers_cleared and not ledger.maybe_forgotten("never-seen-key")
    assert ledger.flags(["on-device", "on-host", "stored"]) == [LOST_DEVICE, LOST_HOST, IN_STORAGE | LOST_DEVICE]


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


class _KeyByKeyLedger(PageLedger):
    """The ledger updating one key at a time (what every change did before stores and storage
    removals took the two-C-loop path): the oracle for the random test below."""

    def _update(self, keys, set_bits, clear_bits):  # type: ignore[no-untyped-def]
        if not keys or self.capacity == 0:
            if keys and self.capacity == 0:
                for key in keys:
                    self._forget(key)
            return
        for key in keys:
            self._flags[key] = (self._flags.get(key, 0) & ~clear_bits) | set_bits
            self._flags.move_to_end(key)
        while len(self._flags) > self.capacity:
            self._forget(self._flags.popitem(last=False)[0])


@pytest.mark.parametrize("seed", range(40))
def test_batched_updates_match_key_by_key(seed: int) -> None:
    """Random stores, removals (corrupt ones too) and clears on every tier, with keys repeated
    within and across changes and a capacity that forgets: same flags, same order (what the
    capacity forgets next), same forgotten bitmap."""
    import random

    rng = random.Random(seed)
    capacity = rng.choice([0, 3, 12, 1000])
    fast, slow = PageLedger(capacity, forgotten_bits=64), _KeyByKeyLedger(capacity, forgotten_bits=64)
    for _ in range(60):
        keys = tuple(f"k{rng.randint(0, 20)}" for _ in range(rng.randint(0, 8)))
        tier = rng.choice(list(Tier))
        change = rng.choice([
            stored(tier, *keys),
            removed(tier, *keys),
            removed(tier, *keys, reason="corrupt"),
            TierChange(ChangeKind.CLEARED, Tier.STORAGE),
        ])
        fast.observe(change)
        slow.observe(change)
        assert list(fast._flags.items()) == list(slow._flags.items())
        assert (fast.forgotten, fast._bits) == (slow.forgotten, slow._bits)


def test_what_is_maybe_forgotten_is_the_same_in_every_process() -> None:
    """A replay must attribute its misses the same way on every run: the forgotten bitmap's
    bit for a key may not depend on the process's string hash seed (it did: Python's ``hash``)."""
    import os
    import subprocess
    import sys

    script = (
        "from hicache.observability.page_ledger import PageLedger\n"
        "from hicache.observability.tier_events import ChangeKind, Tier, TierChange\n"
        "led = PageLedger(capacity=4, forgotten_bits=256)\n"
        "for i in range(40):\n"
        "    led.observe(TierChange(ChangeKind.REMOVED, Tier.HOST, (f'{i:064x}',), reason='evicted'))\n"
        "print(''.join('1' if led.maybe_forgotten(f'{i:064x}') else '0' for i in range(1000)))\n"
    )
    outs = set()
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert len(outs) == 1 and "1" in next(iter(outs))
