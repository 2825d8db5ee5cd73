"""The shared v2 hit policy against the obvious reference, on random existence patterns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.storage import PoolHitPolicy, PoolTransfer, resolve_v2_hits
from hicache.testing import ArrayHostPool, reference_v2_hits
from hicache_backends.memory import MemoryStorage


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 8),
    data=st.data(),
)
def test_matches_reference(n: int, data: st.DataObject) -> None:
    keys = [f"k{i}" for i in range(n)]
    kv = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pools = {name: data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for name in ("a", "b")}
    transfers = []
    for name in data.draw(st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True)):
        policy = data.draw(st.sampled_from(list(PoolHitPolicy)))
        trailing = data.draw(st.integers(1, 3))
        transfers.append(PoolTransfer(name, keys=keys[-trailing:] if keys else [], hit_policy=policy))
    present = {(k, "kv") for k, f in zip(keys, kv) if f}
    present |= {(k, name) for name, flags in pools.items() for k, f in zip(keys, flags) if f}
    got = resolve_v2_hits(kv, pools, transfers)
    want = reference_v2_hits(present, keys, transfers)
    assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (
        want.kv_hit_pages, want.extra_pool_hit_pages, want.restorable_prefix_pages)


def test_the_hit_is_a_length_every_pool_can_restore_not_the_least_boundary() -> None:
    """KV pages 0-5, a state pool (last page only) at pages 2 and 5, an indexer (every page)
    at 0-4: the state boundary is 6 and the indexer's 5, but the state for a 5-page prefix
    (page 4) does not exist; the longest length both restore is 3."""
    keys = [f"k{i}" for i in range(6)]
    kv = [True] * 6
    pools = {"mamba": [False, False, True, False, False, True], "indexer": [True] * 5 + [False]}
    transfers = [PoolTransfer("mamba", keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                 PoolTransfer("indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    got = resolve_v2_hits(kv, pools, transfers)
    assert got.kv_hit_pages == 3 and got.restorable_prefix_pages == [3]
    assert got.extra_pool_hit_pages == {"kv": 6, "mamba": 6, "indexer": 5}


async def test_an_unknown_hit_policy_is_refused_before_any_lookup_even_on_an_empty_store() -> None:
    """Before: a policy outside the enum raised only once the KV pages existed (the policy is
    looked at past the KV hit), after the lookups, as ``'x' is not a valid PoolHitPolicy``
    naming no pool: a caller tested against an empty store, then failed every lookup in
    production once pages were stored."""
    store = MemoryStorage(None)
    pool = ArrayHostPool(4, 4)
    store.register_mem_pool_host(pool)
    keys = ["k0", "k1"]
    bad = [PoolTransfer("kv", keys=keys), PoolTransfer("mamba", keys=keys[-1:], hit_policy="lru")]  # type: ignore[arg-type]
    try:
        for stored in (False, True):
            if stored:
                assert await store.batch_set_v1(keys, pool.indices(0, 2)) == [True, True]
            lookups = store.stats.get("exists_calls")
            with pytest.raises(ValueError, match=r"pool 'mamba'.*'lru'.*all_pages, trailing_pages"):
                await store.batch_exists_v2(keys, bad)
            assert store.stats.get("exists_calls") == lookups  # refused before asking the store
        good = PoolTransfer("mamba", keys=keys[-1:], hit_policy="trailing_pages")  # type: ignore[arg-type]
        assert (await store.batch_exists_v2(keys, [good])).kv_hit_pages == 0  # no state pages: no hit
    finally:
        await store.aclose()
