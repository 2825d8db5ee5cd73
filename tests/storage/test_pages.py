"""Checking a batch's host indices: :func:`checked_starts` (numpy, one conversion) against a
plain-Python reference of the same rules."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.storage.pages import checked_starts


def _reference(host_indices: torch.Tensor | None, num_keys: int, page_size: int) -> tuple[list[int] | None, list[int]]:
    """An integer tensor of ``num_keys * page_size`` indices, each page one run of consecutive
    indices from a non-negative start; page by page, in Python."""
    t = host_indices
    if (not isinstance(t, torch.Tensor) or t.numel() != num_keys * page_size
            or t.is_floating_point() or t.is_complex() or t.dtype is torch.bool):
        return None, []
    flat = [int(x) for x in t.reshape(-1).tolist()]
    pages = [flat[k * page_size : (k + 1) * page_size] for k in range(num_keys)]
    bad = [k for k, p in enumerate(pages) if p[0] < 0 or p != list(range(p[0], p[0] + page_size))]
    return [p[0] for p in pages], bad


def _random_indices(rng: random.Random, num_keys: int, page_size: int) -> torch.Tensor:
    """Pages of one run, scattered pages, and pages broken in one token or a negative start."""
    pages = rng.sample(range(64), num_keys) if rng.random() < 0.5 else range(rng.randint(0, 8), rng.randint(0, 8) + num_keys)
    idx = [p * page_size + j for p in pages for j in range(page_size)]
    for _ in range(rng.choice([0, 0, 1, 3])):
        if idx:
            idx[rng.randrange(len(idx))] = rng.choice([-1, -page_size, rng.randrange(64 * page_size)])
    dtype = rng.choice([torch.int64, torch.int64, torch.int32, torch.int16])
    return torch.tensor(idx, dtype=dtype)


@pytest.mark.parametrize("seed", range(300))
def test_checked_starts_matches_the_two_checks(seed: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    num_keys = rng.randint(0, 6)
    idx = _random_indices(rng, num_keys, page_size)
    if rng.random() < 0.2:  # strided: the same indices, not contiguous in memory
        idx = torch.stack([idx, torch.zeros_like(idx)], dim=1)[:, 0]
    keys = num_keys + rng.choice([0, 0, 0, 1, -1]) if num_keys else num_keys
    assert checked_starts(idx, max(keys, 0), page_size) == _reference(idx, max(keys, 0), page_size)


@pytest.mark.parametrize(
    "indices",
    [None, [0, 1, 2, 3], torch.arange(4).float(), torch.arange(4).bool(), torch.arange(4).to(torch.complex64),
     torch.arange(3)],
)
def test_checked_starts_rejects_a_batch_malformed_as_a_whole(indices: object) -> None:
    assert checked_starts(indices, 1, 4) == _reference(indices, 1, 4) == (None, [])  # type: ignore[arg-type]


def test_checked_starts_of_an_empty_batch() -> None:
    assert checked_starts(torch.zeros(0, dtype=torch.int64), 0, 4) == ([], [])
