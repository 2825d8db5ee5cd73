"""The worker's host page pool (L2): whole pages in host memory, looked up by page key.

A page is ``num_layers`` blocks back to back (the storage page format of
:mod:`.naming`). The pool follows hicache's page protocol (``page_size`` tokens per page,
``page_view``), so storage backends read into and write from its memory directly, with no
staging copy.

Pages are kept in LRU order and evicted only when unpinned: a page being written to storage
or read by a load is pinned, so it is never recycled under an I/O. All state is behind one lock
(the model thread, the load thread and the storage loop all touch it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["HostPagePool"]


class HostPagePool:
    """``num_pages`` pages of ``page_nbytes`` bytes, addressed by slot."""

    def __init__(self, num_pages: int, page_nbytes: int, block_size: int) -> None:
        if num_pages < 1 or page_nbytes < 1 or block_size < 1:
            raise ValueError(f"bad host pool shape: {num_pages} pages of {page_nbytes} bytes, block {block_size}")
        self.page_size = block_size  # page protocol: tokens per page
        self.page_nbytes = page_nbytes
        self.num_pages = num_pages
        self.buffer = torch.empty((num_pages, page_nbytes), dtype=torch.uint8)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._resident: OrderedDict[str, int] = OrderedDict()  # key -> slot, LRU first
        self._key_of: dict[int, str] = {}
        self._pins: dict[int, int] = {}

    # -- page protocol (storage I/O); a page index is the page's first token index
    def page_view(self, index: int) -> torch.Tensor:
        return self.buffer[self._slot_of_index(index)]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buffer[self._slot_of_index(index)]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_nbytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buffer[self._slot_of_index(index)].copy_(data_page.reshape(-1).view(torch.uint8))

    def _slot_of_index(self, index: int) -> int:
        slot, rem = divmod(int(index), self.page_size)
        if rem or not 0 <= slot < self.num_pages:
            raise IndexError(f"page index {index} is not a page of this pool")
        return slot

    def token_indices(self, slots: list[int]) -> torch.Tensor:
        """Host indices of ``slots`` as storage takes them (each page's consecutive tokens)."""
        if not slots:
            return torch.empty(0, dtype=torch.int64)
        base = torch.tensor(slots, dtype=torch.int64).unsqueeze(1) * self.page_size
        return (base + torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)

    # -- residency
    def lookup_pin(self, key: str) -> int | None:
        """The slot holding ``key``'s page, pinned (and made most recent), or ``None``."""
        with self._lock:
            slot = self._resident.get(key)
            if slot is not None:
                self._resident.move_to_end(key)
                self._pins[slot] = self._pins.get(slot, 0) + 1
            return slot

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._resident

    def alloc_pin(self) -> int | None:
        """A pinned empty slot, evicting the least recently used unpinned page if needed;
        ``None`` when every page is pinned (the caller skips that page: never waits)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                slot = None
                for key, s in self._resident.items():
                    if not self._pins.get(s):
                        slot = s
                        break
                if slot is None:
                    return None
                del self._resident[self._key_of.pop(slot)]
            self._pins[slot] = 1
            return slot

    def publish(self, slot: int, key: str) -> None:
        """``slot`` (pinned by the caller) now holds ``key``'s complete page."""
        with self._lock:
            old = self._resident.get(key)
            if old is not None and old != slot:
                # another slot already holds this page: keep that one, recycle this one
                # once it is unpinned
                self._key_of.pop(slot, None)
                return
            self._resident[key] = slot
            self._resident.move_to_end(key)
            self._key_of[slot] = key

    def unpin(self, slot: int) -> None:
        """Drop one pin; an unpinned slot that holds no published page goes back to the free list."""
        with self._lock:
            n = self._pins.get(slot, 0) - 1
            if n > 0:
                self._pins[slot] = n
                return
            self._pins.pop(slot, None)
            if slot not in self._key_of:
                self._free.append(slot)

    def discard(self, slot: int) -> None:
        """Forget what ``slot`` holds (its read failed); it is recycled once unpinned."""
        with self._lock:
            key = self._key_of.pop(slot, None)
            if key is not None and self._resident.get(key) == slot:
                del self._resident[key]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pages": self.num_pages,
                "resident": len(self._resident),
                "pinned": len(self._pins),
                "free": len(self._free),
            }
