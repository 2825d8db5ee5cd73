"""A minimal host pool that follows the page protocol, for storage tests.

``ArrayHostPool(direct=True)`` offers ``page_view`` (storage reads into and writes from pool
memory); ``direct=False`` behaves like a pool whose pages must be staged, as SGLang's
``layer_first`` pools are, and returns copies from ``get_data_page``. ``RelocatingPool``
hands out live views of pages that move on every commit, as SGLang's unified pool's do.
``UncheckedHostPool`` has no ``page_view`` and no bounds check, as SGLang's ``HostKVCache``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["ArrayHostPool", "RelocatingPool", "UncheckedHostPool"]


class ArrayHostPool:
    """``num_pages * page_size`` token rows of ``token_elems`` elements each."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        token_elems: int = 64,
        dtype: torch.dtype = torch.float16,
        *,
        direct: bool = True,
    ) -> None:
        self.page_size = page_size
        self.size = num_pages * page_size
        self.token_elems = token_elems
        self.dtype = dtype
        self.direct = direct
        self.buffer = torch.zeros(self.size, token_elems, dtype=dtype)

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.token_elems * self.buffer.element_size()

    def indices(self, first_page: int, num_pages: int) -> torch.Tensor:
        """Token indices of ``num_pages`` consecutive pages starting at page ``first_page``."""
        start = first_page * self.page_size
        return torch.arange(start, start + num_pages * self.page_size, dtype=torch.int64)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randn(self.buffer.shape, generator=g).to(self.dtype))

    def page_bytes(self, index: int) -> bytes:
        """The flat bytes of the page starting at token ``index`` (for assertions)."""
        page = self.buffer[index : index + self.page_size].reshape(-1)
        return page.view(torch.uint8).numpy().tobytes()

    # -- page protocol
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        self._check(index)
        page = self.buffer[index : index + self.page_size]
        page = page.reshape(-1) if flat else page
        return page if self.direct else page.clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_size * self.token_elems, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._check(index)
        self.buffer[index : index + self.page_size].copy_(
            data_page.reshape(self.page_size, self.token_elems)
        )

    def page_view(self, index: int) -> torch.Tensor | None:
        if not self.direct:
            return None
        self._check(index)
        return self.buffer[index : index + self.page_size].reshape(-1)

    def _check(self, index: int) -> None:
        if index < 0 or index + self.page_size > self.size or index % self.page_size:
            raise IndexError(f"page index {index} outside pool of {self.size} tokens")


class UncheckedHostPool(ArrayHostPool):
    """A pool with the seed page protocol alone, as SGLang's ``HostKVCache``: no ``page_view``
    (every page is copied) and no bounds check, so a page past the pool's end comes out of
    ``get_data_page`` short or empty (a slice), and ``set_from_flat_data_page`` there fails
    only because the reshape does."""

    def __init__(self, num_pages: int, page_size: int, token_elems: int = 64, dtype: torch.dtype = torch.float16) -> None:
        super().__init__(num_pages, page_size, token_elems, dtype, direct=False)

    page_view = None  # type: ignore[assignment] # SGLang's pools have none at all

    def _check(self, index: int) -> None:
        pass


class RelocatingPool:
    """A pool like SGLang's unified host pool: ``get_data_page`` hands out live views of a
    page's current physical slot, and the layout changes on every commit (the next logical
    page moves to the spare slot, contents and all). A view stays the page's memory only until
    the next commit: storage that commits pages mid-batch must never write into a view taken
    before it. (SGLang holds the unified pool's layout lease around every storage call, so
    outside that call's own commits the layout holds still.)"""

    def __init__(self, pages: int, page_size: int, token_elems: int, dtype: torch.dtype = torch.float16) -> None:
        self.page_size = page_size
        self.physical = torch.zeros(pages + 1, page_size * token_elems, dtype=dtype)
        self.where = list(range(pages))  # logical page -> physical slot; slot ``pages`` is spare
        self.spare = pages
        self.moves = 0
        self._lock = threading.Lock()  # commits come from several I/O threads

    def indices(self, first_page: int, num_pages: int) -> torch.Tensor:
        ps = self.page_size
        return torch.arange(first_page * ps, (first_page + num_pages) * ps, dtype=torch.int64)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.physical[self.where[index // self.page_size]]  # a live view, as the unified pool's

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.physical.shape[1], dtype=self.physical.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        with self._lock:
            self.physical[self.where[index // self.page_size]].copy_(data_page.reshape(-1))
            move = (index // self.page_size + 1) % len(self.where)  # compaction: another page moves
            self.physical[self.spare].copy_(self.physical[self.where[move]])
            self.where[move], self.spare = self.spare, self.where[move]
            self.moves += 1

    def logical_bytes(self, page: int) -> bytes:
        return self.physical[self.where[page]].view(torch.uint8).numpy().tobytes()
