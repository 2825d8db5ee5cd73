"""Helpers shared by the KV-event tests."""

from __future__ import annotations

import time

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
