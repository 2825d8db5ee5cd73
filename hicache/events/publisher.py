"""The KV-event publisher: one thread that batches, numbers and sends events, never blocking the
tiers or the event loop.

Why a thread with a bounded queue: tiers report changes on the event loop and on I/O threads,
and a router may be slow, absent or gone. :meth:`EventPublisher.publish` only does a
``put_nowait``; when the queue is full the events are dropped and counted (``dropped_events``),
which a consumer also sees as a gap in the sequence numbers. The thread takes what is queued
(up to ``max_batch_events``) as one :class:`~hicache.events.schema.KVEventBatch`, numbers it
(0, 1, 2, ... per publisher, like vLLM) and hands it to:

* a ZMQ ``PUB`` socket, frames ``(topic, seq as 8 bytes big-endian, msgpack payload)`` - vLLM's
  wire protocol, so vLLM's consumers read it; the socket drops at its high-water mark rather
  than block;
* a bounded replay buffer served on a ``ROUTER`` socket: a consumer that (re)connects sends
  ``(b"", seq as 8 bytes)`` and gets every buffered batch from that sequence on as
  ``(b"", topic, seq, payload)``, then ``(b"", b"", -1 as 8 bytes, b"")`` - vLLM's replay;
* in-process streams (:class:`~hicache.events.stream.EventStream`), each with its own bounded
  queue.

Sockets are created, used and closed on the thread (ZMQ sockets are not thread-safe). An
exception while publishing one batch is logged and counted; the thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import zmq

from hicache.errors import ConfigError
from hicache.events.schema import KVEvent, KVEventBatch, encode_batch
from hicache.events.stream import EventStream

__all__ = ["END_SEQ", "EventPublisher", "is_bind_endpoint"]

log = logging.getLogger(__name__)

#: the sequence frame that ends a replay (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc/inproc addresses are bound, others connected to
    (a proxy in front of several replicas)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) \
        or endpoint.startswith(("tcp://127.0.0.1:", "tcp://localhost:", "tcp://0.0.0.0:"))


class EventPublisher:
    """See the module docstring. ``endpoint`` ``None`` publishes in-process only.

    Args:
        endpoint: the PUB address (``tcp://*:5557`` binds; ``tcp://host:port`` connects).
        replay_endpoint: the ROUTER address for replays (always bound), or ``None``.
        topic: the first frame of every message (consumers subscribe to a prefix of it).
        buffer_steps: batches kept for replay.
        max_queue_events: event lists queued for the thread before ``publish`` drops.
        max_batch_events: most events in one batch.
        hwm: the PUB socket's high-water mark (messages buffered per slow subscriber).
        data_parallel_rank: stamped on every batch (vLLM's field), or ``None``.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_events: int = 100_000,
        max_batch_events: int = 1024,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("max_queue_events", max_queue_events),
                            ("max_batch_events", max_batch_events), ("hwm", hwm)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"events: {name} must be a positive integer, got {value!r}")
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[list[KVEvent]] = queue.Queue(maxsize=max_queue_events)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._max_batch = max_batch_events
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._streams: tuple[EventStream, ...] = ()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint: str | None = endpoint
        self.replay_endpoint: str | None = replay_endpoint
        self.next_seq = 0
        self.published_batches = 0
        self.published_events = 0
        self.dropped_events = 0
        self.replay_requests = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            raise ConfigError("events: the publisher thread did not start within 10 s")
        if self._error is not None:
            self._thread.join(1.0)
            raise ConfigError(f"events: cannot open {endpoint!r} / {replay_endpoint!r}: {self._error}") from self._error

    # ------------------------------------------------------------------ producers (any thread)

    def publish(self, events: list[KVEvent]) -> bool:
        """Queue ``events`` for the next batch without blocking; ``False`` when they were
        dropped (queue full, or the publisher is closed)."""
        if not events:
            return True
        if self._closing.is_set():
            self._drop(len(events))
            return False
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self._drop(len(events))
            return False
        return True

    def _drop(self, n: int) -> None:
        with self._lock:
            self.dropped_events += n

    def add_stream(self, stream: EventStream) -> None:
        with self._lock:
            self._streams = (*self._streams, stream)

    def remove_stream(self, stream: EventStream) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams = tuple(s for s in self._streams if s is not stream)
                self.dropped_events += stream.dropped  # a closed stream drops no more

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "next_seq": self.next_seq,
                "published_batches": self.published_batches,
                "published_events": self.published_events,
                "dropped_events": self.dropped_events + sum(s.dropped for s in self._streams),
                "queued": self._queue.qsize(),
                "replay_requests": self.replay_requests,
                "errors": self.errors,
            }

    def close(self, timeout: float = 2.0) -> dict[str, Any]:
        """Publish what is queued (for at most ``timeout`` s), close the sockets and the
        streams; returns :meth:`stats`. Idempotent; blocks, so call it off the event loop."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv events: publisher still busy after %.1fs; %d event lists left", timeout, self._queue.qsize())
        for stream in self._streams:
            stream.close()
        return self.stats()

    # ------------------------------------------------------------------ the thread

    def _open_sockets(self, ctx: zmq.Context) -> tuple[zmq.Socket | None, zmq.Socket | None]:
        pub = replay = None
        try:
            if self.endpoint is not None:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self._hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if is_bind_endpoint(self.endpoint):
                    pub.bind(self.endpoint)
                    self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by the buffer: send it all
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            raise
        return pub, replay

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        try:
            pub, replay = self._open_sockets(ctx)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None:
                    self._serve_replays(replay)
                try:
                    first = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._closing.is_set():
                        return
                    continue
                self._publish_batch(pub, self._take_more(first))
        finally:
            for s in (pub, replay):
                if s is not None:
                    s.close(0)

    def _take_more(self, first: list[KVEvent]) -> list[KVEvent]:
        events = list(first)
        while len(events) < self._max_batch:
            try:
                events.extend(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _publish_batch(self, pub: zmq.Socket | None, events: list[KVEvent]) -> None:
        try:
            seq = self.next_seq
            batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
            payload = encode_batch(batch)
            if pub is not None:
                try:
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # PUB drops at the HWM; the consumer sees a gap and replays
            self._buffer.append((seq, payload))
            with self._lock:
                self.next_seq = seq + 1
                self.published_batches += 1
                self.published_events += len(events)
                streams = self._streams
            for stream in streams:
                stream.offer(seq, batch)
        except Exception:  # noqa: BLE001 - the thread must outlive a bad batch
            with self._lock:
                self.errors += 1
                self.dropped_events += len(events)
            log.exception("kv events: publishing a batch of %d events failed", len(events))

    def _serve_replays(self, replay: zmq.Socket) -> None:
        while replay.poll(0):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._answer(replay, frames)
            except Exception:  # noqa: BLE001 - a bad request must not stop publishing
                with self._lock:
                    self.errors += 1
                log.exception("kv events: answering a replay request failed")

    def _answer(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            if frames and len(frames) >= 2:
                replay.send_multipart((frames[0], b"", b"", END_SEQ, b""))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            self.replay_requests += 1
        for seq, payload in self._snapshot(start):
            replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _snapshot(self, start: int) -> Iterable[tuple[int, bytes]]:
        return [(s, p) for s, p in self._buffer if s >= start]
