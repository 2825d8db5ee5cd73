"""Publisher restarts and replay load, with real ZMQ sockets: a consumer gets a restarted
publisher's batches from its first one, however it notices the restart, and consumers that ask
for replays and do not read them cannot grow the publisher's memory nor hold up live batches."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from hicache.errors import ConfigError
from hicache.events import BlockStored
from hicache.events.publisher import END_SEQ, EventPublisher, parse_run_frame
from hicache.events.subscriber import EventSubscriber, Received
from event_helpers import LossyLink, rebind

LOOPBACK = "tcp://127.0.0.1:0"
PROBE = ((1 << 63) - 1).to_bytes(8, "big")


def stored(i: int, hashes: int = 1) -> BlockStored:
    return BlockStored(block_hashes=[(i * 4096 + j).to_bytes(32, "big") for j in range(hashes)],
                       parent_block_hash=None, token_ids=[i], block_size=1, lora_id=None, medium="GPU", lora_name=None)


def tokens(got: list[Received]) -> list[int]:
    return [e.token_ids[0] for r in got for e in r.batch.events]


def wait_for(cond: Callable[[], bool], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def publish_batches(pub: EventPublisher, n: int) -> None:
    """Publish ``n`` batches of one event each (``stored(0..n-1)``) and wait until all are out."""
    start = pub.stats()["next_seq"]
    for i in range(n):
        pub.publish([stored(i)])
        # one event a batch: the thread takes each before the next (publishes it finds queued
        # together become one batch, as a slowed thread finds them)
        wait_for(lambda i=i: pub.stats()["next_seq"] == start + i + 1)  # type: ignore[misc]


def until_live(sub: EventSubscriber, pub: EventPublisher, first: int, work_s: float = 0.0) -> list[Received]:
    """Publish ``first``, ``first`` + 1, ... (one batch each) until ``sub`` yields a live batch;
    returns what it yielded. ``work_s``: the consumer's own time per batch."""
    stop = threading.Event()

    def keep_publishing() -> None:
        i = first
        while not stop.wait(0.05):
            pub.publish([stored(i)])
            i += 1

    t = threading.Thread(target=keep_publishing)
    t.start()
    got: list[Received] = []
    try:
        for r in sub.receive(timeout_s=10.0):
            got.append(r)
            time.sleep(work_s)
            if not r.replayed:
                break
    finally:
        stop.set()
        t.join()
    return got


# ---------------------------------------------------------------------------------- restarts


@pytest.mark.parametrize("old_batches", [3, 6])  # the new numbers meet the old position / go back
def test_a_restarted_publishers_first_batches_are_replayed_not_missed(old_batches: int) -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
    time.sleep(0.3)  # subscribed
    for i in range(old_batches):
        pub.publish([stored(1000 + i)])
        time.sleep(0.02)
    wait_for(lambda: pub.stats()["next_seq"] == old_batches)
    old = list(sub.receive(timeout_s=1.0))
    assert tokens(old) == [1000 + i for i in range(old_batches)]
    pub.close()
    new = rebind(pub.endpoint, pub.replay_endpoint)
    try:
        for i in range(3):  # before the subscriber is connected again: PUB drops them
            new.publish([stored(i)])
        got = until_live(sub, new, first=3)
        got += list(sub.receive(timeout_s=0.5))
        seqs = [r.seq for r in got]
        assert tokens(got)[:4] == [0, 1, 2, 3] and tokens(got) == list(range(len(tokens(got))))
        assert seqs == list(range(len(seqs)))
        assert sub.restarts == 1 and sub.lost == 0
        assert sub.run_id == new.run_id != pub.run_id  # told by the run ids
    finally:
        new.close()
        sub.close()



def test_a_consumer_slow_with_each_replayed_batch_loses_none_of_them() -> None:
    """The replay limit was a deadline on the whole answer, and the consumer's own time between
    batches counted against it: a slow consumer's replay was cut, and every batch up to the live
    one was counted lost and skipped, although the publisher still held them all."""
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, replay_timeout_s=0.3)
    time.sleep(0.3)
    pub.publish([stored(1000)])
    wait_for(lambda: pub.stats()["next_seq"] == 1)
    assert tokens(list(sub.receive(timeout_s=1.0))) == [1000]
    pub.close()
    new = rebind(pub.endpoint, pub.replay_endpoint)
    try:
        for i in range(60):  # before the subscriber is connected again
            new.publish([stored(i)])
            wait_for(lambda i=i: new.stats()["next_seq"] == i + 1)  # type: ignore[misc]
        got = until_live(sub, new, first=60, work_s=0.02)  # 60 such batches outlast the 0.3 s limit
        assert [r.seq for r in got] == list(range(len(got))) and len(got) > 60
        assert sub.lost == 0
    finally:
        new.close()
        sub.close()

def test_a_consumer_resuming_ahead_of_a_restarted_publisher_gets_its_batches() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)  # restarted: it numbers from 0 again
    try:
        publish_batches(pub, 5)
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=50) as sub:  # a saved position
            got = until_live(sub, pub, first=5)
            got += list(sub.receive(timeout_s=0.5))
            assert tokens(got)[:5] == [0, 1, 2, 3, 4] and tokens(got) == list(range(len(tokens(got))))
            assert sub.restarts == 1 and sub.lost == 0 and sub.gaps == 0
    finally:
        pub.close()


def test_a_saved_run_id_tells_a_restart_the_numbers_cannot() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    try:
        publish_batches(pub, 10)
        # the saved position 4 was another publisher's: this one is beyond it, yet all of it is news
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=4, start_run_id=pub.run_id ^ 1) as sub:
            got = list(sub.receive(timeout_s=0.5))
            assert tokens(got) == list(range(10)) and sub.restarts == 1 and sub.run_id == pub.run_id
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=4, start_run_id=pub.run_id) as sub:
            got = list(sub.receive(timeout_s=0.5))
            assert tokens(got) == list(range(4, 10)) and sub.restarts == 0
    finally:
        pub.close()


def test_every_replay_ends_with_the_publishers_run_id() -> None:
    a, b = EventPublisher(None, LOOPBACK), EventPublisher(None, LOOPBACK)
    ctx = zmq.Context.instance()
    try:
        a.publish([stored(0)])
        wait_for(lambda: a.stats()["next_seq"] == 1)
        runs = []
        for pub in (a, b):
            d = ctx.socket(zmq.DEALER)
            d.connect(pub.replay_endpoint)
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            d.send_multipart((b"", PROBE))  # beyond the newest: only the end marker
            answers = []
            while len(answers) < 2 + (pub is a) and d.poll(5000):
                answers.append(d.recv_multipart())
            d.close(0)
            if pub is a:  # a batch as vLLM frames it: (b"", topic, seq, payload)
                assert answers.pop(0)[1:3] == [b"", (0).to_bytes(8, "big")]
            assert [len(f) for f in answers] == [4, 4] and all(f[2] == END_SEQ and f[3] == b"" for f in answers)
            assert parse_run_frame(answers[0][1]) == parse_run_frame(answers[1][1]) == pub.run_id
            assert pub.stats()["run_id"] == f"{pub.run_id:016x}"
            runs.append(pub.run_id)
        assert runs[0] != runs[1]
        assert parse_run_frame(b"") is None  # vLLM's end marker: no run id
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------- replay load


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def big_publisher(n: int = 128, **kwargs: Any) -> EventPublisher:
    """``n`` batches of about 130 KiB in the replay buffer (about 17 MiB for 128)."""
    pub = EventPublisher(LOOPBACK, LOOPBACK, buffer_steps=n + 8, max_batch_events=1, **kwargs)
    for i in range(n):
        pub.publish([stored(i, hashes=4000)])
    wait_for(lambda: pub.stats()["next_seq"] == n)
    return pub


def stuck_consumer(pub: EventPublisher, requests: int) -> zmq.Socket:
    """Asks for the whole buffer ``requests`` times and never reads an answer."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    for _ in range(requests):
        d.send_multipart((b"", (0).to_bytes(8, "big")))
    return d


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_unread_replay_requests_neither_grow_memory_nor_hold_up_live_batches() -> None:
    pub = big_publisher(replay_stall_s=600.0)  # only a consumer that goes away ends its replays here
    live = EventSubscriber(pub.endpoint)
    try:
        before = rss_mib()
        stuck = stuck_consumer(pub, 20)  # 20 x 17 MiB of answers if they were all queued
        wait_for(lambda: pub.stats()["replay_requests"] == 20)
        grew = rss_mib() - before
        stats = pub.stats()
        assert grew < 64, f"the publisher holds {grew:.0f} MiB of unread answers"
        assert stats["replays_open"] == 2 and stats["replays_refused"] == 18  # two open per consumer
        # live batches go on while its replays wait; another consumer's replay is served in full
        time.sleep(0.3)  # subscribed
        pub.publish([stored(500)])
        first = next(iter(live.receive(timeout_s=10.0)))
        assert tokens([first]) == [500] and pub.stats()["replays_open"] == 2
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as good:
            got = list(good.receive(timeout_s=0.5))
        assert [r.seq for r in got] == list(range(129)) and good.lost == 0
        stuck.close(0)  # gone: its replays are dropped, and counted
        wait_for(lambda: pub.stats()["replays_open"] == 0)
        stats = pub.stats()
        # served: the good consumer's run-id probe and its catch-up
        assert stats["replays_dropped"] == 2 and stats["replays_served"] == 2 and stats["errors"] == 0
    finally:
        live.close()
        pub.close()


def test_a_stalled_replay_is_dropped_and_consumers_beyond_the_limit_are_refused() -> None:
    pub = big_publisher(replay_clients=2, replay_stall_s=0.3)
    ctx = zmq.Context.instance()
    try:
        stuck = [stuck_consumer(pub, 1) for _ in range(2)]
        wait_for(lambda: pub.stats()["replays_open"] == 2)
        third = ctx.socket(zmq.DEALER)
        third.connect(pub.replay_endpoint)
        third.send_multipart((b"", (0).to_bytes(8, "big")))
        assert third.poll(10_000)
        frames = third.recv_multipart()  # refused at once: an empty answer, not a wait
        assert frames[2] == END_SEQ and parse_run_frame(frames[1]) == pub.run_id
        assert pub.stats()["replays_refused"] == 1
        wait_for(lambda: pub.stats()["replays_dropped"] == 2)  # the stuck ones read nothing for 0.3 s
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
            assert [r.seq for r in sub.receive(timeout_s=0.5)] == list(range(128)) and sub.lost == 0
        assert pub.stats()["replays_open"] == 0 and pub.stats()["errors"] == 0
        for s in (*stuck, third):
            s.close(0)
    finally:
        pub.close()


def test_replay_limits_are_validated() -> None:
    for bad in ({"replay_hwm": 0}, {"replay_clients": -1}, {"replay_pending": True},
                {"replay_pass_bytes": 1.5}, {"replay_stall_s": 0}):
        with pytest.raises(ConfigError):
            EventPublisher(None, **bad)



def test_a_subscribers_timeouts_are_validated() -> None:
    """``replay_timeout_s`` was taken unchecked: ``None`` raised a TypeError from inside
    ``receive()`` at the first replay, and a negative one made every replay wait forever for a
    publisher that does not answer (ZMQ polls without limit on a negative timeout); an infinite
    one of either raised an OverflowError from inside ``receive()``."""
    for name in ("replay_timeout_s", "idle_timeout_s"):
        for bad in (None, -1.0, 0, True, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=name):
                EventSubscriber("tcp://127.0.0.1:9", **{name: bad})

# ---------------------------------------------------------------------------------- tail gaps
# A gap was noticed only when a later batch arrived: batches lost at the end of a burst, or
# published while the subscriber reconnected, were never fetched (``lost`` stayed 0 and the
# consumer's view lagged) until the cache published again.


def collect(sub: EventSubscriber, n: int, within_s: float = 10.0) -> tuple[list[Received], float]:
    """What ``sub`` yields until it has ``n`` batches or ``within_s`` passed without one, and
    how long that took."""
    started = time.monotonic()
    got: list[Received] = []
    for r in sub.receive(timeout_s=within_s):
        got.append(r)
        if len(got) == n:
            break
    return got, time.monotonic() - started


def test_batches_lost_at_the_end_of_a_burst_are_replayed_when_nothing_follows() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK, max_batch_events=1)  # one batch per event
    link = LossyLink(pub.endpoint)
    sub = EventSubscriber(link.endpoint, pub.replay_endpoint, idle_timeout_s=0.3)
    try:
        time.sleep(0.3)  # subscribed to the link
        for i in range(6):
            pub.publish([stored(i)])
        link.forward(6, drop=range(3, 6))  # the burst's last three never reach the subscriber
        got, took = collect(sub, 6)  # and the publisher publishes nothing more
        assert tokens(got) == list(range(6)) and [r.replayed for r in got] == [False] * 3 + [True] * 3
        assert took < 5.0  # an idle timeout (0.3 s) after the last live batch, not receive's 10 s
        assert sub.gaps == 1 and sub.replayed == 3 and sub.lost == 0 and sub.next_seq == 6
    finally:
        sub.close()
        link.close()
        pub.close()


def test_an_idle_subscriber_that_missed_nothing_asks_once_and_counts_nothing() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, idle_timeout_s=0.1)
    try:
        time.sleep(0.3)
        pub.publish([stored(0)])
        got = list(sub.receive(timeout_s=1.5))  # fifteen idle timeouts
        assert tokens(got) == [0] and not got[0].replayed
        # the run-id probe of the first live batch on a new connection, and one empty tail request:
        # no busy polling while nothing happens
        assert pub.stats()["replay_requests"] == 2
        assert sub.gaps == sub.lost == sub.replayed == sub.restarts == 0
    finally:
        sub.close()
        pub.close()
    with pytest.raises(ValueError, match="idle_timeout_s"):
        EventSubscriber(LOOPBACK, idle_timeout_s=0)


def test_batches_published_while_the_subscriber_reconnects_are_replayed() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK, max_batch_events=1)
    link = LossyLink(pub.endpoint)
    sub = EventSubscriber(link.endpoint, pub.replay_endpoint, idle_timeout_s=0.3)
    try:
        time.sleep(0.3)
        for i in range(3):
            pub.publish([stored(i)])
        link.forward(3)
        assert tokens(list(sub.receive(timeout_s=1.0))) == [0, 1, 2]  # its idle check found nothing
        link.cut()  # the subscriber is disconnected
        for i in range(3, 6):
            pub.publish([stored(i)])
        link.forward(3)  # lost: nobody is connected
        link.restore()  # the subscriber reconnects by itself; nothing more is published
        got, took = collect(sub, 3)
        assert tokens(got) == [3, 4, 5] and all(r.replayed for r in got) and took < 5.0
        assert sub.lost == 0 and sub.restarts == 0 and sub.gaps == 1
    finally:
        sub.close()
        link.close()
        pub.close()


def test_a_restarted_publishers_batches_are_replayed_when_it_publishes_no_more() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, idle_timeout_s=0.3)
    try:
        time.sleep(0.3)
        pub.publish([stored(1000)])
        assert tokens(list(sub.receive(timeout_s=1.0))) == [1000]
        pub.close()
        new = rebind(pub.endpoint, pub.replay_endpoint)
        try:
            for i in range(3):  # before the subscriber is connected again (PUB drops them), and no more
                new.publish([stored(i)])
                wait_for(lambda i=i: new.stats()["next_seq"] == i + 1)  # type: ignore[misc]
            got, took = collect(sub, 3)
            assert tokens(got) == [0, 1, 2] and [r.seq for r in got] == [0, 1, 2] and took < 5.0
            assert sub.restarts == 1 and sub.lost == 0 and sub.run_id == new.run_id
        finally:
            new.close()
    finally:
        sub.close()
        pub.close()


def test_a_tail_gap_the_publisher_no_longer_holds_is_counted_lost() -> None:
    pub = EventPublisher(LOOPBACK, LOOPBACK, max_batch_events=1, buffer_steps=2)
    link = LossyLink(pub.endpoint)
    sub = EventSubscriber(link.endpoint, pub.replay_endpoint, idle_timeout_s=0.3)
    try:
        time.sleep(0.3)
        for i in range(8):
            pub.publish([stored(i)])
        link.forward(8, drop=range(3, 8))  # five lost on the way; the buffer holds the last two
        got, took = collect(sub, 5)
        assert [r.seq for r in got] == [0, 1, 2, 6, 7] and [r.replayed for r in got] == [False] * 3 + [True] * 2
        assert sub.lost == 3 and sub.gaps == 1 and sub.next_seq == 8 and took < 5.0
    finally:
        sub.close()
        link.close()
        pub.close()


def test_a_consumer_that_stops_inside_its_catch_up_knows_the_run_of_its_position() -> None:
    """A consumer saves ``next_seq`` with ``run_id`` (``hicache events --from SEQ --count N``
    prints both). The run id came only with the end marker of the catch-up's replay, so one that
    stopped reading inside the catch-up had ``run_id`` None beside a position: resumed against a
    restarted publisher, numbers alone could not tell. The catch-up now asks the run first."""
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    try:
        publish_batches(pub, 5)
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=1) as sub:
            first = next(iter(sub.receive(timeout_s=0.5)))
            assert first.seq == 1 and sub.next_seq == 2
            assert sub.run_id == pub.run_id and sub.restarts == 0
    finally:
        pub.close()


def test_a_consumer_behind_when_the_publisher_restarts_keeps_both_runs_apart() -> None:
    """A consumer still reading the old publisher's queued batches when the new one came up read
    the reconnect from the socket's monitor first, asked the run id, got the new one and took the
    next *old* batch for the new publisher's: the old run's tail was yielded as the new run's
    batches, and the new publisher's first batches were then skipped as duplicates of them
    (silently), or counted lost although they were never missing."""
    pub = EventPublisher(LOOPBACK, LOOPBACK)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, idle_timeout_s=0.3)
    time.sleep(0.3)  # subscribed
    got: list[Received] = []
    items = sub.receive(timeout_s=3.0)
    publish_batches(pub, 1)
    got.append(next(items))  # connected, run known
    for i in range(1, 30):  # the consumer is busy: these wait in its socket
        pub.publish([stored(i)])
        # one batch each (the publisher takes what is queued together into one batch, as a
        # slowed thread does with publishes a few ms apart)
        wait_for(lambda i=i: pub.stats()["next_seq"] == i + 1)  # type: ignore[misc]
    time.sleep(0.1)
    pub.close()
    new = rebind(pub.endpoint, pub.replay_endpoint)
    try:
        wait_for(lambda: sub._sub.poll(0) != 0)
        time.sleep(0.5)  # the consumer's socket reconnects (its monitor tells) before it reads on
        for i in range(40):
            new.publish([stored(1000 + i)])
            wait_for(lambda i=i: new.stats()["next_seq"] == i + 1)  # type: ignore[misc]  # one batch each, as above
        for received in items:
            got.append(received)
            time.sleep(0.01)  # a slow consumer
        old = [r for r in got if r.batch.events[0].token_ids[0] < 1000]
        fresh = [r for r in got if r.batch.events[0].token_ids[0] >= 1000]
        assert [(r.seq, tokens([r])) for r in old] == [(i, [i]) for i in range(30)]
        assert [(r.seq, tokens([r])) for r in fresh] == [(i, [1000 + i]) for i in range(40)]
        assert sub.restarts == 1 and sub.lost == 0
        assert sub.run_id == new.run_id
    finally:
        new.close()
        sub.close()


def test_a_live_message_numbered_past_any_batch_is_counted_bad_not_followed() -> None:
    """A message on the live socket numbered ``-1`` (all ones: the replay's end marker, or a
    foreign publisher's garbage that still decodes) was taken for a batch 2**64 - 1: the
    subscriber counted 2**64 batches lost, then ended in an OverflowError asking for the
    replay from there. A number no publisher reaches (from 2**63 - 1: vLLM's are signed
    64-bit) is a bad message, and the batches after it are followed as before."""
    from hicache.events import KVEventBatch, encode_batch

    pub = EventPublisher(LOOPBACK, LOOPBACK, max_batch_events=1)
    link = LossyLink(pub.endpoint)
    sub = EventSubscriber(link.endpoint, pub.replay_endpoint, idle_timeout_s=0.3)
    try:
        time.sleep(0.3)  # subscribed to the link
        pub.publish([stored(0)])
        link.forward(1)
        got, _ = collect(sub, 1)
        assert tokens(got) == [0]
        forged = encode_batch(KVEventBatch(ts=1.0, events=[stored(99)]))
        link._down.send_multipart([b"", END_SEQ, forged])  # type: ignore[union-attr]
        link._down.send_multipart([b"", PROBE, forged])  # type: ignore[union-attr]
        for i in range(1, 4):
            pub.publish([stored(i)])
        link.forward(3)
        got = list(sub.receive(timeout_s=1.5))  # until the link is quiet
        assert tokens(got) == [1, 2, 3] and sub.next_seq == 4
        assert sub.bad_messages == 2 and sub.lost == 0
    finally:
        sub.close()
        link.close()
        pub.close()
