"""Paged token-slot allocation, shared by the device pools, the host pools and the state pool.

Why one allocator for every tier: the safety rules are the same everywhere (whole pages only, a
double free or an index the allocator never handed out is a bug that must fail loudly, not
corrupt a free list), and a bug in one copy of that logic would silently scramble KV.

Slot numbering: token slots are ``0 .. size-1`` and, by default, all of them are allocatable.
SGLang keeps slot 0 as a padding slot that attention kernels may write garbage into; pass
``reserve_first_page=True`` to keep page 0 (slots ``0 .. page_size-1``) out of circulation the
same way. The pools themselves never reserve anything.

Not thread-safe: an allocator belongs to the one thread (the controller's event loop or the
scheduler) that owns its pool.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.errors import HiCacheError
from hicache.memory.device import IndexLike, as_index_array, is_one_run

__all__ = ["AllocatorError", "PagedTokenAllocator", "pages_of"]


class AllocatorError(HiCacheError, ValueError):
    """An allocator or pool was handed indices it cannot accept (double free, foreign index,
    partial page). Always a caller bug; the allocator's state is unchanged when it is raised."""


def pages_of(
    indices: IndexLike, page_size: int, size: int, *, what: str = "indices"
) -> np.ndarray:
    """Page numbers of token ``indices`` that must cover whole, aligned pages.

    Token ``t`` lives in page ``t // page_size``; a page is covered when its ``page_size`` slots
    appear consecutively in ascending order starting at a multiple of ``page_size``. Anything
    else (a partial page, a misaligned run, an out-of-range slot) raises :class:`AllocatorError`
    naming the first offending index.
    """
    arr = as_index_array(indices, what=what)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= size:
        bad = (arr < 0) | (arr >= size)
        first = int(arr[np.argmax(bad)])
        raise AllocatorError(f"{what}: token index {first} is out of range [0, {size})")
    if arr.size % page_size:
        raise AllocatorError(
            f"{what}: {arr.size} indices do not cover whole pages of {page_size} tokens"
        )
    if page_size == 1:
        return arr.copy()
    first = int(arr[0])
    if first % page_size == 0 and is_one_run(arr):
        # One run of consecutive slots (what a sorted free list hands out, and what a backup of
        # one node copies): strictly increasing and spanning exactly its length, so every page
        # is whole. Checked with one byte a token of scratch instead of the 9 bytes a token the
        # page-by-page check below builds (~4x faster on a 12k-token run).
        return np.arange(first // page_size, first // page_size + arr.size // page_size, dtype=np.int64)
    rows = arr.reshape(-1, page_size)
    starts = rows[:, 0]
    if (starts % page_size).any() or not np.array_equal(rows, starts[:, None] + np.arange(page_size)):
        misaligned = (starts % page_size != 0) | (rows != starts[:, None] + np.arange(page_size)).any(axis=1)
        r = int(np.argmax(misaligned))
        raise AllocatorError(
            f"{what}: indices {rows[r].tolist()[:4]}... at position {r * page_size} are not one "
            f"whole page (page_size={page_size} consecutive slots starting at a multiple of it)"
        )
    return starts // page_size


class PagedTokenAllocator:
    """Hands out token slots of a pool in whole pages.

    ``alloc`` prefers low page numbers (the free list is kept sorted, lazily, like SGLang's
    ``merge_and_sort_free``) so that pages allocated together tend to be consecutive: the copy
    engine then moves them in a few large copies instead of one per page.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: str | torch.device = "cpu",
        *,
        reserve_first_page: bool = False,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if size <= 0 or size % page_size:
            raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")
        if reserve_first_page and size == page_size:
            raise ValueError("reserve_first_page needs at least two pages")
        self.size: int = size
        self.page_size: int = page_size
        self.device: torch.device = torch.device(device)
        self.num_pages: int = size // page_size
        self.reserve_first_page: bool = reserve_first_page
        self._first: int = 1 if reserve_first_page else 0
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._is_free = np.zeros(self.num_pages, dtype=bool)
        self._free = np.zeros(0, dtype=np.int64)
        self._released: list[np.ndarray] = []
        self._num_free = 0
        #: every slot index in order (made on first use): see :meth:`alloc_shared`
        self._slots: torch.Tensor | None = None
        self.clear()

    def clear(self) -> None:
        """Return every page to the free list (forgets all outstanding allocations)."""
        self._is_free[:] = False
        self._is_free[self._first :] = True
        self._free = np.arange(self._first, self.num_pages, dtype=np.int64)
        self._released = []
        self._num_free = self.num_pages - self._first

    @property
    def capacity(self) -> int:
        """Allocatable tokens when nothing is allocated (``size`` minus a reserved page)."""
        return (self.num_pages - self._first) * self.page_size

    def available_size(self) -> int:
        """Free tokens (always a multiple of ``page_size``)."""
        return self._num_free * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slots (int64, on ``device``) in whole pages, or ``None`` if too few are
        free. ``num_tokens`` must be a multiple of ``page_size``."""
        pages = self.alloc_pages_array(self._pages_for(num_tokens))
        return None if pages is None else self._slots_of(pages)

    def _slots_of(self, pages: np.ndarray) -> torch.Tensor:
        """The token slots of ``pages``, as a new tensor on ``device``."""
        tokens = (pages[:, None] * self.page_size + self._offsets).reshape(-1)
        return torch.from_numpy(tokens).to(self.device)

    def alloc_shared(self, num_tokens: int) -> torch.Tensor | None:
        """:meth:`alloc` for a caller that only ever *reads* the slot tensor it gets: a run of
        consecutive pages (the usual case, as the free list is kept sorted) comes back as a
        view of one index tensor shared by all such calls, other runs as :meth:`alloc` makes
        them. Free the slots as usual.

        Why: a fresh index tensor is 8 bytes of new memory a token, and on a machine where
        first touching a page of memory is slow (a sandbox: ~16 us a 4 KiB page) building it
        cost more than the rest of a backup's bookkeeping (the tiered radix benchmark: 100 us
        a node of ~11k tokens, against ~1 us for a view)."""
        pages = self.alloc_pages_array(self._pages_for(num_tokens))
        if pages is None:
            return None
        n = int(pages.size)
        ps = self.page_size
        # the free list is sorted and holds each page once, so first and last tell a run
        if n and int(pages[-1]) - int(pages[0]) == n - 1:
            start = int(pages[0]) * ps
            return self.share_slots()[start : start + n * ps]
        return self._slots_of(pages)

    def share_slots(self) -> torch.Tensor:
        """The index tensor :meth:`alloc_shared` hands out views of (every slot, in order),
        made now if it was not: a cache calls this at start-up so that the first request does
        not pay for it. Costs 8 bytes a slot, against the hundreds of bytes of KV a slot holds."""
        if self._slots is None:
            self._slots = torch.arange(self.size, dtype=torch.int64, device=self.device)
        return self._slots

    def alloc_pages_array(self, num_pages: int) -> np.ndarray | None:
        """``num_pages`` page numbers as a numpy array, or ``None`` (no tensor made)."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self._num_free:
            return None
        if num_pages > self._free.size:
            self._merge_released()
        pages = self._free[:num_pages]
        self._free = self._free[num_pages:]
        self._is_free[pages] = False
        self._num_free -= num_pages
        return pages

    def free(self, indices: IndexLike) -> None:
        """Return whole pages. Raises :class:`AllocatorError` (state unchanged) for a partial
        page, an out-of-range slot, a page freed twice, or a page that is not allocated."""
        pages = pages_of(indices, self.page_size, self.size, what="free()")
        if pages.size == 0:
            return
        self._check_allocated(pages)
        self._is_free[pages] = True
        self._released.append(pages.copy())
        self._num_free += int(pages.size)

    def is_allocated(self, indices: IndexLike) -> bool:
        """Whether every page covered by ``indices`` is currently handed out (for assertions)."""
        pages = pages_of(indices, self.page_size, self.size)
        if self.reserve_first_page and bool((pages == 0).any()):
            return False
        return not bool(self._is_free[pages].any())

    # -- internals
    def _pages_for(self, num_tokens: int) -> int:
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens must be a non-negative multiple of page_size={self.page_size}, "
                f"got {num_tokens}"
            )
        return num_tokens // self.page_size

    def _check_allocated(self, pages: np.ndarray) -> None:
        if self.reserve_first_page and (pages == 0).any():
            raise AllocatorError(
                "free(): page 0 (tokens 0..page_size-1) is the reserved padding page and was "
                "never handed out"
            )
        uniq, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            dup = int(uniq[np.argmax(counts > 1)])
            raise AllocatorError(
                f"free(): page {dup} (token {dup * self.page_size}) appears twice in one call"
            )
        already = self._is_free[pages]
        if already.any():
            p = int(pages[np.argmax(already)])
            raise AllocatorError(
                f"free(): page {p} (token {p * self.page_size}) is not allocated: a double free, "
                f"or an index this allocator never handed out"
            )

    def _merge_released(self) -> None:
        if self._released:
            self._free = np.sort(np.concatenate([self._free, *self._released]))
            self._released = []

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, device={self.device})"
        )


class AllocatorBacked:
    """Mixin for pools whose slots come from a :class:`PagedTokenAllocator` in ``self.allocator``:
    the pool's ``alloc``/``free``/``available_size``/``clear`` are the allocator's."""

    allocator: PagedTokenAllocator

    def alloc(self, num: int = 1) -> torch.Tensor | None:
        """``num`` free slots (tokens, or state slots), or ``None``."""
        return self.allocator.alloc(num)

    def alloc_shared(self, num: int) -> torch.Tensor | None:
        """``num`` free slots the caller only reads (see :meth:`PagedTokenAllocator.alloc_shared`)."""
        return self.allocator.alloc_shared(num)

    def share_slots(self) -> torch.Tensor:
        """See :meth:`PagedTokenAllocator.share_slots`."""
        return self.allocator.share_slots()

    def free(self, indices: IndexLike) -> None:
        """Return slots; double free or foreign slots raise :class:`AllocatorError`."""
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        """Free every slot (contents are left as they are)."""
        self.allocator.clear()
