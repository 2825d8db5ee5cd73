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


async def test_a_subscriber_failing_on_every_change_logs_one_traceback_not_one_per_change(caplog) -> None:  # type: ignore[no-untyped-def]
    """A consumer with a bug raises on every change a busy cache makes (every request stores
    device and host pages): each one logged a full traceback, thousands a minute, burying
    the rest of the log. The first failure is logged with its traceback, the ones after it
    at most once a minute as a count; every one is counted (``subscriber_errors``)."""
    import logging
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "facade"))
    from test_facade import config, prompt, run

    from hicache.facade import HiCache

    async with HiCache.from_config(config()) as cache:
        hub = cache._stack.tier_changes

        def broken(change: TierChange) -> None:
            raise RuntimeError("consumer bug")

        hub.subscribe(broken)
        with caplog.at_level(logging.WARNING, logger="hicache.observability.tier_events"):
            for i in range(20):
                await run(cache, f"r{i}", prompt(i, 40))
            await cache.drain()
    assert hub.subscriber_errors >= 20
    logged = [r for r in caplog.records if r.name == "hicache.observability.tier_events"]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert logged[0].exc_info is not None and "broken" in logged[0].getMessage()
