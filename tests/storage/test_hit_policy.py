"""The shared v2 hit policy against the obvious reference, on random existence patterns."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.storage import PoolHitPolicy, PoolTransfer, resolve_v2_hits
from hicache.testing import reference_v2_hits


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
    assert (got.kv_hit_pages, got.extra_pool_hit_pages) == (want.kv_hit_pages, want.extra_pool_hit_pages)
