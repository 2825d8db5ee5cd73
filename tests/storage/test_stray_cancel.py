"""A backend that raises ``CancelledError`` when nobody cancelled the caller (a library under
it that leaks one) is failing like any other: misses, counted. A real cancellation of the
caller still unwinds."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hicache_backends.memory import MemoryStorage

from hicache.storage import PageKey
from hicache.testing.pools import ArrayHostPool

PS = 4


class StrayCancel(MemoryStorage):
    backend_name = "stray-cancel-memory"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.stray = True
        self.entered = asyncio.Event()

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        self.entered.set()
        if self.stray:
            raise asyncio.CancelledError()
        await asyncio.sleep(10)  # long enough for the caller to be cancelled
        return [False] * len(pages)


async def test_a_stray_cancelled_error_is_a_counted_miss_and_a_real_cancel_unwinds() -> None:
    store = StrayCancel(store_id=uuid.uuid4().hex)
    store.register_mem_pool_host(ArrayHostPool(num_pages=4, page_size=PS, token_elems=8))
    # before: the CancelledError reached the caller as if it had been cancelled, and no error
    # was counted (a prefetch or a write "cancelled" by nobody)
    assert await store.batch_exists_v2(["a", "b"]) is not None
    assert store.stats.get("backend_errors") == 1
    store.stray = False
    store.entered.clear()
    call = asyncio.ensure_future(store.batch_exists_v2(["a", "b"]))
    await store.entered.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert store.stats.get("backend_errors") == 1
    await store.aclose()
