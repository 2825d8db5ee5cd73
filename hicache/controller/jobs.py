"""The units of work the controller queues, and the close report.

Jobs carry a completion callback instead of a future: the callback runs on the event loop (the
tree's thread) as soon as the copy is done, so the cache updates node state without a polling
step, and a job nobody awaits cannot leave an unretrieved-exception warning behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import torch

from hicache.keys import validate_key, validate_keys
from hicache.memory.device import has_integer_dtype
from hicache.controller.transfers import slice_transfer
from hicache.storage import PoolTransfer

__all__ = ["BackupJob", "StorageWriteJob", "PrefetchOp", "PrefetchResult", "UnwrittenBackup", "CloseReport"]


@dataclasses.dataclass(eq=False)
class BackupJob:
    """Copy device pages to host pages; ``on_done(ok)``."""

    device_indices: torch.Tensor
    host_indices: torch.Tensor
    on_done: Callable[[bool], None]

    @property
    def num_tokens(self) -> int:
        return int(self.host_indices.numel())


@dataclasses.dataclass(eq=False)
class StorageWriteJob:
    """Write host pages to storage under chained ``keys``; ``on_done(pages)`` gets the number
    of leading pages known written (a page after a failed one is not reachable by a prefix
    lookup, so it does not count)."""

    keys: list[str]
    host_indices: torch.Tensor
    prior_key: str | None
    on_done: Callable[[int], None]
    extra: list[PoolTransfer] = dataclasses.field(default_factory=list)
    #: pages a placement policy evicts to make room for this write, deleted before it
    #: (``AsyncHiCacheStorage.batch_delete``) so the write never lands before its room
    delete_first: list[str] = dataclasses.field(default_factory=list)
    #: set by the controller when the backend answered ``delete_first``. A job that ends
    #: without it (the store was down or went down, the controller closed) leaves those pages in storage,
    #: so the policy that chose them sends them again (the tree: with its next write)
    deletions_sent: bool = False

    def keep_first(self, pages: int, page_size: int) -> None:
        """Cut the job to its first ``pages`` pages, in every pool (the rest is not sent)."""
        total = len(self.keys)
        self.keys = self.keys[:pages]
        self.host_indices = self.host_indices[: pages * page_size]
        self.extra = [slice_transfer(t, 0, pages, total) for t in self.extra]

    def check(self, page_size: int) -> None:
        """Raise ``ValueError`` (:class:`~hicache.errors.InvalidKeyError` for a key) when the
        job cannot be written as given. Why before it is queued: in the queue a malformed job
        only fails inside the storage call, where it looks like a failing store (retried,
        counted against the store's health, eventually marking a good store down)."""
        validate_keys(self.keys)
        validate_keys(self.delete_first)
        if self.prior_key is not None:
            validate_key(self.prior_key)
        hi = self.host_indices
        if not isinstance(hi, torch.Tensor) or hi.dim() != 1 or not has_integer_dtype(hi):
            raise ValueError(f"host_indices must be a 1-D integer tensor, got {type(hi).__name__} "
                             f"{getattr(hi, 'dtype', '')} {tuple(getattr(hi, 'shape', ()))}")
        if hi.numel() != len(self.keys) * page_size:
            raise ValueError(f"{len(self.keys)} key(s) of {page_size}-token pages need {len(self.keys) * page_size} "
                             f"host indices, got {hi.numel()}")


@dataclasses.dataclass(eq=False)
class PrefetchOp:
    """One request's storage->host prefetch.

    The op owns the host pages it allocated until the request takes the completed ones
    (``take``) or aborts; whatever is not taken is freed when the op's task ends.
    """

    rid: str
    keys: list[str]
    page_size: int
    extra: list[PoolTransfer] = dataclasses.field(default_factory=list)
    #: pages an engine already counted as hits (``HiCacheController.start_prefetch``)
    promised: bool = False
    started: float = dataclasses.field(default_factory=time.monotonic)
    found_pages: int = 0
    completed_pages: int = 0
    host_indices: torch.Tensor | None = None
    taken_pages: int | None = None
    stop_requested: bool = False
    finished: bool = False
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: set once a waiter may take the op: it finished, or a storage call of it was given up on
    #: (timed out, or interrupted as the store went down) while it may still run (a read stuck
    #: on a hung mount returns when it returns): the op lands nothing more a waiter should wait
    #: for, so the request takes the pages that completed now, as under the ``timeout`` policy;
    #: the op keeps the pages that call was given out of use until it has really returned
    #: (``finished``)
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    inflight_start: int = 0
    inflight_end: int = 0
    #: when the op's current storage call began (``time.monotonic()``; the wait for a turn,
    #: then ``exists``, then each read: an unfinished op is always in one, with no await
    #: between them): how far into it, or how late, a waiter is
    inflight_since: float = 0.0
    #: set whenever the op moves (exists answered, a batch landed, the op ended): a request
    #: waiting under the recompute bound re-decides then (see :mod:`hicache.controller.recompute`)
    progress: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: the recompute bound ended this op's wait (counted once, however often it is polled)
    recompute_cut: bool = False
    #: the read in flight has ended on the I/O loop, its answer not yet taken on this loop (a
    #: blocked loop): the ``timeout`` policy waits for it rather than cut pages already here
    read_landed: bool = False
    #: when it landed there (``time.monotonic()``): the read's time is the store's up to here,
    #: not the blocked loop's after (the pace of :mod:`hicache.controller.recompute`)
    landed_at: float = 0.0
    released: bool = False
    #: (ours, for miss attribution) whether ``exists`` answered, and why the fetch stopped
    #: short of ``found_pages``: ``"cut"`` (the stop policy took it early), ``"exists_failed"``,
    #: ``"read_failed"`` (a read call gave no answer), ``"page_failed"`` (a page read as a
    #: miss), ``"backend_error"`` (that read made the backend count an error),
    #: ``"no_host_room"``, ``"below_threshold"`` (the hit, or the host room for it, was below
    #: ``prefetch_threshold``), ``"error"``; ``room_pages``: found pages host memory was found for
    exists_answered: bool = False
    room_pages: int = 0
    stop: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.page_size

    def note_read_landed(self) -> None:
        """(On the I/O loop.) The read in flight has returned there (see ``read_landed``)."""
        self.landed_at = time.monotonic()  # first: a reader seeing read_landed finds it set
        self.read_landed = True


@dataclasses.dataclass
class PrefetchResult:
    """What a request gets from its prefetch: ``pages`` complete pages at ``host_indices``
    (owned by the caller from now on)."""

    pages: int
    host_indices: torch.Tensor
    waited_s: float = 0.0
    found_pages: int = 0


@dataclasses.dataclass
class UnwrittenBackup:
    """A storage backup the controller could not write before it closed. ``reason``:
    ``"closed"`` (never sent, or its call had ended short), ``"stuck"`` (its write call was
    still running when the close gave up on it, a hung mount: the store may yet hold some of
    these pages once the call returns)."""

    first_key: str
    pages: int
    reason: str


@dataclasses.dataclass
class CloseReport:
    """What ``aclose()`` did: whether the queues drained, and every backup left unwritten."""

    drained: bool
    unwritten: list[UnwrittenBackup] = dataclasses.field(default_factory=list)
    cancelled_prefetches: int = 0
    failed_device_backups: int = 0
    #: pages meant for storage that are not there when the cache closes, besides those in
    #: ``unwritten`` (queued or in flight at close): their write failed (retries spent), was
    #: skipped while storage was down and no re-offer landed it since, or never started (it
    #: waits for its prefix's). Counted by the tree that holds them (see
    #: ``HiCacheController.set_unstored_count``); a controller used alone, which never offers
    #: a write again by itself, reports ``lifetime_failed_storage_pages``
    failed_storage_pages: int = 0
    #: storage write pages that failed, were skipped while storage was down, or that host
    #: dropped before their write could start, over the controller's whole life (the sum of
    #: those counters): a page offered again counts at each skip, and one a later write
    #: landed still counts, so this is a history, not what storage lacks at close
    lifetime_failed_storage_pages: int = 0
    #: pages committed on device whose copy to host waited for host room and had not started
    #: when the cache closed (filled in by the tree, which alone holds those backups): written
    #: nowhere
    deferred_backup_pages: int = 0
    #: pages a placement policy evicted from storage whose deletion could not be sent before
    #: the cache closed (the store was down): they stay in the store, unknown to the next
    #: directory, until the backend's own bound evicts them (filled in by the tree)
    undeleted_storage_pages: int = 0
    #: storage calls (writes, deletions, prefetch reads) still running when the close gave up
    #: waiting for them (the ``storage_calls_stuck`` counter's calls still out at close): the
    #: pages of a stuck write are listed in ``unwritten`` with reason ``"stuck"``
    stuck_storage_calls: int = 0

    @property
    def unwritten_pages(self) -> int:
        return sum(u.pages for u in self.unwritten)

    def summary(self) -> str:
        """One line for a shutdown log: what the close left, stuck calls apart from writes
        never started (a stuck write may still land; an unstarted one never will)."""
        stuck_pages = sum(u.pages for u in self.unwritten if u.reason == "stuck")
        parts = [f"drained={self.drained}", f"{self.unwritten_pages - stuck_pages} page(s) unwritten"]
        if self.stuck_storage_calls or stuck_pages:
            parts.append(f"{self.stuck_storage_calls} storage call(s) stuck "
                         f"({stuck_pages} page(s) of stuck writes, which may still land)")
        for name in ("cancelled_prefetches", "failed_device_backups", "failed_storage_pages",
                     "deferred_backup_pages", "undeleted_storage_pages"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        return "close: " + ", ".join(parts)
