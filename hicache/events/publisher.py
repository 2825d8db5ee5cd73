"""The KV-event publisher: one thread that batches, numbers and sends events, never blocking the
tiers or the event loop.

Why a thread with a bounded queue: tiers report changes on the event loop and on I/O threads,
and a router may be slow, absent or gone. :meth:`EventPublisher.publish` only does a
``put_nowait``; when the queue is full the events are dropped and counted (``dropped_events``),
which a consumer also sees as a gap in the sequence numbers: dropped events never reach the
thread, so the thread skips one number before its next batch (nothing is buffered under it; a
batch that failed to publish is skipped the same way; when no batch follows, an empty one is sent
after the skipped number). A consumer sees the gap, its replay finds
nothing there, and it counts the batch lost (``lost``) - it knows its view of this replica is
incomplete. Why a gap and not an ``AllBlocksCleared``: vLLM-schema consumers take that event as
"the replica's cache was emptied" and forget every block of it, and nothing announces the blocks
still held again, so a few lost events would cost the router every prefix this replica still
holds; a gap is what vLLM's own consumer already watches for (it asks for a replay).

The thread takes what is queued (up to ``max_batch_events``) as one
:class:`~hicache.events.schema.KVEventBatch`, numbers it (0, 1, 2, ... per publisher, like vLLM)
and hands it to:

* a ZMQ ``PUB`` socket, frames ``(topic, seq as 8 bytes big-endian, msgpack payload)`` - vLLM's
  wire protocol, so vLLM's consumers read it; the socket drops at its high-water mark rather
  than block;
* a bounded replay buffer served on a ``ROUTER`` socket: a consumer that (re)connects sends
  ``(b"", seq as 8 bytes)`` and gets every buffered batch from that sequence on (up to the
  newest one when the request arrived) as ``(b"", topic, seq, payload)``, then
  ``(b"", run, -1 as 8 bytes, b"")`` - vLLM's replay, whose end marker has ``b""`` where ours
  has ``run``: ``RUN_PREFIX`` and this publisher's run id in 16 hex digits (see below);
* in-process streams (:class:`~hicache.events.stream.EventStream`), each with its own bounded
  queue.

Run id: sequence numbers restart at 0 with every publisher, so a consumer cannot tell a
restarted publisher from the one it knew by the numbers alone (the new one may be exactly where
the old one was). Each publisher draws a random 64-bit ``run_id``; consumers read it from the end
of any replay (a request for a sequence beyond the newest answers only the end marker: a cheap
probe). vLLM's consumers read ``-1`` in the sequence frame and ignore the frame before it.

Why replays are served in slices: an answer is up to the whole buffer, and a consumer that asks
and does not read (stuck, or retrying in a loop) must not make this process hold answer after
answer, nor delay live batches. So the ROUTER has a finite high-water mark (``replay_hwm``
messages per consumer) and ``ROUTER_MANDATORY``, and sends never block: a full consumer is
retried on the next pass and its replays are dropped after ``replay_stall_s`` without progress
(``replays_dropped``; the consumer times out and counts what it lacks as lost); a consumer that
went away is dropped at once. Each consumer has at most ``replay_pending`` requests open and at
most ``replay_clients`` consumers are served at once: further requests are refused
(``replays_refused``; a new consumer gets an empty answer, one with a replay open gets none, as
an end marker in the middle of its replay would end that one). Each pass of the thread sends at
most ``replay_pass_bytes`` of answers, round-robin over consumers, then publishes the next live
batch.

Sockets are created, used and closed on the thread (ZMQ sockets are not thread-safe). An
exception while publishing one batch or serving one replay is logged and counted (``errors``);
the thread goes on.
"""

from __future__ import annotations

import errno
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import zmq

from hicache.errors import ConfigError
from hicache.events.schema import KVEvent, KVEventBatch, encode_batch
from hicache.events.stream import EventStream

__all__ = ["END_SEQ", "RUN_PREFIX", "EventPublisher", "allow_ipv6", "is_bind_endpoint", "parse_run_frame", "run_frame"]

log = logging.getLogger(__name__)

#: the sequence frame that ends a replay (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: what precedes the run id (16 hex digits) in the end marker's second frame
RUN_PREFIX = b"hicache-run="
_POLL_S = 0.05
_STALLED_POLL_S = 0.005  # replays wait on full consumers: look again soon, without spinning
_REQUESTS_PER_PASS = 64  # a flood of requests is read in slices too
_FRAME_COST = 64  # bytes a message counts for beyond its payload (identity, seq, topic)


def run_frame(run_id: int) -> bytes:
    """The end marker's second frame for ``run_id``."""
    return RUN_PREFIX + b"%016x" % run_id


def parse_run_frame(frame: bytes) -> int | None:
    """The run id in an end marker's second frame; ``None`` for vLLM's and older publishers'
    ``b""`` (or anything else)."""
    if len(frame) != len(RUN_PREFIX) + 16 or not frame.startswith(RUN_PREFIX):
        return None
    try:
        return int(frame[len(RUN_PREFIX):], 16)
    except ValueError:
        return None


@dataclass(slots=True)
class _Replay:
    """One open replay request: what to send next, where to stop, since when it is blocked."""

    next: int
    end: int
    stalled_since: float | None = None


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc/inproc addresses are bound, others connected to
    (a proxy in front of several replicas)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) \
        or endpoint.startswith(("tcp://127.0.0.1:", "tcp://localhost:", "tcp://0.0.0.0:"))


def allow_ipv6(sock: zmq.Socket, endpoint: str) -> None:
    """Turn on ``sock``'s IPV6 option for an IPv6 address (``tcp://[::]:5557``), before it
    binds or connects: without it ZMQ refuses one ("No such device"). vLLM's publisher does
    the same."""
    if endpoint.startswith("tcp://") and ":" in endpoint[len("tcp://"):].rpartition(":")[0]:
        sock.setsockopt(zmq.IPV6, 1)


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
        replay_hwm: answer messages ZMQ may hold per replay consumer.
        replay_clients: consumers whose replays are served at once.
        replay_pending: open requests per consumer (the one being answered included).
        replay_pass_bytes: answer bytes sent per pass of the thread before the next live batch.
        replay_stall_s: a replay whose consumer reads nothing for this long is dropped.
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
        replay_hwm: int = 32,
        replay_clients: int = 8,
        replay_pending: int = 2,
        replay_pass_bytes: int = 1 << 20,
        replay_stall_s: float = 10.0,
    ) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("max_queue_events", max_queue_events),
                            ("max_batch_events", max_batch_events), ("hwm", hwm), ("replay_hwm", replay_hwm),
                            ("replay_clients", replay_clients), ("replay_pending", replay_pending),
                            ("replay_pass_bytes", replay_pass_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"events: {name} must be a positive integer, got {value!r}")
        if isinstance(replay_stall_s, bool) or not isinstance(replay_stall_s, int | float) or not replay_stall_s > 0:
            raise ConfigError(f"events: replay_stall_s must be a positive number, got {replay_stall_s!r}")
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[list[KVEvent]] = queue.Queue(maxsize=max_queue_events)
        # (seq, payload); ``None`` for a skipped number (dropped events), so numbers stay consecutive
        self._buffer: deque[tuple[int, bytes | None]] = deque(maxlen=buffer_steps)
        self._max_batch = max_batch_events
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._replay_hwm = replay_hwm
        self._replay_clients = replay_clients
        self._replay_pending = replay_pending
        self._replay_pass_bytes = replay_pass_bytes
        self._replay_stall_s = float(replay_stall_s)
        # open replays per consumer identity, first one being answered; only the thread uses it
        self._replays: OrderedDict[bytes, deque[_Replay]] = OrderedDict()
        #: random per publisher: tells consumers a restarted publisher from the one they knew
        self.run_id = secrets.randbits(64)
        self._run_frame = run_frame(self.run_id)
        self._streams: tuple[EventStream, ...] = ()
        self._lock = threading.Lock()
        self._gap_pending = False  # events were dropped since the last batch (under _lock)
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
        self.replays_served = 0
        self.replays_refused = 0
        self.replays_dropped = 0
        self.replays_open = 0
        self.replay_bytes = 0
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
            self._gap_pending = True  # the next batch's number is skipped: consumers see the loss

    def add_stream(self, stream: EventStream) -> None:
        with self._lock:
            self._streams = (*self._streams, stream)

    def remove_stream(self, stream: EventStream) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams = tuple(s for s in self._streams if s is not stream)
                # its drops so far (a batch that raced its end marker is counted on the stream alone)
                self.dropped_events += stream.dropped_events

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "next_seq": self.next_seq,
                "published_batches": self.published_batches,
                "published_events": self.published_events,
                "dropped_events": self.dropped_events + sum(s.dropped_events for s in self._streams),
                "queued": self._queue.qsize(),
                "replay_requests": self.replay_requests,
                "replays_served": self.replays_served,
                "replays_refused": self.replays_refused,
                "replays_dropped": self.replays_dropped,
                "replays_open": self.replays_open,
                "replay_bytes": self.replay_bytes,
                "run_id": f"{self.run_id:016x}",
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
                allow_ipv6(pub, self.endpoint)
                if is_bind_endpoint(self.endpoint):
                    pub.bind(self.endpoint)
                    self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, self._replay_hwm)  # bounded: see the module docstring
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone consumer raises, never queues
                allow_ipv6(replay, self.replay_endpoint)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            raise
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._open_sockets(ctx)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                wait = _POLL_S
                if replay is not None:
                    progressed = self._serve_replays(replay)
                    if progressed:
                        wait = 0.0  # more to send: only a live batch goes first
                    elif self._replays:
                        wait = _STALLED_POLL_S
                try:
                    first = self._queue.get(timeout=wait) if wait else self._queue.get_nowait()
                except queue.Empty:
                    if self._gap_pending:
                        self._publish_gap_marker(pub)
                    if self._closing.is_set():
                        return
                    continue
                self._publish_batch(pub, self._take_more(first))
        finally:
            with self._lock:  # replays still open are not answered any more
                self.replays_dropped += self.replays_open
                self.replays_open = 0
            self._replays.clear()
            for s in (pub, replay):
                if s is not None:
                    s.close(0)

    def _publish_gap_marker(self, pub: zmq.Socket | None) -> None:
        """Publish an empty batch after the number a drop skipped, the queue being empty.

        Why: a drop skips the number of the *next* batch (:meth:`_publish_batch`). When the
        drop ends a burst no next batch comes, and consumers saw nothing: a live one waits
        for a number that never follows, and a replay probe answers the newest number, which
        the skip had not taken yet. With this marker every consumer sees the gap within a
        poll of the burst's end. It is sent only after a drop, at most once a poll; an empty
        batch is valid vLLM-schema KV events, which vLLM's consumers read as no events."""
        self._publish_batch(pub, [])

    def _take_more(self, first: list[KVEvent]) -> list[KVEvent]:
        events = list(first)
        while len(events) < self._max_batch:
            try:
                events.extend(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _publish_batch(self, pub: zmq.Socket | None, events: list[KVEvent]) -> None:
        with self._lock:
            if self._gap_pending:  # events dropped since the last batch: see the module docstring
                self._gap_pending = False
                self._buffer.append((self.next_seq, None))  # a replay skips it: counted lost
                self.next_seq += 1
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
                self._gap_pending = True  # as for a drop: the next batch's number tells the loss
            log.exception("kv events: publishing a batch of %d events failed", len(events))

    def _serve_replays(self, replay: zmq.Socket) -> bool:
        """Read new requests, then send answers for at most ``replay_pass_bytes``, one consumer
        after another; ``True`` when something was sent. Never raises (the thread must go on)."""
        for _ in range(_REQUESTS_PER_PASS):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except Exception:  # noqa: BLE001 - counted; the socket is read again next pass
                self._count_error("reading a replay request")
                break
            try:
                self._accept(replay, frames)
            except Exception:  # noqa: BLE001 - a bad request must not stop publishing
                self._count_error("accepting a replay request")
        budget = self._replay_pass_bytes
        progressed = False
        now = time.monotonic()
        for client in list(self._replays):
            if budget <= 0:
                break
            self._replays.move_to_end(client)  # the next pass starts with the next consumer
            try:
                sent = self._send_some(replay, client, budget, now)
            except Exception:  # noqa: BLE001 - drop this consumer's replays rather than fail again
                self._count_error("answering a replay request")
                self._drop_replays(client)
                continue
            budget -= sent
            progressed = progressed or sent > 0
        return progressed

    def _count_error(self, what: str) -> None:
        with self._lock:
            self.errors += 1
        log.exception("kv events: %s failed", what)

    def _accept(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        """Open a replay for a well-formed request, or refuse it (see the module docstring)."""
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            if len(frames) >= 2 and frames[0] not in self._replays:
                self._send_end(replay, frames[0])  # an empty answer, not a hang
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        pending = self._replays.get(client)
        full = len(self._replays) >= self._replay_clients if pending is None else len(pending) >= self._replay_pending
        with self._lock:
            self.replay_requests += 1
            if full:
                self.replays_refused += 1
            else:
                self.replays_open += 1
        if full:
            if pending is None:  # nothing of this consumer's is open: an empty answer ends its wait
                self._send_end(replay, client)
            return
        request = _Replay(next=start, end=self.next_seq)  # what is published meanwhile is live
        if pending is None:
            self._replays[client] = deque((request,))
        else:
            pending.append(request)

    def _send_end(self, replay: zmq.Socket, client: bytes) -> bool:
        try:
            replay.send_multipart((client, b"", self._run_frame, END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError:  # full or gone: the consumer times out
            return False
        return True

    def _send_some(self, replay: zmq.Socket, client: bytes, budget: int, now: float) -> int:
        """Send ``client``'s open replay on for at most ``budget`` bytes (at least one message);
        returns the bytes sent."""
        pending = self._replays[client]
        request = pending[0]
        sent = 0
        while sent < budget:
            oldest = self._buffer[0][0] if self._buffer else self.next_seq
            request.next = max(request.next, oldest)  # gone from the buffer: the consumer sees the gap
            payload = self._payload(request.next) if request.next < request.end else None
            if request.next < request.end and payload is None:
                request.next += 1  # not in the buffer (a failed batch): the consumer sees the gap
                continue
            if payload is None:
                frames: tuple[bytes, ...] = (client, b"", self._run_frame, END_SEQ, b"")
            else:
                frames = (client, b"", self._topic, request.next.to_bytes(8, "big"), payload)
            try:
                replay.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: try again next pass, up to replay_stall_s
                if request.stalled_since is None:
                    request.stalled_since = now
                elif now - request.stalled_since >= self._replay_stall_s:
                    log.warning("kv events: dropped the replays of a consumer that reads nothing")
                    self._drop_replays(client)
                break
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._drop_replays(client)  # it went away
                break
            request.stalled_since = None
            cost = _FRAME_COST + (len(payload) if payload is not None else 0)
            sent += cost
            with self._lock:
                self.replay_bytes += cost
            if payload is not None:
                request.next += 1
                continue
            pending.popleft()
            with self._lock:
                self.replays_served += 1
                self.replays_open -= 1
            if not pending:
                del self._replays[client]
            break
        return sent

    def _drop_replays(self, client: bytes) -> None:
        pending = self._replays.pop(client, None)
        if pending:
            with self._lock:
                self.replays_dropped += len(pending)
                self.replays_open -= len(pending)

    def _payload(self, seq: int) -> bytes | None:
        """The buffered payload of ``seq`` (the buffer's numbers are consecutive); ``None`` when
        it is not buffered or was skipped."""
        if not self._buffer:
            return None
        i = seq - self._buffer[0][0]
        return self._buffer[i][1] if 0 <= i < len(self._buffer) else None
