"""The order of one session's turns: one at a time, first come first served, and a place in
that order that is kept when its turn goes away.

Why not an ``asyncio.Lock`` per session: a turn cancelled while it waits for a lock loses its
place in the lock's queue. A final turn (``end_session``) whose client hangs up while an earlier
turn of its session runs must still end the session, and end it *in its place*: after the turns
submitted before it and before the ones submitted after it. Re-queued at the back, its release
ran after a later turn and closed that turn's fresh session. Here each turn is a link in a chain
of futures: its place is taken when it is reserved (synchronously, by whoever orders the
session's work) and is given up only by :meth:`SessionTurn.leave`, which runs the work the turn
owes in that place (``after``: the release) once every earlier turn has left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hicache.errors import quoted

__all__ = ["SessionOrder", "SessionTurn"]

logger = logging.getLogger("hicache.server")


class SessionTurn:
    """One place in a session's order (see :meth:`SessionOrder.reserve`)."""

    __slots__ = ("_before", "_done", "_left", "_order", "after", "session_id")

    def __init__(self, order: SessionOrder, session_id: str, before: asyncio.Future[None] | None,
                 after: Callable[[], Awaitable[object]] | None) -> None:
        self._order = order
        self.session_id = session_id
        self._before = before  # the previous turn's ``_done``; None: first in line
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._left = False
        #: work this turn owes the session when it leaves (ending it), run in its place; the
        #: holder clears it once it has done that work itself
        self.after = after

    async def wait(self) -> None:
        """Return once every earlier turn of the session has left. Cancelling the wait keeps
        the place: the turn still leaves in order, when :meth:`leave` is called."""
        before = self._before
        if before is not None and not before.done():
            await asyncio.shield(before)

    def leave(self) -> None:
        """Give the session up (idempotent). ``after``, if set, runs first, in this place: now
        when the earlier turns have left, else once they have; the next turn waits for it."""
        if self._left:
            return
        self._left = True
        if self.after is not None:
            self._order._owed.add(self)
        before = self._before
        if before is not None and not before.done():
            before.add_done_callback(lambda _f: self._order._finish(self))
        else:
            self._order._finish(self)


class SessionOrder:
    """Runs each session's turns one at a time, in the order they were reserved.

    The work a leaving turn owes (``after``) runs on tasks this object owns; :meth:`aclose`
    waits for them, so nothing owed is dropped at shutdown."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}  # per session, the newest turn's ``_done``
        self._tasks: set[asyncio.Task[None]] = set()
        # turns that left owing work not yet run: queued behind earlier turns (each link of a
        # chain of left turns passes on one loop turn later, before any task exists) or running
        self._owed: set[SessionTurn] = set()

    def reserve(self, session_id: str, after: Callable[[], Awaitable[object]] | None = None) -> SessionTurn:
        """Take the next place in ``session_id``'s order. Synchronous: the order of the calls is
        the order of the turns."""
        turn = SessionTurn(self, session_id, self._last.get(session_id), after)
        self._last[session_id] = turn._done
        return turn

    def __len__(self) -> int:
        """Sessions with a turn in line or holding."""
        return len(self._last)

    def _finish(self, turn: SessionTurn) -> None:
        after, turn.after = turn.after, None
        if after is None:
            self._pass_on(turn)
            return
        task = asyncio.get_running_loop().create_task(self._run_after(turn, after),
                                                      name=f"hicache-session-{turn.session_id}-end")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_after(self, turn: SessionTurn, after: Callable[[], Awaitable[object]]) -> None:
        try:
            await after()
        except Exception as exc:  # noqa: BLE001 - whoever owed it is gone; the cache counts it
            logger.warning("ending session %s in its turn failed: %r", quoted(turn.session_id), exc)
        finally:
            self._pass_on(turn)

    def _pass_on(self, turn: SessionTurn) -> None:
        self._owed.discard(turn)
        turn._done.set_result(None)
        if self._last.get(turn.session_id) is turn._done:
            del self._last[turn.session_id]

    async def aclose(self) -> None:
        """Wait until the work owed by every turn that has left has run, that of turns still
        queued behind earlier ones included (a turn leaving meanwhile may owe more)."""
        while self._owed or self._tasks:
            await asyncio.gather(*(t._done for t in self._owed), *self._tasks, return_exceptions=True)
