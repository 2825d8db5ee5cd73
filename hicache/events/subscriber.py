"""A KV-event consumer that never silently misses a batch: ZMQ SUB plus replay on gaps.

Why replay: PUB/SUB drops messages while a subscriber is (re)connecting, and drops at the
high-water mark when it is slow. Every batch carries its sequence number, so a gap is visible;
the subscriber then asks the publisher's replay socket for everything since the first missing
number (vLLM's protocol, see :mod:`hicache.events.publisher`) and yields those batches in order
before going on, skipping live duplicates. Batches older than the publisher's replay buffer are
lost, and counted (``lost``). A live sequence number that goes back (live numbers only grow) is
a restarted publisher: the subscriber follows its new numbers (``restarts``).

Used by ``hicache events URL`` and by the tests; synchronous (a router would run it on a thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq

from hicache.events.publisher import END_SEQ
from hicache.events.schema import KVEventBatch, decode_batch

__all__ = ["EventSubscriber", "Received"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """One batch, and whether it came through a replay rather than live."""

    seq: int
    batch: KVEventBatch
    replayed: bool = False


class EventSubscriber:
    """Connects to a publisher's PUB (and, optionally, replay) endpoint.

    Args:
        endpoint: the publisher's PUB address (``tcp://host:5557``).
        replay_endpoint: its ROUTER address, or ``None`` (gaps are then only counted).
        topic: subscribe to messages whose topic starts with this.
        start_seq: replay from this sequence before going live (``None``: live only).
        replay_timeout_s: how long one replay may take before it is given up (counted).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        start_seq: int | None = None,
        replay_timeout_s: float = 5.0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._sub = self._connect()
        self._replay: zmq.Socket | None = None
        self._replay_timeout = replay_timeout_s
        self.next_seq: int | None = start_seq
        self._last_live: int | None = None  # the last sequence seen on the live socket
        self._catch_up = start_seq is not None
        self.gaps = 0
        self.lost = 0
        self.replayed = 0
        self.restarts = 0
        self.bad_messages = 0

    def _connect(self) -> zmq.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        return sub

    def reconnect(self) -> None:
        """Drop the connection and make a new one, keeping the position: what was published
        meanwhile comes through the replay when the next live batch shows the gap."""
        self._sub.close(0)
        self._sub = self._connect()

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(0)
        self._replay = None

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving

    def receive(self, timeout_s: float | None = None) -> Iterator[Received]:
        """Yield batches in sequence order; stops after ``timeout_s`` without a live message
        (``None``: never)."""
        if self._catch_up:
            self._catch_up = False
            time.sleep(0.1)  # let the subscription reach the publisher before the replay
            yield from self._replay_from(self.next_seq or 0)
        poll_ms = None if timeout_s is None else int(timeout_s * 1000)
        while True:
            if not self._sub.poll(poll_ms):
                return
            frames = self._sub.recv_multipart()
            item = self._decode(frames)
            if item is None:
                continue
            seq, batch = item
            restarted = self._last_live is not None and seq <= self._last_live  # live numbers only grow
            self._last_live = seq
            if restarted:
                self.restarts += 1  # a new publisher numbers from 0 again: follow it
            elif self.next_seq is not None and seq < self.next_seq:
                continue  # a duplicate of something a replay gave us
            elif self.next_seq is not None and seq > self.next_seq:
                self.gaps += 1
                yield from self._replay_from(self.next_seq, upto=seq)
                if seq < (self.next_seq or 0):
                    continue
            self.next_seq = seq + 1
            yield Received(seq, batch)

    def _decode(self, frames: list[bytes]) -> tuple[int, KVEventBatch] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return None
        try:
            return int.from_bytes(frames[1], "big"), decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.bad_messages += 1
            log.warning("kv events: undecodable batch (%s)", exc)
            return None

    def _replay_from(self, start: int, upto: int | None = None) -> Iterator[Received]:
        """Batches ``start`` .. (``upto`` - 1, or the newest) from the replay socket; what the
        buffer no longer holds is counted as lost."""
        if self.replay_endpoint is None:
            if upto is not None:
                self.lost += upto - start
            return
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        expected = start
        deadline = time.monotonic() + self._replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                log.warning("kv events: replay from %d timed out", start)
                self._replay.close(0)  # a late answer must not be read as the next one's
                self._replay = None
                break
            frames = self._replay.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:  # (b"", topic, seq, payload) until the end
                break
            item = self._decode(frames[1:]) if len(frames) == 4 else None
            if item is None:
                continue
            seq, batch = item
            if seq < expected or (upto is not None and seq >= upto):
                continue
            if seq > expected:
                self.lost += seq - expected  # older than the publisher's buffer
            expected = seq + 1
            self.replayed += 1
            self.next_seq = expected
            yield Received(seq, batch, replayed=True)
        if upto is not None and expected < upto:
            self.lost += upto - expected
            self.next_seq = upto
