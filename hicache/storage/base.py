"""``AsyncHiCacheStorage``: the one async interface every storage backend implements.

A backend implements five small coroutines over *pages* - ``(key, pool)`` pairs holding opaque
bytes - and inherits the whole SGLang-compatible surface built on them: v2 batches with per-pool
hit policies, v1 batches, and the v0 single-key calls. The split keeps semantics in one place:
the hit policy, index validation, staging and counting are written once here, and a backend
only moves bytes. How a v2 transfer's pages move between a host pool and the primitives (page
views, pool memory pieces, staging) is in :mod:`hicache.storage.pool_pages`; the v0 calls'
tensors in :mod:`hicache.storage.tensor_pages`.

Primitives (override in a backend)::

    _exists(pages)                 -> list[bool]
    _read(pages, buffers)          -> list[bool]     payload lands in buffers (exact size;
                                                     PageSegments too if supports_segments)
    _write(pages, buffers, parents)-> list[bool]     parents: the page before each, or None
                                                     (changes.Written: also which were held)
    _read_bytes(page)              -> bytes | None   payload of unknown size (v0 ``get``)
    _clear()                       -> pages | None   this namespace only (the pages it
                                                     removed, where it can name them all)
    _open(), _close(), _backend_stats()              optional

A bounded backend that refuses pages of a write for lack of room answers them ``False`` and
counts them in ``rejected_pages_no_space``; where no eviction could ever make that room (a
page bigger than the whole store, ``oversized_pages``, or a chained batch longer than the store
beside the prefix it continues), also in ``rejected_pages_beyond_capacity``. The flags stay
SGLang's; the controller reads the counts of its own call to tell "never fits" (final: a
chained batch keeps its leading pages that fit, a retry would only be refused again) from a
refusal that may clear up or a failure, both of which it retries.

Every primitive call is guarded: an exception inside a backend is logged, counted as
``backend_errors`` and turned into misses/False (so is a result list of the wrong length).
Nothing a backend raises reaches the caller's background tasks.

Cancellation: once ``_read``/``_write`` returns *or raises* (``CancelledError`` included), the
backend must not touch the buffers any more - they are host-pool pages the caller reuses. A
backend that fills buffers on threads waits for them before letting a cancellation unwind
(:func:`hicache.storage.offload.run_to_completion`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import logging
import numbers
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hicache.errors import BackendLoadError, HiCacheError, StorageStateError
from hicache.keys import Namespace, validate_key, validate_keys
from hicache.observability.throttle import Throttle
from hicache.observability.tier_events import TierChangeHub
from hicache.storage import changes, pool_pages, staging, tensor_pages
from hicache.storage.hit_policy import checked_policies, leading_run, resolve_v2_hits
from hicache.storage.key_screen import is_storable
from hicache.storage.pool_format import pool_format_tag, signature_tag, states_its_format
from hicache.storage.pool_pages import page_keys
from hicache.storage.stats import StorageStats
from hicache.storage.view_pages import LivePageViews
from hicache.storage.types import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PageKey,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    pool_name_str,
)

__all__ = ["AsyncHiCacheStorage", "StorageState"]


@functools.cache
def _class_answers_now(cls: type, hook: str, overridable: tuple[str, ...]) -> bool:
    """Whether ``cls``'s ``hook`` (a primitive answered on the caller's thread) is its own: no
    class below the one that defines it overrides one of ``overridable``, the loop's primitives
    it stands for (it would answer for them and skip them: added latency, injected faults).
    Once per class."""
    for klass in cls.__mro__:
        if hook in vars(klass):
            return klass is not AsyncHiCacheStorage
        if any(name in vars(klass) for name in overridable):
            return False
    return False

logger = logging.getLogger("hicache.storage")

#: what a guarded primitive that raised answers (told apart from a primitive's own ``None``)
_FAILED: Any = object()

KV = PoolName.KV.value

#: a failing primitive's traceback is logged at most once per this many seconds (per primitive)
FAILURE_LOG_PERIOD_S = 60.0

#: seconds an open may take before a warning says it has not answered (and again each as long
#: after): an open waits as long as its backend does, and one whose medium does not answer (a
#: plugin's service, a hung network mount) held a cache's start with nothing in the log
OPEN_WARN_S = 30.0


class StorageState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


def time_share(limit: float, deadline: float | None, part: float = 1.0) -> float:
    """``limit`` seconds, or ``part`` of what is left until ``deadline`` (``time.monotonic()``)
    if less, never below 0: a step of a close that must leave time for the steps after it.
    ``deadline`` ``None`` (no caller's deadline): ``limit``."""
    if deadline is None:
        return limit
    return max(0.0, min(limit, part * (deadline - time.monotonic())))


async def _wait_in_progress(step: concurrent.futures.Future[None]) -> None:
    """Wait for an open (or a close) in progress, from any event loop; a cancelled waiter
    leaves it running (it belongs to the caller that started it)."""
    await asyncio.shield(asyncio.wrap_future(step))


class AsyncHiCacheStorage(ABC):
    """Async storage of KV pages; see the module docstring for what a backend implements.

    Use as ``async with backend:`` or call :meth:`open`/:meth:`aclose`. Calls made before
    ``open`` open the backend on first use; calls after ``aclose`` raise
    :class:`~hicache.errors.StorageStateError`.
    """

    #: Name under which the backend is registered (informational).
    backend_name: ClassVar[str] = "abstract"
    #: Whether ``_read``/``_write`` accept :class:`~hicache.storage.segments.PageSegments` as a
    #: buffer (a page as pieces of pool memory). Then pages of a pool that describes them so
    #: move without a staging copy; otherwise they take the staging path.
    supports_segments: ClassVar[bool] = False
    #: Whether ``_read`` accepts :class:`~hicache.storage.staging.StagedPage` buffers (read,
    #: verify and commit each page on one I/O thread, through a staging page still in cache)
    #: and ``_write`` :class:`~hicache.storage.staging.PoolPage` ones (copied out of the pool
    #: by the thread that writes it). Otherwise pools without a page view move in pipelined
    #: chunks of staging pages.
    supports_staged_pages: ClassVar[bool] = False
    #: Why ``hicache inspect`` cannot look at this backend's store when it cannot list its
    #: namespaces (said with the backends that can).
    not_inspectable_why: ClassVar[str] = "cannot list its namespaces, so its store cannot be inspected"
    #: Whether the constructor takes ``read_only=True``: an observer's store that changes
    #: nothing on its medium (``hicache inspect`` opens stores so where they can be).
    supports_read_only: ClassVar[bool] = False
    #: Whether the store keeps its pages in the memory of the process that wrote them, so that
    #: no other process reads them (another rank of an engine whose ranks are processes): a
    #: class's, or a store's own where its location says (an fsspec ``memory://`` url).
    process_local: bool = False

    @classmethod
    def stored_page_nbytes(cls, payload_nbytes: int) -> int:
        """Bytes one page of ``payload_nbytes`` counts against this backend's ``max_bytes``
        (what a store sized in pages is given per page). By default the page itself; a backend
        that counts more per page (a file's header and footer) says so."""
        return payload_nbytes

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        *,
        namespace: Namespace | dict[str, Any] | None = None,
    ) -> None:
        self.storage_config = storage_config or HiCacheStorageConfig()
        if isinstance(namespace, dict):
            namespace = Namespace.from_dict(namespace)
        self._namespace: Namespace = namespace or Namespace.from_storage_config(self.storage_config)
        self.registered_pools: dict[str, Any] = {}
        self._unformatted_pools: set[str] = set()  # pools told their format came too late
        self.mem_pool_host: Any = None
        self.stats = StorageStats()
        self._staging = staging.StagingArena()  # reused staging pages of pools without page_view
        self._view_reads = LivePageViews()  # pools whose get_data_page(flat=False) is live memory
        self._state = StorageState.UNOPENED
        #: the open in progress (a thread-safe future: callers on other event loops wait for it
        #: too, as a backend that serves several loops is opened by whichever calls first)
        self._opening: concurrent.futures.Future[None] | None = None
        self._opening_guard = threading.Lock()
        #: the close in progress (thread-safe, as ``_opening``): a second close waits for it
        self._closing: concurrent.futures.Future[None] | None = None
        #: stores, removals and clears of KV pages are reported here (:mod:`hicache.storage.changes`)
        self.tier_changes = TierChangeHub()
        #: when the close under way must end (``time.monotonic()``), the caller's ``aclose``
        #: timeout; ``None``: the backend's own bounds (see :meth:`aclose`)
        self._close_deadline: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def namespace(self) -> Namespace:
        """The namespace this backend reads and writes (fixed once the backend is open)."""
        return self._namespace

    @property
    def state(self) -> StorageState:
        return self._state

    async def open(self) -> None:
        """Open the backend (idempotent). Backends do their set-up in :meth:`_open`.

        The first caller opens; callers meanwhile, on this event loop or another one, wait for
        that open (a cancelled waiter leaves it running) and, if it failed, try again
        themselves."""
        while True:
            if self._state is StorageState.OPEN:
                return
            if self._state is StorageState.CLOSED:
                raise StorageStateError(f"{type(self).__name__} is closed; create a new one")
            with self._opening_guard:
                opening = self._opening
                if opening is None:
                    opening = self._opening = concurrent.futures.Future()
                    break
            await _wait_in_progress(opening)
        try:
            await self._open_checked()
            if self._state is StorageState.CLOSED:
                # aclose() ran while _open() was awaiting: release what _open() just built
                # (aclose waits for this open, so it returns only once that is done).
                await self._close_quietly()
                raise StorageStateError(f"{type(self).__name__} was closed while opening")
            self._state = StorageState.OPEN
        finally:
            with self._opening_guard:
                self._opening = None  # failed or cancelled: the next caller opens again
            opening.set_result(None)

    async def _open_checked(self) -> None:
        """:meth:`_open`, where an error of the backend's own (a plugin's ``RuntimeError``, a
        client library's exception) is a :class:`BackendLoadError` naming the backend and the
        cause: raised as it came, it ended ``hicache demo``/``serve`` in a traceback and an
        embedding server's ``HiCache.start()`` in an exception of no hicache type, as a
        constructor's once did (:func:`~hicache.storage.registry.create_async_storage`).
        Errors said already (ours, a folder or a network's ``OSError``) pass as they are. An
        open still running after :data:`OPEN_WARN_S` is said in a warning, and again each as
        long after."""
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        warning: asyncio.TimerHandle

        def still_opening() -> None:
            nonlocal warning
            logger.warning("%s: storage backend %r has not opened after %.0f s; whatever needs it (a cache's "
                           "start) waits on", type(self).__name__, self.backend_name, time.monotonic() - began)
            warning = loop.call_later(OPEN_WARN_S, still_opening)

        warning = loop.call_later(OPEN_WARN_S, still_opening)
        try:
            await self._open()
        except (HiCacheError, OSError):
            raise
        except Exception as exc:  # noqa: BLE001 - a backend's own failure, reported whole
            raise BackendLoadError(
                f"storage backend {self.backend_name!r} ({type(self).__qualname__}) could not be opened: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            warning.cancel()

    async def aclose(self, timeout: float | None = None) -> None:
        """Release everything the backend holds (idempotent). An open in progress is waited
        for and then undone, so nothing it creates outlives this call; so is a close in
        progress (on this event loop or another one).

        ``timeout``: seconds the whole close may take (what is left of a caller's shutdown
        budget). A backend whose close waits (writes in flight, uploads to abort, clients of
        other event loops) stops waiting by then, leaves the rest and says what it left;
        ``None``: the backend's own bounds. Why: each wait bounded on its own, a close summed
        them past a server's drain, and the shutdown's SIGKILL came before its report."""
        if self._state is StorageState.CLOSED:
            # a close in progress is waited for: returned at once, the second caller went on
            # (exited, looked at the medium) with the first still writing and aborting
            # (no longer than this caller's own timeout: a step bounded by its budget must not
            # hang with a first close stuck on a hung medium)
            closing = self._closing
            if closing is None:
                return
            if timeout is None:
                await _wait_in_progress(closing)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_wait_in_progress(closing), max(0.0, timeout))
            return
        was_open = self._state is StorageState.OPEN
        self._state = StorageState.CLOSED
        self._close_deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if was_open:
            closing = self._closing = concurrent.futures.Future()
            try:
                await self._close_quietly()
            finally:
                closing.set_result(None)
        else:
            opening = self._opening
            if opening is not None:  # open() sees CLOSED and closes what it opened
                await _wait_in_progress(opening)

    async def _close_quietly(self) -> None:
        try:
            await self._close()
        except Exception:  # noqa: BLE001 - closing must not raise into shutdown paths
            logger.exception("%s: error while closing", type(self).__name__)

    async def __aenter__(self) -> AsyncHiCacheStorage:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _ensure_open(self) -> None:
        if self._state is not StorageState.OPEN:
            await self.open()

    # ------------------------------------------------------------------ backend primitives

    async def _open(self) -> None:  # noqa: B027 - optional hook
        """Set up the medium (create folders, connect, start background tasks)."""

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release the medium."""

    @abstractmethod
    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        """Whether each page is stored (a positive answer must be readable)."""

    @abstractmethod
    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each page's verified payload into its buffer; ``False`` for a miss."""

    @abstractmethod
    async def _write(
        self,
        pages: Sequence[PageKey],
        buffers: Sequence[memoryview],
        parents: Sequence[PageKey | None],
    ) -> list[bool]:
        """Store each buffer as the page's payload; ``False`` when not stored. A backend that
        knows which pages it held before answers a :class:`~hicache.storage.changes.Written`
        (those are not announced stored again)."""

    @abstractmethod
    async def _read_bytes(self, page: PageKey) -> bytes | None:
        """The verified payload of one page whose size the caller does not know."""

    @abstractmethod
    async def _clear(self) -> Sequence[PageKey] | None:
        """Remove every page of this namespace (and nothing else); answer the pages removed
        where the backend can name them all (their removal is reported, see
        :func:`~hicache.storage.changes.report_cleared`), ``None`` where it cannot."""

    def _backend_stats(self) -> dict[str, Any]:
        """Backend-specific figures merged into :meth:`get_stats`."""
        return {}

    async def _delete(self, pages: Sequence[PageKey]) -> list[bool]:
        """Remove each page; ``True`` where it was stored and is gone now. Optional: a backend
        without it keeps its pages until its own bound evicts them (:meth:`batch_delete` then
        answers ``None``), so a placement policy's eviction is a hint, never a requirement."""
        raise NotImplementedError

    @property
    def supports_delete(self) -> bool:
        """Whether :meth:`batch_delete` removes pages (the backend implements ``_delete``)."""
        return type(self)._delete is not AsyncHiCacheStorage._delete

    async def _exists_prefix(self, pages: Sequence[PageKey]) -> int:
        """How many of ``pages``, from the first, exist: all a prefix lookup needs. Optional;
        the default asks :meth:`_exists` about every page. A backend whose lookups cost round
        trips overrides it to stop at the first miss (and never to answer past one)."""
        return leading_run(await self._exists(pages))

    def _exists_prefix_now(self, pages: Sequence[PageKey], deadline: float | None = None) -> int | None:
        """(Any thread; optional.) :meth:`_exists_prefix` answered on the calling thread from
        what the backend holds in memory (and at most a quick look at its medium), or ``None``
        when only the event loop can answer. It must not change loop-owned state. A look at the
        medium still unanswered at ``deadline`` (``time.monotonic()``) is a miss: a hung mount
        must not hold the caller past its timeout. The default answers ``None`` (every lookup
        goes through the loop)."""
        return None

    def _read_now(self, pages: Sequence[PageKey], buffers: Sequence[Any], deadline: float | None = None) -> list[bool] | None:
        """(Any thread; optional.) :meth:`_read` done on the calling thread: one flag per page,
        or ``None`` before anything is read when the backend would rather take the batch on its
        loop (large pages it spreads over its threads). Buffers are byte views or
        :class:`PageSegments`. Past ``deadline`` (``time.monotonic()``), pages not started fail.
        Loop-owned state may change only through ``loop.call_soon_threadsafe``. The default
        answers ``None``."""
        return None

    def _reads_now(self, num_pages: int, nbytes: int) -> bool:
        """(Any thread; optional.) Whether :meth:`_read_now` would take a batch of ``num_pages``
        pages of ``nbytes`` in all: asked before the batch's buffers are made, so a batch the
        backend leaves to its loop costs no preparation twice. The default: yes."""
        return True

    # ------------------------------------------------------------------ optional introspection

    async def list_namespaces(self) -> list[Namespace]:
        """Every namespace stored on this backend's medium (for ``hicache inspect``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list namespaces")

    async def read_namespaces(self) -> tuple[list[Namespace], dict[str, str]]:
        """:meth:`list_namespaces`, and the namespaces on this medium whose description cannot
        be read (a corrupt manifest) by digest, each with why, from one read of the medium
        (``hicache inspect`` lists the second kind as corrupt: ``list_namespaces`` cannot name
        them). By default none is unreadable."""
        return await self.list_namespaces(), {}

    async def list_pages(self) -> list[tuple[PageKey, int]]:
        """Every page of this namespace with its stored size in bytes (for ``hicache inspect``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list pages")

    async def describe_space(self) -> dict[str, Any]:
        """Space facts for ``hicache inspect``: free space, limits, and whether (and how many)
        writes were refused for space. Empty when the backend has none to give."""
        return {}

    def other_namespaces_holding(self, key: str, pool: str = "kv", *, limit: int = 8) -> list[str] | None:
        """(On a worker thread; miss attribution's explain mode.) Digests of up to ``limit``
        other namespaces of this medium that hold the page ``(key, pool)``; ``None`` when the
        backend cannot tell. Must stay cheap: a few stats, no page read."""
        return None

    async def verify_page(self, page: PageKey) -> bool:
        """Read and verify one page; a corrupt page is a miss (and is dropped, as on any read)."""
        await self._ensure_open()
        return await self._guard("verify", self._read_bytes(page), None) is not None

    async def survey_pages(self) -> tuple[list[tuple[PageKey, int]], int]:
        """:meth:`list_pages`, and how many stored pages the listing could not read (``hicache
        inspect`` counts them corrupt), from the same look at the store. By default none: a
        backend whose listing can meet unreadable pages (torn files) counts them."""
        return await self.list_pages(), 0

    async def check_page(self, page: PageKey) -> str:
        """:meth:`verify_page` with why a page failed (``hicache inspect``): ``"ok"``,
        ``"corrupt"``, or ``"vanished"`` (removed by a writer before it was read: no damage).
        By default every failed read is ``"corrupt"``; a backend that can tell a missing page
        from a damaged one says so."""
        return "ok" if await self.verify_page(page) else "corrupt"

    # ------------------------------------------------------------------ guarded calls

    async def _guard(self, what: str, coro: Any, fallback: Any) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the caller was cancelled: let it unwind
            # nobody cancelled this task: the backend (or a library under it) raised a stray
            # CancelledError, which is an error of the store like any other
            self._bad_answer(what, "%s: %s raised CancelledError without being cancelled; answering with misses",
                             type(self).__name__, what)
            return fallback
        except Exception:  # noqa: BLE001 - see module docstring
            self._failed(what)
            return fallback

    def _failed(self, what: str) -> None:
        """A primitive raised (called from its ``except``): counted, and logged with its
        traceback at most once per :data:`FAILURE_LOG_PERIOD_S` per primitive, the line saying
        how many failures it stands for; the caller answers with misses.

        Why the throttle: a broken backend fails every call, a page at a time under load, and a
        traceback per failure flooded the server's log (every failure is still counted in
        ``backend_errors``)."""
        count = self._backend_error(what)
        if count:
            since = "" if count == 1 else f" ({count} failures of it since its last report)"
            logger.exception("%s: %s failed%s; answering with misses", type(self).__name__, what, since)

    def _bad_answer(self, what: str, message: str, *args: Any) -> None:
        """A primitive answered what no store may (flags of another count, a prefix run out of
        range, a stray CancelledError): counted in ``backend_errors``, and ``message`` logged
        at most once per :data:`FAILURE_LOG_PERIOD_S` per primitive, as :meth:`_failed` does: a
        buggy backend answers every call so, and a line per call flooded the log under load."""
        count = self._backend_error(("answer", what))
        if count:
            since = "" if count == 1 else f" ({count} such answers since the last report)"
            logger.error(message + "%s", *args, since)

    def _backend_error(self, kind: object) -> int:
        """Count one error of the backend (``backend_errors``); returns how many errors of
        ``kind`` to report now (0: stay quiet), by a throttle of :data:`FAILURE_LOG_PERIOD_S`
        per kind."""
        self.stats.incr("backend_errors")
        throttles = self.__dict__.setdefault("_failure_logs", {})  # (set here: a subclass may skip __init__)
        throttle = throttles.get(kind)
        if throttle is None:
            throttle = throttles.setdefault(kind, Throttle(FAILURE_LOG_PERIOD_S))
        return throttle.due()

    async def _guard_flags(self, what: str, coro: Any, n: int) -> list[bool]:
        """A guarded primitive that answers one flag per page; a list of another length is a
        backend bug, and trusting it would shift every answer onto the wrong page."""
        return self._checked_flags(what, await self._guard(what, coro, _FAILED), n)

    def _checked_flags(self, what: str, flags: Any, n: int) -> list[bool]:
        """A primitive's answer as ``n`` flags: a failure the guard counted (``_FAILED``) is
        ``n`` misses; so is anything else that is not ``n`` flags (a list of another length
        would shift every answer onto the wrong page; ``None`` is a forgotten ``return``),
        counted and logged as the backend bug it is."""
        if flags is _FAILED:  # it raised: counted and logged by the guard
            return [False] * n
        try:
            flags = list(map(bool, flags))
        except TypeError:  # None (a forgotten return) or no list at all
            flags = []
        if len(flags) != n:
            self._bad_answer(what, "%s: %s answered %d flags for %d pages; answering with misses",
                             type(self).__name__, what, len(flags), n)
            return [False] * n
        return flags

    async def _exists_guarded(self, pages: Sequence[PageKey]) -> list[bool]:
        if not pages:
            return []
        t0 = time.perf_counter()
        flags = await self._guard_flags("exists", self._exists(pages), len(pages))
        self._count_lookup(len(pages), sum(flags), t0)
        return flags

    def _answers_now(self, hook: str, overridable: tuple[str, ...]) -> bool:
        """Whether this open store answers on the caller's thread through ``hook``: its class
        defines the hook with none of ``overridable`` overridden below it, and no instance
        attribute replaces one of them (a patched instance)."""
        return (
            self._state is StorageState.OPEN
            and _class_answers_now(type(self), hook, overridable)
            and not any(name in vars(self) for name in overridable)
        )

    def _count_lookup(self, keys: int, hits: int, t0: float) -> None:
        self.stats.incr("exists_calls")
        self.stats.incr("exists_keys", keys)
        self.stats.incr("exists_hits", hits)
        self.stats.incr("exists_seconds", time.perf_counter() - t0)

    def _checked_run(self, run: Any, n: int) -> int | None:
        """A prefix lookup's answer as a count of pages from the first (any integral type);
        ``None`` for anything else, a backend bug, counted and logged."""
        if isinstance(run, bool) or not isinstance(run, numbers.Integral) or not 0 <= int(run) <= n:
            self._bad_answer("exists", "%s: exists answered %r for %d pages", type(self).__name__, run, n)
            return None
        return int(run)

    async def _kv_prefix(self, pages: Sequence[PageKey]) -> int:
        """The guarded :meth:`_exists_prefix`, through :meth:`_exists_guarded` when the backend
        keeps the default (so its counters stay per page)."""
        if type(self)._exists_prefix is AsyncHiCacheStorage._exists_prefix:
            return leading_run(await self._exists_guarded(pages))
        if not pages:
            return 0
        t0 = time.perf_counter()
        run = await self._guard("exists", self._exists_prefix(pages), 0)
        run = self._checked_run(run, len(pages)) or 0  # a bad answer is a miss
        self._count_lookup(len(pages), run, t0)
        return run

    async def _read_guarded(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        if not pages:
            return []
        t0 = time.perf_counter()
        ok = await self._guard_flags("read", self._read(pages, buffers), len(pages))
        self._count_reads(buffers, ok, t0)
        return ok

    def _read_guarded_now(self, pages: Sequence[PageKey], buffers: Sequence[Any], deadline: float | None = None) -> list[bool] | None:
        """:meth:`_read_guarded` on the calling thread through :meth:`_read_now`; ``None`` when
        the backend declined (nothing read, nothing counted)."""
        if not pages:
            return []
        t0 = time.perf_counter()
        try:
            got = self._read_now(pages, buffers, deadline)
        except Exception:  # noqa: BLE001 - see module docstring
            self._failed("read on the calling thread")
            got = [False] * len(pages)
        if got is None:
            return None
        ok = self._checked_flags("read", got, len(pages))
        self._count_reads(buffers, ok, t0)
        return ok

    def _count_reads(self, buffers: Sequence[Any], ok: list[bool], t0: float) -> None:
        hits = sum(ok)
        self.stats.incr("read_pages", len(ok))
        self.stats.incr("read_hits", hits)
        self.stats.incr("read_misses", len(ok) - hits)
        self.stats.incr("read_bytes", sum(len(b) for b, f in zip(buffers, ok) if f))
        self.stats.incr("read_seconds", time.perf_counter() - t0)

    async def _write_guarded(
        self,
        pages: Sequence[PageKey],
        buffers: Sequence[memoryview],
        parents: Sequence[PageKey | None],
    ) -> list[bool]:
        if not pages:
            return []
        t0 = time.perf_counter()
        answer = await self._guard("write", self._write(pages, buffers, parents), _FAILED)
        held = getattr(answer, "held", None)  # a :class:`changes.Written`: pages held before
        ok = self._checked_flags("write", answer, len(pages))
        done = sum(ok)
        self.stats.incr("write_pages", len(pages))
        self.stats.incr("write_ok", done)
        self.stats.incr("write_failures", len(pages) - done)
        if done == len(ok) == len(buffers):  # the usual batch: every page stored
            self.stats.incr("write_bytes", sum(map(len, buffers)))
        else:
            self.stats.incr("write_bytes", sum(len(b) for b, f in zip(buffers, ok) if f))
        self.stats.incr("write_seconds", time.perf_counter() - t0)
        changes.report_written(self.tier_changes, self.backend_name, self._kv_page_size(), pages, parents,
                               changes.new_pages(ok, held))
        return ok

    def _kv_page_size(self) -> int:
        pool = self.registered_pools.get(KV)
        return int(getattr(pool, "page_size", 0) or 0)

    def report_removed(self, pages: Sequence[PageKey], *, reason: str, origin: str = "local") -> None:
        """For backends: ``pages`` left the store (evicted, deleted as corrupt, removed by a
        peer process); reported to :attr:`tier_changes`."""
        changes.report_removed(self.tier_changes, self.backend_name, pages, reason=reason, origin=origin)

    # ------------------------------------------------------------------ pools

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the KV host pool used by the v1 calls (and by v2 as pool ``kv``)."""
        self.mem_pool_host = mem_pool_host
        self.register_mem_host_pool_v2(mem_pool_host, PoolName.KV)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: PoolName | str) -> None:
        """Register the host pool that v2 transfers of ``host_pool_name`` read from/write to.

        A KV pool that reports ``storage_signature()`` fills the namespace's unknown geometry.
        An engine's pool without one that states its ``layout`` (SGLang's host pools, registered
        directly) stores its own bytes, so its format (:mod:`hicache.storage.pool_format`) goes
        into the namespace. Either must happen before the backend opens, since the namespace
        decides where pages live.
        """
        name = pool_name_str(host_pool_name)
        missing = [
            m
            for m in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
            if not callable(getattr(host_pool, m, None))
        ]
        if missing:
            raise TypeError(f"host pool for {name!r} does not follow the page protocol: missing {missing}")
        page_size = getattr(host_pool, "page_size", None)
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            # a page of 0 tokens (or a bool) failed every transfer later, or raised from numpy
            raise TypeError(f"host pool for {name!r}: page_size must be a positive int, got {page_size!r:.40}")
        signature = getattr(host_pool, "storage_signature", None)
        refined = self._namespace
        if name == KV and callable(signature):
            refined = refined.with_signature(signature())
        elif callable(signature) and "@" not in name:
            # An extra pool with a signature (hicache's MambaHostPool: state dtype and shapes)
            # had none of it in the namespace, so a server whose states differ in meaning but
            # not in size (bfloat16 and float16, shapes in another split) restored another's
            # states as valid. Its format goes in as an engine pool's does. A pool whose stored
            # name carries its format already ("name@format", the SGLang integration's canonical
            # sidecars) keeps the namespace as it is.
            refined = self._with_format_of(name, host_pool, signature_tag(signature()))
        elif states_its_format(host_pool):
            refined = self._with_format_of(name, host_pool)
        if refined != self._namespace:
            if self._state is not StorageState.UNOPENED:
                raise StorageStateError(
                    "register host pools before the backend opens: the pool's geometry or byte "
                    "format changes the namespace, and pages already live under the old one"
                )
            self._namespace = refined
        self.registered_pools[name] = host_pool

    def _with_format_of(self, name: str, host_pool: Any, tag: str | None = None) -> Namespace:
        """The namespace with the byte format of ``host_pool`` (an engine's pool, which stores
        its own bytes: without its format a pool of another layout or dtype, another server of
        the model, reads them as KV). A store opened before any such pool of this name was
        known keeps its namespace (as before), said once; a pool of another format than the
        one named is refused by the caller."""
        tag = tag or pool_format_tag(host_pool)
        refined = self._namespace.with_pool_format(name, tag)
        opened_without = (self._state is not StorageState.UNOPENED
                          and f"pool.{name}" not in dict(self._namespace.extra))
        if refined == self._namespace or not opened_without:
            return refined
        if name not in self._unformatted_pools:
            self._unformatted_pools.add(name)
            logger.warning(
                "%s: pool %r (%s) was registered after the store opened, so its byte format is not "
                "part of the namespace: register host pools before the first call, or a pool of another "
                "layout or dtype sharing the store reads its pages", type(self).__name__, name, tag)
        return self._namespace

    def _pool(self, name: str) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None:
            raise StorageStateError(
                f"no host pool registered for pool {name!r}; call register_mem_host_pool_v2 "
                f"(registered: {sorted(self.registered_pools)})"
            )
        return pool

    # ------------------------------------------------------------------ v2

    async def exists_pages(self, keys: Sequence[str], pool: PoolName | str = PoolName.KV) -> list[bool]:
        """Whether each key's page of ``pool`` exists (one batched backend call)."""
        keys = validate_keys(keys)
        await self._ensure_open()
        name = pool_name_str(pool)
        return await self._exists_guarded([PageKey(k, name) for k in keys])

    async def exists_prefix(self, keys: Sequence[str], pool: PoolName | str = PoolName.KV) -> int:
        """How many of ``keys``, from the first, have a page of ``pool`` stored: a prefix lookup
        in as few backend round trips as the backend allows (it stops at the first miss)."""
        keys = validate_keys(keys)
        await self._ensure_open()
        return await self._kv_prefix([PageKey(k, pool_name_str(pool)) for k in keys])

    def exists_prefix_now(self, keys: Sequence[str], pool: PoolName | str = PoolName.KV,
                          timeout: float | None = None) -> int | None:
        """:meth:`exists_prefix` answered on the calling thread, or ``None`` when it cannot be
        (not open, keys the loop's path must refuse, or a backend that answers only on its
        loop: then await :meth:`exists_prefix`). Thread-safe; counted like a lookup.
        ``timeout`` bounds it as a facade's ``call_timeout`` bounds a call on the loop: a look
        at the medium (a shared file store's disk probe) not answered by then is a miss.

        Counted as a backend that stops at the first miss counts a prefix lookup:
        ``exists_hits`` grows by the run. A subclass that overrides ``_exists`` or
        ``_exists_prefix`` below the class that answers here (added latency, injected faults)
        is always asked on the loop, so its override runs.

        Why: a blocking caller on a thread of its own (SGLang's prefetch thread, through the
        ``dynamic`` backend) otherwise pays two thread hand-offs for what is a dictionary
        lookup, and in a busy engine process each waits for the GIL: 0.84 ms a lookup of 34
        pages in SGLang's engine, against 0.2 ms for SGLang's own file backend."""
        if not self._answers_now("_exists_prefix_now", ("_exists", "_exists_prefix")):
            return None
        try:
            keys = validate_keys(keys)
            pages = [PageKey(k, pool_name_str(pool)) for k in keys]
        except Exception:  # noqa: BLE001 - the loop's path raises the proper error
            return None
        if not pages:
            return 0
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            run = self._exists_prefix_now(pages, deadline)
        except Exception:  # noqa: BLE001 - see module docstring
            self.stats.incr("backend_errors")
            logger.exception("%s: a lookup on the calling thread failed; asking on the loop", type(self).__name__)
            return None
        run = None if run is None else self._checked_run(run, len(pages))
        if run is None:
            return None  # the loop's lookup answers
        self._count_lookup(len(pages), run, t0)
        return run

    async def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Usable prefix length in pages, honouring each extra pool's hit policy."""
        keys = validate_keys(keys)
        extra = [t for t in (pool_transfers or ()) if pool_name_str(t.name) != KV]
        checked_policies(extra)
        await self._ensure_open()
        kv_pages = await self._kv_prefix([PageKey(k, KV) for k in keys])
        kv_flags = [True] * kv_pages + [False] * (len(keys) - kv_pages)  # only its leading run counts
        pool_flags: dict[str, list[bool]] = {}
        if kv_pages and extra:
            names = list(dict.fromkeys(pool_name_str(t.name) for t in extra))
            asked = [PageKey(k, n) for n in names for k in keys[:kv_pages]]
            flags = await self._exists_guarded(asked)
            for j, n in enumerate(names):
                pool_flags[n] = flags[j * kv_pages : (j + 1) * kv_pages]
        return resolve_v2_hits(kv_flags, pool_flags, extra)

    async def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages from storage into its host pool."""
        await self._ensure_open()
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = pool_name_str(transfer.name)
            keys = validate_keys(transfer.keys or [])
            results[name] = await pool_pages.read_pages(self, name, keys, transfer.host_indices)
        return results

    async def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Write each transfer's pages from its host pool to storage."""
        await self._ensure_open()
        prefix = (extra_info.prefix_keys if extra_info is not None else None) or []
        # ``prefix_keys + keys`` is one chain: the first page's parent is the last prefix key,
        # or none where that key is not storable (as a run after a bad key has none). Bad keys
        # filtered out first, a page was recorded as continuing one two or more pages back
        last = prefix[-1] if prefix else None
        parent = last if is_storable(last) else None
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = pool_name_str(transfer.name)
            keys = validate_keys(transfer.keys or [])
            kv_pages = page_keys(keys, KV)
            parents: Sequence[PageKey | None]
            if name == KV:  # each page's parent is the page before it (validated keys: never empty)
                first: list[PageKey | None] = [PageKey(parent, KV) if parent is not None else None]
                parents = [*first, *kv_pages[:-1]]
            else:  # an extra pool's page lives and dies with the KV page of the same key
                parents = kv_pages
            results[name] = await pool_pages.write_pages(
                self, name, keys, transfer.host_indices, parents, kv_pages if name == KV else None
            )
        return results

    # ------------------------------------------------------------------ v1

    def _kv_pool_registered(self) -> None:
        if KV not in self.registered_pools:
            raise StorageStateError("the v1 calls need register_mem_pool_host(host_pool) first")

    async def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read KV pages into the registered host pool at ``host_indices``."""
        return await self._v1(self.batch_get_v2, keys, host_indices, extra_info)

    def batch_get_v1_now(self, keys: list[str], host_indices: torch.Tensor, timeout: float | None = None) -> list[bool] | None:
        """:meth:`batch_get_v1` on the calling thread, or ``None`` (nothing read, nothing
        counted: await :meth:`batch_get_v1`) where it cannot be: the store not open, no KV pool,
        keys or host indices the loop's path must refuse, pages the pool can hand out only
        through staging, a backend that reads only on its loop or declines this batch, or one
        whose ``_read`` is overridden below the class that reads here. Thread-safe.

        For a blocking caller on its own thread that may block on the store's medium (SGLang's
        prefetch thread: SGLang's own file backend reads there too). ``timeout`` bounds it as a
        facade's ``call_timeout`` bounds a call on the loop: pages not started by then fail
        (counted in ``call_timeouts``); a page being read is finished, as on the loop, whose
        cancelled batch waits for its threads' pages in flight.
        """
        if not self._answers_now("_read_now", ("_read",)) or KV not in self.registered_pools:
            return None
        try:
            keys = validate_keys(keys)
        except Exception:  # noqa: BLE001 - the loop's path raises the proper error
            return None
        if not keys:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return pool_pages.read_pages_now(self, KV, keys, host_indices, deadline)
        except Exception:  # noqa: BLE001 - a check before the read failed (the read guards itself)
            logger.exception("%s: checking a batch for a read on the calling thread failed; reading on the loop",
                             type(self).__name__)
            return None

    async def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write KV pages from the registered host pool at ``host_indices``."""
        return await self._v1(self.batch_set_v2, keys, host_indices, extra_info)

    async def _v1(self, v2: Any, keys: list[str], host_indices: torch.Tensor, extra_info: Any) -> list[bool]:
        """A v1 call is the v2 call with one KV transfer."""
        self._kv_pool_registered()
        result = await v2([PoolTransfer(PoolName.KV, host_indices, keys=keys)], extra_info)
        return result[KV]

    # ------------------------------------------------------------------ v0 (single keys, tensors)

    async def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        """The tensor stored under ``key``: read into ``target_location`` when given (its size
        must match), else a new uint8 tensor. ``None`` on a miss."""
        return (await self.batch_get([key], [target_location]))[0]

    async def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor | None] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """The tensor stored under each key, as :meth:`get` reads one."""
        keys = validate_keys(keys)
        await self._ensure_open()
        return await tensor_pages.read_tensors(self, keys, target_locations)

    async def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store ``value`` (or ``target_location`` when no value is given) under ``key``."""
        return await self.batch_set([key], [value if value is not None else target_location])

    async def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor | None] | None = None,
        target_locations: Sequence[torch.Tensor | None] | None = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store each tensor under its key; True only if every one was stored."""
        keys = validate_keys(keys)
        await self._ensure_open()
        vals = list(values if values is not None else (target_locations or []))
        return await tensor_pages.write_tensors(self, keys, vals)

    async def exists(self, key: str) -> bool:
        validate_key(key)
        return (await self.exists_pages([key]))[0]

    async def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of consecutive existing keys from the start."""
        return leading_run(await self.exists_pages(keys))

    async def batch_delete(self, keys: Sequence[str], pool: PoolName | str = PoolName.KV) -> list[bool] | None:
        """Remove the pages of ``keys`` in ``pool`` (an eviction chosen by the caller, who knows
        which pages the tree still needs). One flag per key: ``True`` where a page was removed,
        ``False`` where none was stored or the backend failed (counted, logged, never raised).
        ``None`` where the backend has no delete: it keeps evicting by its own bound. Removed KV
        pages are reported to tier-change subscribers with reason ``"deleted"``."""
        keys = validate_keys(keys)
        if not self.supports_delete:
            return None
        await self._ensure_open()
        name = pool_name_str(pool)
        pages = [PageKey(k, name) for k in keys]
        if not pages:
            return []
        flags = await self._guard_flags("delete", self._delete(pages), len(pages))
        self.stats.incr("delete_calls")
        self.stats.incr("deleted_pages", sum(flags))
        gone = [p for p, f in zip(pages, flags) if f]
        if gone:
            self.report_removed(gone, reason="deleted")
        return flags

    async def clear(self) -> bool:
        """Remove every page of this namespace; other namespaces are untouched."""
        await self._ensure_open()
        try:
            removed = await self._clear()
            changes.report_cleared(self.tier_changes, self.backend_name, removed)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001
            self.stats.incr("backend_errors")
            logger.exception("%s: clear failed", type(self).__name__)
            return False

    def get_stats(self) -> dict[str, Any]:
        """Counters (see :class:`~hicache.storage.stats.StorageStats`) plus backend figures."""
        out: dict[str, Any] = {"backend": self.backend_name, "namespace": self._namespace.digest}
        out.update(self.stats.snapshot())
        try:
            out.update(self._backend_stats())
        except Exception:  # noqa: BLE001
            logger.exception("%s: stats failed", type(self).__name__)
        return out
