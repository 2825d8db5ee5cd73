"""In-process KV events: ``async for seq, batch in stream`` with a bounded queue per consumer.

Why per-consumer queues: one slow consumer must neither block the publisher thread nor make
another consumer miss events. The publisher thread hands each batch to the consumer's event
loop (``call_soon_threadsafe``); a full queue drops the batch and counts it (``dropped``, and its
events in ``dropped_events``, which the publisher's ``dropped_events`` adds up), and the
consumer sees the gap in the sequence numbers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from hicache.events.schema import KVEventBatch

__all__ = ["EventStream"]

_CLOSED = object()


class EventStream:
    """One consumer's bounded queue of ``(seq, batch)``; iterate it on the loop that made it.

    ``on_close`` runs once when the stream closes (the publisher forgets it then).
    """

    def __init__(self, maxsize: int = 1024, on_close: Callable[[EventStream], None] | None = None) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()  # bounded by _put, which keeps one slot for _CLOSED
        self._maxsize = maxsize
        self._on_close = on_close
        self._closed = False
        self._sealed = False  # the end marker is queued (on the loop): a later batch is dropped
        self._lock = threading.Lock()
        self.dropped = 0
        #: the events of the dropped batches (the unit of the publisher's ``dropped_events``)
        self.dropped_events = 0
        self.delivered = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, seq: int, batch: KVEventBatch) -> None:
        """(Any thread.) Queue a batch for this consumer, dropping it when the queue is full."""
        if self._closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._put, (seq, batch))
        except RuntimeError:  # the consumer's loop is closed: nobody will read
            self.close()  # (and the publisher forgets the stream)

    def _put(self, item: tuple[int, KVEventBatch]) -> None:
        # not "closed": a batch offered before close() lands here after close() ran on its
        # thread, and ahead of the end marker (the loop runs these in order); dropping it lost
        # the last batches a closing publisher flushes, uncounted
        if self._sealed or self._queue.qsize() >= self._maxsize:
            with self._lock:
                self.dropped += 1
                self.dropped_events += len(item[1].events)
            return
        self._queue.put_nowait(item)

    def close(self) -> None:
        """(Any thread.) End the iteration once what is queued has been read. Idempotent."""
        with self._lock:
            already, self._closed = self._closed, True
        if already:
            return
        try:
            self._loop.call_soon_threadsafe(self._seal)
        except RuntimeError:
            pass
        if self._on_close is not None:
            self._on_close(self)

    def _seal(self) -> None:
        self._sealed = True
        self._queue.put_nowait(_CLOSED)

    async def get(self) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``; ``None`` once the stream is closed and drained."""
        item = await self._queue.get()
        if item is _CLOSED:
            self._queue.put_nowait(_CLOSED)  # later calls end too
            return None
        self.delivered += 1
        return item  # type: ignore[return-value]

    def __aiter__(self) -> AsyncIterator[tuple[int, KVEventBatch]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, KVEventBatch]]:
        try:
            while True:
                item = await self.get()
                if item is None:
                    return
                yield item
        finally:
            self.close()
