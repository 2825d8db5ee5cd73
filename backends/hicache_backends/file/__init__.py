"""The ``file`` backend: verified page files under a root shared by processes on one machine.

Modules: ``layout`` (paths, page ids, the parent footer), ``index`` (in-memory index with
leaf-first LRU), ``io`` (blocking page I/O run on executor threads), ``threads`` (the I/O
threads and how a batch is spread over them), ``pins`` (pages in use or being unlinked),
``space`` (reservations, the shared usage ledger and eviction), ``scan`` (the index scan and
its tombstones), ``peers`` (removals shared through the journal), ``ledger``, ``journal`` and
``locks`` (the files processes share), ``backend`` (``FileStorage``, which coordinates them).
"""

from hicache_backends.file.backend import DEFAULT_MAX_BYTES, DEFAULT_MIN_FREE_BYTES, FileStorage

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MIN_FREE_BYTES", "FileStorage"]
