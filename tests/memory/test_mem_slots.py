"""Slot index copies and joins (``hicache.memory.slots``): the tree's and the controller's."""

from __future__ import annotations

import torch

from hicache.memory.slots import cat_slots, copy_slots, read_slots


def _never() -> torch.Tensor:
    raise AssertionError("made an empty tensor while there were parts")


def test_copy_slots_copies_the_range_privately() -> None:
    row = torch.arange(100)
    part = copy_slots(row, 10, 20)
    assert part.tolist() == list(range(10, 20))
    part[0] = -1
    row[11] = -2
    assert row[10] == 10 and part[1] == 11  # neither sees the other's writes
    assert copy_slots(row).tolist() == row.tolist()


def test_cat_slots_joins_flattened_parts_into_a_new_tensor() -> None:
    a, b = torch.arange(4), torch.arange(10, 16).view(2, 3)
    joined = cat_slots([a, b], _never)
    assert joined.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15]
    joined[0] = 99
    assert a[0] == 0
    only = cat_slots([a], _never)
    assert only.tolist() == a.tolist() and only.data_ptr() != a.data_ptr()
    assert cat_slots([b], _never).tolist() == list(range(10, 16))  # flattened, even alone


def test_cat_slots_casts_to_the_dtype_asked() -> None:
    narrow = [torch.arange(3, dtype=torch.int32), torch.arange(3, 5, dtype=torch.int32)]
    wide = cat_slots(narrow, _never, torch.int64)
    assert wide.dtype == torch.int64 and wide.tolist() == [0, 1, 2, 3, 4]
    assert cat_slots(narrow[:1], _never, torch.int64).dtype == torch.int64


def test_cat_slots_of_nothing_is_the_empty_factorys() -> None:
    empty = torch.empty((0,), dtype=torch.int64)
    assert cat_slots([], lambda: empty) is empty


def test_tensors_off_the_cpu_go_through_torch() -> None:
    parts = [torch.empty(3, dtype=torch.int32, device="meta"), torch.empty((2, 2), dtype=torch.int32, device="meta")]
    joined = cat_slots(parts, _never, torch.int64)
    assert joined.device.type == "meta" and joined.shape == (7,) and joined.dtype == torch.int64


def test_read_slots_shares_a_lone_part_and_joins_the_rest() -> None:
    a = torch.arange(5)
    assert read_slots([a]) is a  # nothing copied: the caller only reads it
    assert read_slots([a], torch.int64) is a
    narrow = torch.arange(3, dtype=torch.int32)
    wide = read_slots([narrow], torch.int64)
    assert wide.dtype == torch.int64 and wide.tolist() == [0, 1, 2]
    grid = torch.arange(6).view(2, 3)
    assert read_slots([grid]).tolist() == list(range(6))  # flattened
    assert read_slots([a, grid]).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert read_slots([]).numel() == 0
