"""A close that is itself cancelled: the shutdown sweep of ``asyncio.run`` (it cancels every
task still pending when the main coroutine returns, the close task included).

The cancellation used to unwind the close where it was: the controller stayed running (or
closing) with its workers, the storage stayed open, its I/O and file threads stayed alive, and
every queued write was neither written nor reported. Now a cancellation only hurries the close:
the drain is cut short, what is left is reported, and every thread ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.controller.controller import ControllerState
from hicache.facade import HiCache

sys.path.insert(0, str(Path(__file__).parent))
from test_facade import PS, config, prompt, run  # noqa: E402

SESSIONS, PAGES = 4, 6


def _thread_idents() -> set[int | None]:
    return {t.ident for t in threading.enumerate()}


def _assert_no_new_hicache_threads(before: set[int | None]) -> None:
    """No hicache thread started since ``before`` is still alive (polled briefly: a thread may
    take a moment to end after the close joined or stopped it). Only threads this test started:
    one left by an earlier test (ended later by gc) is not this test's."""
    deadline = time.monotonic() + 2.0
    while True:
        new = [t.name for t in threading.enumerate()
               if t.ident not in before and t.name.startswith("hicache") and t.is_alive()]
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not new


async def _cache_with_hung_writes(tmp_path: Path, held: dict[str, Any]) -> HiCache:
    """A started cache (kept in ``held``) whose storage writes never answer, with a short
    close and grace, so a close has queued writes to cut short and report."""
    cache = await HiCache.from_config(config(tmp_path, session={"idle_offload_s": None})).start()
    held["cache"] = cache
    ctl = cache._stack.controller
    ctl.config = dataclasses.replace(ctl.config, storage_stall_s=0, storage_io_timeout_s=60.0,
                                     close_timeout_s=5.0, cancelled_io_grace_s=0.2)

    async def hung_write(*_: Any) -> Any:
        await asyncio.Event().wait()

    cache._stack.storage._write = hung_write  # type: ignore[method-assign]
    return cache


async def _close_unawaited(cache: HiCache, controller_closing: bool) -> None:
    """Start the close and return while it runs (the sweep then cancels it); with
    ``controller_closing``, once the controller is draining its queued writes."""
    ctl = cache._stack.controller
    asyncio.ensure_future(cache.aclose())  # never awaited: main returns while it runs
    if controller_closing:
        while ctl.state is not ControllerState.CLOSING:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the storage writes are queued, the first one hung


def _run_to_swept_close(main: Any, held: dict[str, Any], bare: bool = False) -> Any:
    """Run ``main`` under ``asyncio.run`` (whose shutdown sweep cancels the close it left
    running), then check the close ended (controller closed, no thread of it alive); the
    cache's close report. ``bare``: ``main`` is the loop's main task itself (no wait_for
    around it), so the sweep comes in the very iteration after it returns."""
    before = _thread_idents()
    asyncio.run(main() if bare else asyncio.wait_for(main(), 20.0))
    cache = held["cache"]
    assert cache._stack.controller.state is ControllerState.CLOSED
    _assert_no_new_hicache_threads(before)
    return cache.close_report


@pytest.mark.parametrize("controller_closing", [False, True], ids=["in-session-drain", "in-controller-drain"])
def test_a_close_cancelled_by_the_loops_shutdown_still_ends_and_reports(tmp_path: Path,
                                                                      controller_closing: bool) -> None:
    held: dict[str, Any] = {}

    async def main() -> None:
        cache = await _cache_with_hung_writes(tmp_path, held)
        for i in range(SESSIONS):
            await run(cache, f"s{i}", prompt(i, PAGES * PS), session_id=f"S{i}")
        await _close_unawaited(cache, controller_closing)

    report = _run_to_swept_close(main, held)
    assert report is not None and not report.drained
    if controller_closing:  # every session's pages were queued for storage: each is listed
        assert report.unwritten_pages == SESSIONS * PAGES
    else:  # their host copies never ran: each write-back is reported as a failed backup
        assert report.failed_device_backups + report.unwritten_pages > 0


@pytest.mark.parametrize("where", ["storage-close", "copy-engine-close"])
def test_a_close_cancelled_after_the_drain_still_ends_and_keeps_its_report(tmp_path: Path, where: str) -> None:
    """The sweep lands after the drain: in the storage backend's close (the controller
    re-raised there: the I/O and file threads stayed alive, the state CLOSING) or in the copy
    engine's close (the report was lost). Either way the close task ended cancelled, and every
    later aclose() raised CancelledError to a caller nobody cancelled."""
    held: dict[str, Any] = {}

    async def main() -> None:
        cache = await HiCache.from_config(config(tmp_path, session={"idle_offload_s": None})).start()
        held["cache"] = cache
        ctl = cache._stack.controller
        for i in range(2):
            await run(cache, f"s{i}", prompt(i, PAGES * PS), session_id=f"S{i}")
        if where == "storage-close":
            storage = cache._stack.storage
            close = storage.aclose

            async def slow_close() -> None:  # on the I/O loop
                await asyncio.sleep(0.5)
                await close()

            storage.aclose = slow_close  # type: ignore[method-assign]
            asyncio.ensure_future(cache.aclose())
            while not (ctl._close_task and ctl._sealed):
                await asyncio.sleep(0.005)
        else:
            engine = cache._stack.copy_engine
            close_engine = engine.close

            def slow_engine_close() -> None:  # on a thread
                time.sleep(0.5)
                close_engine()

            engine.close = slow_engine_close  # type: ignore[method-assign]
            asyncio.ensure_future(cache.aclose())
            while ctl.state is not ControllerState.CLOSED:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)

    report = _run_to_swept_close(main, held)
    assert report is not None and report.drained and not report.unwritten
    later = asyncio.run(held["cache"].aclose())  # on another loop: a finished close answers there
    assert later is not None and later.drained


@pytest.mark.parametrize("controller_closing", [False, True], ids=["in-session-drain", "in-controller-drain"])
def test_a_cancelled_close_keeps_the_trees_part_of_the_report(tmp_path: Path, controller_closing: bool) -> None:
    """The fallback after a cancelled close closed the controller alone: the tree's part of
    the report (here: pages the store could not delete) was lost, and the tree's own close
    steps were skipped."""
    held: dict[str, Any] = {}

    async def main() -> None:
        cache = await _cache_with_hung_writes(tmp_path, held)
        cache._stack.cache.storage_writes.undeleted = lambda: 7  # type: ignore[method-assign]
        for i in range(SESSIONS):
            await run(cache, f"s{i}", prompt(i, PAGES * PS), session_id=f"S{i}")
        await _close_unawaited(cache, controller_closing)

    asyncio.run(asyncio.wait_for(main(), 20.0))
    cache = held["cache"]
    report = cache.close_report
    assert report is not None and not report.drained
    assert report.undeleted_storage_pages == 7
    assert cache._stack.cache._close_begun


def test_a_hicache_thread_an_earlier_test_left_is_not_counted_as_this_close_s(tmp_path: Path) -> None:
    """The thread check was process-wide: after tests whose file threads gc ends later, the
    close tests failed depending on the order they ran in."""
    stop = threading.Event()
    stray = threading.Thread(target=stop.wait, name="hicache-file-io_stray", daemon=True)
    stray.start()
    try:
        test_a_close_cancelled_by_the_loops_shutdown_still_ends_and_reports(tmp_path, False)
    finally:
        stop.set()
        stray.join()


@pytest.mark.parametrize("how", ["close-task-unstarted", "caller-cancelled-unstarted", "started-by-the-last-callback"])
def test_a_close_the_sweep_cancels_before_it_ever_ran_still_ends_and_reports(tmp_path: Path, how: str) -> None:
    """``main`` returns right after starting the close, so the sweep cancels it before it
    ever ran: the cancellation was thrown into coroutines that never started (the facade's
    close task, or the caller's aclose() itself), so nothing closed - the controller kept
    running, the storage I/O and file threads stayed alive after asyncio.run returned, and
    a later aclose() answered drained=False with nothing written or reported."""
    held: dict[str, Any] = {}

    async def main() -> None:
        cache = await _cache_with_hung_writes(tmp_path, held)
        for i in range(SESSIONS):
            await run(cache, f"s{i}", prompt(i, PAGES * PS), session_id=f"S{i}")
        if how == "started-by-the-last-callback":
            # a callback the loop runs just before it stops: the close task is made then,
            # and the sweep cancels it before its first step
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(cache.aclose()))
            return
        caller = asyncio.ensure_future(cache.aclose())
        if how == "caller-cancelled-unstarted":
            caller.cancel()

    report = _run_to_swept_close(main, held, bare=True)
    assert report is not None and not report.drained
    # the sessions' write-backs never got their host copies: each one is reported
    assert report.failed_device_backups + report.unwritten_pages > 0
    assert held["cache"]._stack.cache._close_begun
    assert asyncio.run(held["cache"].aclose()) is report  # a later caller gets the whole report


async def test_a_cancellation_of_the_close_task_alone_hurries_the_controllers_drain(tmp_path: Path) -> None:
    """Only the facade's close task is cancelled (not the controller's: no sweep), while the
    controller drains writes the store never answers: the fallback waited for that drain,
    close_timeout_s, instead of hurrying it as a cancellation does."""
    before = _thread_idents()
    cache = await _cache_with_hung_writes(tmp_path, {})
    ctl = cache._stack.controller
    for i in range(SESSIONS):
        await run(cache, f"s{i}", prompt(i, PAGES * PS), session_id=f"S{i}")
    closing = asyncio.ensure_future(cache.aclose())
    while ctl.state is not ControllerState.CLOSING:
        await asyncio.sleep(0.005)
    await ctl.drain_backups()  # every page is on host: its storage write queued, hung
    task = cache._close_task
    assert task is not None and not task.done()
    t0 = time.monotonic()
    task.cancel()
    report = await asyncio.wait_for(closing, 10.0)
    assert time.monotonic() - t0 < 2.0  # not close_timeout_s (5 s)
    assert ctl.state is ControllerState.CLOSED
    assert not report.drained and report.unwritten_pages == SESSIONS * PAGES
    assert cache.close_report is report
    _assert_no_new_hicache_threads(before)


@pytest.mark.parametrize("deadline, error", [("30", TypeError), (True, TypeError), (float("nan"), ValueError)])
async def test_a_bad_close_deadline_is_refused_before_the_close_starts(tmp_path: Path, deadline: Any,
                                                                       error: type[Exception]) -> None:
    """``aclose(deadline=...)`` with a deadline that is no time (a string from a setting, a
    flag, NaN): refused at once with the cache still open, so a plain ``aclose()`` then drains
    every queued write and ends every thread. A string used to fail inside the close task after
    the cache was marked closed: the controller stayed running with its storage open and its
    threads alive, the queued writes were neither written nor reported, and every later
    ``aclose()`` raised the same ``TypeError``: the cache could not be closed at all."""
    before = _thread_idents()
    cache = await HiCache.from_config(config(tmp_path)).start()
    for i in range(SESSIONS):
        await run(cache, f"r{i}", prompt(i, PAGES * PS))
    with pytest.raises(error, match="deadline"):
        await cache.aclose(deadline=deadline)
    await run(cache, "after", prompt(SESSIONS, PAGES * PS))  # still open and serving
    report = await asyncio.wait_for(cache.aclose(), 60)
    assert report.drained and not report.unwritten, report
    assert cache._stack.controller.state is ControllerState.CLOSED
    _assert_no_new_hicache_threads(before)
