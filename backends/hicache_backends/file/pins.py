"""Pages a file store must not remove, and pages on their way out: the two sets every path shares.

A page being read or written is *busy* and never evicted (by the store's own eviction or a
placement policy's deletes). A page whose unlink is pending is *deleting*: lookups do not
answer present for it, the scan does not index it, and a write of it waits until the unlink
ended, or the late unlink would remove the page just written.

Changed only on the event loop thread (the scan's last sum and a blocking caller's lookup on
its own thread read ``deleting``: membership tests only).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["PagePins"]


class PagePins:
    """Busy pages (counted: several reads may hold one) and pages whose unlink is pending."""

    __slots__ = ("busy", "deleting", "_removals_ended")

    def __init__(self) -> None:
        self.busy: Counter[str] = Counter()  # pages being read or written: never evicted
        self.deleting: set[str] = set()  # evicted, unlink pending: not "existing"
        # set (and replaced) whenever a batch of unlinks ends: a write of a page whose unlink
        # is pending waits for it, or the late unlink would remove the page just written
        self._removals_ended = asyncio.Event()

    def hold(self, ids: Iterable[str]) -> None:
        self.busy.update(ids)

    def release(self, ids: Iterable[str]) -> None:
        self.busy.subtract(ids)
        self.busy += Counter()  # drop zero counts

    def removing(self, ids: Iterable[str]) -> None:
        """Mark pages whose unlink starts now (on the loop, in the step that picked them)."""
        self.deleting.update(ids)

    def removals_done(self, ids: Iterable[str]) -> None:
        self.deleting.difference_update(ids)
        ended, self._removals_ended = self._removals_ended, asyncio.Event()
        ended.set()

    async def after_pending_removals(self, ids: Sequence[str]) -> None:
        """Wait until no page of ``ids`` has an unlink in flight. Evictions pick and mark their
        victims in one step on the loop, and never pick a page being written, so once this
        returns and the write marks its pages busy, no unlink can remove what it writes."""
        while self.deleting and not self.deleting.isdisjoint(ids):
            await self._removals_ended.wait()
