"""A minimal third-party backend: pages in a plain dict, one per (namespace, key, pool).

It exists to prove that a backend installed as its own package is found through the
``hicache.backends`` entry points and passes hicache's conformance suite with no change to
hicache itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.storage import AsyncHiCacheStorage, PageKey

_MEDIA: dict[str, dict[tuple[str, str, str], bytes]] = {}


class DictStorage(AsyncHiCacheStorage):
    backend_name = "sample-dict"

    def __init__(self, storage_config: Any = None, *, medium: str = "default", namespace: Any = None) -> None:
        super().__init__(storage_config, namespace=namespace)
        self.pages = _MEDIA.setdefault(medium, {})

    def _k(self, page: PageKey) -> tuple[str, str, str]:
        return (self.namespace.digest, page.key, page.pool)

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        return [self._k(p) in self.pages for p in pages]

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        out = []
        for p, b in zip(pages, buffers):
            data = self.pages.get(self._k(p))
            ok = data is not None and len(data) == len(b)
            if ok:
                b[:] = data
            out.append(ok)
        return out

    async def _write(self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]) -> list[bool]:
        for p, b in zip(pages, buffers):
            self.pages[self._k(p)] = bytes(b)
        return [True] * len(pages)

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        return self.pages.get(self._k(page))

    async def _clear(self) -> None:
        for k in [k for k in self.pages if k[0] == self.namespace.digest]:
            del self.pages[k]
