"""Allocators: misuse fails loudly with the state unchanged; accounting is exact under churn."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.memory import AllocatorError, MambaStatePool, PagedTokenAllocator, ReqToTokenPool
from hicache.memory.allocator import pages_of


def pages(*ps: int, page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + j for p in ps for j in range(page_size)], dtype=torch.int64)


def test_alloc_returns_whole_pages_low_first():
    a = PagedTokenAllocator(32, 4, "cpu")
    assert a.available_size() == 32 and a.size == 32 and a.page_size == 4
    idx = a.alloc(8)
    assert idx.dtype == torch.int64 and idx.tolist() == list(range(8))
    assert a.available_size() == 24
    assert a.alloc(0).numel() == 0
    assert a.alloc(28) is None  # not enough: None, not an exception
    assert a.available_size() == 24


def test_error_type_is_value_error_and_hicache_error():
    assert issubclass(AllocatorError, ValueError) and issubclass(AllocatorError, HiCacheError)


@pytest.mark.parametrize("bad", [3, 5, -4])
def test_alloc_needs_multiple_of_page(bad):
    a = PagedTokenAllocator(32, 4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(bad)


def test_constructor_validation():
    with pytest.raises(ValueError):
        PagedTokenAllocator(30, 4)
    with pytest.raises(ValueError):
        PagedTokenAllocator(32, 0)


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        (lambda t: t[:3], "whole pages"),
        (lambda t: t + 1, "not one whole page"),
        (lambda t: t.flip(0), "not one whole page"),
        (lambda t: torch.tensor([100, 101, 102, 103]), "out of range"),
        (lambda t: torch.tensor([-4, -3, -2, -1]), "out of range"),
        (lambda t: torch.cat([t[:4], t[:4]]), "twice"),
        (lambda t: pages(7, page_size=4), "not allocated"),
    ],
    ids=["partial", "misaligned", "reversed", "too-high", "negative", "dup-in-call", "foreign"],
)
def test_free_misuse_raises_and_leaves_state(make_bad, message):
    a = PagedTokenAllocator(32, 4)
    got = a.alloc(8)
    before = a.available_size()
    with pytest.raises(AllocatorError, match=message):
        a.free(make_bad(got))
    assert a.available_size() == before
    a.free(got)  # the real allocation is still intact and frees cleanly
    assert a.available_size() == 32


def test_double_free():
    a = PagedTokenAllocator(16, 2)
    got = a.alloc(4)
    a.free(got[:2])
    with pytest.raises(AllocatorError, match="double free"):
        a.free(got[:2])
    with pytest.raises(AllocatorError):
        a.free(got)  # half of it is already free: nothing is freed
    assert a.available_size() == 14
    a.free(got[2:])
    assert a.available_size() == 16


def test_float_indices_rejected():
    a = PagedTokenAllocator(16, 2)
    a.alloc(2)
    with pytest.raises(TypeError):
        a.free(torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_bool_is_no_slot(page_size):
    """``True`` is an int in Python: ``free(True)`` freed slot 1 (another request's, page size
    1: the Mamba state pool's) where ``free([True])`` and a bool tensor are refused."""
    a = PagedTokenAllocator(16, page_size)
    a.alloc(16)
    for bad in (True, False):
        with pytest.raises(TypeError, match="bool"):
            a.free(bad)
        with pytest.raises(TypeError, match="bool"):
            pages_of(bad, page_size, 16)
    assert a.available_size() == 0 and a.is_allocated(torch.arange(16))


def test_reserved_padding_page():
    a = PagedTokenAllocator(16, 4, reserve_first_page=True)
    assert a.available_size() == 12 and a.capacity == 12
    got = a.alloc(12)
    assert 0 not in got.tolist()
    assert a.alloc(4) is None
    with pytest.raises(AllocatorError, match="reserved"):
        a.free(torch.arange(4))


def test_is_allocated():
    a = PagedTokenAllocator(16, 4, reserve_first_page=True)
    got = a.alloc(8)
    assert a.is_allocated(got) and not a.is_allocated(pages(3, page_size=4))
    assert not a.is_allocated(pages(0, page_size=4))
    a.free(got[:4])
    assert not a.is_allocated(got) and a.is_allocated(got[4:])


def test_clear_resets():
    a = PagedTokenAllocator(16, 4)
    a.alloc(8)
    a.clear()
    assert a.available_size() == 16
    assert a.alloc(16).tolist() == list(range(16))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_churn_accounting(seed, page_size):
    rng = random.Random(seed)
    num_pages = 64
    a = PagedTokenAllocator(num_pages * page_size, page_size)
    live: list[torch.Tensor] = []
    owned: set[int] = set()
    for _ in range(400):
        if live and rng.random() < 0.45:
            t = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5 and t.numel() > page_size:  # free part of an allocation
                k = rng.randrange(1, t.numel() // page_size) * page_size
                live.append(t[k:])
                t = t[:k]
            a.free(t)
            owned -= set(t.tolist())
        else:
            n = rng.randrange(0, 9) * page_size
            t = a.alloc(n)
            if n // page_size > num_pages - len(owned) // page_size:
                assert t is None
                continue
            assert t is not None and t.numel() == n
            toks = set(t.tolist())
            assert not toks & owned, "handed out a slot that is in use"
            arr = t.numpy().reshape(-1, page_size)
            assert (arr[:, 0] % page_size == 0).all()
            assert (arr == arr[:, :1] + np.arange(page_size)).all()
            owned |= toks
            if n:
                live.append(t)
        assert a.available_size() == num_pages * page_size - len(owned)
    for t in live:
        a.free(t)
    assert a.available_size() == num_pages * page_size


def test_req_to_token_pool():
    pool = ReqToTokenPool(4, 16, "cpu")
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int64
    assert pool.alloc(2) == [0, 1]
    assert pool.available_size() == 2
    assert pool.alloc(3) is None
    pool.write((0, slice(0, 3)), torch.tensor([7, 8, 9]))
    assert pool.req_to_token[0, :3].tolist() == [7, 8, 9]
    pool.free(np.int64(0))  # a numpy index (a scheduler's array element) frees like an int
    with pytest.raises(AllocatorError, match="double free"):
        pool.free(0)
    with pytest.raises(AllocatorError, match="out of range"):
        pool.free([9])
    with pytest.raises(AllocatorError):
        pool.free([1, 1])
    assert pool.available_size() == 3
    # the session cache returns slots by appending to free_slots directly
    pool.free_slots.append(1)
    assert pool.available_size() == 4
    with pytest.raises(AllocatorError):
        pool.free(1)
    pool.alloc(4)
    pool.clear()
    assert pool.free_slots == [0, 1, 2, 3]
    # a float is no slot: int() freed slot 1 for 1.7, silently
    pool.alloc(4)
    for bad in (torch.tensor([1.7]), [2.9], np.array([0.5]), True, [True]):
        with pytest.raises(TypeError):
            pool.free(bad)  # type: ignore[arg-type]
    assert pool.available_size() == 0
    pool.free(torch.tensor([3, 1]))
    assert pool.alloc(2) == [3, 1]  # freed slots go out in the order they were freed


def test_mamba_state_pool_alloc():
    pool = MambaStatePool(5, {"conv": (2, 3), "ssm": (4,)}, torch.float32, "cpu")
    assert pool.get_state("conv").shape == (5, 2, 3)
    got = pool.alloc(2)
    assert got.tolist() == [0, 1]
    assert pool.available_size() == 3
    assert pool.alloc(4) is None
    pool.free(got[:1])
    with pytest.raises(AllocatorError):
        pool.free(got[:1])
    with pytest.raises(AllocatorError):
        pool.free([7])
    pool.clear()
    assert pool.available_size() == 5


@pytest.mark.parametrize(
    "slots, message",
    [
        ([4, 5, 6, 7, 8, 9, 10, 11], None),  # one run: the fast path
        ([8, 9, 10, 11, 0, 1, 2, 3], None),  # two runs: the page-by-page path
        ([1, 2, 3, 4], "not one whole page"),  # one run, misaligned
        ([0, 1, 3, 2], "not one whole page"),  # spans its length, not increasing
        ([0, 2, 2, 3], "not one whole page"),  # spans its length, a repeat
        ([4, 5, 6, 7, 9, 10, 11, 12], "not one whole page"),  # second page misaligned
    ],
)
def test_pages_of_one_run_and_others(slots, message):
    idx = torch.tensor(slots, dtype=torch.int64)
    if message is None:
        assert pages_of(idx, 4, 64).tolist() == [s // 4 for s in slots[::4]]
    else:
        with pytest.raises(AllocatorError, match=message):
            pages_of(idx, 4, 64)
