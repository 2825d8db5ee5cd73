"""Space accounting and eviction of one file store: ``max_bytes`` and the free-space floor.

What a store counts: the bytes of its index, the bytes of its write batches in flight
(*reserved*, so concurrent batches never count the same free space twice), and, for a shared
store, the namespace's usage ledger (:mod:`.ledger`), which every process on the root changes:
a batch reserves its bytes there before any byte is written, gives back what it did not
publish, and an evictor subtracts what it actually unlinked. When the ledger is unavailable
for a call (a peer frozen holding its lock, no descriptor left, the folder deleted under us),
what it could not be told is *owed* to it and settled by the next write's reservation.

Eviction makes room before a write: leaves first, least recently used first
(:meth:`~.index.PageIndex.pick_victims`), never a busy page (:mod:`.pins`). The accountant
is touched only on the event loop thread; its ``(on an I/O thread)`` methods only talk to
the ledger and the disk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hicache.storage import PageKey
from hicache.storage.offload import run_to_completion
from hicache.storage.stats import StorageStats, Throttle

from hicache_backends.file import io as page_io
from hicache_backends.file.index import PageIndex
from hicache_backends.file.layout import PAGE_SUFFIX, NamespaceLayout
from hicache_backends.file.ledger import LEDGER_NAME, Usage, UsageLedger, give_back, mark, read_usage
from hicache_backends.file.pins import PagePins

__all__ = ["Reservation", "SpaceAccountant"]

logger = logging.getLogger("hicache.storage.file")

_FREE_SPACE_TTL = 1.0  # seconds a statvfs answer is reused (adjusted by our own writes)
_REFUSAL_WARN_SECONDS = 60.0  # at most one "writes refused for space" warning per store this often
_EVICT_ROUNDS = 4  # victims may turn out gone already (evicted by another process): retry


@dataclass(slots=True)
class Reservation:
    """Bytes a write batch reserved in the shared ledger; filled in on the I/O thread, so a
    caller cancelled while waiting still knows what to give back."""

    amount: int = 0
    usage: Usage | None = None
    #: in-flight bytes of earlier batches whose settlement could not release them (the
    #: ledger was unavailable), released by this reservation's call (see ``unreleased``)
    release: int = 0
    #: the store's generation when the batch began: a clear since took its reservation along
    generation: int = 0


@dataclass(slots=True)
class _Removal:
    """What unlinking a batch of pages did (:meth:`SpaceAccountant._remove_victims`)."""

    freed: int  # bytes of the page files this call removed
    idents: list[tuple[str, str]]  # their (key, pool), when anyone needs them
    kept: list[int]  # positions of the pages left in place (an unlink refused)
    owed: int = 0  # bytes the ledger could not be told of (unavailable): owed to it
    unreleased: int = 0  # bytes of this process's slot it could not release then
    usage: Usage | None = None  # a reading that may have given back a dead writer's slot


class SpaceAccountant:
    """Reservations, the shared ledger (and what is owed to it), free space and eviction.

    Handed what it needs of its store: the index and pins it evicts from, the stats it counts
    in, ``generation`` (bumped by each clear: what was owed to a cleared ledger is dropped),
    ``report_removed`` (evicted pages), ``wants_identities`` (whether anyone needs the keys of
    evicted pages), ``leaving`` (evicted pages: the running scan must not index them again)
    and ``on_reclaim`` (a ledger call gave back a dead writer's reservation). The ledger, the
    layout and the I/O threads come at :meth:`open`.
    """

    def __init__(
        self,
        root: str,
        max_bytes: int | None,
        min_free_bytes: int,
        *,
        index: PageIndex,
        pins: PagePins,
        stats: StorageStats,
        generation: Callable[[], int],
        report_removed: Callable[..., None],
        wants_identities: Callable[[], bool],
        leaving: Callable[[Iterable[str]], None],
        on_reclaim: Callable[[Usage], None],
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self._index = index
        self._pins = pins
        self._stats = stats
        self._generation = generation
        self._report_removed = report_removed
        self._wants_identities = wants_identities
        self._leaving = leaving
        self._on_reclaim = on_reclaim
        self._layout: NamespaceLayout | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the store's (where a read's removal is settled)
        self.ledger: UsageLedger | None = None  # shared usage (shared stores only)
        # an observer's (read_only) view of the ledger: the path, and the file it saw at open
        # (see :meth:`give_back_removed`)
        self._observed: str | None = None
        self._observed_token: int | None = None
        self.reserved = 0  # bytes of writes in flight
        self._free_est = 0
        self._free_at = float("-inf")
        # bytes the shared count owes: corrupt pages reads removed and evictions it could not be
        # told of (given back), less pages written while it was unavailable (added), all settled
        # by the next write's reservation (a read's removal by the read, see give_back_removed)
        self.debt = 0
        # bytes of this process's in-flight slot in the ledger that settlements could not
        # release (unavailable), and the marks of corrupt pages reads removed (see discard),
        # released by the next reservation: left there, a later death of this process had a
        # peer take them off the count again
        self.unreleased = 0
        self.writes_in_flight = 0  # batches between their reservation and its settlement
        self.writes_started = 0
        self._refusal_warnings = Throttle(_REFUSAL_WARN_SECONDS)
        self._removal_warnings = Throttle(_REFUSAL_WARN_SECONDS)  # evicted pages the medium kept

    def open(self, layout: NamespaceLayout, executor: ThreadPoolExecutor, *, shared: bool, observer: bool = False) -> None:
        """``observer``: a read-only store of a shared namespace, which keeps out of the ledger
        but gives back the pages its reads remove (:meth:`give_back_removed`)."""
        self._layout = layout
        self._executor = executor
        self._loop = asyncio.get_running_loop()
        if shared:
            self.ledger = UsageLedger(layout.ns_dir)
        elif observer:
            self._observed = os.path.join(layout.ns_dir, LEDGER_NAME)

    def observe(self) -> None:
        """(On an I/O thread, at an observer's open.) Note the ledger file there is now: what
        this observer removes was counted in it."""
        if self._observed is not None:
            usage = read_usage(self._observed)
            self._observed_token = usage.token if usage is not None else None

    async def give_back_removed(self, executor: ThreadPoolExecutor | None) -> None:
        """Reads removed corrupt pages (``debt``): their bytes leave the shared count now
        (a writer's with its slot's marks, see :meth:`discard`), not with the next write
        batch: until then peers evicted sound pages for room the count no longer had, and a
        process that reads and never writes kept them counted until its close.

        An observer's: kept, they stayed counted for as long as a writer kept the namespace open:
        its eviction found such a page gone (nothing freed, nothing subtracted) and evicted a
        sound page in its place, each ``hicache inspect --verify`` drop shrinking ``max_bytes``
        for good. Not given to a ledger a clear replaced since the open (it never counted
        them); a ledger that cannot be used now is tried again by the next call (or the close)."""
        if self._observed is None:
            if self.ledger is not None and (self.debt or self.unreleased):
                generation = self._generation()
                debt, release = self.debt, self.unreleased
                self.debt = self.unreleased = 0
                if await self.ledger_call(executor, -debt, inflight=-release) is None:
                    self.owe(debt, generation)  # the next reservation tries again
                    if generation == self._generation():
                        self.unreleased += release
            return
        if not self.debt and not self.unreleased:
            return
        amount, release = self.debt, self.unreleased
        self.debt = self.unreleased = 0
        token = self._observed_token
        if token is None:
            return
        done = await run_to_completion(give_back, self._observed, amount, token, release, executor=executor)
        if done is None:
            self.debt += amount
            self.unreleased += release

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()

    async def settle_owed(self, executor: ThreadPoolExecutor | None) -> None:
        """Closing: give the shared ledger what it is still owed (``debt``) and release this
        process's in-flight bytes a settlement could not (``unreleased``), which the next
        reservation would have done. Dropped at close, the slot kept a finished batch's bytes
        and a peer took them off the count once this process exited, under-counting pages
        on disk for as long as peers kept the namespace open. Still unavailable: logged."""
        if self._observed is not None:
            await self.give_back_removed(executor)
            if self.debt:
                logger.warning("file store %s: closing with %d byte(s) of corrupt pages it removed still counted in the "
                               "shared usage ledger (unavailable)", self.root, self.debt)
            return
        if self.ledger is None or not (self.debt or self.unreleased):
            return
        debt, release = self.debt, self.unreleased
        if await self.ledger_call(executor, -debt, inflight=-release) is None:
            logger.warning("file store %s: closing with %d byte(s) owed to the shared usage ledger and %d in-flight "
                           "byte(s) unreleased (the ledger is unavailable): the count stays off until a scan "
                           "of the namespace alone corrects it", self.root, debt, release)
            return
        self.debt -= debt
        self.unreleased -= release

    # ------------------------------------------------------------------ free space

    async def free_bytes(self) -> int:
        now = time.monotonic()
        if now - self._free_at > _FREE_SPACE_TTL:
            assert self._executor is not None
            self._free_est = await run_to_completion(page_io.free_bytes, self.root, executor=self._executor)
            self._free_at = time.monotonic()
        return self._free_est

    def wrote(self, nbytes: int) -> None:
        """Our own writes took ``nbytes`` of the free space (until the next ``statvfs``)."""
        self._free_est -= nbytes

    def disk_full(self) -> None:
        """A write found the disk full: ask the file system again next time."""
        self._free_at = float("-inf")

    # ------------------------------------------------------------------ the shared ledger

    async def ledger_call(
        self,
        executor: ThreadPoolExecutor | None,
        delta: int,
        *,
        refused: int = 0,
        token: int | None = None,
        if_seq: int | None = None,
        inflight: int = 0,
        floor: int | Callable[[int, int], int] | None = None,
    ) -> Usage | None:
        """``ledger.add`` on a thread (``None`` without a ledger or when it is unavailable)."""
        if self.ledger is None:
            return None
        add = functools.partial(self.ledger.add, delta, refused=refused, token=token, if_seq=if_seq,
                                inflight=inflight, floor=floor)
        usage = await run_to_completion(add, executor=executor)
        self.after_reclaim(usage)
        return usage

    def after_reclaim(self, usage: Usage | None) -> None:
        """A ledger call gave back a dead writer's reservation (see :class:`Usage`), or found
        the ledger's counters lost: index the namespace again, so the pages it published
        before dying (all pages, for a lost count) are found, evictable, and counted again by
        the scan's ``floor``."""
        if usage is not None and (usage.reclaimed or usage.lost):
            self._on_reclaim(usage)

    async def baseline(self, executor: ThreadPoolExecutor) -> tuple[Usage | None, int | None]:
        """Before a scan: the shared count, when what the scan measures may replace it (``None``
        when not), and the token of the ledger file current now (``None``: unavailable). What
        the scan measures replaces the shared count (correcting what killed writers left
        behind) only if nothing can be in flight meanwhile (see .ledger); otherwise it only
        raises the count (a floor), and only in *this* ledger: a clear by another process
        during the scan replaces it, and a floor of the old folder's pages landing on the
        fresh, empty namespace's ledger counted it full for as long as peers kept it open
        (floors never lower, only a lone scan does), so every write evicted its own pages."""
        # The order matters: no write of ours in flight from before the reading until after
        # it (one that reserved before it may publish during the scan without changing seq),
        # then "alone" (a process that reserved before the reading holds the users lock by
        # then); any reservation after the reading changes seq.
        quiet = not self.writes_in_flight and not self.debt and not self.unreleased
        started = self.writes_started
        reading = await self.ledger_call(executor, 0, token=-1)
        token = reading.token if reading is not None else None
        before = reading if quiet else None
        if before is not None and self.ledger is not None:
            alone = await asyncio.get_running_loop().run_in_executor(executor, self.ledger.alone)
            if not alone or self.writes_started != started or self.debt or self.unreleased:
                before = None
        return before, token

    async def measured(
        self, executor: ThreadPoolExecutor, before: Usage | None, token: int | None, found: int,
        still_on_disk: Callable[[int, int], int],
    ) -> None:
        """A complete scan found ``found`` bytes of pages: replace the shared count with them
        (``before``: :meth:`baseline`), or, not alone, raise the count to ``still_on_disk(count,
        seq)`` (summed under the ledger's lock) if it is below, in the ledger file ``token`` names
        only (a clear since the scan began replaced it: the floor is dropped, see
        :meth:`baseline`; so is one for a ledger that could not be read then)."""
        if before is not None and not self.debt and not self.unreleased:
            # applied only if nobody changed the ledger during the scan (seq)
            await self.ledger_call(executor, found - before.used, token=before.token, if_seq=before.seq)
        elif token is not None:  # not alone: never lowered, but raised to what is on disk if below
            await self.ledger_call(executor, 0, token=token, floor=still_on_disk)

    def owe(self, amount: int, generation: int) -> None:
        """Add ``amount`` bytes to what the shared count is owed (settled by the next write's
        reservation), unless a clear ran since ``generation``: it was owed to the ledger that
        went with the cleared folder, and carried over the new one would count pages that are
        gone."""
        if generation == self._generation():
            self.debt += amount

    def discard(self, path: str, nbytes: int, remove: Callable[[], bool]) -> bool:
        """(On an I/O or a caller's thread; :data:`~.io.Discard`.) Remove a page file of
        ``nbytes`` a read found corrupt (``remove``: whether it removed it), its bytes marked
        in this process's ledger slot first, as an eviction's victims are: they leave the
        shared count with the next ledger call of this process (:meth:`give_back_removed`, or a
        write's reservation), and were left counted for as long as any peer kept the
        namespace open when it was killed before that call (each kill shrank ``max_bytes``,
        peers evicting sound pages for room the count no longer had); the next process to
        take the ledger's lock now gives them back with the dead process's slot. The loop
        learns what to settle by a callback (:meth:`_discarded`)."""
        generation = self._generation()
        marked = self.ledger.add(0, inflight=nbytes) if self.ledger is not None and nbytes else None
        held = nbytes if marked is not None or self._observer_marks(nbytes) else 0
        removed = remove()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._discarded, path, nbytes if removed else 0, held, marked, generation)
            except RuntimeError:  # the loop closed under the read: nothing is left to settle into
                pass
        return removed

    def _observer_marks(self, nbytes: int) -> bool:
        """(An observer's :meth:`discard`.) Whether ``nbytes`` it is about to remove are marked
        in its process's observer slot of the ledger it observes (:func:`~.ledger.mark`; a
        writer of the same process has a slot of its own), to be freed by its give-back
        (:meth:`give_back_removed`): killed before that, a writer's next ledger call gives
        them back with the dead process's slot."""
        token = self._observed_token
        if self._observed is None or token is None or not nbytes:
            return False
        return mark(self._observed, nbytes, token) is True

    def _discarded(self, path: str, freed: int, marked: int, usage: Usage | None, generation: int) -> None:
        """(Loop.) A read's removal (:meth:`discard`): the page leaves the running scan
        (before its bytes leave the count: that scan's floor sums what it found less what
        left), its bytes are owed, its slot's mark to be released, both settled together."""
        self._leaving([os.path.basename(path)[: -len(PAGE_SUFFIX)]])
        self.owe(freed, generation)
        if generation == self._generation():
            self.unreleased += marked
        self.after_reclaim(usage)

    def cleared(self) -> None:
        self.debt = 0  # owed to the ledger that goes with the cleared folder
        self.unreleased = 0  # and its slot with it

    def owe_unreserved(self, results: Sequence[page_io.WriteResult]) -> None:
        """A batch written while the shared ledger was unavailable (a peer frozen holding its
        lock, no file descriptor left, the namespace folder deleted under us) reserved nothing,
        so what it published is added with the next reservation. Dropped, it was never counted:
        every such batch raised the namespace above ``max_bytes`` for good (the count is what
        eviction goes by, and a scan only corrects it when the namespace is not shared)."""
        self.debt -= sum(r.size - r.replaced for r in results if r.ok and not r.skipped)

    # ------------------------------------------------------------------ write batches

    def begin_batch(self, incoming: int) -> Reservation:
        """A write batch of ``incoming`` new bytes starts: reserved locally at once (so that
        concurrent batches cannot both claim the same space); :meth:`reserve` takes them in
        the shared ledger, :meth:`end_batch` gives back and settles."""
        self.reserved += incoming
        self.writes_in_flight += 1
        self.writes_started += 1
        return Reservation(generation=self._generation())

    def unreserve(self, nbytes: int) -> None:
        """Pages of a batch dropped before they were written (no room for them)."""
        self.reserved -= nbytes

    async def reserve(self, res: Reservation, incoming: int) -> None:
        """Reserve a batch's bytes in the shared ledger before any byte is written (so that
        other processes cannot claim the same space), giving back what is owed to it."""
        if self.ledger is None or not incoming:
            return
        assert self._executor is not None
        debt = self.take_debt(res)
        try:
            await run_to_completion(self._reserve, res, incoming, debt, executor=self._executor)
        finally:
            self._not_reserved(res, debt)
        self.after_reclaim(res.usage)

    def _reserve(self, res: Reservation, amount: int, debt: int) -> None:
        """(On an I/O thread.) Reserve ``amount`` bytes, giving back ``debt`` (what is owed, see
        :attr:`debt`) and releasing ``res.release`` of this process's in-flight slot; the
        outcome lands in ``res``."""
        assert self.ledger is not None
        res.usage = self.ledger.add(amount - debt, inflight=amount - res.release)
        if res.usage is not None:
            res.amount = amount

    def _not_reserved(self, res: Reservation, debt: int) -> None:
        """A reservation that was not applied still owes ``debt`` and still has ``res.release``
        to release (unless a clear since the batch began took both along)."""
        if res.usage is None:
            self._carry(res, debt, res.release)
            res.release = 0

    def _carry(self, res: Reservation, owed: int, inflight: int) -> None:
        """A ledger call of ``res``'s batch found the ledger unavailable: ``owed`` bytes and
        ``inflight`` bytes of this process's slot go to the next reservation (:attr:`debt`,
        :attr:`unreleased`), unless a clear since the batch began took both along."""
        self.owe(owed, res.generation)
        if res.generation == self._generation():
            self.unreleased += inflight

    async def reserves_in_batch(self, incoming: int) -> bool:
        """Whether a write batch of ``incoming`` new bytes takes its shared reservation on its
        own I/O thread, before its first write (:meth:`reserve_first`), rather than in a round
        trip of its own: with a shared ledger, when the free-space floor (cached) leaves room.
        Small pages pay for every round trip: a 64-page batch of 32 KiB pages spent ~0.9 ms of
        its ~9 ms in the reservation's and the settlement's."""
        if self.ledger is None or not incoming:
            return False
        return not self.min_free_bytes or self.min_free_bytes + self.reserved - await self.free_bytes() <= 0

    def take_debt(self, res: Reservation) -> int:
        """What is owed to the shared ledger, handed to a reservation (see :meth:`reserved_first`),
        and the in-flight bytes it is to release (into ``res``)."""
        debt, self.debt = self.debt, 0
        res.release, self.unreleased = self.unreleased, 0
        return debt

    def reserve_first(self, res: Reservation, amount: int, debt: int) -> bool:
        """(On an I/O thread, before a batch's first write.) :meth:`reserve` there; True when
        the batch may go on as it is: reserved, and the shared count (this batch included)
        within ``max_bytes``. Otherwise no page is written and the event loop makes room
        (:meth:`evict_for`) first, as for a batch that reserved on its own."""
        self._reserve(res, amount, debt)
        return res.usage is not None and (self.max_bytes is None or res.usage.used <= self.max_bytes)

    def reserved_first(self, res: Reservation, debt: int) -> None:
        """(On the event loop, after the batch.) What :meth:`reserve` does once its call is
        back: a reservation that was not applied still owes ``debt``."""
        self._not_reserved(res, debt)
        self.after_reclaim(res.usage)

    def settle_last(
        self, res: Reservation, refused: int, results: Sequence[page_io.WriteResult | None]
    ) -> tuple[Usage | None]:
        """(On an I/O thread, after a batch's last write.) :meth:`settle` there; the ledger's
        answer in a 1-tuple (its ``None`` means unavailable, the tuple that it settled)."""
        if res.usage is None or self.ledger is None:
            raise RuntimeError("settling a batch that reserved nothing")
        delta = self._kept(results) - res.amount
        usage = self.ledger.add(delta, refused=refused, token=res.usage.token, inflight=-res.amount)
        return (usage,)

    def _writes_in_flight(self, usage: Usage | None) -> int:
        """Bytes reserved by writes in flight, of every process when ``usage`` (a ledger
        reading) is given, else this store's own. What this process's slot still holds for
        settlements the ledger missed (``unreleased``) is pages, not writes."""
        if usage is None:
            return self.reserved
        return max(0, usage.inflight - self.unreleased)

    @staticmethod
    def ledger_replaced(res: Reservation, settled: tuple[Usage | None] | None) -> bool:
        """Whether a batch's settlement (:meth:`settle_last`) found another ledger file than
        the one it reserved in: a clear by another process (or a cleaner deleting the folder)
        replaced it meanwhile, so the settlement, carrying the old token, was not applied, and
        the pages the batch published into the new folder are in no count yet (this store's
        own clear is told by its generation instead)."""
        return (res.usage is not None and settled is not None and settled[0] is not None
                and settled[0].token != res.usage.token)

    async def end_batch(
        self, res: Reservation, incoming: int, results: Sequence[page_io.WriteResult] | None, refused: int,
        raced: bool, settled: tuple[Usage | None] | None = None,
    ) -> None:
        """The batch is over (written, failed or cancelled): its local reservation goes, and
        the shared count learns what it published (``raced``: a clear ran meanwhile, and
        what landed after it is counted there; ``settled``: the batch's last step did it,
        :meth:`settle_last`)."""
        self.reserved -= incoming
        try:
            if settled is not None:
                if settled[0] is None:
                    self._unsettled(res, results)
                self.after_reclaim(settled[0])
            elif res.usage is not None:
                await self.settle(res, results, refused)
            elif self.ledger is not None and results is not None and not raced:
                self.owe_unreserved(results)
        finally:
            self.writes_in_flight -= 1

    @staticmethod
    def _kept(results: Sequence[page_io.WriteResult | None] | None) -> int:
        """Bytes a batch's writes added to the store (new pages, less what they replaced); a
        ``None`` result is a page never started (its caller gave up): it added nothing, so the
        settlement gives back all it reserved."""
        kept = 0
        if results is not None:
            for r in results:
                if r is not None and r.ok and not r.skipped:
                    kept += r.size - r.replaced
        return kept

    async def settle(self, res: Reservation, results: Sequence[page_io.WriteResult] | None, refused: int) -> None:
        """Give back what a batch reserved but did not publish (failed, dropped, cancelled),
        and the bytes of the pages its writes replaced; record refused pages."""
        assert res.usage is not None
        delta = self._kept(results) - res.amount
        if delta or refused or res.amount:  # res.amount: this batch's in-flight mark goes too
            usage = await self.ledger_call(self._executor, delta, refused=refused, token=res.usage.token,
                                           inflight=-res.amount)
            if usage is None:
                self._unsettled(res, results)

    def _unsettled(self, res: Reservation, results: Sequence[page_io.WriteResult | None] | None) -> None:
        """A batch's settlement found the ledger unavailable (a peer frozen holding its lock,
        no descriptor left): what it reserved and did not keep (pages replaced, failed,
        dropped or never started) is owed, given back by the next reservation, which also
        releases the batch's in-flight bytes. Lost, both stayed counted for good: the bytes
        as used, shrinking ``max_bytes``, the in-flight mark as this process's, taken off the
        count again by a peer once this process dies. Refused pages it was to record are
        only a statistic, and are not carried. A clear since the batch began (its results
        are then the new folder's, see ``_published_after_clear``) took the reservation and
        the slot along: nothing is owed."""
        self._carry(res, res.amount - self._kept(results), res.amount)

    async def refused_for_space(self, n: int, usage: Usage | None) -> None:
        """Say, at most once a minute, that and why writes are refused (DEBUG is not enough:
        a free-space floor above a small disk's size would otherwise refuse every write
        silently)."""
        count = self._refusal_warnings.due(n)
        if not count:
            return
        free = await self.free_bytes() if self.min_free_bytes else None
        if free is not None and free < self.min_free_bytes + self.reserved:
            why = (
                f"{free} bytes free on the file system, below min_free_bytes={self.min_free_bytes}; "
                "lower min_free_bytes or free disk space"
            )
        else:
            # what the namespace holds is its pages: the shared count also holds every write in
            # flight (reserved before a byte is written), the refused one's included, so it is
            # over max_bytes whenever a write is refused for it. Reported as what the namespace
            # held, each such warning read as a store over its bound ("3095232 bytes of
            # max_bytes=3000000") while its pages were within it. Read now, after the eviction
            # the refusal followed (``usage``, read at the reservation, is from before it)
            now = await self.ledger_call(self._executor, 0, token=-1) if self.ledger is not None else None
            usage = now or usage
            inflight = self._writes_in_flight(usage)
            stored = max(0, usage.used - inflight) if usage is not None else self._index.nbytes
            why = (
                f"the namespace holds {stored} bytes of pages of max_bytes={self.max_bytes}, with "
                f"{inflight} byte(s) reserved by writes in flight (this one's included), and nothing more "
                "of it may be evicted now (pages in use, or written by other processes)"
            )
        logger.warning("file store %s: refused %d page write(s) for space: %s", self.root, count, why)

    # ------------------------------------------------------------------ eviction

    async def evict_for(
        self, check_free: bool, protect: frozenset[str] | set[str], usage: Usage | None = None,
        *, whole_excess: bool = False,
    ) -> int:
        """Evict until stored + reserved bytes fit; returns the bytes still missing (0 = fits).

        Callers reserve their incoming bytes in ``reserved`` (and in the shared ledger, whose
        reading they pass as ``usage``) *before* calling, so batches that run concurrently
        (this awaits), in this process or another, never count the same free space twice.
        With the ledger, the bound is on every process's pages together; victims are this
        process's (and the pages it has seen) - each writer makes room for its own writes.
        ``whole_excess``: evict all that the namespace's stored pages take over its bound,
        not only this store's reservation (after a scan: a max_bytes lowered since the last
        run); the writes in flight are left out, as each makes its own room.
        """
        want = 0
        shared = False
        if self.max_bytes is not None:
            if usage is None and self.ledger is not None:
                usage = await self.ledger_call(self._executor, 0, token=-1)
            shared = usage is not None
            used = usage.used if usage is not None else self._index.nbytes + self.reserved
            want = used - self.max_bytes
            if whole_excess:
                # the count holds the writes in flight (reserved, in this process or another),
                # and each of them evicts for itself: evicting for them here too, the eviction
                # after the opening scan, racing the first write over the bound, took a second
                # page for it (a store bounded to 16 pages held 15)
                want -= self._writes_in_flight(usage)
            elif shared:
                # the shared count holds every process's reservations: each makes room for its
                # own. Evicting for another's too, two writers each emptied the namespace for
                # both, then refused their own writes for the room the other still held
                want = min(want, self.reserved)
        if self.min_free_bytes and check_free:
            free = await self.free_bytes()
            want = max(want, self.min_free_bytes + self.reserved - free)
        if want <= 0:
            return 0
        guard = set(protect) | set(self._pins.busy)
        for _ in range(_EVICT_ROUNDS):
            victims = self._index.pick_victims(want, guard)
            if not victims:
                break
            ids = [pid for pid, _ in victims]
            sizes = [e.size for _, e in victims]
            self._leaving(ids)
            removed, idents, kept = await self.remove(ids, sizes)
            self._report_removed([PageKey(k, p) for k, p in idents], reason="evicted")
            self._stats.incr("evicted_pages", len(victims) - len(kept))
            self._stats.incr("evicted_bytes", removed)
            logger.debug("file store %s: evicted %d pages (%d bytes)", self.root, len(victims), removed)
            # a victim another process had evicted already frees nothing: against the shared
            # count only bytes really removed count; the local count dropped with the index
            want -= removed if shared else sum(sizes)
            if want <= 0:
                return 0
        return max(0, want)

    async def remove(self, ids: list[str], sizes: list[int]) -> tuple[int, list[tuple[str, str]], set[str]]:
        """Unlink pages already out of the index (marked deleting meanwhile); returns the bytes
        removed, the ``(key, pool)`` of the pages removed (see :meth:`_remove_victims`), and
        the ids of those left in place (an unlink refused: not removed, nor to be reported)."""
        assert self._layout is not None and self._executor is not None
        self._pins.removing(ids)
        generation = self._generation()
        try:
            out = await run_to_completion(
                self._remove_victims, [self._layout.path(p) for p in ids], sizes, executor=self._executor
            )
        finally:
            self._pins.removals_done(ids)
        self.owe(out.owed, generation)
        if generation == self._generation():
            self.unreleased += out.unreleased
        self.after_reclaim(out.usage)
        self._free_est += out.freed
        return out.freed, out.idents, {ids[i] for i in out.kept}

    def _remove_victims(self, paths: list[str], sizes: list[int]) -> _Removal:
        """(On an I/O thread.) Unlink evicted pages, and take the bytes actually removed off
        the shared count (see :class:`_Removal`). Their bytes are marked in this process's
        slot of the reservation table before the first unlink, and the mark goes with the
        subtraction, in one locked change: a process killed between the unlinks and the
        subtraction left them counted for as long as any peer kept the namespace open (each
        such kill shrank ``max_bytes`` for good); the next process to take the ledger's lock
        now gives them back with the dead process's slot. The mark is all the victims' bytes,
        so that reclaim may also take a victim not unlinked yet (or gone already) off the
        count: an under-count the reclaim's rescan raises back (its floor), as for a writer
        killed after publishing. A replaced ledger (a clear since the mark) keeps nothing of
        the mark: what the unlinks freed is then taken off the current one, as before."""
        named = list(map(page_io.page_identity, paths)) if self._wants_identities() else []
        ledger, claimed = self.ledger, sum(sizes)
        marked = ledger.add(0, inflight=claimed) if ledger is not None and claimed else None
        freed, kept = page_io.remove_files(paths, sizes, self._removal_warnings)
        idents = [n for i, n in enumerate(named) if n is not None and i not in kept]
        if ledger is None:
            return _Removal(freed, idents, kept)
        if marked is not None:
            usage = ledger.add(-freed, token=marked.token, inflight=-claimed)
            if usage is None:  # both given to the next reservation (debt, unreleased)
                return _Removal(freed, idents, kept, owed=freed, unreleased=claimed, usage=marked)
            if usage.token == marked.token or not freed:
                return _Removal(freed, idents, kept, usage=usage if usage.reclaimed or usage.lost else marked)
        if freed and ledger.add(-freed) is None:
            return _Removal(freed, idents, kept, owed=freed, usage=marked)
        return _Removal(freed, idents, kept, usage=marked)
