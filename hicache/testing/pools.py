"""A minimal host pool that follows the page protocol, for storage tests.

``ArrayHostPool(direct=True)`` offers ``page_view`` (storage reads into and writes from pool
memory); ``direct=False`` behaves like a pool whose pages must be staged, as SGLang's
``layer_first`` pools are, and returns copies from ``get_data_page``.
"""

from __future__ import annotations

import torch

__all__ = ["ArrayHostPool"]


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
