"""Hot-path shortcuts of the radix tree must not change what it answers or frees."""

from __future__ import annotations

import torch

from hicache.memory import PagedTokenAllocator
from hicache.prefix_cache import RadixKey
from hicache.prefix_cache.tokens import key_run


def test_shared_slots_are_views_for_runs_and_copies_otherwise() -> None:
    alloc = PagedTokenAllocator(16 * 4, 4)
    a = alloc.alloc_shared(8)
    assert a is not None and a.tolist() == list(range(8))
    assert a.untyped_storage().data_ptr() == alloc.share_slots().untyped_storage().data_ptr()
    b = alloc.alloc_shared(4)
    alloc.free(a[:4])  # pages 0 and 2 free: not a run
    alloc.free(b)
    alloc.alloc_shared(4 * 13)  # drain the run at the end
    c = alloc.alloc_shared(8)
    assert c is not None and sorted(c.tolist()) == list(range(4)) + list(range(8, 12))
    alloc.free(c)
    alloc.free(a[4:])
    assert alloc.alloc_shared(1000) is None


def test_a_match_without_a_hit_gets_its_own_empty_tensor() -> None:
    """A caller may reshape its result in place: no other request's result may change with it."""
    from hicache.prefix_cache import MatchPrefixParams, RadixCache

    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=PagedTokenAllocator(64, 4), page_size=4)
    first = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).device_indices
    again = cache.match_prefix(MatchPrefixParams(key=RadixKey([5, 6, 7, 8]))).device_indices
    assert first.numel() == again.numel() == 0 and first.dtype == torch.int64
    first.unsqueeze_(0)
    assert first.shape == (1, 0) and again.shape == (0,)
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).device_indices.shape == (0,)


def test_a_hit_on_one_node_shares_its_slots_and_a_reshape_leaves_the_tree_alone() -> None:
    """A prefix held by one node comes back without a copy (read-only, see ``MatchResult``);
    reshaping that result in place changes neither the node nor the next match, and a hit
    across nodes is still a joined copy."""
    from hicache.prefix_cache import InsertParams, MatchPrefixParams, RadixCache

    alloc = PagedTokenAllocator(64, 4)
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    slots = alloc.alloc(8)
    assert slots is not None
    cache.insert(InsertParams(key=RadixKey(list(range(8))), value=slots))
    hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(8))))).device_indices
    node = cache.root_node.children[next(iter(cache.root_node.children))]
    assert hit.tolist() == slots.tolist()
    assert hit.untyped_storage().data_ptr() == node.value.untyped_storage().data_ptr()
    hit.unsqueeze_(0)
    assert node.value.shape == (8,)
    again = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(8))))).device_indices
    assert again.shape == (8,) and again.tolist() == slots.tolist()
    more = alloc.alloc(8)
    assert more is not None
    cache.insert(InsertParams(key=RadixKey(list(range(4)) + [9] * 4), value=more))  # splits the node
    joined = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(8))))).device_indices
    assert joined.tolist() == slots.tolist()  # two nodes now: joined into a new tensor
    assert joined.untyped_storage().data_ptr() != node.value.untyped_storage().data_ptr()
    cache.sanity_check()


def test_list_key_packed_once_and_repacked_when_its_list_changes() -> None:
    toks = list(range(8))
    key = RadixKey(toks)
    run = key_run(key, 8)
    assert list(run) == toks and key_run(key, 8) is run
    toks.append(9)  # a changed length is never served the old run
    assert list(key_run(key, 9)) == toks
    packed = RadixKey(run)
    assert key_run(packed, 8) is run



async def test_match_leaves_the_storage_prior_hash_to_the_prefetch() -> None:
    """A match hashes nothing; the prior hash asked for later is the chain key of the path."""
    from hicache.controller import ControllerConfig
    from hicache.keys import page_hashes
    from hicache.prefix_cache import InsertParams, MatchPrefixParams
    from hicache.prefix_cache.hashing import namespace_seed
    from hicache.stack import StackConfig, build_stack

    ps = 4
    cfg = StackConfig(page_size=ps, layer_num=1, head_num=1, head_dim=1, dtype="float16",
                      device_pages=16, host_pages=16, storage_backend="memory", storage_pages=16,
                      controller=ControllerConfig(write_policy="write_back"), req_slots=2)
    stack = build_stack(cfg)
    cache = stack.cache
    toks = list(range(100, 124))
    try:
        for extra in (None, "tenant"):
            key = RadixKey(toks, extra)
            cache.insert(InsertParams(key=key, value=stack.allocator.alloc(len(toks))))
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks + [1, 2, 3, 4], extra)))
            node = m.last_host_node
            assert m.storage_prior_hash is None and node._hash_value is None  # nothing hashed
            want = page_hashes(toks, ps, namespace_seed(extra))[-1]
            assert cache.storage_prior_hash(node, extra) == want
            assert cache.storage_prior_hash(cache.root_node, extra) == namespace_seed(extra)
        assert cache.storage_prior_hash(object(), None) is None  # not a tree node
    finally:
        await stack.aclose()


def test_a_split_cuts_the_key_in_place_copying_only_the_smaller_part() -> None:
    """A split reuses the node's key array for its larger part (no second copy of a long key);
    an array something still reads through a buffer is copied instead, and either way both
    halves hold exactly their tokens."""
    from array import array

    from hicache.prefix_cache import RadixCache

    cut = RadixCache._cut_key
    key = array("I", range(12))
    head, tail = cut(key, 4)  # the tail is larger: it is the old array
    assert (head.tolist(), tail.tolist()) == (list(range(4)), list(range(4, 12))) and tail is key
    key = array("I", range(12))
    head, tail = cut(key, 8)  # the head is larger
    assert (head.tolist(), tail.tolist()) == (list(range(8)), list(range(8, 12))) and head is key
    key = array("I", range(12))
    view = memoryview(key)  # exported: cannot be resized
    head, tail = cut(key, 4)
    assert (head.tolist(), tail.tolist()) == (list(range(4)), list(range(4, 12)))
    assert head is not key and tail is not key and key.tolist() == list(range(12))
    view.release()


def test_splits_of_long_keys_answer_as_before() -> None:
    """Splits at both ends of long nodes, either half the larger: every match and the tree's
    shape stay what copying both halves gave."""
    from hicache.prefix_cache import InsertParams, MatchPrefixParams, RadixCache

    ps = 4
    alloc = PagedTokenAllocator(4096, ps)
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps)
    base = list(range(1000, 1400))
    prompts = [base, base[:8] + [1] * 8, base[:392] + [2] * 8, base[:200] + [3] * 4, base[:16] + [4] * 4]
    expected_hits = [0, 8, 392, 200, 16]
    for prompt, hit in zip(prompts, expected_hits):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
        assert m.device_indices.numel() == hit
        slots = alloc.alloc(len(prompt))
        assert slots is not None
        cache.insert(InsertParams(key=RadixKey(prompt), value=slots))
    for prompt in prompts:
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt))).device_indices.numel() == len(prompt)
    keys = sorted(n.key.tolist() for n in cache._nodes())
    assert sum(len(k) for k in keys) == 400 + 8 + 8 + 4 + 4
    assert base[8:16] in keys and base[392:400] in keys and base[:8] in keys
    cache.sanity_check()
