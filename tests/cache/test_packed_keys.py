"""Packed tree keys (``prefix_cache.tokens``) and page keys computed on first use.

The tree compares and stores token ids packed in C arrays and hashes a node's pages only when
someone asks for them. Neither may change what the tree answers: the same matches as a plain
reference, the same nodes for list and packed keys, the same storage keys as
``hicache.keys.page_hashes`` of the node's path.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from hicache.controller import ControllerConfig
from hicache.keys import page_hashes
from hicache.memory import PagedTokenAllocator, ReqToTokenPool
from hicache.prefix_cache import InsertParams, MatchPrefixParams, RadixCache, RadixKey
from hicache.prefix_cache.hashing import namespace_seed
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.tokens import pack_tokens, page_key
from hicache.replay import StackConfig, build_stack, serve_request

PS = 4


def make(pages: int = 4096) -> RadixCache:
    alloc = PagedTokenAllocator(pages * PS, PS)
    return RadixCache(req_to_token_pool=ReqToTokenPool(2, 64), token_to_kv_pool_allocator=alloc, page_size=PS)


def put(cache: RadixCache, key: RadixKey) -> None:
    n = len(key) // PS * PS
    value = cache.token_to_kv_pool_allocator.alloc(n)
    res = cache.insert(InsertParams(key=key, value=value))
    if res.prefix_len:
        cache.token_to_kv_pool_allocator.free(value[: res.prefix_len])


def matched(cache: RadixCache, key: RadixKey) -> int:
    return int(cache.match_prefix(MatchPrefixParams(key=key)).device_indices.numel())


def reference_match(stored: list[list[int]], tokens: list[int]) -> int:
    """Longest whole-page prefix of ``tokens`` that some stored prompt shares."""
    best = 0
    for s in stored:
        n = 0
        while n < min(len(s), len(tokens)) and s[n] == tokens[n]:
            n += 1
        best = max(best, n // PS * PS)
    return best


@pytest.mark.parametrize("packed", [False, True])
def test_matches_equal_a_reference_on_random_prompts(packed: bool) -> None:
    """Prompts that diverge at every offset (inside pages, at page ends, inside long nodes)."""
    rng = random.Random(5)
    cache = make()
    stored: list[list[int]] = []
    base = [rng.randrange(50) for _ in range(400)]
    for i in range(80):
        cut = rng.randrange(0, 400)
        tokens = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 60))]
        tokens = tokens[: len(tokens) // PS * PS]
        key = RadixKey(array("I", tokens) if packed else list(tokens))
        assert matched(cache, key) == reference_match(stored, tokens), i
        put(cache, key)
        stored.append(tokens)
        assert matched(cache, key) == len(tokens)
    cache.sanity_check()


def test_list_and_packed_keys_share_nodes() -> None:
    cache = make()
    tokens = list(range(100, 164))
    put(cache, RadixKey(tokens))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("I", tokens))))
    assert int(m.device_indices.numel()) == 64
    put(cache, RadixKey(array("q", tokens[:32] + [7] * 32)))  # int64-packed: splits the same node
    assert matched(cache, RadixKey(tokens[:32] + [7] * 32)) == 64
    assert len(cache.root_node.children) == 1
    cache.sanity_check()


def test_radix_key_keeps_packed_runs_and_compares_by_value() -> None:
    run = array("I", [1, 2, 3])
    assert RadixKey(run).token_ids is run
    assert RadixKey(run) == RadixKey([1, 2, 3])
    assert RadixKey(array("b", [1, 2, 3])).token_ids == [1, 2, 3]  # other typecodes: a list
    assert RadixKey(torch.tensor([1, 2])).token_ids == [1, 2]


def test_ids_outside_uint32_are_exact_in_the_device_tree() -> None:
    cache = make()
    wide = [-5, 2**40, 3, 2**63 - 1] * 4
    put(cache, RadixKey(wide))
    assert matched(cache, RadixKey(wide)) == 16
    assert matched(cache, RadixKey(wide[:12] + [0, 0, 0, 0])) == 12
    assert matched(cache, RadixKey([x % 2**32 for x in wide])) == 0  # no wrap-around aliasing
    cache.sanity_check()


def test_child_keys_are_the_same_whatever_the_packing() -> None:
    """Children are looked up by their first page's bytes: a list, an ``'I'`` run and a ``'q'``
    run of the same ids find the same child, and a page with a wide id never aliases the
    uint32 page its ids wrap to."""
    ids = [1, 2, 3, 2**32 - 1]
    assert page_key(ids) == page_key(array("I", ids)) == page_key(array("q", ids)) == array("I", ids).tobytes()
    assert page_key([-1, 2, 3, 4]) == page_key(array("q", [-1, 2, 3, 4])) == (-1, 2, 3, 4)
    assert page_key([2**32 - 1, 0, 0, 0]) != page_key([-1, 0, 0, 0])
    cache = make()
    shared = [10, 11, 12, 13]
    put(cache, RadixKey(shared + [20, 21, 22, 23]))  # packed as 'I'
    put(cache, RadixKey(shared + [-1, 2**40, 5, 6]))  # packed as 'q': its first page fits uint32
    assert len(cache.root_node.children) == 1  # both under one child for the shared page
    assert matched(cache, RadixKey(array("q", shared + [-1, 2**40, 5, 6]))) == 8
    assert matched(cache, RadixKey(shared + [20, 21, 22, 23])) == 8
    cache.sanity_check()


def test_a_match_with_a_non_integer_id_is_an_error_like_an_insert() -> None:
    cache = make()
    put(cache, RadixKey(list(range(8))))
    for bad in ([1.0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4.5, 5, 6, 7], ["0", 1, 2, 3]):
        with pytest.raises(ValueError, match="token ids"):
            cache.match_prefix(MatchPrefixParams(key=RadixKey(bad)))
    assert matched(cache, RadixKey(list(range(8)))) == 8


@pytest.mark.parametrize("bad", [[1.5] * 8, ["7"] * 8, [2**64] * 8])
def test_tokens_that_are_not_int64_are_a_clear_error(bad: list) -> None:
    cache = make()
    with pytest.raises(ValueError, match="token ids"):
        put(cache, RadixKey(bad))
    assert not cache.root_node.children
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens(bad)


def cfg() -> StackConfig:
    return StackConfig(page_size=PS, layer_num=1, head_num=1, head_dim=2, dtype="float32", device_pages=512,
                       host_pages=512, storage_backend="memory", storage_pages=1024, req_slots=4)


def path_keys(cache, node) -> list[str]:  # type: ignore[no-untyped-def]
    chain: list[str] = []
    while node is not cache.root_node:
        chain = node.hash_value + chain
        node = node.parent
    return chain


async def test_page_keys_are_computed_on_first_use_and_equal_the_chained_hashes() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    a = list(range(1000, 1064))
    await serve_request(stack, a, rid="a", extra_key="ns")
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey(a, "ns"))).last_host_node
    await cache.drain()  # storage writes asked for the keys
    assert leaf._hash_value is not None
    # a split of a node whose keys are not computed yet: both halves compute their own
    b = a[:24] + list(range(5000, 5040))
    key_b = RadixKey(b, "ns")
    fresh = cache.insert(InsertParams(key=key_b, value=stack.allocator.alloc(64))).last_device_node
    assert fresh._hash_value is None and fresh.parent._hash_value is not None  # the split half kept its slice
    assert path_keys(cache, fresh) == page_hashes(b, PS, namespace_seed("ns"))
    assert path_keys(cache, leaf) == page_hashes(a, PS, namespace_seed("ns"))
    cache.sanity_check()
    await cache.drain()
    await stack.aclose()


async def test_a_deep_chain_of_unhashed_nodes_hashes_without_recursion() -> None:
    stack = build_stack(cfg())
    cache = stack.cache
    node, tokens = cache.root_node, []
    for i in range(1100):  # deeper than the recursion limit, as a long chat's turns make it
        child = TreeNode(parent=node)
        child.key = pack_tokens([i] * PS)
        child.hasher, child._hash_value = cache._hash_pages, None
        node.children[cache._child_key(None, child.key, 0)] = child
        node, tokens = child, tokens + [i] * PS
    assert path_keys(cache, node) == page_hashes(tokens, PS)
    gone = TreeNode(parent=None)
    gone.key, gone.hasher, gone._hash_value = pack_tokens([1] * PS), cache._hash_pages, None
    assert gone.hash_value == []  # left the tree before anyone asked: no keys, not wrong ones
    await stack.aclose()


async def test_uint32_only_in_the_tree_with_storage() -> None:
    stack = build_stack(cfg())
    with pytest.raises(ValueError, match="uint32"):
        stack.cache.insert(InsertParams(key=RadixKey([-1] * 8), value=stack.allocator.alloc(8)))
    await stack.aclose()


async def test_an_int64_packed_key_is_stored_like_a_list_and_a_bad_one_changes_nothing() -> None:
    """SGLang holds tokens as ``array('q')``: such a key whose ids fit uint32 inserts into the
    hierarchical tree with the page keys of the same list (it was refused *after* its node was
    linked, which left a node without keys whose children got the keys of a prompt starting at
    the root: another prefix's KV served from storage). A key with an id that does not fit is
    refused before the tree changes."""
    from hicache.prefix_cache import fast_page_hashes

    stack = build_stack(StackConfig(page_size=4, device_pages=32, host_pages=32, storage_backend=None))
    cache = stack.cache
    try:
        a, b = list(range(100, 108)), list(range(900, 908))
        res = cache.insert(InsertParams(key=RadixKey(array("q", a)), value=stack.allocator.alloc(8)))
        assert res.total_len == 8
        cache.insert(InsertParams(key=RadixKey(array("q", a + b)), value=stack.allocator.alloc(16)))
        leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + b))).last_device_node
        assert leaf.hash_value == fast_page_hashes(a + b, 4, None)[2:]
        assert leaf.key.typecode == "I"
        cache.sanity_check()
        before = cache.total_size()
        for bad in ([1, 2, 3, -4], [1, 2, 3, 1 << 40]):
            with pytest.raises(ValueError, match="uint32"):
                cache.insert(InsertParams(key=RadixKey(array("q", bad)), value=stack.allocator.alloc(4)))
        assert cache.total_size() == before
        cache.sanity_check()
    finally:
        await stack.aclose()
