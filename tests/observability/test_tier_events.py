"""The tier-change hub: fan-out, unsubscribe, and a failing subscriber never reaching the tier."""

from __future__ import annotations

import threading

from hicache.observability import ChangeKind, Tier, TierChange, TierChangeHub


def test_fan_out_and_unsubscribe() -> None:
    hub = TierChangeHub()
    first: list[TierChange] = []
    second: list[TierChange] = []
    stop_first = hub.subscribe(first.append)
    hub.subscribe(second.append)
    stored = TierChange(ChangeKind.STORED, Tier.DEVICE, ("k1", "k2"), page_size=16)
    hub.emit(stored)
    stop_first()
    stop_first()  # idempotent
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.STORAGE, backend="file"))
    assert first == [stored]
    assert [c.kind for c in second] == [ChangeKind.STORED, ChangeKind.CLEARED]


def test_failing_subscriber_is_counted_not_raised() -> None:
    hub = TierChangeHub()
    seen: list[TierChange] = []

    def broken(change: TierChange) -> None:
        raise RuntimeError("consumer bug")

    hub.subscribe(broken)
    hub.subscribe(seen.append)
    hub.emit(TierChange(ChangeKind.REMOVED, Tier.HOST, ("k",)))
    assert hub.subscriber_errors == 1
    assert len(seen) == 1


def test_emit_from_many_threads() -> None:
    hub = TierChangeHub()
    seen: list[TierChange] = []
    lock = threading.Lock()

    def record(change: TierChange) -> None:
        with lock:
            seen.append(change)

    hub.subscribe(record)
    change = TierChange(ChangeKind.STORED, Tier.STORAGE, ("k",), backend="file")
    threads = [threading.Thread(target=lambda: [hub.emit(change) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 800
    assert hub.active


def test_wants_filters_changes_and_tells_tiers() -> None:
    hub = TierChangeHub()
    storage_only: list[TierChange] = []
    stop = hub.subscribe(storage_only.append, wants=frozenset({(ChangeKind.STORED, Tier.STORAGE)}))
    assert hub.wants(ChangeKind.STORED, Tier.STORAGE)
    assert not hub.wants(ChangeKind.STORED, Tier.DEVICE)  # the tree skips hashing for nobody
    hub.emit(TierChange(ChangeKind.STORED, Tier.DEVICE, ("d",)))
    hub.emit(TierChange(ChangeKind.STORED, Tier.STORAGE, ("s",), backend="file"))
    assert [c.keys for c in storage_only] == [("s",)]
    everything: list[TierChange] = []
    hub.subscribe(everything.append)
    assert hub.wants(ChangeKind.STORED, Tier.DEVICE)
    stop()
    assert not hub.wants(ChangeKind.STORED, Tier.STORAGE) or hub.wants(ChangeKind.REMOVED, Tier.HOST)
    hub.emit(TierChange(ChangeKind.REMOVED, Tier.HOST, ("h",)))
    assert [c.keys for c in everything] == [("h",)]
