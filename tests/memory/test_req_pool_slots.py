"""A slot that is ``True`` is a TypeError, not slot 1 freed in its place, in a list beside
integers too."""
import pytest
import torch
from hicache.memory.req_pool import ReqToTokenPool


def test_true_in_a_list_of_slots_is_refused() -> None:
    pool = ReqToTokenPool(size=8, max_context_len=4, device="cpu")
    got = pool.alloc(4)  # slots 0..3 in use
    assert got == [0, 1, 2, 3]
    with pytest.raises(TypeError):
        pool.free([2, True])  # True is no slot
    assert 1 not in pool.free_slots, "slot 1 (still in use) was freed in True's place"
