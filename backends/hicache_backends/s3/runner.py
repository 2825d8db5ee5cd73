"""Running requests against an object store that may be slow, throttling, or gone.

:class:`RequestRunner` is the one place where a request meets the service's failure modes, so
the storage classes only say *what* to ask:

* a circuit-breaker gate (:mod:`.breaker`): an outage costs microseconds per call, not a timeout;
* a concurrency slot from the current event loop's semaphore (the HTTP pool is sized alike);
* a timeout on every attempt (``asyncio.timeout``);
* retries with jittered backoff for transient errors only (:mod:`.retry`);
* a bound on a whole batch (``call_timeout``): pages not done by then are failures.

Everything is counted in the store's :class:`~hicache.storage.stats.StorageStats`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from hicache.storage.stats import StorageStats, Throttle
from hicache_backends.s3.breaker import BreakerState, CircuitBreaker
from hicache_backends.s3.fs import LoopLocal, LoopResources, ObjectOps
from hicache_backends.s3.naming import Redactor
from hicache_backends.s3.retry import RetryPolicy, is_throttle, is_transient

__all__ = ["GaveUp", "RequestRunner"]

logger = logging.getLogger("hicache.storage.s3")

T = TypeVar("T")


class GaveUp(Exception):
    """A request failed for good (refused by the breaker, retries spent, or a permanent error);
    already counted and logged, the caller answers with a miss."""


class RequestRunner:
    """Runs object operations for one store (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        location: str,
        local: LoopLocal[LoopResources],
        breaker: CircuitBreaker,
        policy: RetryPolicy,
        request_timeout: float,
        call_timeout: float,
        stats: StorageStats,
        redactor: Redactor,
    ) -> None:
        self.name = name  # for log lines: the store's class
        self.location = location  # for log lines: the URL, already redacted
        self.local = local
        self.breaker = breaker
        self.policy = policy
        self.request_timeout = request_timeout
        self.call_timeout = call_timeout
        self.stats = stats
        self.redactor = redactor
        #: set when the store closes: a request still running (or retrying) then gives up
        #: instead of building a new client for this loop that nobody would close
        self.closed = False
        self._permanent_warnings: dict[tuple[str, str], Throttle] = {}

    def permanent(self, what: str, doing: str, exc: Exception) -> GaveUp:
        """The miss for a failure no retry mends (``doing`` failed with ``exc``), counted
        (``permanent_errors``) and said in one line a minute per ``doing`` and error kind, with
        how many it stands for: a refusal repeats for every page (no ListBucket right: a 403
        per miss), as a filesystem that cannot be built does for every call."""
        self.stats.incr("permanent_errors")
        count = self._permanent_warnings.setdefault((doing, type(exc).__name__), Throttle()).due()
        if count:
            logger.warning("%s: %s failed (%d time(s) since the last warning): %s: %s", self.name, doing, count,
                           type(exc).__name__, self.redactor.scrub(str(exc)))
        return GaveUp(what)

    def resources(self, what: str) -> LoopResources:
        """This loop's resources, for ``what``; :class:`GaveUp` where its filesystem cannot be
        built (open built one, so the options were fine there): a counted miss, said once a
        minute, as nothing raises out of a primitive."""
        try:
            return self.local.get()
        except Exception as exc:  # noqa: BLE001 - whatever a filesystem's constructor raises
            raise self.permanent(what, "building the filesystem for this event loop", exc) from exc

    async def request(self, what: str, op: Callable[[ObjectOps], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``op`` with breaker gate, concurrency slot, timeout and retries.

        Raises ``FileNotFoundError`` (an answer: the object or bucket is absent) or
        :class:`GaveUp`; every other outcome is counted.
        """
        if self.closed:
            raise GaveUp(what)
        res = self.resources(what)
        timeout = self.request_timeout if timeout is None else timeout
        for attempt in range(self.policy.attempts):
            if self.closed:
                raise GaveUp(what)
            if not self.breaker.allow():
                self.stats.incr("breaker_rejected")
                self.stats.incr("unavailable")  # the call's miss is the service's absence
                raise GaveUp(what)
            self.stats.incr("requests")
            try:
                async with res.semaphore:  # waiting for a slot is bounded by call_timeout
                    if self.closed:  # closed while it waited: it would build a client nobody closes
                        raise GaveUp(what)
                    async with asyncio.timeout(timeout):
                        result = await op(res.ops)
            except FileNotFoundError:
                self.breaker.record_success()  # the service answered
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, GaveUp):  # closed while it waited for its slot
                    raise
                if self.closed:  # cut by our own close (its client went away): not the service's fault
                    raise GaveUp(what) from exc
                if isinstance(exc, TimeoutError):
                    self.stats.incr("timeouts")
                if not is_transient(exc):
                    self.breaker.record_success()  # the service answered, just not with data
                    raise self.permanent(what, what, exc) from exc
                self.stats.incr("transient_errors")
                throttled = is_throttle(exc)
                if throttled:
                    self.stats.incr("throttled")
                if self.breaker.record_failure():
                    self.stats.incr("breaker_open")
                    logger.warning(
                        "%s: %s unreachable (%s); answering misses for %.1f s before probing",
                        self.name, self.location, type(exc).__name__, self.breaker.cooldown,
                    )
                if attempt + 1 >= self.policy.attempts:
                    if not throttled:  # a throttling service answers: it is there, only busy
                        self.stats.incr("unavailable")
                    logger.debug("%s: %s gave up after %d attempts: %s: %s", self.name, what, attempt + 1,
                                 type(exc).__name__, self.redactor.scrub(str(exc)))
                    raise GaveUp(what) from exc
                self.stats.incr("retries")
                await asyncio.sleep(self.policy.delay(attempt, throttled=throttled))
            else:
                if self.breaker.state is not BreakerState.CLOSED:
                    logger.info("%s: %s is reachable again", self.name, self.location)
                self.breaker.record_success()
                return result
        raise GaveUp(what)  # pragma: no cover - the loop always returns or raises

    async def batch(
        self, what: str, coros: list[Coroutine[Any, Any, bool]], timeout: float | None = None
    ) -> list[bool]:
        """Run per-page coroutines concurrently; whatever is not done after ``timeout`` (default
        ``call_timeout``; a call made of several batches passes what is left of its own) is a
        failure. The coroutines bound their own I/O through :meth:`request` and never raise; a
        caller cancelled mid-batch cancels and drains every page's task before re-raising."""
        if not coros:
            return []
        timeout = self.call_timeout if timeout is None else max(0.0, timeout)
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if pending:
            self.stats.incr("call_timeouts")
            logger.warning("%s: %s: %d of %d pages not done within %.1f s", self.name, what,
                           len(pending), len(tasks), timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        out: list[bool] = []
        for t in tasks:
            if t.cancelled():
                out.append(False)
            elif t.exception() is not None:
                self.stats.incr("backend_errors")
                logger.error("%s: %s page failed", self.name, what, exc_info=t.exception())
                out.append(False)
            else:
                out.append(bool(t.result()))
        return out
