"""What a cache stack runs for KV events: a hub subscriber feeding one publisher.

:class:`KVEventService` subscribes to the stack's
:class:`~hicache.observability.TierChangeHub`, turns each change into a vLLM-schema event
(:func:`~hicache.events.convert.to_event`, in the emitting thread: a few dict lookups and
``bytes.fromhex`` per page) and queues it on the
:class:`~hicache.events.publisher.EventPublisher` without blocking. In-process consumers get an
:class:`~hicache.events.stream.EventStream` from :meth:`KVEventService.stream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from hicache.events.convert import HashFormat, to_event
from hicache.events.publisher import EventPublisher
from hicache.events.stream import EventStream
from hicache.observability.tier_events import Tier, TierChange, TierChangeHub

__all__ = ["KVEventService", "start_events"]


class KVEventService:
    """Publishes the changes of ``hub`` (see the module docstring).

    Args:
        hub: the stack's tier-change hub.
        publisher: where events go (its ZMQ sockets, if any, and its streams).
        hash_format: ``"bytes"`` (32-byte sha256, vLLM's default) or ``"int"`` (low 64 bits).
        tiers: the tiers to publish (default: all three).
    """

    def __init__(
        self,
        hub: TierChangeHub,
        publisher: EventPublisher,
        *,
        hash_format: HashFormat = "bytes",
        tiers: Iterable[Tier | str] | None = None,
    ) -> None:
        if hash_format not in ("bytes", "int"):
            raise ValueError(f"hash_format must be 'bytes' or 'int', got {hash_format!r}")
        self.publisher = publisher
        self.hash_format: HashFormat = hash_format
        self.tiers = frozenset(Tier(t) for t in tiers) if tiers is not None else frozenset(Tier)
        self._unsubscribe = hub.subscribe(self._on_change)

    def _on_change(self, change: TierChange) -> None:
        if change.tier not in self.tiers:
            return
        event = to_event(change, self.hash_format)
        if event is not None:
            self.publisher.publish([event])

    def stream(self, maxsize: int = 1024) -> EventStream:
        """A new in-process consumer of every batch published from now on (call on its loop)."""
        stream = EventStream(maxsize, on_close=self.publisher.remove_stream)
        self.publisher.add_stream(stream)
        return stream

    def stats(self) -> dict[str, Any]:
        return self.publisher.stats()

    async def aclose(self) -> dict[str, Any]:
        """Stop listening, publish what is queued, close the sockets (off the event loop)."""
        self._unsubscribe()
        return await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)


def start_events(hub: TierChangeHub, config: Any) -> KVEventService:
    """A service for a deployment config's ``events`` section
    (:class:`~hicache.config.schema.EventsConfig`); raises ``ConfigError`` when a socket
    cannot be opened."""
    publisher = EventPublisher(
        config.endpoint,
        config.replay_endpoint,
        topic=config.topic,
        buffer_steps=config.buffer_steps,
        max_queue_events=config.max_queue_events,
        hwm=config.hwm,
        data_parallel_rank=config.data_parallel_rank,
    )
    return KVEventService(hub, publisher, hash_format=config.hash_format, tiers=config.tiers)
