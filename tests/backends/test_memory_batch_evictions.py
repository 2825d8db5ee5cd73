"""The memory backend's answer and events for a batch that evicts: a page stored earlier and
evicted by its own rewrite batch is reported REMOVED (every subscriber held it), and a page
whose old copy the batch evicted before putting it again is stored, not failed."""
import torch
from hicache.observability.tier_events import ChangeKind, Tier
from hicache.storage import create_async_storage


async def test_rewritten_page_evicted_by_its_own_batch_is_reported_removed() -> None:
    store = create_async_storage("memory", None, max_bytes=2_000)
    seen: list[tuple[str, tuple[str, ...]]] = []
    store.tier_changes.subscribe(lambda c: seen.append((c.kind.name, tuple(c.keys))),
                                 wants={(ChangeKind.REMOVED, Tier.STORAGE), (ChangeKind.STORED, Tier.STORAGE)})
    async with store:
        assert await store.batch_set(["a"], [torch.full((1000,), 1, dtype=torch.uint8)])
        await store.batch_set(["a", "b", "c"], [torch.full((1000,), i, dtype=torch.uint8) for i in range(3)])
        held = set()
        for kind, keys in seen:
            held = held | set(keys) if kind == "STORED" else held - set(keys)
        actually = {k for k in "abc" if (await store.exists_pages([k]))[0]}
        assert held == actually, f"subscriber holds {sorted(held)}, store holds {sorted(actually)}"


async def test_a_page_stored_by_the_batch_is_not_reported_failed() -> None:
    """The old copy of the batch's second page is evicted by its first page's put; the second
    put stores it again. It is in the store, yet the write answers False for it."""
    from hicache.storage.types import PageKey
    store = create_async_storage("memory", None, max_bytes=2_000)
    async with store:
        assert await store.batch_set(["b"], [torch.full((1000,), 1, dtype=torch.uint8)])
        assert await store.batch_set(["x"], [torch.full((1000,), 2, dtype=torch.uint8)])
        bufs = [memoryview(bytes([i]) * 1000) for i in range(2)]
        ok = store._store([PageKey("a", "kv"), PageKey("b", "kv")], bufs)
        held = await store.exists_pages(["a", "b"])
        assert ok == held
