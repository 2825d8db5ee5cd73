"""``WriteBackQueue.drain`` when copies can never finish: it reports them and returns, and it
never holds the event loop."""

from __future__ import annotations

import asyncio
import types

from hicache.session.writeback import WriteBackQueue


class _ClosedTree:
    """A tree whose controller has closed: one node's copy is in flight for good, and
    ``drain_backups`` returns at once (nothing left to wait for)."""

    def __init__(self) -> None:
        self.root_node = types.SimpleNamespace(parent=None)
        self.node = types.SimpleNamespace(parent=self.root_node, host_value=None, backup_op=object(), value=object())
        self.drains = 0

    def write_backup(self, node: object) -> bool:
        return False

    async def drain_backups(self) -> None:
        self.drains += 1


async def test_drain_gives_up_copies_that_can_never_finish_and_yields_meanwhile() -> None:
    tree = _ClosedTree()
    counts: dict[str, int] = {}
    queue = WriteBackQueue(tree, count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))
    queue.enqueue("chat", tree.node, 12)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    try:
        await asyncio.wait_for(queue.drain(), 2.0)
    finally:
        other.cancel()
    assert len(queue) == 0
    assert counts["writeback_lost"] == 1
    assert ticks > 0  # the loop ran other work while drain went round
