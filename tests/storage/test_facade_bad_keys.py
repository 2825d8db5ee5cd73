"""The blocking facade fails an unstorable key alone: a clean miss / False for that key, counted
in ``invalid_requests``, while every other key of the batch is served (the async interface still
raises ``InvalidKeyError`` for the whole batch: a caller bug it can name)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache.storage import HiCacheStorage, PoolTransfer
from hicache.storage.types import HiCacheStorageExtraInfo
from hicache.testing import ArrayHostPool
from hicache_backends.file import FileStorage
from hicache_backends.file.layout import page_id
from hicache_backends.memory import MemoryStorage

PAGE = 4
BAD: list[Any] = ["", "nul\x00key", "x" * 5000, 7, None, b"bytes"]


@pytest.fixture(params=["memory", "file"])
def facade(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[HiCacheStorage]:
    backend = MemoryStorage(None) if request.param == "memory" else FileStorage(None, root=str(tmp_path), min_free_bytes=0)
    store = HiCacheStorage(backend)
    try:
        yield store
    finally:
        store.close()


def pools(store: HiCacheStorage) -> tuple[ArrayHostPool, ArrayHostPool]:
    src = ArrayHostPool(8, PAGE)
    src.fill_random(3)
    dst = ArrayHostPool(8, PAGE)
    return src, dst


def invalid(store: HiCacheStorage) -> int:
    return store.get_stats().get("invalid_requests", 0)


@pytest.mark.parametrize("bad", BAD, ids=["empty", "nul", "too-long", "int", "none", "bytes"])
def test_v2_set_get_exists_fail_the_bad_key_only(facade: HiCacheStorage, bad: Any) -> None:
    src, dst = pools(facade)
    keys = ["a", "b", bad, "c"]
    facade.register_mem_host_pool_v2(src, "kv")
    assert facade.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 4), keys=keys)]) == {"kv": [True, True, False, True]}
    assert invalid(facade) == 1
    facade.register_mem_host_pool_v2(dst, "kv")
    got = facade.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 4), keys=keys)])
    assert got == {"kv": [True, True, False, True]}
    for page in (0, 1, 3):  # the good pages landed where their keys said, the bad page untouched
        assert dst.page_bytes(page * PAGE) == src.page_bytes(page * PAGE)
    assert dst.page_bytes(2 * PAGE) == bytes(dst.page_nbytes)
    # a prefix lookup stops at the bad key; the pages after it are still there
    assert facade.batch_exists_v2(keys).kv_hit_pages == 2
    assert facade.batch_exists(keys) == 2
    assert facade.batch_exists(["c"]) == 1
    assert facade.exists(bad) is False
    assert invalid(facade) == 5


def test_v2_set_after_a_bad_key_keeps_the_caller_prefix_for_the_first_run(facade: HiCacheStorage) -> None:
    src, dst = pools(facade)
    facade.register_mem_host_pool_v2(src, "kv")
    info = HiCacheStorageExtraInfo(prefix_keys=["parent"])
    res = facade.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 5), keys=["", "a", "", "", "b"])], info)
    assert res == {"kv": [False, True, False, False, True]}
    assert invalid(facade) == 3
    facade.register_mem_host_pool_v2(dst, "kv")
    assert facade.batch_get_v2([PoolTransfer("kv", host_indices=dst.indices(0, 2), keys=["a", "b"])]) == {"kv": [True, True]}
    assert dst.page_bytes(0) == src.page_bytes(1 * PAGE) and dst.page_bytes(PAGE) == src.page_bytes(4 * PAGE)


def test_v2_malformed_indices_with_a_bad_key_fail_the_transfer(facade: HiCacheStorage) -> None:
    src, _ = pools(facade)
    facade.register_mem_host_pool_v2(src, "kv")
    res = facade.batch_set_v2([PoolTransfer("kv", host_indices=torch.arange(7), keys=["a", ""])])
    assert res == {"kv": [False, False]}
    assert facade.batch_exists(["a"]) == 0


def test_v1_fails_the_bad_key_only(facade: HiCacheStorage) -> None:
    src, dst = pools(facade)
    facade.register_mem_pool_host(src)
    assert facade.batch_set_v1(["a", "nul\x00", "b"], src.indices(0, 3)) == [True, False, True]
    facade.register_mem_pool_host(dst)
    assert facade.batch_get_v1(["a", "nul\x00", "b"], dst.indices(0, 3)) == [True, False, True]
    assert dst.page_bytes(0) == src.page_bytes(0) and dst.page_bytes(2 * PAGE) == src.page_bytes(2 * PAGE)
    assert invalid(facade) == 2


def test_v0_fails_the_bad_key_only(facade: HiCacheStorage) -> None:
    values = [torch.full((16,), float(i)) for i in range(3)]
    assert facade.set("", values[0]) is False
    assert facade.batch_set(["a", "", "b"], values) is False  # not every key stored...
    assert facade.batch_exists(["a"]) == 1 and facade.batch_exists(["b"]) == 1  # ...but the good ones are
    got = facade.batch_get(["a", "", "b"], [torch.empty(16), torch.empty(16), torch.empty(16)])
    assert got[1] is None
    assert got[0] is not None and torch.equal(got[0], values[0])
    assert got[2] is not None and torch.equal(got[2], values[2])
    assert facade.get("\x00") is None
    assert invalid(facade) == 4


def test_reads_into_one_host_page_across_a_bad_key_fail_except_the_first(facade: HiCacheStorage) -> None:
    # before: the runs either side of the bad key were read one after the other, each checked
    # alone for pages sharing host memory, so "a" and "c" (same host page) both reported a hit
    # and the page held "c"'s KV under "a"'s name
    src, dst = pools(facade)
    facade.register_mem_pool_host(src)
    assert facade.batch_set_v1(["a", "b", "c"], src.indices(0, 3)) == [True, True, True]
    facade.register_mem_pool_host(dst)
    same = torch.cat([dst.indices(5, 1), dst.indices(6, 1), dst.indices(5, 1)])
    assert facade.batch_get_v1(["a", "", "c"], same) == [True, False, False]
    assert dst.page_bytes(5 * PAGE) == src.page_bytes(0)
    assert invalid(facade) == 2  # the bad key and the clashing page
    # a page clashing only with the bad key's target is read: the bad key reads nothing
    dst.buffer.zero_()
    assert facade.batch_get_v1(["", "b", "c"], same) == [False, True, True]
    assert dst.page_bytes(5 * PAGE) == src.page_bytes(2 * PAGE)


def _parent_of(store: HiCacheStorage, key: str) -> object:
    """The page the backend recorded ``key``'s page as continuing (its eviction tree)."""
    backend = store.backend
    if isinstance(backend, FileStorage):
        entry = backend.index.get(page_id(key, "kv"))
        assert entry is not None
        return entry.parent
    assert isinstance(backend, MemoryStorage)
    link = backend.medium.links[(backend.namespace.digest, key, "kv")]
    return None if link is None else link[1]


@pytest.mark.parametrize("bad", BAD, ids=["empty", "nul", "too-long", "int", "none", "bytes"])
def test_v2_set_with_a_bad_last_prefix_key_records_no_parent_not_an_earlier_key(facade: HiCacheStorage, bad: Any) -> None:
    """``prefix_keys + keys`` is one chain (SGLang's interface): the last prefix key is the
    parent of the first page. A bad one was filtered out and the key before it taken instead:
    the page was recorded as continuing a page two back, another chain's (the eviction tree
    kept that page for it and let its real parent go first). With no storable parent it has
    none, as a run after a bad key has in a batch."""
    src, _ = pools(facade)
    facade.register_mem_host_pool_v2(src, "kv")
    info = HiCacheStorageExtraInfo(prefix_keys=["p1", bad])
    assert facade.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 2), keys=["a", "b"])], info) == \
        {"kv": [True, True]}
    assert _parent_of(facade, "a") is None
    assert _parent_of(facade, "b") == (page_id("a", "kv") if isinstance(facade.backend, FileStorage) else "a")
