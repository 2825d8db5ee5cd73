"""Storage backends that misbehave on purpose, for the controller's fault tests.

``FaultyStorage`` is the ``memory`` backend with switches: fail writes/reads/exists (return
misses, as a guarded backend does), raise from inside a primitive, hang (await an event that
never fires unless released) or delay each call. ``seed_memory_store`` fills a shared
``memory`` medium through a separate, well-behaved cache, for the tests that read it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hicache_backends.memory import MemoryStorage

from hicache.replay import StackConfig, build_stack, serve_request
from hicache.storage import PageKey


async def seed_memory_store(store_id: str, *prompts: list[int], page_size: int = 4) -> None:
    """Write every prompt's pages to the ``memory`` medium ``store_id`` (shared by every store
    that names it) through a cache of its own, drained and closed before returning."""
    cfg = StackConfig(page_size=page_size, device_pages=32, host_pages=64, storage_backend="memory",
                      storage_options={"store_id": store_id})
    writer = build_stack(cfg)
    for i, tokens in enumerate(prompts):
        await serve_request(writer, tokens, rid=f"seed-{i}")
    await writer.cache.drain()
    await writer.aclose()


class FaultyStorage(MemoryStorage):
    backend_name = "faulty-memory"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.fail_writes = 0  # number of write calls that store nothing
        self.raise_writes = 0  # number of write calls that raise
        self.fail_reads = False
        self.hang = asyncio.Event()  # cleared by hang_now(); set again by release()
        self.hang.set()
        self.delay = 0.0
        self.write_calls = 0
        self.read_calls = 0

    def hang_now(self) -> None:
        self.hang.clear()

    def release(self) -> None:
        self.hang.set()

    async def _pause(self) -> None:
        await self.hang.wait()
        if self.delay:
            await asyncio.sleep(self.delay)

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        await self._pause()
        return await super()._exists(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        self.read_calls += 1
        await self._pause()
        if self.fail_reads:
            return [False] * len(pages)
        return await super()._read(pages, buffers)

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        self.write_calls += 1
        await self._pause()
        if self.raise_writes:
            self.raise_writes -= 1
            raise OSError("injected write failure")
        if self.fail_writes:
            self.fail_writes -= 1
            return [False] * len(pages)
        return await super()._write(pages, buffers, parents)
