"""The ``file`` backend: verified page files under a root shared by processes on one machine.

Modules: ``layout`` (paths, page ids, the parent footer), ``index`` (in-memory index with
leaf-first LRU), ``io`` (blocking page I/O run on executor threads), ``backend``
(``FileStorage``, the asyncio glue).
"""

from hicache_backends.file.backend import DEFAULT_MAX_BYTES, DEFAULT_MIN_FREE_BYTES, FileStorage

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MIN_FREE_BYTES", "FileStorage"]
