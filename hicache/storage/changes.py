"""What a storage backend tells its :class:`~hicache.observability.TierChangeHub`.

Why in the base class: every backend, ours or a plugin, and every caller (our controller,
SGLang's, vLLM's connector) goes through :meth:`AsyncHiCacheStorage._write_guarded` and
:meth:`~AsyncHiCacheStorage.clear`, so writes and clears are reported once, here. Removals are
backend-specific (file-store eviction, a corrupt page deleted, an S3 delete); backends call
:func:`report_removed`. Only pages of the KV pool are reported: a router tracks KV blocks, and
extra pools (Mamba state, indexer) hang off the same keys.

Storage knows keys and parents, not tokens: a stored event's ``token_ids`` is empty.

A page is announced stored once per stay in the store: a write of a page the store already
held (the same prompt served again after a cache reset) announces nothing. A backend says which
pages it held by answering its write with :class:`Written`; a backend answering a plain list
has every page it stored announced. Why: vLLM's contract lets a consumer reference-count
``BlockStored`` against ``BlockRemoved``, and a page announced twice stayed stored for it
after its one removal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import and_, attrgetter, not_

from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub
from hicache.storage.types import PageKey, PoolName

__all__ = ["Written", "new_pages", "report_cleared", "report_removed", "report_written"]

KV = PoolName.KV.value


class Written(list[bool]):
    """A backend's write answer (one flag per page, as a plain list) that also says which pages
    the store held before the write (``held``, one flag per page; ``None``: none held). A held
    page stored again was announced already: it is not announced again (see the module
    docstring). A backend also flags a page it answers stored that a racing clear took
    before the write returned: announced, nothing would ever remove it."""

    __slots__ = ("held",)

    def __init__(self, ok: Iterable[bool], held: Sequence[bool] | None = None) -> None:
        super().__init__(ok)
        self.held = held


def new_pages(ok: Sequence[bool], held: Sequence[bool] | None) -> Sequence[bool]:
    """The pages a write stored that the store did not hold before it (in C: no Python step
    per page); a ``held`` of another length (a backend bug) announces every stored page, as a
    backend that does not say does."""
    if held is None or len(held) != len(ok):
        return ok
    return list(map(and_, ok, map(not_, held)))


def report_written(
    hub: TierChangeHub,
    backend: str,
    page_size: int,
    pages: Sequence[PageKey],
    parents: Sequence[PageKey | None],
    ok: Sequence[bool],
) -> None:
    """Report the KV pages a write stored (``ok``: those to announce, see :func:`new_pages`), as
    runs chained page to page (a run breaks where a page is not announced or its parent is not
    the page before it)."""
    if not hub.wants(ChangeKind.STORED, Tier.STORAGE) or not any(ok):  # (a batch of held pages: no loop)
        return
    if _one_run(pages, parents, ok):  # the usual batch: one event, no loop over its pages
        parent = parents[0]
        _flush(hub, backend, page_size, list(map(_key_of, pages)), parent.key if parent is not None else None)
        return
    run: list[str] = []
    run_parent: str | None = None
    for page, parent, done in zip(pages, parents, ok):
        if not done or page.pool != KV:
            _flush(hub, backend, page_size, run, run_parent)
            run = []
            continue
        parent_key = parent.key if parent is not None else None
        if run and parent_key != run[-1]:
            _flush(hub, backend, page_size, run, run_parent)
            run = []
        if not run:
            run_parent = parent_key
        run.append(page.key)
    _flush(hub, backend, page_size, run, run_parent)


_key_of = attrgetter("key")
_pool_of = attrgetter("pool")


def _one_run(pages: Sequence[PageKey], parents: Sequence[PageKey | None], ok: Sequence[bool]) -> bool:
    """Whether every page landed, is a KV page and chains from the page before it (checked in
    C: the storage thread writes the usual batch without a Python step per page)."""
    n = len(pages)
    return (
        n > 0 and len(parents) == n and len(ok) >= n and all(ok[:n])
        and all(map(KV.__eq__, map(_pool_of, pages)))
        and list(parents[1:]) == list(pages[: n - 1])
    )


def _flush(hub: TierChangeHub, backend: str, page_size: int, keys: list[str], parent: str | None) -> None:
    if keys:
        hub.emit(TierChange(ChangeKind.STORED, Tier.STORAGE, tuple(keys), parent_key=parent,
                            page_size=page_size, backend=backend))


def report_removed(
    hub: TierChangeHub, backend: str, pages: Sequence[PageKey], *, reason: str, origin: str = "local"
) -> None:
    """Report KV pages gone from the store (``origin="peer"``: another process removed them)."""
    if not hub.wants(ChangeKind.REMOVED, Tier.STORAGE):
        return
    keys = tuple(p.key for p in pages if p.pool == KV)
    if keys:
        hub.emit(TierChange(ChangeKind.REMOVED, Tier.STORAGE, keys, backend=backend, origin=origin, reason=reason))


def report_cleared(
    hub: TierChangeHub, backend: str, pages: Sequence[PageKey] | None = None, *, origin: str = "local"
) -> None:
    """Report that every page of the namespace is gone: ``pages``, where the store named them
    all (the change lists their KV pages, ``keys_complete``), or any page (``None``).

    Why name them: a vLLM-schema consumer takes the clear without pages (``AllBlocksCleared``,
    which in vLLM has no medium) for "this replica holds nothing", and forgets the device and
    host pages it still serves too; the named pages are published as their ``BlockRemoved``
    (:func:`~hicache.events.convert.to_event`)."""
    if not hub.wants(ChangeKind.CLEARED, Tier.STORAGE):
        return
    keys = () if pages is None else tuple(p.key for p in pages if p.pool == KV)
    hub.emit(TierChange(ChangeKind.CLEARED, Tier.STORAGE, keys, backend=backend, origin=origin, reason="clear",
                        keys_complete=pages is not None))
