"""Device-tier radix cache: the behaviours SGLang's own radix-cache tests check."""

from __future__ import annotations

import pytest
import torch

from hicache.errors import ConfigError
from hicache.memory import PagedTokenAllocator, ReqToTokenPool
from hicache.prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
    RadixCache,
    RadixKey,
    Req,
    Session,
)

PS = 4


def make(pages: int = 32, policy: str = "lru", ps: int = PS) -> RadixCache:
    alloc = PagedTokenAllocator(pages * ps, ps)
    pool = ReqToTokenPool(4, 512)
    return RadixCache(req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=ps, eviction_policy=policy)


def insert(cache: RadixCache, tokens: list[int], extra: str | None = None, priority: int = 0) -> torch.Tensor:
    """Insert like an engine would: allocate, insert, free the duplicates."""
    n = len(tokens) // cache.page_size * cache.page_size
    value = cache.token_to_kv_pool_allocator.alloc(n)
    res = cache.insert(InsertParams(key=RadixKey(tokens[:n], extra), value=value, priority=priority))
    if res.prefix_len:
        cache.token_to_kv_pool_allocator.free(value[: res.prefix_len])
    return value


def match(cache: RadixCache, tokens: list[int], extra: str | None = None) -> MatchResult:
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))


def test_match_rounds_to_pages() -> None:
    cache = make()
    value = insert(cache, list(range(10)))  # 2 full pages cached, 2 tokens dropped
    assert cache.total_size() == 8
    m = match(cache, list(range(10)))
    assert torch.equal(m.device_indices, value[:8])
    assert len(match(cache, list(range(7))).device_indices) == 4  # partial second page
    assert len(match(cache, [0, 1, 2, 9]).device_indices) == 0  # first page differs
    assert m.last_device_node is m.last_host_node
    cache.sanity_check()


def test_namespaces_never_share_nodes() -> None:
    cache = make()
    insert(cache, list(range(8)), extra="lora-a")
    assert len(match(cache, list(range(8))).device_indices) == 0
    assert len(match(cache, list(range(8)), extra="lora-b").device_indices) == 0
    assert len(match(cache, list(range(8)), extra="lora-a").device_indices) == 8
    insert(cache, list(range(8)), extra="lora-b")
    assert cache.total_size() == 16
    assert len(cache.root_node.children) == 2
    # the namespace comes from the request when the key has none
    req = Req(rid="r", origin_input_ids=list(range(8)), extra_key="lora-a")
    assert len(cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(8))), req=req)).device_indices) == 8


def test_split_keeps_sizes_and_indices() -> None:
    cache = make()
    a = insert(cache, list(range(12)))
    b_tokens = list(range(8)) + [100, 101, 102, 103]
    b = insert(cache, b_tokens)
    assert cache.total_size() == 16  # 12 + the new page
    assert torch.equal(match(cache, b_tokens).device_indices, torch.cat([a[:8], b[8:]]))
    assert torch.equal(match(cache, list(range(12))).device_indices, a)
    # a match that ends inside a node splits it too, and sizes stay put
    match(cache, list(range(4)))
    assert cache.total_size() == 16
    cache.sanity_check()


def test_lock_accounting_and_protection() -> None:
    cache = make()
    insert(cache, list(range(8)))
    insert(cache, list(range(8)) + [50, 51, 52, 53])
    node = match(cache, list(range(8)) + [50, 51, 52, 53]).last_device_node
    assert cache.evictable_size() == 12 and cache.protected_size() == 0
    res = cache.inc_lock_ref(node)
    assert res.delta == -12
    assert cache.evictable_size() == 0 and cache.protected_size() == 12
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 0
    assert cache.dec_lock_ref(node, res.to_dec_params()).delta == 12
    assert cache.protected_size() == 0
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node, DecLockRefParams())
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 12
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 32 * PS
    cache.sanity_check()


def _three_leaves(policy: str) -> tuple[RadixCache, dict[str, list[int]]]:
    cache = make(policy=policy)
    keys = {name: [base + i for i in range(4)] for name, base in (("a", 100), ("b", 200), ("c", 300))}
    insert(cache, keys["a"], priority=5)
    insert(cache, keys["b"], priority=1)
    insert(cache, keys["c"], priority=3)
    return cache, keys


def _evicted_first(cache: RadixCache, keys: dict[str, list[int]]) -> str:
    cache.evict(EvictParams(num_tokens=1))
    gone = [k for k, toks in keys.items() if len(match(cache, toks).device_indices) == 0]
    assert len(gone) == 1
    return gone[0]


def test_eviction_order_lru() -> None:
    cache, keys = _three_leaves("lru")
    match(cache, keys["a"])  # a is now the most recent; b the least
    assert _evicted_first(cache, keys) == "b"


def test_eviction_order_lfu() -> None:
    cache, keys = _three_leaves("lfu")
    for _ in range(3):
        match(cache, keys["b"])
    match(cache, keys["a"])
    assert _evicted_first(cache, keys) == "c"  # c has the fewest hits


def test_eviction_order_slru() -> None:
    cache, keys = _three_leaves("slru")
    match(cache, keys["a"])  # a enters the protected segment (2 hits)
    match(cache, keys["b"])
    match(cache, keys["b"])
    insert(cache, [400, 401, 402, 403])  # newest, but only on probation
    keys["d"] = [400, 401, 402, 403]
    assert _evicted_first(cache, keys) == "c"  # oldest probationary entry


def test_eviction_order_priority() -> None:
    cache, keys = _three_leaves("priority")
    match(cache, keys["b"])  # recency does not save a low priority
    assert _evicted_first(cache, keys) == "b"


def test_unknown_policy_is_config_error() -> None:
    with pytest.raises(ConfigError, match="allowed"):
        make(policy="fifo")


def test_parents_evicted_after_children() -> None:
    cache = make()
    insert(cache, list(range(8)))
    insert(cache, list(range(8)) + [9, 9, 9, 9])
    cache.evict(EvictParams(num_tokens=4))
    assert len(match(cache, list(range(8))).device_indices) == 8  # the shared prefix stays
    cache.evict(EvictParams(num_tokens=8))
    assert cache.total_size() == 0


def _req_with_kv(cache: RadixCache, rid: str, tokens: list[int], prefix: torch.Tensor) -> Req:
    """A request whose KV for ``tokens`` sits in its row: ``prefix`` from the tree, the rest new."""
    req = Req(rid=rid, origin_input_ids=tokens)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    p = prefix.numel()
    n = -(-(len(tokens) - p) // cache.page_size) * cache.page_size
    new = cache.token_to_kv_pool_allocator.alloc(n)
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[:p] = prefix
    row[p : p + n] = new
    req.prefix_indices = prefix
    req.cache_protected_len = p
    req.kv_committed_len = len(tokens)
    req.kv_allocated_len = p + n
    return req


def test_cache_finished_req_frees_duplicates_and_tail() -> None:
    cache = make()
    alloc = cache.token_to_kv_pool_allocator
    full = alloc.available_size()
    tokens = list(range(10))
    r1 = _req_with_kv(cache, "1", tokens, torch.empty(0, dtype=torch.int64))
    r2 = _req_with_kv(cache, "2", tokens, torch.empty(0, dtype=torch.int64))  # raced: same prompt
    cache.cache_finished_req(r1)
    cache.cache_finished_req(r2)
    assert cache.total_size() == 8
    assert alloc.available_size() == full - 8  # duplicates and partial pages went back
    cache.req_to_token_pool.free(r1.req_pool_idx)
    cache.req_to_token_pool.free(r2.req_pool_idx)
    cache.sanity_check()


def test_cache_unfinished_req_moves_lock_and_prefix() -> None:
    cache = make()
    tokens = list(range(14))
    req = _req_with_kv(cache, "c", tokens, torch.empty(0, dtype=torch.int64))
    req.fill_ids = tokens
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 12
    assert cache.protected_size() == 12
    assert req.prefix_indices.numel() == 14
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    assert torch.equal(req.prefix_indices, row[:14])
    # next chunk: two more pages; the lock moves to the deeper node
    more = cache.token_to_kv_pool_allocator.alloc(8)
    row[16:24] = more
    req.fill_ids = tokens + list(range(100, 106))
    req.kv_allocated_len = 24
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 20 and cache.protected_size() == 20
    req.kv_committed_len = 20
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 20
    cache.sanity_check()


def test_interface_shapes_used_by_the_session_cache() -> None:
    """The seed builds MatchResult by keyword and reads/writes these Req fields."""
    cache = make()
    assert isinstance(cache, BasePrefixCache)
    m = MatchResult(device_indices=torch.empty(0, dtype=torch.int64), last_device_node=None,
                    last_host_node=None, cache_protected_len=0)
    assert m.host_hit_length == 0 and m.best_match_node is None
    req = Req(rid="s", origin_input_ids=[1, 2], session=Session("sess", streaming=True))
    for name in (
        "req_pool_idx", "kv_committed_len", "kv_allocated_len", "swa_evicted_seqlen", "last_node",
        "cache_protected_len", "swa_uuid_for_lock", "mamba_pool_idx", "mamba_ping_pong_track_buffer",
        "mamba_next_track_idx", "mamba_last_track_seqlen", "mamba_branching_seqlen", "fill_ids",
        "prefix_indices", "last_host_node", "host_hit_length", "storage_hit_length", "priority",
        "extra_key", "output_ids", "origin_input_ids",
    ):
        assert hasattr(req, name), name
    assert req.session.session_id == "sess" and req.session.streaming
    for name in ("req_to_token_pool", "token_to_kv_pool_allocator", "page_size", "disable"):
        assert hasattr(cache, name)
    for name in ("evictable_size", "full_evictable_size", "swa_evictable_size", "protected_size",
                 "full_protected_size", "swa_protected_size", "total_size", "pretty_print",
                 "supports_swa", "supports_mamba", "is_chunk_cache", "is_tree_cache",
                 "available_and_evictable_str", "init_metrics_collector", "sanity_check",
                 "ready_to_load_host_cache", "flush_write_through_acks", "check_hicache_events",
                 "take_events", "reset"):
        getattr(cache, name)()


def test_disabled_cache_never_hits() -> None:
    cache = make()
    cache.disable = True
    req = _req_with_kv(cache, "d", list(range(8)), torch.empty(0, dtype=torch.int64))
    cache.cache_finished_req(req)
    assert cache.total_size() == 0
    assert len(match(cache, list(range(8))).device_indices) == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 32 * PS


def test_a_request_without_priority_counts_as_priority_zero() -> None:
    """SGLang's Req carries ``priority=None`` unless priority scheduling is on (SGLang reads it
    as 0); a match or insert with it raised TypeError partway through the path."""
    c = make(ps=2)
    c.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=c.token_to_kv_pool_allocator.alloc(4),
                          priority=None))  # type: ignore[arg-type]
    req = Req(rid="x", origin_input_ids=[1, 2, 3, 4])
    req.priority = None  # type: ignore[assignment]
    m = c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), req=req))
    assert m.device_hit_length == 4
    c.sanity_check()
