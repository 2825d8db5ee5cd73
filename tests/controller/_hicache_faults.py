"""Storage backends that misbehave on purpose, for the controller's fault tests.

``FaultyStorage`` is the ``memory`` backend with switches: fail writes/reads/exists (return
misses, as a guarded backend does), raise from inside a primitive, hang (await an event that
never fires unless released) or delay each call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hicache_backends.memory import MemoryStorage

from hicache.storage import PageKey


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
