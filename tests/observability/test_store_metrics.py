"""A real file store's figures as they reach a scrape: which are counters, and how a store shared
by several caches is counted."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from hicache.observability.cache_gauges import _export_storage
from hicache.observability.metrics import InstanceMetrics, exposition_text
from hicache.observability.scrape import Scrape
from hicache.storage import create_async_storage
from hicache.testing.store_tests import NS_A
from hicache_backends.file.journal import JOURNAL_NAME, RemovalJournal

_JOURNAL_TOTALS = ("journal_dropped_lines", "journal_missed_files", "journal_torn_lines", "journal_failed_removals",
                   "journal_malformed_lines")


async def test_journal_totals_are_counters_that_a_rate_can_read(tmp_path: Path) -> None:
    """The journal's cumulative counts only grow: exported as gauges, ``rate()`` refused them."""
    store = create_async_storage("file", None, root=str(tmp_path), namespace=NS_A, journal_poll_s=3600)
    metrics = InstanceMetrics()
    try:
        async with store:
            assert await store.wait_index_ready(10)
            _export_storage(metrics, store)
            scrape = Scrape(exposition_text())
            for name in _JOURNAL_TOTALS:
                assert scrape.types.get(f"hicache_backend_{name}") == "counter", (name, scrape.types.get(f"hicache_backend_{name}"))
                assert scrape.value(f"hicache_backend_{name}_total", cache=metrics.label) == 0
            # another process rotates the journal twice before this store reads it: one file missed
            rotor = RemovalJournal(store.layout.ns_dir, max_bytes=1)
            for i in range(3):
                rotor.append_removed([(f"filler-{i}", "kv")], "evicted")
            rotor.close()
            assert os.path.exists(os.path.join(store.layout.ns_dir, JOURNAL_NAME))
            store._peers.journal.poll()
            assert store.get_stats()["journal_missed_files"] == 1
            _export_storage(metrics, store)
            scrape = Scrape(exposition_text())
            assert scrape.value("hicache_backend_journal_missed_files_total", cache=metrics.label) == 1
            # a line no store could have written (kept count of, but not exported before)
            with open(os.path.join(store.layout.ns_dir, JOURNAL_NAME), "ab") as f:
                f.write(b"not json\n")
            store._peers.journal.poll()
            assert store.get_stats()["journal_malformed_lines"] == 1
            _export_storage(metrics, store)
            scrape = Scrape(exposition_text())
            assert scrape.value("hicache_backend_journal_malformed_lines_total", cache=metrics.label) == 1
    finally:
        metrics.close()


async def test_a_memory_medium_shared_by_two_stores_is_counted_once() -> None:
    """Stores naming one ``store_id`` each report the whole medium; private ones stay apart."""
    import uuid

    import torch

    from hicache.observability.stats_view import render_scrape
    from hicache_backends.memory import MemoryMedium

    sid = f"obs-{uuid.uuid4().hex}"
    a = create_async_storage("memory", None, store_id=sid, namespace={"model": "a"})
    b = create_async_storage("memory", None, store_id=sid, namespace={"model": "b"})
    alone = create_async_storage("memory", None, namespace={"model": "c"})
    owners = [InstanceMetrics() for _ in range(3)]
    try:
        async with a, b, alone:
            assert await a.batch_set(["p0", "p1"], [torch.zeros(1000, dtype=torch.uint8)] * 2)
            assert await b.batch_set(["q0"], [torch.ones(1000, dtype=torch.uint8)])
            assert await alone.batch_set(["r0"], [torch.ones(1000, dtype=torch.uint8)])
            for owner, store in zip(owners, (a, b, alone)):
                _export_storage(owner, store)
            scrape = Scrape(exposition_text())
            mine = [s for s in scrape.select("hicache_backend_stored_pages") if s.labels["cache"] in {o.label for o in owners}]
            assert sorted(s.value for s in mine) == [1.0, 3.0, 3.0]  # the medium's pages, twice
            text = "".join(f'hicache_backend_stored_pages{{cache="{s.labels["cache"]}",backend="memory",'
                           f'store="{s.labels["store"]}"}} {s.value}\n' for s in mine)
            assert "stored 4 pages" in render_scrape(Scrape(text), "x")
    finally:
        for owner in owners:
            owner.close()
        MemoryMedium.drop_shared(sid)


async def test_evictions_on_a_shared_memory_medium_sum_to_the_mediums_over_caches() -> None:
    """Every store on one ``store_id`` exported the whole medium's evictions as its own counter:
    a sum over caches counted each eviction once per cache, and a cache that never wrote
    reported evictions. Each store counts the evictions its writes made."""
    import uuid

    import torch

    from hicache.observability.stats_view import render_scrape
    from hicache_backends.memory import MemoryMedium

    sid = f"obs-evict-{uuid.uuid4().hex}"
    a = create_async_storage("memory", None, store_id=sid, max_bytes=3_000, namespace={"model": "a"})
    b = create_async_storage("memory", None, store_id=sid, namespace={"model": "b"})
    idle = create_async_storage("memory", None, store_id=sid, namespace={"model": "a"})
    owners = [InstanceMetrics() for _ in range(3)]
    try:
        async with a, b, idle:
            assert await a.batch_set(["p0", "p1", "p2"], [torch.zeros(1000, dtype=torch.uint8)] * 3)
            assert await b.batch_set(["q0", "q1"], [torch.ones(1000, dtype=torch.uint8)] * 2)  # evicts 2 of a's
            assert await a.batch_set(["p3"], [torch.zeros(1000, dtype=torch.uint8)])  # evicts 1
            assert (a.medium.evicted_pages, a.medium.evicted_bytes) == (3, 3000)
            assert (idle.get_stats()["evicted_pages"], idle.get_stats()["evicted_bytes"]) == (0, 0)
            for owner, store in zip(owners, (a, b, idle)):
                _export_storage(owner, store)
            scrape = Scrape(exposition_text())
            labels = {o.label for o in owners}
            pages = sum(s.value for s in scrape.select("hicache_backend_evicted_pages_total") if s.labels["cache"] in labels)
            nbytes = sum(s.value for s in scrape.select("hicache_backend_evicted_bytes_total") if s.labels["cache"] in labels)
            assert (pages, nbytes) == (3, 3000)
            text = "".join(f'hicache_backend_evicted_pages_total{{cache="{s.labels["cache"]}",backend="memory"}} {s.value}\n'
                           for s in scrape.select("hicache_backend_evicted_pages_total") if s.labels["cache"] in labels)
            assert "evicted 3 " in render_scrape(Scrape(text), "x")
    finally:
        for owner in owners:
            owner.close()
        MemoryMedium.drop_shared(sid)


async def test_private_memory_stores_each_count_in_the_dashboards_per_store_figure() -> None:
    """The dashboard's storage panel counts a store once per server, ``sum(max by (instance,
    store) (hicache_backend_stored_bytes))``, and the README says ``store`` names the medium.
    Private memory stores (no ``store_id``) all carried ``store=""``: the max took one of them,
    so two caches with a private medium each showed as one (TP ranks on one server, half the
    pages). Each private medium now has a ``store`` of its own."""
    import torch

    stores = [create_async_storage("memory", None, namespace={"model": m}) for m in ("a", "b")]
    owners = [InstanceMetrics() for _ in stores]
    try:
        async with stores[0], stores[1]:
            for i, store in enumerate(stores):
                assert await store.batch_set([f"p{i}"], [torch.zeros(1000, dtype=torch.uint8)])
            for owner, store in zip(owners, stores):
                _export_storage(owner, store)
            scrape = Scrape(exposition_text())
            mine = [s for s in scrape.select("hicache_backend_stored_bytes") if s.labels["cache"] in {o.label for o in owners}]
            assert sorted(s.value for s in mine) == [1000.0, 1000.0]
            per_store: dict[str, float] = {}
            for s in mine:  # max by (store), as the dashboard's query takes it
                per_store[s.labels["store"]] = max(per_store.get(s.labels["store"], 0.0), s.value)
            assert sum(per_store.values()) == 2000.0, per_store
    finally:
        for owner in owners:
            owner.close()
