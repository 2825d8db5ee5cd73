"""Starting and stopping the demo server: ``serve`` (the CLI's blocking entry) and
``running_server`` (an async context manager for the demo and tests).

Why both share one context manager: the start-up and drain order is the part that is easy to
get wrong - the cache must be entered before the app starts and closed only after the HTTP
server has stopped taking requests and the scheduler has finished the ones it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from hicache.config.schema import HiCacheConfig
from hicache.controller.close_task import close_with
from hicache.engine.model import ModelSpec
from hicache.engine.recompute import RecomputeCache
from hicache.engine.runner import CacheLike
from hicache.errors import ConfigError
from hicache.server.app import STATE, ProtocolLog, ServerState, create_app

__all__ = ["RunningServer", "running_server", "serve"]

logger = logging.getLogger("hicache.server")


@dataclass(eq=False)
class RunningServer:
    """A started server: where it listens and what it serves."""

    url: str
    port: int
    app: web.Application
    cache: CacheLike

    @property
    def state(self) -> ServerState:
        return self.app[STATE]


def _open_cache(config: HiCacheConfig, mode: Literal["hicache", "recompute"]) -> Any:
    if mode == "recompute":
        return RecomputeCache(config)
    from hicache.facade import HiCache  # imported late: the facade pulls in the whole controller

    return HiCache.from_config(config)


@contextlib.asynccontextmanager
async def running_server(
    config: HiCacheConfig,
    *,
    mode: Literal["hicache", "recompute"] = "hicache",
    cache: CacheLike | None = None,
    host: str | None = None,
    port: int | None = None,
    spec: ModelSpec | None = None,
    shutdown_timeout: float | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve on ``host:port`` (default: ``config.server``; port 0 picks a free one) until the
    block exits, then drain: stop listening, finish in-flight requests, close the cache, all
    within ``shutdown_timeout`` (default ``config.server.shutdown_timeout_s``; see
    :func:`_drain_shares`). A request that has not started within a quarter of it is answered
    503 (retry elsewhere); one still running just before half of it (when aiohttp would cut it)
    is stopped and answered 503 too (a stream already under way: its last line carries the
    error). The cache's close drains its queued writes for at most a quarter (less when
    ``cache.close_timeout_s`` says so) and its report is logged.

    ``mode="recompute"`` serves with no cache at all (the baseline); ``cache`` serves an
    already entered cache that the caller keeps ownership of.
    """
    host = config.server.host if host is None else host
    port = config.server.port if port is None else port
    budget = config.server.shutdown_timeout_s if shutdown_timeout is None else shutdown_timeout
    requests_s, close_s = _drain_shares(budget)
    external = cache is not None
    drain = _Drain(budget)
    async with contextlib.AsyncExitStack() as stack:
        if cache is None:
            opened: CacheLike = await _open_cache(_close_within(config, close_s), mode).__aenter__()
            stack.push_async_callback(_close_and_report, opened, drain)
            cache = opened
        app = create_app(cache, config, spec=spec)
        _answer_unfinished_at_drain_end(app, requests_s, stack)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=requests_s,
                               logger=ProtocolLog(app[STATE].metrics))  # a request it cannot parse: one line
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # port in use, address not on this machine, no permission
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound = runner.addresses[0][1] if runner.addresses else port
        url_host = f"[{host}]" if ":" in host else host
        server = RunningServer(url=f"http://{url_host}:{bound}", port=bound, app=app, cache=cache)
        logger.info("serving on %s (%s)", server.url, "caller's cache" if external else mode)
        stack.callback(drain.begin)  # the first callback out: the drain's budget counts from here
        yield server
    logger.info("server stopped")


class _Drain:
    """When a drain of ``budget`` seconds must end, once it has begun (on the monotonic clock,
    the one every close step below the server counts on)."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.deadline: float | None = None

    def begin(self) -> None:
        self.deadline = time.monotonic() + self.budget


async def _close_and_report(cache: Any, drain: _Drain | None = None) -> None:
    """Close ``cache`` by the drain's deadline (what the requests left of its budget: the
    storage's close stops waiting then and says what it left) and log its close report: what
    its drain left unwritten, if anything. The report was dropped (``__aexit__`` returns
    nothing), so a drain cut by its bound left no trace of the writes it gave up; and each
    step of the close bounded on its own, a slow store's close took the drain past its budget."""
    deadline = None if drain is None else drain.deadline
    report = await close_with(cache.aclose, deadline=deadline)
    summary = getattr(report, "summary", None)
    if summary is None:  # a cache with nothing to write (the recompute baseline)
        return
    clean = report.drained and not report.unwritten
    logger.log(logging.INFO if clean else logging.WARNING, "cache closed: %s", summary())


def _drain_shares(budget: float) -> tuple[float, float]:
    """How a drain of ``budget`` seconds is shared: aiohttp's ``shutdown_timeout`` (the
    requests get twice that: a wait, then the cut) and the cache close's drain of its queued
    writes, each a quarter. The last quarter is for what follows a drain that timed out (the
    store's close and its thread's stop): the close is handed the drain's deadline, so its
    steps share what the requests left of the budget instead of each taking the close's limit.

    Why: the bound was a fixed 30 s for aiohttp alone (60 s for the requests) and the cache's
    close 30 s more; a container's grace (Kubernetes': 30 s by default) ended first, and the
    SIGKILL lost the queued writes with no close report."""
    return budget / 4, budget / 4


def _close_within(config: HiCacheConfig, seconds: float) -> HiCacheConfig:
    """``config`` with the cache's close bounded by ``seconds`` (its own bound when lower)."""
    if config.cache.close_timeout_s <= seconds:
        return config
    return config.model_copy(update={"cache": config.cache.model_copy(update={"close_timeout_s": seconds})})


def _answer_unfinished_at_drain_end(app: web.Application, delay: float, stack: contextlib.AsyncExitStack) -> None:
    """Answer what the drain would cut. Once it begins, in ``delay`` (the runner's
    ``shutdown_timeout``, when aiohttp stops waiting for its handlers) the requests that have
    not started are refused with a 503 (:meth:`Scheduler.shed_waiting`), not cut with their connections a timeout later. The ones
    still running are answered (:meth:`Scheduler.stop_running`) shortly before aiohttp cancels
    their handlers and cuts their connections, ``2 * delay`` in (at the earliest): they keep
    all the time they had to finish, less :func:`_answer_margin`."""
    timers: list[asyncio.TimerHandle] = []

    async def on_shutdown(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        scheduler = app[STATE].scheduler
        timers.append(loop.call_later(delay, scheduler.shed_waiting))
        timers.append(loop.call_later(max(delay, 2 * delay - _answer_margin(delay)), scheduler.stop_running))

    app.on_shutdown.append(on_shutdown)

    def cancel() -> None:
        for timer in timers:
            timer.cancel()

    stack.callback(cancel)  # runs after the runner's cleanup


def _answer_margin(delay: float) -> float:
    """How long before aiohttp's cut a request still running is answered: time for its handler
    to wake and write the answer (a quarter of ``delay``, at most 1 s)."""
    return min(1.0, delay / 4)


async def _serve_until_signal(config: HiCacheConfig, mode: Literal["hicache", "recompute"]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with running_server(config, mode=mode) as server:
        print(f"hicache server on {server.url} (Ctrl-C to stop)", flush=True)
        await stop.wait()
        scheduler = server.state.scheduler
        logger.info("shutting down: draining %d queued and %d running request(s) and the cache, for at most %g s",
                    scheduler.queued, scheduler.running, config.server.shutdown_timeout_s)


def serve(config: HiCacheConfig, *, mode: Literal["hicache", "recompute"] = "hicache") -> None:
    """Run the server on ``config.server.host:port`` until SIGINT/SIGTERM, then drain the
    requests in flight and close the cache (its controller finishes pending write-backs).
    ``mode="recompute"`` serves the no-cache baseline instead."""
    asyncio.run(_serve_until_signal(config, mode))
