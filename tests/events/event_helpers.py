"""Helpers shared by the KV-event tests."""

from __future__ import annotations

import time

import zmq

from hicache.errors import ConfigError
from hicache.events.publisher import EventPublisher


def rebind(endpoint: str, replay_endpoint: str, within_s: float = 10.0) -> EventPublisher:
    """A restarted publisher on addresses just released: on a loaded machine the old sockets
    may take a moment to close on their thread, as an old process's would."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return EventPublisher(endpoint, replay_endpoint)
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class LossyLink:
    """A forwarder between a publisher's PUB and its subscribers (a proxy in front of the
    publisher, on real sockets) that loses the batches it is told to lose: what a PUB drops at
    its high-water mark, or what is published while the link is down. The replay endpoint is
    the publisher's own."""

    def __init__(self, upstream: str) -> None:
        ctx = zmq.Context.instance()
        self._up = ctx.socket(zmq.SUB)
        self._up.setsockopt(zmq.LINGER, 0)
        self._up.setsockopt(zmq.SUBSCRIBE, b"")
        self._up.connect(upstream)
        self._down = ctx.socket(zmq.PUB)
        self._down.setsockopt(zmq.LINGER, 0)
        self._down.bind("tcp://127.0.0.1:0")
        self.endpoint = self._down.getsockopt_string(zmq.LAST_ENDPOINT)
        time.sleep(0.3)  # subscribed upstream

    def forward(self, n: int, drop: range | tuple[int, ...] = ()) -> None:
        """Pass the next ``n`` batches on, less those numbered in ``drop``."""
        for _ in range(n):
            assert self._up.poll(10_000), "the publisher sent nothing"
            frames = self._up.recv_multipart()
            if self._down is not None and int.from_bytes(frames[1], "big") not in drop:
                self._down.send_multipart(frames)

    def cut(self) -> None:
        """The link goes down: subscribers are disconnected, and what is forwarded is lost."""
        assert self._down is not None
        self._down.close(0)
        self._down = None

    def restore(self, within_s: float = 10.0) -> None:
        """The link comes back on the same address (subscribers reconnect by themselves)."""
        deadline = time.monotonic() + within_s
        while True:
            sock = zmq.Context.instance().socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(self.endpoint)
            except zmq.ZMQError:
                sock.close(0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            self._down = sock
            return

    def close(self) -> None:
        self._up.close(0)
        if self._down is not None:
            self._down.close(0)
