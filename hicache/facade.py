"""``HiCache``: the one object an inference server embeds.

It builds everything from a config (device pool, host pool, storage backend, controller, radix
prefix cache, session cache) and gives a server the request path it needs, as coroutines on the
server's own event loop::

    async with HiCache.from_config("configs/default.toml") as cache:
        h = await cache.begin(rid, token_ids, session_id=sid)   # match + load-back + prefetch
        # prefill h.token_ids[h.prefix_len:] writing KV at h.kv_indices[h.prefix_len:];
        # attention of layer i first waits h.wait_layer(i) (prefix KV being loaded from host)
        new = await cache.extend(h, [next_token])                # decode: slots for new tokens
        await cache.commit(h, finished=True)                     # KV into the prefix cache / session
        await cache.release_session(sid)                         # conversation over

Leaving the ``async with`` (or ``aclose()``) releases every session, drains the queued
write-backs and backups to host and storage, and reports any page it could not write; a second
close is a no-op and any call after it raises :class:`~hicache.errors.CacheClosedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import numbers
import operator
import os
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hicache.config import HiCacheConfig, aload_config, load_config
from hicache.controller.close_task import CLOSE_CUT, coroutine_function, start_close_task, wait_for_close
from hicache.controller.jobs import CloseReport
from hicache.errors import (
    CacheClosedError,
    HiCacheError,
    LoopMisuseError,
    OutOfKVSlotsError,
    PrefixLoadError,
    RequestAbortedError,
    quoted,
)
from hicache.events.service import start_events
from hicache.memory import MambaHostPool, MambaStatePool
from hicache.observability import tracing
from hicache.observability.cache_gauges import export_cache_state
from hicache.observability.metrics import exposition_text
from hicache.prefix_cache import Req, Session
from hicache.session import SessionAwareCache
from hicache.session.config import SessionConfig as SessionCacheConfig
from hicache.stack import CacheStack, build_stack, stack_config_from, torch_dtype
from hicache.storage.types import PoolHitPolicy, PoolTransfer
# the request path's token check, shared with the engine (which must not import the facade)
from hicache.tokens import token_ids_of as token_ids_of

__all__ = ["HiCache", "RequestHandle"]

logger = logging.getLogger("hicache")

_T = TypeVar("_T")


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False)
class RequestHandle:
    """One request's view of its KV.

    ``token_ids`` is the whole sequence whose KV the request holds or will write;
    ``kv_indices[i]`` is the device slot of ``token_ids[i]``; the first ``prefix_len`` tokens'
    KV is already valid (from device, host or storage: ``hits`` says how many from each)."""

    rid: str
    session_id: str | None
    token_ids: list[int]
    prefix_len: int
    kv_indices: torch.Tensor
    hits: dict[str, int]
    req: Req = field(repr=False)
    load: Any = field(default=None, repr=False)
    done: bool = False
    #: hits per tier and misses per reason of the prompt's tokens
    #: (:class:`~hicache.observability.attribution.RequestAttribution`; ``None`` when off)
    attribution: Any = None
    #: the model's KV layers (the valid ``layer`` arguments of :meth:`wait_layer` are
    #: ``0..num_layers-1``); ``None``: the load's own count, when there is a load
    num_layers: int | None = None

    async def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of the prefix KV is on device; a failed load raises
        :class:`~hicache.errors.PrefixLoadError` (abort the request). A ``layer`` that is not
        an integer in ``0..num_layers-1`` raises ``TypeError``/``IndexError``."""
        layer = self._checked_layer(layer)
        if self.load is not None:
            with self._typed_load_errors():
                await self.load.wait_layer(layer)

    def wait_layer_sync(self, layer: int) -> None:
        """Blocking :meth:`wait_layer`, for a model's forward running on a worker thread."""
        layer = self._checked_layer(layer)
        if self.load is not None:
            with self._typed_load_errors():
                self.load.wait_layer_sync(layer)

    def _checked_layer(self, layer: Any) -> int:
        """``layer`` as an int in ``0..num_layers-1``, checked before the load is looked at.

        Why: without a load any value returned as if the layer were ready, and with one the
        counter's ``IndexError`` came out of :meth:`_typed_load_errors` as a
        :class:`~hicache.errors.PrefixLoadError` ("could not be loaded from host; abort it")
        although the load was fine: a server following that contract aborted a good request
        for its own wrong argument. The same bad argument now fails the same way either way."""
        if isinstance(layer, bool):
            raise TypeError("layer must be an integer layer index, not a bool")
        try:
            index = operator.index(layer)  # ints and integer scalars (numpy, 0-d tensors)
        except TypeError:
            raise TypeError(f"layer must be an integer layer index, got {layer!r:.40} "
                            f"({type(layer).__name__})") from None
        n = self.num_layers if self.num_layers is not None else getattr(self.load, "num_layers", None)
        if n is not None and not 0 <= index < n:
            raise IndexError(f"request {quoted(self.rid)}: layer {index} out of range [0, {n})")
        return index

    async def wait_loaded(self) -> None:
        """Return once every layer of the prefix KV is on device (a forward that reads the
        prefix without waiting layer by layer must wait for this first); a failed load raises
        :class:`~hicache.errors.PrefixLoadError`."""
        if self.load is not None:
            with self._typed_load_errors():
                await self.load.wait()

    @contextlib.contextmanager
    def _typed_load_errors(self) -> Iterator[None]:
        """The copy engine raises whatever the copy raised (a torch or CUDA error): the caller
        gets one documented type, whose message says what to do (cancellation passes)."""
        try:
            yield
        except HiCacheError:
            raise
        except Exception as exc:
            raise PrefixLoadError(f"request {quoted(self.rid)}: its prefix KV could not be loaded from host ({exc}); "
                                  "abort it (commit aborts it too)") from exc


class HiCache:
    """A hierarchical KV cache built from a :class:`~hicache.config.HiCacheConfig`.

    Attributes a server may use: ``config``, ``device_pool`` (the L1 KV tensors the model reads
    and writes by slot), ``host_pool``, ``storage`` (``None`` without L3), ``cache`` (the
    session-aware prefix cache), ``extra_pools`` (hybrid models' state pools by name).
    """

    def __init__(self, config: HiCacheConfig) -> None:
        if not isinstance(config, HiCacheConfig):
            # a path or a dict (what from_config takes) failed deep in the wiring with
            # "'dict' object has no attribute 'model'", naming neither the mistake nor the fix
            raise TypeError(f"HiCache() takes a HiCacheConfig, got {type(config).__name__}; build one from a "
                            "config file or dict with HiCache.from_config(...) (or afrom_config on a running loop)")
        self.config = config
        self._stack_config = stack_config_from(config)
        self._stack: CacheStack | None = None
        self.cache: SessionAwareCache | None = None
        self.extra_pools: dict[str, tuple[MambaStatePool, MambaHostPool]] = {}
        self._state = _State.UNOPENED
        self._live: dict[int, RequestHandle] = {}
        self._rids: set[str] = set()  # the cache's request ids in use (begun, not finished)
        self._rid_seq = 0
        self._close_task: asyncio.Task[Any] | None = None
        # one start at a time: a concurrent start() waits for the running one (and finds the
        # cache open) instead of building a second stack; aclose() waits for it too
        self._start_lock = asyncio.Lock()
        #: the storage open a start() is waiting for; an aclose() meanwhile cancels it
        self._opening: asyncio.Future[None] | None = None
        self._events: Any = None  # hicache.events.service.KVEventService, once events are on
        self.close_report: Any = None
        #: the event loop start() ran on: the one loop every call must come from (see _check_loop)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | dict | HiCacheConfig | None = None) -> HiCache:
        """Build from a config file or dict (``HICACHE__*`` environment overrides apply) or a
        :class:`HiCacheConfig` object, taken as it is (it was loaded already)."""
        return cls(load_config(source))

    @classmethod
    async def afrom_config(
        cls, source: str | os.PathLike[str] | dict | HiCacheConfig | None = None
    ) -> HiCache:
        """:meth:`from_config` for a server already on its event loop: the config file is read
        without blocking the loop (``aiofiles``)."""
        return cls(await aload_config(source))

    # ------------------------------------------------------------------ lifecycle

    @property
    def device_pool(self) -> Any:
        return self._require_stack().device_pool

    @property
    def host_pool(self) -> Any:
        return self._require_stack().host_pool

    @property
    def storage(self) -> Any:
        return self._require_stack().storage

    def pool_transfer(
        self, name: str, *, keys: list[str] | None = None, host_indices: torch.Tensor | None = None
    ) -> PoolTransfer:
        """A v2 transfer of extra pool ``name`` (``extra_pools`` in the config) for the
        storage's ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``, with the hit policy
        the config gives the pool (``extra_pools[].hit_policy``: a hybrid model's Mamba state
        needs only its trailing pages, an indexer every page). ``KeyError`` for a pool the
        config does not define."""
        spec = next((p for p in self.config.extra_pools if p.name == name), None)
        if spec is None:
            raise KeyError(f"no extra pool {name!r} in the config (extra_pools: "
                           f"{[p.name for p in self.config.extra_pools]})")
        return PoolTransfer(name, host_indices=host_indices, keys=keys, hit_policy=PoolHitPolicy(spec.hit_policy))

    def _require_stack(self) -> CacheStack:
        if self._stack is None:
            raise CacheClosedError("HiCache is not open; use `async with HiCache.from_config(...)` or await start()")
        return self._stack

    async def start(self) -> HiCache:
        """Allocate the pools, open the storage backend and start the controller.

        Concurrent calls start the cache once; an :meth:`aclose` that overtakes the start
        takes down what it built (the start then raises :class:`CacheClosedError`)."""
        self._check_loop()
        self._loop = asyncio.get_running_loop()
        async with self._start_lock:
            if self._state is _State.OPEN:
                return self
            if self._state is _State.CLOSED:
                raise CacheClosedError("HiCache is closed; build a new one")
            self._loop = asyncio.get_running_loop()
            try:
                return await self._start()
            except BaseException:
                if self._state is _State.UNOPENED:
                    self._loop = None  # a failed start binds nothing: a retry may run on another loop
                raise

    async def _start(self) -> HiCache:
        if self.config.tracing.enabled:
            tracing.enable()  # before anything is built: a missing otel extra fails the start
        stack = build_stack(self._stack_config)
        self._stack = stack
        try:
            for spec in self.config.extra_pools:
                shapes = {k: tuple(v) for k, v in spec.state_shapes.items()}
                state = MambaStatePool(spec.slots, shapes, torch_dtype(spec.dtype), stack.device_pool.device)
                # pinned exactly when the KV host pool is (the user's host.pin_memory, never on a CPU device)
                host = MambaHostPool(state, host_size=spec.host_slots, pin_memory=stack.host_pool.pin_memory)
                self.extra_pools[spec.name] = (state, host)
                if stack.storage is not None:
                    stack.storage.register_mem_host_pool_v2(host, spec.name)
            if self.config.events.enabled:
                self._events = start_events(stack.tier_changes, self.config.events)
            await self._open_storage(stack)
        except BaseException:
            if self._events is not None:
                await self._events.aclose()
                self._events = None
            # nothing half-built outlives a failed start (copy thread, I/O thread, storage)
            self._stack = None
            self.extra_pools = {}
            try:
                await stack.aclose()
            except Exception:  # noqa: BLE001 - the start error is the one to report
                logger.exception("hicache: cleaning up after a failed start failed")
            raise
        s = self.config.session
        session_config = SessionCacheConfig(
            idle_offload_s=s.idle_offload_s if s.enabled else None,
            session_timeout_s=s.session_timeout_s if s.enabled else None,
            reap_interval_s=s.reap_interval_s if s.enabled else None,
            preempt_queued_turns=s.preempt_queued_turns,
        )
        self.cache = SessionAwareCache(stack.cache, session_config)
        self.cache.start()
        export_cache_state(stack.controller.metrics, stack, lambda: self.cache, lambda: self._events)
        self._state = _State.OPEN
        logger.info(
            "hicache open: device %d tokens, host %d tokens, storage %s",
            self._stack_config.device_pages * self._stack_config.page_size,
            stack.host_pool.size, self.config.storage.backend or "none",
        )
        return self

    async def _open_storage(self, stack: CacheStack) -> None:
        """Open the storage backend; an :meth:`aclose` meanwhile cancels the open (a store
        that does not answer, an S3 endpoint behind a dead network, must not hold a shutdown
        for as long as its client retries) and the start raises :class:`CacheClosedError`."""
        # on the controller's I/O loop: the loop every later storage call (and the close)
        # runs on; a backend opened on this loop would bind its tasks and events here
        opening = self._opening = asyncio.ensure_future(stack.controller.open_storage())
        try:
            await opening
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._state is _State.CLOSED and opening.cancelled() and not (me and me.cancelling()):
                raise CacheClosedError("HiCache was closed while it started") from None
            raise
        finally:
            self._opening = None
        if self._state is _State.CLOSED:  # aclose() came as the open finished
            raise CacheClosedError("HiCache was closed while it started")

    @coroutine_function
    def aclose(self, *, deadline: float | None = None) -> Coroutine[Any, Any, Any]:
        """Release every session, drain write-backs and backups, close storage; idempotent.

        ``deadline`` (``time.monotonic()``): when the close must end, the storage's close
        included (a server passes what is left of its drain): each step takes a share of the
        time left and the store stops waiting and says what it left, rather than overrunning
        into the shutdown's SIGKILL. ``None``: ``cache.close_timeout_s`` and each step's own
        bound. The first call's deadline holds.

        Returns the controller's close report (pages it could not write, if any). Raises
        :class:`~hicache.errors.LoopMisuseError` on another loop than the one that started the
        cache (a finished close answers on any loop).

        Called on the cache's loop, the close starts at this call, not at the first step of
        the coroutine it returns. Why: a task awaiting that coroutine may be cancelled before
        its first step (``t = create_task(cache.aclose()); t.cancel()``, or asyncio.run's
        shutdown sweep when ``main`` returned right after starting it): none of its code would
        run, and the cache was left open, its threads running and its queued writes neither
        written nor reported. The close itself runs in a task that a cancellation, however
        early, only hurries (:class:`~hicache.controller.close_task.CloseTask`).

        A ``deadline`` that is no time (not a number, a bool, NaN) raises ``TypeError`` /
        ``ValueError`` from the returned coroutine and changes nothing: the cache stays open."""
        bad = _deadline_error(deadline)
        if bad is not None:
            # refused before the close starts: a string used to fail inside the close task
            # after the cache was marked closed, leaving the controller running, its storage
            # open and its queued writes unreported, and every later aclose() failing alike
            return _raise(bad)
        self._begin_close_here(deadline)
        return self._aclose(deadline)

    def _begin_close_here(self, deadline: float | None = None) -> None:
        """Start the close task now when called on the cache's own running loop with the
        cache open (anything else is the coroutine's to sort out: another loop, a start
        still running, a close already begun)."""
        if self._close_task is not None or self._state is not _State.OPEN:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is self._loop:
            self._start_close(deadline)

    def _start_close(self, deadline: float | None = None) -> None:
        self._state = _State.CLOSED
        # One close, run to its end even if this caller is cancelled (a half-done close
        # would leave the copy thread and the storage open); a concurrent or later aclose()
        # waits for the same one.
        self._close_task = start_close_task(self._close(deadline), name="hicache-close")

    async def _aclose(self, deadline: float | None = None) -> Any:
        if self._close_task is None or not self._close_task.done():
            self._check_loop()
        if self._close_task is None:
            if self._state is not _State.OPEN:
                self._state = _State.CLOSED
                if self._start_lock.locked():
                    # a start() is running: it sees the close and takes its half-built stack
                    # down; return once it has (no thread or open storage outlives the close).
                    # A storage open it waits for is cancelled: the close does not wait on it.
                    if self._opening is not None:
                        self._opening.cancel()
                    async with self._start_lock:
                        pass
                return self.close_report
            self._start_close(deadline)
        assert self._close_task is not None
        report = await wait_for_close(self._close_task)
        if report is not CLOSE_CUT:
            return report
        # the close task, not this caller, was cancelled and could not go on: what it learned
        return self.close_report if self.close_report is not None else CloseReport(drained=False)

    async def _close(self, deadline: float | None = None) -> Any:
        assert self.cache is not None and self._stack is not None
        for handle in list(self._live.values()):
            self._abort_now(handle)
        try:
            try:
                report = await self.cache.aclose(deadline=deadline)
            except asyncio.CancelledError:
                # This close task itself was cancelled (a shutdown sweep: asyncio.run cancels
                # every task left at its end). Unwinding here left the controller running, its
                # storage open and its I/O thread alive, and every queued write neither written
                # nor reported. A cancellation only hurries the close: the controller closes
                # without draining and reports what it leaves.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                logger.warning("hicache: the close was cancelled; closing without draining")
                # through the caches' own close (not the controller's alone): the report keeps
                # the tree's part (deferred backups, undeleted storage pages), and the session
                # release, write-back seal and deferred backups are not skipped
                report = await _through_cancel(self.cache.finish_cut_close())
            # kept before the closes below: a cancellation there must not lose it
            self.close_report = report
        finally:
            # waited out through a cancellation (the copy thread or the sockets left open, and
            # the report lost, were the price of unwinding here)
            await _through_cancel(self._stack.copy_engine.aclose())
            if self._events is not None:  # after the close: its last removals are published too
                await _through_cancel(self._events.aclose())
        return report

    async def __aenter__(self) -> HiCache:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _check_open(self) -> SessionAwareCache:
        if self._state is not _State.OPEN or self.cache is None:
            state = "closed" if self._state is _State.CLOSED else "not started"
            raise CacheClosedError(f"HiCache is {state}")
        self._check_loop()
        return self.cache

    def _check_loop(self) -> None:
        """Raise :class:`~hicache.errors.LoopMisuseError` when called on an event loop other
        than the one that started the cache.

        Why: the tree, the pools and the controller's queues, workers and futures belong to that
        loop and are not thread-safe. A call from another loop mutated them from a second thread
        (a request "served" while the owner's loop ran), and an ``aclose()`` there made a close
        task of that loop, which hung and left the cache unable to close on its own loop. A
        thread with no running loop (an engine worker calling :meth:`note_prefill`, a metrics
        scrape) is not refused."""
        owner = self._loop
        if owner is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is not owner:
            why = ("that loop is closed: close the cache before its loop ends" if owner.is_closed()
                   else "call it there (asyncio.run_coroutine_threadsafe from another thread)")
            raise LoopMisuseError(f"HiCache was started on another event loop; {why}")

    # ------------------------------------------------------------------ request path

    async def begin(self, rid: str, token_ids: list[int], *, session_id: str | None = None) -> RequestHandle:
        """Admit a request: match its prefix on every tier, load what is on host (layer by
        layer, see :meth:`RequestHandle.wait_layer`), fetch from storage per the prefetch
        policy, and give it device slots for the rest of its tokens.

        For a streaming session, send the whole conversation so far (history + new turn): the
        session's slot restores its KV without a tree match.
        """
        cache = self._check_open()
        tokens = token_ids_of(token_ids)
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a str, got {type(rid).__name__}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise TypeError(f"session_id must be a non-empty str or None, got {quoted(session_id)}")
        if not tokens:
            raise ValueError("begin() needs at least one token")
        if len(tokens) > self.config.device.max_context_len:
            raise ValueError(
                f"{len(tokens)} tokens exceed device.max_context_len ({self.config.device.max_context_len})"
            )
        session = Session(session_id, streaming=True) if session_id is not None and self.config.session.enabled else None
        # The cache tracks requests by id (prefetches, locks, session turns): two live requests
        # under one caller id must not share it, or one's finish would release the other's state.
        cache_rid = self._claim_rid(rid)
        req = Req(rid=cache_rid, origin_input_ids=tokens, session=session, explain_misses=True, defer_counts=True)
        try:
            with tracing.span("hicache.begin") as span:
                span.set_attribute("hicache.tokens", len(tokens))
                with tracing.span("hicache.match"):
                    cache.match_req(req)
                cache.start_prefetch(req)
                with tracing.span("hicache.admit"):
                    admitted = await cache.admit(req, mem_quota=self.config.cache.load_back_quota_tokens, wait_load=False)
                span.set_attribute("hicache.prefix_tokens", int(admitted.prefix_len))
                slots = await cache.alloc_extend(req, len(tokens))
                # counted only once it really starts: a request refused for room is retried
                attribution = await self._explain(admitted.attribution) if slots is not None else None
            if self._state is not _State.OPEN:  # closed while this request was being admitted
                raise CacheClosedError("HiCache was closed while the request was being admitted")
        except BaseException as exc:
            cache.abort_req(req)
            self._rids.discard(cache_rid)
            if isinstance(exc, RequestAbortedError) and self._state is not _State.OPEN:
                # the close aborted it: say so, as for any call the close overtook
                raise CacheClosedError("HiCache was closed while the request was being admitted") from exc
            raise
        if slots is None:
            # alloc_extend answers None whether the request found no req_to_token row or no device
            # KV slots: told apart here (the caller's remedy differs: wait for a running request
            # to end vs. make KV room), before the abort frees anything
            no_row = req.req_pool_idx is None and cache.req_to_token_pool.available_size() == 0
            cache.abort_req(req)
            self._rids.discard(cache_rid)
            if no_row:
                raise OutOfKVSlotsError(
                    f"no request slot for request {quoted(rid)}: all {self.config.device.max_requests} "
                    "(device.max_requests) are held by running requests and session turns even after "
                    f"session offload ({self._require_stack().allocator.available_size()} device KV "
                    "tokens are free); retry when a request ends"
                )
            raise OutOfKVSlotsError(
                f"no room for {len(tokens)} tokens on device even after eviction and session offload"
            )
        cache.count_admitted(req)
        restored = bool(getattr(admitted, "restored", False))
        hits = {
            "device": int(admitted.device_hit) if not restored else int(admitted.prefix_len),
            "host": int(admitted.host_hit),
            "storage": int(admitted.storage_hit),
        }
        handle = RequestHandle(
            rid=rid,
            session_id=session_id,
            token_ids=tokens,
            prefix_len=min(int(admitted.prefix_len), len(tokens)),
            kv_indices=slots,
            hits=hits,
            req=req,
            load=admitted.load_handle,
            attribution=attribution,
            num_layers=self._require_stack().copy_engine.num_layers,
        )
        self._live[id(handle)] = handle
        return handle

    async def _explain(self, attribution: Any) -> Any:
        """Count the admitted request's attribution, after its namespace probe in explain mode."""
        stack = self._require_stack()
        if attribution is None or stack.attributor is None:
            return attribution
        return await stack.attributor.explain(attribution, stack.storage)

    def _claim_rid(self, rid: str) -> str:
        cache_rid = rid
        while cache_rid in self._rids:
            self._rid_seq += 1
            cache_rid = f"{rid}#{self._rid_seq}"
        self._rids.add(cache_rid)
        return cache_rid

    async def extend(self, handle: RequestHandle, new_token_ids: list[int]) -> torch.Tensor:
        """Device slots for tokens appended to the request (decode); returns the new slots."""
        cache = self._check_open()
        self._check_live(handle)
        new = token_ids_of(new_token_ids, "new_token_ids")
        old = len(handle.token_ids)
        slots = await cache.alloc_extend(handle.req, old + len(new))
        if slots is None:
            raise OutOfKVSlotsError(f"no room on device for {len(new)} more tokens of request {quoted(handle.rid)}")
        handle.token_ids.extend(new)
        handle.kv_indices = slots
        return slots[old:]

    async def commit(self, handle: RequestHandle, *, finished: bool = True) -> None:
        """The KV of every token in ``handle.token_ids`` is written: make it reusable.

        ``finished``: the request is over (its KV goes to the prefix cache, or stays in its
        session's slot); otherwise it is a prefill chunk and the request goes on.

        Raises :class:`~hicache.errors.HiCacheError` (the request is then aborted, its pages
        freed) when the prefix KV it was handed never arrived: its load from host failed."""
        cache = self._check_open()
        self._check_live(handle)
        if not await self._wait_load(handle):
            # The prefix KV never arrived and the tree freed its slots: inserting the request
            # would hand freed slots to the tree. Its KV is not reusable; the request is over.
            self._abort_now(handle)
            raise HiCacheError(
                f"request {quoted(handle.rid)}: loading its prefix from host failed; the request was "
                "aborted (begin it again to recompute)"
            )
        self._check_open()
        self._check_live(handle)
        req = handle.req
        n_prompt = len(req.origin_input_ids)
        req.output_ids = list(handle.token_ids[n_prompt:])
        req.fill_ids = list(handle.token_ids)
        req.kv_committed_len = len(handle.token_ids)
        if finished:
            cache.release_req(req)
            self._finish(handle)
        else:
            cache.cache_unfinished_req(req, chunked=True)
            # the insert may have replaced the request's slots by the tree's (and freed its
            # duplicates): kv_indices must not keep naming freed slots
            if int(req.prefix_indices.numel()) == len(handle.token_ids):
                handle.kv_indices = req.prefix_indices.clone()
            # The chunk's prefix may now point at tree slots another request is still loading
            # from host (the insert found them "on device" and freed our duplicates): the next
            # chunk reads them, so wait for those loads.
            wait_loads = getattr(cache.inner, "wait_loads", None)
            if wait_loads is not None and not await wait_loads(req.prefix_indices):
                if not handle.done:
                    self._abort_now(handle)
                raise HiCacheError(
                    f"request {quoted(handle.rid)}: a prefix load it shares failed; the request was aborted"
                )

    async def abort(self, handle: RequestHandle) -> None:
        """Drop a request: its prefetch is cancelled and every page it held is freed; a
        session keeps its state from before this turn. Safe to call twice.

        The request's slots (``kv_indices`` and what :meth:`extend` gave) go back to the pool
        at once and the next request may get them: call it once no forward pass of the
        request is still writing them (a server aborts between steps, as SGLang's scheduler
        does), and write nothing into them after. ``handle.done`` tells a task that shares
        the handle that the request is over."""
        self._check_open()
        if handle.done:
            return
        self._check_ours(handle)
        await self._wait_load(handle)
        if handle.done:  # committed or aborted by someone else meanwhile
            return
        self._abort_now(handle)

    def _finish(self, handle: RequestHandle) -> None:
        handle.done = True
        self._live.pop(id(handle), None)
        self._rids.discard(handle.req.rid)

    def _abort_now(self, handle: RequestHandle) -> None:
        assert self.cache is not None
        self._finish(handle)
        self.cache.abort_req(handle.req)

    async def _wait_load(self, handle: RequestHandle) -> bool:
        """Slots under a running host->device load must not be freed or reused mid-copy.
        Returns whether the prefix KV arrived (``False``: the load failed)."""
        if handle.load is not None:
            try:
                await handle.load.wait()
            except Exception:  # noqa: BLE001 - a failed load only means the prefix is not reusable
                logger.warning("request %s: load-back failed; its prefix is not reusable", quoted(handle.rid))
                return False
        return True

    def _check_live(self, handle: RequestHandle) -> None:
        if handle.done:
            raise ValueError(f"request {quoted(handle.rid)} is already committed or aborted")
        self._check_ours(handle)

    def _check_ours(self, handle: RequestHandle) -> None:
        """``handle`` is one this cache's :meth:`begin` returned (not another cache's, not a
        copy): its slots are this device pool's, so inserting or freeing them is safe."""
        if self._live.get(id(handle)) is not handle:
            raise ValueError(f"request {quoted(getattr(handle, 'rid', handle))} was not begun by this cache (or is a copy)")

    async def release_session(self, session_id: str) -> bool:
        """The conversation is over: its KV is handed to the prefix cache (written back to host
        and storage) and its request slot freed. Returns whether the session existed (``False``:
        never opened, released already, or expired), so a server can tell a client so."""
        return self._check_open().release_session(session_id)

    async def drain(self) -> None:
        """Wait until every queued write-back, backup and storage write has completed."""
        await self._check_open().drain()

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Report a prefill the engine ran: ``tokens`` computed in ``seconds`` of compute.

        Why: a storage hit is only worth waiting for while it lands sooner than its tokens
        would be recomputed. With the engine's prefill rate known, the ``timeout`` prefetch
        policy stops a request's wait as soon as fetching the rest would take longer, and
        never waits longer than recomputing it (``cache.prefetch.recompute_tokens_per_s``
        fixes the rate instead). Report compute time only, of prefills that waited for no
        load; prefills under 32 tokens and odd values are ignored (never raised on)."""
        self._check_open()
        self._require_stack().controller.note_prefill(tokens, seconds)

    # ------------------------------------------------------------------ observability

    def events(self, maxsize: int = 1024) -> Any:
        """KV events in-process: ``async for seq, batch in cache.events(): ...`` yields every
        :class:`~hicache.events.KVEventBatch` published from now on (a bounded queue of
        ``maxsize`` batches per consumer; a slow consumer loses batches, counted and visible as
        a gap in ``seq``). Works with events off in the config too (then in-process only).
        The iteration ends when the cache closes."""
        self._check_open()
        if self._events is None:
            self._events = start_events(
                self._require_stack().tier_changes,
                self.config.events.model_copy(update={"endpoint": None, "replay_endpoint": None}),
            )
        return self._events.stream(maxsize)

    def metrics(self) -> dict[str, Any]:
        """Hits per tier, bytes and time per direction, queue depths, failures, sessions."""
        stack = self._require_stack()
        out: dict[str, Any] = {"controller": stack.controller.metrics.snapshot()}
        if self.cache is not None:
            out["sessions"] = self.cache.metrics()
        if stack.storage is not None:
            out["storage"] = stack.storage.get_stats()
        out["device"] = {
            "size_tokens": int(stack.allocator.size),
            "free_tokens": int(stack.allocator.available_size()),
            "cached_tokens": int(stack.cache.total_size()),
            "evictable_tokens": int(stack.cache.evictable_size()),
        }
        out["host"] = {
            "size_tokens": int(stack.host_pool.size),
            "free_tokens": int(stack.host_pool.available_size()),
        }
        if self._events is not None:
            out["events"] = self._events.stats()
        return out

    @property
    def metrics_label(self) -> str | None:
        """The ``cache`` label of this cache's metric families (None before :meth:`start`)."""
        return self._stack.controller.metrics.label if self._stack is not None else None

    def prometheus_text(self) -> str:
        """The process's Prometheus scrape: this cache's families (under its ``cache`` label),
        every other family on the default registry, or every worker's in multi-process mode
        (see :mod:`hicache.observability.metrics`)."""
        self._require_stack()
        return exposition_text()


async def _smoke() -> None:  # pragma: no cover - manual check
    async with HiCache.from_config({"storage": {"backend": "memory"}}) as cache:
        h = await cache.begin("r", list(range(40)))
        await cache.commit(h)


if __name__ == "__main__":  # pragma: no cover
    asyncio.run(_smoke())


def _deadline_error(deadline: object) -> Exception | None:
    """Why ``deadline`` is no :meth:`HiCache.aclose` deadline (``None`` when it is one)."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real):
        return TypeError(f"aclose(): deadline must be a time.monotonic() value or None, got {quoted(deadline)} "
                         f"({type(deadline).__name__})")
    if math.isnan(float(deadline)):
        return ValueError("aclose(): deadline must be a time.monotonic() value or None, got nan")
    return None


async def _raise(exc: Exception) -> Any:
    raise exc


async def _through_cancel(aw: Awaitable[_T]) -> _T | None:
    """Await ``aw`` (a step of the close) to its end through any cancellation of the running
    task, each one taken back: a cancellation only hurries a close, it never stops it halfway.
    ``None`` when the step's own task was cancelled (its work, on a thread, still ends)."""
    fut = asyncio.ensure_future(aw)
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
    return None if fut.cancelled() else fut.result()
