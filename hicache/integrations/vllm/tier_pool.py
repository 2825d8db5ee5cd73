"""The primary tier's chunks as a hicache host pool, so storage moves them without a copy.

vLLM hands a secondary tier one ``memoryview`` of shape ``(num_chunks, chunk_stride)`` over its
CPU primary tier (a shared mmap); each row is one contiguous chunk. :class:`ChunkPool` follows
hicache's page protocol with one chunk per page (``page_size == 1``, host index == chunk id)
and offers ``page_view``: a live view of the row. Storage backends then read a verified page
straight into the row and write straight from it (``preadv``/``pwritev`` for files, one PUT
body for objects) - no staging page, no second copy.

The pool holds an export of vLLM's memoryview; vLLM releases that view when the primary tier
shuts down, which fails while exports live. :meth:`ChunkPool.close` drops ours, and the tier
calls it before vLLM's primary tier shuts down.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from hicache.errors import StorageStateError

__all__ = ["ChunkPool"]


class ChunkPool:
    """Page protocol over vLLM's primary-tier memoryview: page ``i`` is chunk ``i``."""

    page_size = 1

    def __init__(self, primary_kv_view: memoryview) -> None:
        if not isinstance(primary_kv_view, memoryview) or primary_kv_view.ndim != 2:
            raise TypeError("the primary tier view must be a 2-D memoryview (num_chunks, chunk_stride)")
        if primary_kv_view.readonly:
            raise TypeError("the primary tier view is read-only; loads need to write into it")
        if not primary_kv_view.c_contiguous:
            raise TypeError("the primary tier view must be C-contiguous (one row per chunk)")
        self.num_chunks, self.page_nbytes = cast("tuple[int, int]", primary_kv_view.shape)  # ndim == 2
        rows = np.frombuffer(primary_kv_view, dtype=np.uint8)  # shares memory, checks nothing else
        self._rows: torch.Tensor | None = torch.from_numpy(rows).view(self.num_chunks, self.page_nbytes)

    def close(self) -> None:
        """Drop the export of vLLM's memoryview (idempotent); the pool is unusable after."""
        self._rows = None

    def _row(self, index: int) -> torch.Tensor:
        if self._rows is None:
            raise StorageStateError("the chunk pool is closed")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index!r} outside the primary tier of {self.num_chunks} chunks")
        return self._rows[index]

    # -- page protocol (see docs/architecture.md)
    def page_view(self, index: int) -> torch.Tensor:
        """The live bytes of chunk ``index``: writes land in vLLM's primary tier."""
        return self._row(index)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._row(index)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_nbytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._row(index).copy_(data_page.reshape(-1).view(torch.uint8))
