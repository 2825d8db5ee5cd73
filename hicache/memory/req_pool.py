"""The request-to-token table (SGLang's ``req_to_token_pool``).

Each running request owns one row (a *slot*); the row lists the KV pool slots of its tokens in
order. The session cache (seed ``000``) reads rows directly and returns a slot by appending to
``free_slots``, so ``free_slots`` is the one source of truth for which slots are free: this class
keeps no shadow state that such a direct append could desynchronise.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from typing import Any

import numpy as np
import torch

from hicache.memory.allocator import AllocatorError
from hicache.memory.device import as_index_array

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """``size`` request slots of ``max_context_len`` token indices each (int64)."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"size and max_context_len must be positive, got {size} and {max_context_len}"
            )
        self.size: int = size
        self.max_context_len: int = max_context_len
        self.device: torch.device = torch.device(device)
        self.req_to_token: torch.Tensor = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=self.device
        )
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        """Free request slots."""
        return len(self.free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        """``n`` free slots, or ``None`` when fewer than ``n`` are free. First the slots never
        used (lowest first), then the freed ones in the order they were freed, as SGLang's pool
        hands them out."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self.free_slots):
            return None
        taken = self.free_slots[:n]
        del self.free_slots[:n]
        return taken

    def free(self, idx_or_list: int | Iterable[int] | torch.Tensor) -> None:
        """Return slots. A slot out of range, already free, or listed twice raises
        :class:`AllocatorError` and nothing is freed."""
        # a float (1.7) or a bool is no slot: int() would free slot 1 in its place
        if isinstance(idx_or_list, torch.Tensor):
            items: Any = idx_or_list  # as_index_array refuses float and bool tensors
        else:
            items = [idx_or_list] if isinstance(idx_or_list, (int, Integral, np.bool_)) else list(idx_or_list)
            if any(isinstance(i, (bool, np.bool_)) for i in items):
                raise TypeError("ReqToTokenPool.free(): slots must be integers, got a bool")
        slots = as_index_array(items, what="ReqToTokenPool.free() slots").tolist()
        free_now = set(self.free_slots)
        seen: set[int] = set()
        for s in slots:
            if not 0 <= s < self.size:
                raise AllocatorError(f"ReqToTokenPool.free(): slot {s} is out of range [0, {self.size})")
            if s in free_now or s in seen:
                raise AllocatorError(
                    f"ReqToTokenPool.free(): slot {s} is already free (double free)"
                )
            seen.add(s)
        self.free_slots.extend(slots)

    def write(self, indices: int | slice | tuple | torch.Tensor, values: torch.Tensor) -> None:
        """``req_to_token[indices] = values`` (SGLang's helper, kept for drop-in use)."""
        self.req_to_token[indices] = values

    def clear(self) -> None:
        """Free every slot (row contents are left as they are; they are meaningless when free)."""
        self.free_slots = list(range(self.size))

    def __repr__(self) -> str:
        return (
            f"ReqToTokenPool(size={self.size}, max_context_len={self.max_context_len}, "
            f"available={self.available_size()}, device={self.device})"
        )
