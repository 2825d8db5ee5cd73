"""Submitting storage writes, and the deletions the placement policy makes room with.

Where the placement policy chooses storage's evictions (a :class:`~hicache.placement.StoredPages`
directory, and a backend that can delete), every write first asks the directory for room: the
pages it gives up ride in the job's ``delete_first`` and are deleted ahead of the write by the
same worker. Deletions a refused or failed job could not send wait (``doomed``) for the next
job, and at close go in a job of their own. Pages a queued job writes are counted (``writing``):
a deletion of one waits for that job, or it would delete the page the directory then holds.

Why a collaborator the cache owns (``cache.storage_writes``) and not a part of the cache class:
the directory's side of a write (room, pins, what landed, deletions owed) touches no tree node;
the tree decides *what* to write (continuity from the root, the policy's admission) and hands
the job here. It needs nothing of the cache, so this module does not import it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from hicache.controller.controller import HiCacheController
from hicache.controller.jobs import StorageWriteJob
from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub
from hicache.placement import StoredPages

__all__ = ["StorageWrites"]


class StorageWrites:
    """The storage write path of one cache: job submission, room making, owed deletions.

    Args:
        controller: queues the jobs.
        metrics: the controller's.
        page_size: tokens a page (a job cut to the room it got keeps whole pages).
        stored: the stored-page directory when the policy chooses storage's evictions and the
            backend can delete; ``None``: the backend's own bound evicts, jobs go as they are.
        tier_changes: the hub the backend reports its own removals on (followed only with a
            directory, see :meth:`_on_storage_change`).
        on_cleared: called (on the cache's loop) once a clear of the store reached the
            directory: the tree's nodes still count pages storage lost (a removal of single
            pages the tree finds itself, checking a node against the directory when it needs
            its count; a clear concerns every node, so they are all corrected at once).
    """

    def __init__(self, *, controller: HiCacheController, metrics: Any, page_size: int,
                 stored: StoredPages | None, tier_changes: TierChangeHub,
                 on_cleared: Callable[[], None] | None = None) -> None:
        self.controller = controller
        self.on_cleared = on_cleared
        self.metrics = metrics
        self.page_size = page_size
        self.stored = stored
        self.doomed: list[str] = []  # storage evictions not yet sent (their job was refused)
        #: keys of storage writes queued and not ended: a deferred deletion of one waits for it
        self.writing: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = (
            tier_changes.subscribe(self._on_storage_change, wants=frozenset(
                {(ChangeKind.REMOVED, Tier.STORAGE), (ChangeKind.CLEARED, Tier.STORAGE)}))
            if stored is not None else None
        )

    def submit(self, job: StorageWriteJob) -> bool:
        """Queue ``job``. Where the policy chooses storage's evictions (``self.stored``), room
        is made first: the pages it picks ride in the job's ``delete_first``, deleted ahead of
        the write by the same worker, so the write never lands before its room and the
        backend's own bound never has to evict. The job's completion tells the directory what
        landed. Evictions of a job the queue refuses wait for the next one."""
        stored = self.stored
        if stored is None:
            return self.controller.submit_storage_write(job)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()  # where removal reports are applied
        prior, on_done = job.prior_key, job.on_done
        doomed, n, pinned = stored.room_for_write(len(job.keys), prior)
        self.doomed.extend(doomed)
        if n < len(job.keys):
            self.metrics.incr("storage_writes_no_room_pages", len(job.keys) - n)
            if not n:
                stored.landed(0, [], prior, pinned)
                return False
            job.keep_first(n, self.page_size)
        keys = job.keys
        # deletions a job could not send (below) go now, unless the page was written again;
        # one of a page a queued job writes again waits for that job (sent now, it would run
        # after that write and delete the page the directory then holds)
        writing = self.writing
        later: list[str] = []
        job.delete_first = []
        for k in self.doomed:
            if k not in stored:
                (later if k in writing else job.delete_first).append(k)

        def done(written: int) -> None:
            # storage's state, whatever the tree's generation; the prefix is unpinned only now
            stored.landed(n, keys[:written], prior, pinned)
            for k in keys:
                left = writing.get(k, 0) - 1
                if left > 0:
                    writing[k] = left
                else:
                    writing.pop(k, None)
            if job.delete_first and not job.deletions_sent:
                # the store was down when the job's turn came (or went down during its delete):
                # the pages chosen to make room for the write were not deleted. The directory forgot
                # them when it chose them, so they would stay in storage unseen, past its
                # capacity; they go with the next write instead
                self.doomed.extend(job.delete_first)
                self.metrics.incr("storage_deletes_deferred_pages", len(job.delete_first))
            on_done(written)

        job.on_done = done
        if not self.controller.submit_storage_write(job):
            job.delete_first = []
            stored.landed(n, [], prior, pinned)
            return False
        self.doomed = later
        for k in keys:
            writing[k] = writing.get(k, 0) + 1
        return True

    def _on_storage_change(self, change: TierChange) -> None:
        """The backend removed pages by itself (its own bound, a corrupt page, a peer) or was
        cleared: the directory forgets them. Called on whatever thread the backend runs on;
        applied on the cache's loop. Our own deletions were forgotten when they were chosen."""
        stored, loop = self.stored, self._loop
        if stored is None or loop is None or (change.reason == "deleted" and change.origin == "local"):
            return
        keys = change.keys

        def apply() -> None:
            if change.kind is ChangeKind.CLEARED:
                stored.clear()
                if self.on_cleared is not None:
                    self.on_cleared()
            else:
                stored.remove(keys)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            apply()
        elif not loop.is_closed():
            try:
                loop.call_soon_threadsafe(apply)
            except RuntimeError:  # the loop closed meanwhile: nothing left to keep in step
                pass

    def unsubscribe(self) -> None:
        """Stop following the backend's removals (the cache closes)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def send_doomed(self) -> None:
        """Closing: storage evictions still waiting for a write to ride with (``doomed``) go
        in a job of their own that writes nothing, so a store that outlives the cache is left
        within the directory's capacity. One of a page a queued write stores again still waits
        for that write; what the store was down for is reported by :meth:`undeleted`."""
        if self.stored is not None and self.doomed:
            self.submit(StorageWriteJob(
                keys=[], host_indices=torch.empty(0, dtype=torch.int64), prior_key=None, on_done=lambda _: None))

    def undeleted(self) -> int:
        """Pages the policy evicted from storage that were never deleted there (and not written
        again since): after the close, what the store was down for."""
        stored = self.stored
        return len({k for k in self.doomed if k not in stored}) if stored is not None else 0
