"""Fault injection into a :class:`~hicache.memory.CopyEngine`, for tests of what the cache, the
controller and a server do when host -> device loads are slow or fail."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["inject_load_faults"]


def inject_load_faults(
    engine: Any, *, delay: float = 0.0, fail: bool | Callable[[], bool] = False
) -> Callable[[], None]:
    """Make every layer of ``engine``'s CPU loads sleep ``delay`` seconds, then raise
    ``RuntimeError("injected load failure")`` when ``fail`` is true (or, if callable, returns
    true for that layer). Returns a function that puts the engine back as it was.

    A slow load is a big one: every copy then goes to the engine's copy thread, none runs on
    the caller's thread (``inline_max_bytes`` 0 until the restore)."""
    had_own = "_load_layer" in vars(engine)
    inline = engine.inline_max_bytes
    engine.inline_max_bytes = 0
    inner = engine._load_layer
    should_fail = fail if callable(fail) else (lambda: bool(fail))

    def layer(plan: Any, index: int) -> None:
        time.sleep(delay)
        if should_fail():
            raise RuntimeError("injected load failure")
        inner(plan, index)

    engine._load_layer = layer

    def restore() -> None:
        engine.inline_max_bytes = inline
        if had_own:
            engine._load_layer = inner
        else:
            del engine._load_layer

    return restore
