"""A KV-event consumer that never silently misses a batch: ZMQ SUB plus replay on gaps.

Why replay: PUB/SUB drops messages while a subscriber is (re)connecting, and drops at the
high-water mark when it is slow. Every batch carries its sequence number, so a gap is visible;
the subscriber then asks the publisher's replay socket for everything since the first missing
number (vLLM's protocol, see :mod:`hicache.events.publisher`) and yields those batches in order
before going on, skipping live duplicates. Batches older than the publisher's replay buffer are
lost, and counted (``lost``).

Why tail checks: a gap shows only when a later batch arrives. Batches lost at the end of a burst
(the PUB's high-water mark, a proxy) or published while the SUB was (re)connecting are followed
by nothing when the cache then goes quiet, and the consumer's view would lag until it publishes
again. So the subscriber also asks the replay socket for everything from ``next_seq`` once the
live socket has been silent for ``idle_timeout_s`` after a batch (or ``receive`` times out
first), and shortly after its SUB (re)connects; what the answer holds is yielded like a gap's
replay, what the buffer no longer holds is counted lost. One request per quiet period, and only
after something happened (a batch, a reconnect): an idle subscriber does not poll, and when
nothing was missed the answer is the end marker alone (nothing counted). While the monitor
says the SUB is disconnected there is nothing to ask; the reconnect asks.

Why run ids: a restarted publisher numbers from 0 again and its first batches are published
before this subscriber's connection to it carries the subscription, so they never arrive live.
Its numbers alone do not always show the restart (they may go on exactly where the old
publisher stopped). Our publishers end every replay with their random run id, and the socket's
monitor tells when the SUB (re)connects; on the first live batch after a (re)connect (or the
tail check after it, when no live batch comes first), a gap, or numbers going back, the
subscriber asks for the run id (an empty replay: one round trip). A new run is a restart
(``restarts``): the subscriber replays the new publisher's batches from 0 up to the live one (or
all it has, at a tail check), then follows its numbers. A live batch read after the run id
changed may still be the old publisher's (queued in the SUB before its connection dropped): the
new publisher's batch of that number is asked for and compared, and an old one is yielded as the
old run's. Without run ids (vLLM's publisher, older hicache ones)
the numbers decide: a live number at or below the last live one is a restart; so is a first
live number below the position a consumer resumed from (``start_seq``) when the catch-up replay
had nothing at or after it (the publisher never got there: it is a new one). A consumer that
saves its position saves ``run_id`` with it and passes it back (``start_run_id``) so that a
resume against a new publisher starts from 0 however far that one got.

Used by ``hicache events URL`` and by the tests; synchronous (a router would run it on a thread).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from hicache.errors import quoted
from hicache.events.publisher import END_SEQ, allow_ipv6, parse_run_frame
from hicache.events.schema import KVEventBatch, decode_batch

__all__ = ["EventSubscriber", "Received"]

log = logging.getLogger(__name__)

#: a replay request beyond any batch: the answer is only the end marker, with the run id
_PROBE_SEQ = (1 << 63) - 1
#: after a (re)connect, the time the subscription takes to reach the publisher: a tail request
#: sent sooner could miss batches published between its answer and the subscription
_SETTLE_S = 0.1


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
        start_run_id: the publisher run ``start_seq`` belongs to (a saved ``run_id``); when the
            publisher now runs another one, the catch-up starts from 0 (``None``: unknown).
        replay_timeout_s: how long a replay answer may stay silent before it is given up (what it
            had answered is kept, and the rest asked for again while answers make progress).
        idle_timeout_s: how long the live socket may stay silent after a batch before the
            subscriber asks the replay socket whether the last batches were lost on the way (see
            the module docstring).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        start_seq: int | None = None,
        start_run_id: int | None = None,
        replay_timeout_s: float = 5.0,
        idle_timeout_s: float = 1.0,
    ) -> None:
        # a negative replay timeout polled without limit: a silent publisher hung the consumer
        for name, value in (("idle_timeout_s", idle_timeout_s), ("replay_timeout_s", replay_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        if start_seq is not None and (isinstance(start_seq, bool) or not isinstance(start_seq, int)
                                      or not 0 <= start_seq < (1 << 63) - 1):
            raise ValueError(f"start_seq must be an integer from 0 to 2**63 - 2, got {start_seq!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._monitor: zmq.Socket | None = None
        self._connected = False  # the SUB has a connection (as far as the monitor tells)
        self._verify = False  # the SUB (re)connected: check the publisher's run on the next live batch
        self._idle_timeout = float(idle_timeout_s)
        self._tail_due: float | None = None  # when to ask for batches lost at the tail (None: nothing to ask)
        self._sub = self._connect()
        self._replay: zmq.Socket | None = None
        self._replay_timeout = float(replay_timeout_s)
        self.next_seq: int | None = start_seq
        self._last_live: int | None = None  # the last sequence seen on the live socket
        self._catch_up = start_seq is not None
        self._start_run = start_run_id
        self._resumed_at: int | None = None  # a catch-up found nothing at or after this position
        self._answer_run: int | None = None  # the run id of the last replay answer
        self._answer_ended = False  # whether the last replay answer came to its end marker
        self._old_run = False  # the last live batch was still queued from a publisher that restarted
        #: the run id of the publisher whose numbers ``next_seq`` follows (``None``: not known)
        self.run_id: int | None = start_run_id
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
        try:  # tells reconnects; without a monitor, numbers alone tell restarts
            self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as exc:
            log.warning("kv events: no socket monitor (%s); restarts are told by sequence numbers only", exc)
            self._monitor = None
        self._connected = self._monitor is None  # without a monitor, assume a connection
        allow_ipv6(sub, self.endpoint)
        sub.connect(self.endpoint)
        return sub

    def _close_sub(self) -> None:
        if self._monitor is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        self._sub.close(0)

    def _reconnected(self) -> bool:
        """Whether the SUB (re)connected since the last call (monitor events, read without
        waiting); keeps ``_connected`` up to date."""
        seen = False
        while self._monitor is not None and cast(int, self._monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            if event.get("event") == zmq.EVENT_CONNECTED:
                seen = self._connected = True
            elif event.get("event") == zmq.EVENT_DISCONNECTED:
                self._connected = False
        return seen

    def _note_reconnect(self) -> bool:
        """Read the monitor: after a (re)connect the publisher's run is checked (on the next live
        batch, or by the tail check) and what was published meanwhile is asked for once the
        subscription has settled, even if no live batch follows to show the gap. Returns
        whether it (re)connected."""
        if not self._reconnected():
            return False
        self._verify = True
        due = time.monotonic() + _SETTLE_S
        self._tail_due = due if self._tail_due is None else min(self._tail_due, due)
        return True

    def reconnect(self) -> None:
        """Drop the connection and make a new one, keeping the position: what was published
        meanwhile comes through the replay, when the next live batch shows the gap or, if none
        comes, by the tail check after the new connection is made."""
        self._close_sub()
        self._sub = self._connect()

    def close(self) -> None:
        self._close_sub()
        if self._replay is not None:
            self._replay.close(0)
        self._replay = None

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving

    def receive(self, timeout_s: float | None = None) -> Iterator[Received]:
        """Yield batches in sequence order; stops after ``timeout_s`` without a batch (``None``:
        never). A silence of ``idle_timeout_s`` after a batch or a reconnect, or the end of
        ``timeout_s``, asks once for batches lost at the tail (see the module docstring)."""
        if self._catch_up:
            self._catch_up = False
            time.sleep(_SETTLE_S)  # let the subscription reach the publisher before the replay
            self._reconnected()  # that connection is older than the catch-up, which tells the run
            yield from self._catch_up_from(self.next_seq or 0)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            wake = min((t for t in (deadline, self._tail_due) if t is not None), default=None)
            if not self._wait_live(None if wake is None else wake - now):
                now = time.monotonic()
                timed_out = deadline is not None and now >= deadline
                if self._tail_due is None or not (timed_out or now >= self._tail_due):
                    if timed_out:
                        return
                    continue  # woken by the monitor, or early
                got = False
                for received in self._fill_tail():
                    got = True
                    yield received
                if got and timeout_s is not None:
                    deadline = time.monotonic() + timeout_s  # batches came: the silence starts again
                elif timed_out:
                    return
                continue
            frames = self._sub.recv_multipart()
            if timeout_s is not None:
                deadline = time.monotonic() + timeout_s
            item = self._decode(frames)
            if item is None:
                continue
            seq, batch = item
            self._note_reconnect()
            # a quiet period starts with every live batch: if it is the last for a while, ask
            # whether the ones after it were lost on the way
            self._tail_due = time.monotonic() + self._idle_timeout
            restarted = self._restarted(seq, batch)
            self._last_live = seq
            if restarted:  # a new publisher: its batches from 0, then its numbers
                self.restarts += 1
                self.next_seq = 0
                yield from self._replay_from(0, upto=seq)
            elif self.next_seq is not None and seq < self.next_seq:
                continue  # a duplicate of something a replay gave us
            elif self.next_seq is not None and seq > self.next_seq:
                self.gaps += 1
                if self._old_run:  # that publisher is gone: its replay socket is the new one's
                    self.lost += seq - self.next_seq
                    self.next_seq = seq
                else:
                    yield from self._replay_from(self.next_seq, upto=seq)
                if seq < (self.next_seq or 0):
                    continue
            self.next_seq = seq + 1
            yield Received(seq, batch)

    def _wait_live(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` (``None``: no limit) for a live message, reading the monitor
        meanwhile (a reconnect sets the tail check); ``True`` when a message waits."""
        poller = zmq.Poller()  # made each time: reconnect() replaces both sockets
        poller.register(self._sub, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))
        if self._monitor is not None and self._monitor in ready:
            self._note_reconnect()
        return self._sub in ready

    def _fill_tail(self) -> Iterator[Received]:
        """The tail check: everything the publisher has from ``next_seq`` on (lost at the end of
        a burst, or while reconnecting), what it no longer holds counted as lost; a restarted
        publisher (another run id since a reconnect) is replayed from 0. Done once per quiet
        period: a check that found something sets another, in case more was lost meanwhile."""
        self._tail_due = None
        if self.replay_endpoint is None or self.next_seq is None:
            return
        if self._note_reconnect() or not self._connected:
            return  # just reconnected: asked once that settles; disconnected: the reconnect asks
        if self._verify:  # (re)connected since the last live batch: is it still the same publisher?
            changed = self._run_changed()
            if not self._answer_ended:
                return  # no answer (logged): the next live batch asks again
            self._verify = False
            if changed:
                self.restarts += 1  # a new publisher: its batches from 0
                self.next_seq = 0
                self._last_live = None  # the old run's numbers tell nothing about the new one's
        before = (self.replayed, self.lost)
        done = False
        try:
            yield from self._replay_from(self.next_seq)
            done = True
        finally:
            if (self.replayed, self.lost) != before:
                self.gaps += 1
                # more may have been lost meanwhile; a consumer that stopped reading gets the rest
                self._tail_due = time.monotonic() + (self._idle_timeout if done else 0.0)

    def _catch_up_from(self, start: int) -> Iterator[Received]:
        if self.replay_endpoint is not None:
            # the run asked first, not read from the replay's end marker alone: a consumer that
            # stops inside the catch-up never reads that marker, and saved its position with
            # ``run_id`` None (a resume against a restarted publisher then went by numbers)
            run = self._probe()
            if run is not None and self._start_run is not None and run != self._start_run:
                self.restarts += 1  # the saved position is another publisher's
                self.next_seq = start = 0
            if run is not None:
                self.run_id = run
        got = False
        for received in self._replay_from(start):
            got = True
            yield received
        if not got and self._start_run is None:
            self._resumed_at = start

    def _restarted(self, seq: int, batch: KVEventBatch) -> bool:
        """Whether the live batch ``seq`` comes from another publisher than ``next_seq``'s (see
        the module docstring); asks for the run id when something looks different."""
        went_back = self._last_live is not None and seq <= self._last_live  # live numbers only grow
        ahead = self.next_seq is not None and seq > self.next_seq
        below_resume = self._resumed_at is not None and seq < self._resumed_at
        self._resumed_at = None  # only the first live batch after the catch-up tells
        if not (self._verify or went_back or ahead or below_resume):
            return False
        self._verify = False
        known = self.run_id
        changed = self._run_changed() if self.replay_endpoint is not None else None
        self._old_run = bool(changed) and not below_resume and self._sent_before_restart(seq, batch)
        if self._old_run:  # the restart shows on a later batch, the new publisher's first one
            self.run_id = known
            self._verify = True
            return False
        if changed is not None and not below_resume:
            return changed
        return went_back or below_resume

    def _sent_before_restart(self, seq: int, batch: KVEventBatch) -> bool:
        """Whether the live batch ``seq``, read after the run id told a restart, is still the old
        publisher's: the new one holds another batch under that number, or none yet.

        Why: the SUB keeps what the old publisher sent before its connection dropped, and the
        monitor tells the new connection at once, while a consumer that is behind has not read
        those batches yet. Taken for the new publisher's, they were yielded as its batches and
        its own first batches were then skipped as duplicates of them. One replay request, only
        while a restart is being told; a batch the new publisher no longer holds cannot be
        compared and counts as its own."""
        answer = self._ask(seq)
        try:
            for got, replayed in answer:
                return got == seq and replayed != batch
        finally:
            answer.close()  # the rest of that answer is not read (its socket is replaced)
        return self._answer_ended  # it has not published that number yet

    def _run_changed(self) -> bool | None:
        """Ask the publisher's run id and keep it: whether it is another run than the one known
        (``None``: it said none, or none was known to compare with)."""
        known = self.run_id
        run = self._probe()
        if run is None:
            return None
        self.run_id = run
        return None if known is None else run != known

    def _probe(self) -> int | None:
        """The publisher's run id (an empty replay); ``None`` when it does not say one."""
        for _ in self._ask(_PROBE_SEQ):
            pass
        return self._answer_run

    def _decode(self, frames: list[bytes]) -> tuple[int, KVEventBatch] | None:
        """``(seq, batch)`` of a message, or ``None`` (counted in ``bad_messages``) for one that
        is no batch, one numbered where no publisher gets among them (from ``_PROBE_SEQ`` on:
        vLLM's numbers are signed 64-bit, and ``-1``, all ones, is the replay's end marker):
        followed, it counted 2**64 batches lost and broke the next replay request."""
        if len(frames) != 3 or len(frames[1]) != 8 or int.from_bytes(frames[1], "big") >= _PROBE_SEQ:
            self.bad_messages += 1
            return None
        try:
            return int.from_bytes(frames[1], "big"), decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.bad_messages += 1
            # quoted: msgspec repeats the bad value as it came, whoever sent it chose it
            log.warning("kv events: undecodable batch (%s)", quoted(str(exc)))
            return None

    def _ask(self, start: int) -> Generator[tuple[int, KVEventBatch], None, None]:
        """One replay request: the batches of the answer as they come; afterwards
        ``_answer_run`` is the run id the end marker carried (``None``: none, or no end) and
        ``_answer_ended`` whether the answer came to that marker."""
        self._answer_run = None
        self._answer_ended = False
        if self.replay_endpoint is None:
            return
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            allow_ipv6(self._replay, self.replay_endpoint)
            self._replay.connect(self.replay_endpoint)
        replay = self._replay
        replay.send_multipart((b"", start.to_bytes(8, "big")))
        # a limit on silence, not on the whole answer: a long answer, or a consumer slow with
        # each batch (the time it spends between our yields), is no dead publisher
        try:
            while True:
                if not replay.poll(int(self._replay_timeout * 1000)):
                    log.warning("kv events: replay from %d timed out", start)
                    return
                frames = replay.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:  # (b"", topic, seq, payload) until the end
                    self._answer_run = parse_run_frame(frames[1])
                    self._answer_ended = True
                    return
                item = self._decode(frames[1:]) if len(frames) == 4 else None
                if item is not None:
                    yield item
        finally:
            if not self._answer_ended:  # timed out, or the caller stopped reading: the rest of this answer
                replay.close(0)  # must not be read as the next one's
                if self._replay is replay:
                    self._replay = None

    def _replay_from(self, start: int, upto: int | None = None) -> Iterator[Received]:
        """Batches ``start`` .. (``upto`` - 1, or the newest) from the replay socket; what the
        buffer no longer holds is counted as lost."""
        if self.replay_endpoint is None:
            if upto is not None:
                self.lost += upto - start
            return
        expected = start
        while True:
            asked = expected
            for seq, batch in self._ask(asked):
                if seq < expected or (upto is not None and seq >= upto):
                    continue
                if seq > expected:
                    self.lost += seq - expected  # older than the publisher's buffer
                expected = seq + 1
                self.replayed += 1
                self.next_seq = expected
                yield Received(seq, batch, replayed=True)
            # an answer cut short (silence) that still made progress: ask for the rest, which
            # the publisher may well hold; counted lost only what it no longer has
            if self._answer_ended or expected == asked or (upto is not None and expected >= upto):
                break
        if self._answer_run is not None:
            self.run_id = self._answer_run
        if upto is not None and expected < upto:
            self.lost += upto - expected
            self.next_seq = upto
