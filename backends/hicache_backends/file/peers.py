"""Removals shared with the other processes of a root: this store's out, theirs in.

A store appends its own removals (evictions, corrupt pages, clears) to the namespace's
removal journal (:mod:`.journal`) and tails the lines the other processes append, handing
each to its store (which forgets the pages and reports them as KV events). The journal has
a thread of its own: its lock waits never hold up page I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hicache.storage.offload import run_to_completion

from hicache_backends.file.journal import PeerRemoval, RemovalJournal

__all__ = ["PeerRemovals"]

logger = logging.getLogger("hicache.storage.file")


class PeerRemovals:
    """One store's end of the removal journal: appends queued on the loop and written on the
    journal's thread, and a task that polls the journal every ``poll_s`` and hands what other
    processes removed to ``on_removal`` (on the loop)."""

    def __init__(self, root: str, poll_s: float, on_removal: Callable[[PeerRemoval], None]) -> None:
        self.root = root
        self.poll_s = poll_s
        self._on_removal = on_removal
        self.journal: RemovalJournal | None = None
        # the journal whose counts the figures below read: kept once closed, so a closed store's
        # totals (and a scrape's last read of them, taken after the close) keep their values
        self._counted: RemovalJournal | None = None
        # the removal journal's own thread: its lock waits never hold up page I/O
        self.executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        #: journal lines whose removal could not be applied (logged, skipped)
        self.failed_removals = 0

    @property
    def dropped_lines(self) -> int:
        return self._counted.dropped_lines if self._counted is not None else 0

    @property
    def torn_lines(self) -> int:
        return self._counted.torn_lines if self._counted is not None else 0

    @property
    def missed_files(self) -> int:
        return self._counted.missed_files if self._counted is not None else 0

    @property
    def malformed_lines(self) -> int:
        return self._counted.malformed_lines if self._counted is not None else 0

    async def open(self, ns_dir: str, digest: str) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-file-journal")
        self.journal = self._counted = await run_to_completion(RemovalJournal, ns_dir, executor=self.executor)
        self._task = asyncio.get_running_loop().create_task(
            self._tail(self.journal), name=f"hicache-file-journal-{digest[:8]}"
        )

    def queue(self, pages: list[tuple[str, str]], reason: str) -> None:
        """Queue a journal line (called on the loop); the journal's thread writes whatever is
        queued in one append, not waited for."""
        if self.journal is None or self.executor is None:
            return
        if self.journal.queue_removed(pages, reason):
            try:
                self.executor.submit(self.journal.flush)
            except RuntimeError:  # shutting down: the store is closing, and flushes at the end
                pass

    def clearing(self, clearing: bool = True) -> None:
        """(Loop.) This store starts clearing (before its rename), or its clear failed: while
        it clears, the fresh folder its tail finds is its own clear's, not a replaced one."""
        if self.journal is not None:
            self.journal.clearing = clearing

    async def append_cleared(self) -> None:
        if self.journal is not None:
            await run_to_completion(self.journal.append_cleared, executor=self.executor)

    async def _tail(self, journal: RemovalJournal) -> None:
        """Report what other processes removed, every ``poll_s``; never dies."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                removals = await run_to_completion(journal.poll, executor=self.executor)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the journal is advisory; the next poll retries
                logger.exception("file store %s: polling the removal journal failed", self.root)
                continue
            for removal in removals:
                try:
                    self._on_removal(removal)
                except Exception:  # noqa: BLE001 - one line's removal must not end the tail for good
                    self.failed_removals += 1
                    logger.exception("file store %s: applying a removal journal line failed; skipped", self.root)

    async def stop_tailing(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """(After the journal's thread has stopped.) Idempotent; the journal is closed however
        this ends (a cancelled caller waits for the flush first)."""
        journal, self.journal = self.journal, None
        if journal is None:
            return
        try:
            # removals reported while the executors shut down: written (or counted) now
            await run_to_completion(journal.flush)
        except RuntimeError:  # no thread takes work (interpreter exit): flushed on this one
            journal.flush()
        finally:
            journal.close()
