"""Close races found by a randomized fuzzer of the facade (many clients, random close).

A plain (non-session) ``begin`` that is still inside ``admit`` when ``aclose()`` runs is not
aborted by the close (only live handles and attached session turns are): it goes on against a
closing/closed controller and must end in ``CacheClosedError`` without logging an error.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from hicache.errors import CacheClosedError
from hicache.facade import HiCache

sys.path.insert(0, str(Path(__file__).parent))
from test_facade import PS, config, prompt  # noqa: E402
from test_facade_races import assert_no_leak, demote_shared  # noqa: E402


async def test_begin_that_reaches_its_load_back_after_close_logs_no_error(caplog) -> None:
    """A begin whose prefix is on host waits in admit (here: for its prefetch) while the cache
    closes; it then tries the host->device load on the closed controller. That is the close
    overtaking a request, not a failure: CacheClosedError for the caller, nothing at ERROR
    (was: ``logger.exception("load-back could not start")`` with a CacheClosedError traceback)."""
    caplog.set_level(logging.ERROR)
    cache = await HiCache.from_config(config(storage={"backend": None})).start()
    shared = prompt(2, 5 * PS)
    await demote_shared(cache, shared)
    inner = cache.cache.inner
    entered, go = asyncio.Event(), asyncio.Event()

    async def gated_wait_prefetch(rid, **_):  # type: ignore[no-untyped-def]
        entered.set()
        await go.wait()  # the close runs while this begin is inside admit
        return 0

    inner.is_prefetching = lambda rid: True  # type: ignore[method-assign]
    inner.wait_prefetch = gated_wait_prefetch  # type: ignore[method-assign]
    task = asyncio.ensure_future(cache.begin("late", shared + prompt(5, 7)))
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(cache.aclose(), 10)
    assert cache._stack.controller.state.value == "closed"
    go.set()
    with pytest.raises(CacheClosedError):
        await task
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert_no_leak(cache)
    assert not cache._live and not cache._rids
