"""``WriteBackQueue``: sessions' KV handed to the tree, followed until its host copy exists.

Why hand KV to the tree instead of copying it beside the tree: once a session's committed,
page-aligned KV is inserted into the inner radix tree, the tree owns the pages. Every tier rule
then holds for it with no second implementation: a node being copied to host is locked, so its
device pages cannot be freed mid-copy; a node with a host copy is demoted when device memory is
needed; host copies go on to storage through the controller's normal backup path; a later turn
of the conversation finds it with an ordinary match (device, host or storage hit), even while
the copy is still in flight (the device pages are still there then).

What this queue adds is the guarantee that the copy is *started* whatever the write policy
(``write_back`` and ``write_through_selective`` would otherwise not copy a fresh node), retries
when the controller refused (queue or host pool full), and a ``drain()`` for shutdown and
tests. Everything runs on the event loop; :meth:`pump` never waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from hicache.errors import quoted

__all__ = ["WriteBackQueue"]

logger = logging.getLogger("hicache.session")

#: how long :meth:`WriteBackQueue.drain` waits in all for storage writes to free host room, for
#: a tree without a controller config to take its close timeout from
_HOST_ROOM_WAIT_S = 30.0


@dataclasses.dataclass(eq=False)
class _Entry:
    session_id: str
    leaf: Any
    tokens: int
    attempts: int = 0  # submissions refused (controller queue or host pool full)
    submits: int = 0  # submissions accepted (a failed copy is submitted again)
    started: bool = False  # every node's copy was seen started (in flight or done)
    # a submission was refused: the tree deferred those backups and keeps the nodes on device
    # until their copies start (``write_backup``'s promise), so it may start them itself,
    # between two pumps, and the path may leave the tree before the next one looks
    kept: bool = False
    #: the nodes the tree keeps on device for this entry (their backup was refused): released
    #: however the entry ends, or a node that outlived the entry's path stayed pinned for good
    kept_nodes: list[Any] = dataclasses.field(default_factory=list)


class WriteBackQueue:
    """Follows tree paths (given by their deepest node) until every node on them has a host
    copy, the node left the tree, or the attempts ran out.

    Args:
        tree: the inner cache; it needs ``write_backup(node)`` (``HiRadixCache``) for anything
            to be copied; without it (a device-only tree) entries complete at once.
        max_attempts: refused submissions per entry before it is given up.
        count: ``count(name, amount)`` metrics callback.
    """

    def __init__(self, tree: Any, *, max_attempts: int = 4,
                 count: Callable[[str, int], None] | None = None) -> None:
        self._tree = tree
        self._max_attempts = max_attempts
        self._count = count or (lambda name, amount: None)
        self._entries: list[_Entry] = []
        self.enabled: bool = callable(getattr(tree, "write_backup", None))
        self._sealed = False

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pending_tokens(self) -> int:
        return sum(e.tokens for e in self._entries)

    def enqueue(self, session_id: str, leaf: Any, tokens: int) -> None:
        """Follow the path ending at ``leaf`` (just inserted for ``session_id``). After
        :meth:`seal` (the cache closed) nobody would drain it: it is counted lost at once."""
        self._count("writeback_queued", 1)
        self._count("writeback_queued_tokens", tokens)
        if self._sealed and self.enabled:
            self._count("writeback_lost", 1)
            logger.warning("session %s: %d token(s) handed over after the cache closed; not written back",
                           quoted(session_id), tokens)
            return
        if not self.enabled:
            self._count("writeback_done", 1)
            return
        entry = _Entry(session_id, leaf, tokens)
        self._entries.append(entry)
        self.pump()

    def pump(self, *, count_refusals: bool = False) -> None:
        """Start the copies that can start; drop entries that are finished. Every entry is
        offered, oldest first, even after a refusal: the tree defers a refused backup and
        keeps the node on device until it starts (``write_backup``), so offering it is what
        protects the KV. A refusal counts against an entry only with ``count_refusals``
        (after the controller drained, when it is no longer mere backpressure)."""
        left: list[_Entry] = []
        for e in self._entries:
            try:
                going = self._advance(e, count_refusals=count_refusals)
            except Exception:  # noqa: BLE001 - pump runs from the reaper, releases and pressure relief
                # one entry the tree fails on is given up, counted and logged: kept, it raised
                # again at every later pump, and each of those callers failed with it
                logger.exception("session %s: the write-back of %d token(s) failed; given up", quoted(e.session_id), e.tokens)
                self._count("writeback_dropped", 1)
                going = False
            if going:
                left.append(e)
            else:
                self._unkeep(e)
        self._entries = left

    def release_kept(self) -> int:
        """Give up the write-backs the tree keeps on device for want of host room: a live
        request needs device memory that nothing else can free, and host has not taken them
        (it may never: a small host pool, a session longer than it). Their nodes become
        evictable (a copy that still starts before eviction is kept, best effort); each is
        counted dropped. Returns the entries given up."""
        if getattr(self._tree, "release_backup", None) is None:
            return 0  # nothing is kept on device for its copy without it
        left: list[_Entry] = []
        for e in self._entries:
            if e.kept and (todo := self._todo(self._path(e.leaf)) or self._todo(e.kept_nodes)):
                self._give_up(e, todo, "device room is needed and host has not taken it")
                self._unkeep(e)
            else:
                left.append(e)
        given_up = len(self._entries) - len(left)
        self._entries = left
        return given_up

    def seal(self) -> None:
        """No more entries: the cache closed after its last drain (see :meth:`enqueue`). An
        entry still here (a close cut short by a cancellation drained nothing) can no longer
        be followed: it ends now, counted, or ``writeback_pending`` stayed above 0 for good."""
        self._sealed = True
        self._end_all("the cache closed before its copy was done")

    def discard_all(self) -> None:
        """Forget every entry (the tree is being reset), each counted: done when its host
        copy existed, else lost (left uncounted, queued exceeded what ended for good)."""
        self._end_all("the cache was reset before its copy was done")

    def _path(self, leaf: Any) -> list[Any]:
        root = self._tree.root_node
        path = []
        node = leaf
        while node is not None and node is not root:
            path.append(node)
            node = node.parent
        return path if node is root else []

    def _unkeep(self, e: _Entry) -> None:
        """The entry ends: the tree stops keeping its nodes on device for their copy (the
        backups stay deferred, best effort). Its leaf's path may have left the tree while an
        ancestor it asked for (a shared prefix host could not take) was still kept."""
        release = getattr(self._tree, "release_backup", None)
        if release is not None:
            for node in self._todo(e.kept_nodes):
                release(node)
        e.kept_nodes.clear()

    @staticmethod
    def _todo(nodes: list[Any]) -> list[Any]:
        """The ``nodes`` (a path, or an entry's kept nodes) still on device with no host copy
        made or being made."""
        return [n for n in nodes if n.host_value is None and n.backup_op is None and n.value is not None]

    def _give_up(self, e: _Entry, todo: list[Any], why: str) -> None:
        """Stop keeping ``e``'s ``todo`` nodes on device for their copy (device eviction may
        take them now); counted dropped."""
        self._count("writeback_dropped", 1)
        logger.warning("session %s: giving up the write-back of %d token(s): %s", quoted(e.session_id), e.tokens, why)
        release = getattr(self._tree, "release_backup", None)
        if release is not None:
            for node in todo:
                release(node)

    def _advance(self, e: _Entry, *, count_refusals: bool) -> bool:
        """Move ``e`` on; returns whether it still needs watching."""
        path = self._path(e.leaf)
        if not path:
            if e.started or e.kept:
                # copied, then evicted from host by the tree's rules before we looked. A kept
                # node leaves the device only once its copy started: the tree started it
                # (a deferred backup, once room freed), not a submission of ours, and a
                # path gone since had its host copy: what host eviction did with it next is
                # the tree's rule, not a lost write-back
                self._count("writeback_done", 1)
                return False
            self._count("writeback_lost", 1)  # evicted without a host copy (or tree reset)
            logger.debug("session %s: write-back path left the tree before its backup", quoted(e.session_id))
            return False
        todo = self._todo(path)
        in_flight = any(n.backup_op is not None for n in path)
        if not todo:
            if in_flight:
                e.started = True  # a node being copied is locked until the copy is done
                return True
            self._count("writeback_done", 1)
            return False
        if e.attempts >= self._max_attempts or e.submits > 4 * self._max_attempts:
            self._give_up(e, todo, f"{e.attempts} refusals")
            return False
        self._count("writeback_attempts", 1)
        refused = False
        for node in reversed(todo):  # root side first: storage writes follow the tree downwards
            if not self._tree.write_backup(node):  # refused: deferred, kept on device
                refused = True
                if node not in e.kept_nodes:
                    e.kept_nodes.append(node)
        if refused:
            e.attempts += int(count_refusals)
            e.kept = True
        else:
            e.submits += 1
            e.started = True
        return True

    def close_budget(self) -> float:
        """Seconds a close may spend: the tree's controller's close timeout (what
        :meth:`drain`'s waits for host room are bounded by)."""
        controller = getattr(self._tree, "controller", None)
        return float(getattr(getattr(controller, "config", None), "close_timeout_s", _HOST_ROOM_WAIT_S))

    async def drain(self, deadline: float | None = None) -> None:
        """Wait until every entry finished: copies complete (the tree's controller drains),
        refused ones are retried up to the attempt limit. ``deadline`` (the loop's clock, a
        close's) bounds the waits for copies and for host room: past it nothing is waited for,
        and what still cannot finish is given up and reported. Without one (a plain drain, the
        cache staying open) copies are waited for as long as they take, since one given up
        then is counted lost though it lands, and host room up to :meth:`close_budget`."""
        # Only the host copies are followed here: wait for the device->host copies, not for
        # the storage writes queued behind them (a slow or hung backend would hold up a
        # session close, or aclose() past its close timeout; the controller's close bounds
        # and reports those writes). The one exception, bounded: a copy refused because host
        # is full of pages those writes hold waits for the next to land (_wait_for_host_room).
        drain = getattr(self._tree, "drain_backups", None) or getattr(self._tree, "drain", None)
        loop = asyncio.get_running_loop()
        bounded = deadline is not None
        if deadline is None:
            deadline = loop.time() + self.close_budget()
        idle = 0
        late = False  # past the deadline: copies are no longer waited for
        while self._entries:
            self.pump()
            if not self._entries:
                return
            if drain is None:
                return
            before = [(e.attempts, e.submits, e.started) for e in self._entries]
            if not bounded:
                await drain()
            elif not late:
                # bounded as the controller's own close is: a copy that never returns (a wedged
                # copy stream) held aclose() for good, its close timeout never reached
                try:
                    await asyncio.wait_for(drain(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    late = True
            if await self._wait_for_host_room(deadline):
                continue  # a storage write landed: its pages' host copies can go, retry uncounted
            self.pump(count_refusals=True)
            # a drain that had nothing to wait for (the controller closed) while entries wait
            # for copies that can never end: report them rather than spin on the loop
            now = [(e.attempts, e.submits, e.started) for e in self._entries]
            idle = idle + 1 if now == before else 0
            if idle >= 2:
                self._give_up_stuck()
                return
            await asyncio.sleep(0)  # never starve the loop, whatever drain() did

    async def _wait_for_host_room(self, deadline: float) -> bool:
        """Wait for the next storage write to land when an entry was refused for host room
        and writes are in flight; returns whether one landed before ``deadline``.

        Why: host full of pages on their way to storage refuses every copy at once, and each
        write that lands frees room (a written page's host copy can be shed). Counted instead,
        the refusals used up an entry's attempts in microseconds and it was reported dropped,
        with a warning, though the cache's close then copied and wrote it. Bounded by the
        controller's close timeout: a hung store must not hold a session close longer than
        it holds the controller's (a store that hangs is marked down, which ends its writes)."""
        controller = getattr(self._tree, "controller", None)
        wait = getattr(controller, "wait_storage_progress", None)
        if wait is None or not getattr(controller, "storage_writes_pending", 0) \
                or not getattr(getattr(controller, "health", None), "up", True) \
                or not any(e.kept for e in self._entries):  # (a store down lands nothing)
            return False
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(wait(), left)
        except TimeoutError:
            return False
        return True

    def _give_up_stuck(self) -> None:
        self._end_all("it can no longer finish (the cache is closing, or the drain's deadline passed)")

    def _end_all(self, why: str) -> None:
        """End every entry now, without offering anything to the tree: counted done when its
        copy was made (as :meth:`_advance` counts it), else lost, with ``why`` logged."""
        for e in self._entries:
            path = self._path(e.leaf)
            copied = all(n.host_value is not None and n.backup_op is None for n in path)
            if (path and copied) or (not path and (e.started or e.kept)):
                self._count("writeback_done", 1)
            else:
                self._count("writeback_lost", 1)
                logger.warning("session %s: write-back of %d token(s) given up: %s", quoted(e.session_id), e.tokens, why)
            self._unkeep(e)  # an entry that ends lets go of what the tree kept for it
        self._entries.clear()
