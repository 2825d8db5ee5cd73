"""Moving pages between a device pool and its host pool, off the event loop.

Backup (device -> host) copies all layers of a set of pages and completes as a whole. Load
(host -> device) copies layer by layer and reports each layer through a
:class:`~hicache.memory.layer_counter.LayerDoneCounter`, so attention of layer ``i`` waits for
layer ``i`` only.

Where copies run:

* CPU: on one dedicated executor thread, never on the event loop thread. One thread makes the
  engine a FIFO, like a CUDA stream: a load queued after a backup sees the backup's result.
  Where the native span copier is built (:mod:`hicache.memory.spans`), each step (a backup, or
  one layer of a load) is one bounds-checked call per view pair that copies every piece with the
  GIL released, with streaming stores for big steps: one thread then matches a contiguous
  two-thread torch copy, scattered pages included. Without it (no C compiler at install time),
  runs of pages are copied with ``np.copyto`` on numpy views of the pools made once: the same
  bytes as ``Tensor.copy_`` (and the GIL is released likewise) at a fraction of its per-call
  cost, which dominates scattered loads (one call per 256 KiB page-layer). Splitting a load
  step across two threads (per layer, or pipelined across layers) was measured on a 2-core box
  and did not help, so it is not done. A backup of scattered big pages is split: with two or
  more CPUs, half of its pages are copied by a second copy thread (started on first use, shut
  down in :meth:`CopyEngine.close`) while the engine thread copies the other half, and the
  backup completes only when both halves have.
* Small CPU steps on the caller's thread: a backup or load of at most
  :data:`INLINE_MAX_BYTES` runs where it is asked for, when nothing of this engine is queued or
  running (so the FIFO order holds). A hop to the copy thread costs the loop more than such a
  copy: the thread needs the GIL to start the job and again to finish it, each time while the
  loop is matching and inserting (measured in the tiered radix benchmark, 256-byte pages: the
  copy thread spent ~180 us of CPU a backup, most of it on the GIL, and the tree's match+insert
  ran 0.076-0.091 s through the thread against 0.059-0.065 s with the copies on the loop).
* CUDA: on a dedicated stream that first waits for the caller's current stream (so KV written by
  the forward pass is complete before it is backed up), with one event per loaded layer and
  pinned host memory. Enqueueing and event waits happen on the executor thread too, because a
  copy from a strided host view makes torch stage it synchronously.

Cancelling ``await backup(...)`` does not abandon a half-done copy: the caller still waits for it
to finish before the cancellation propagates, so it cannot free or reuse pages mid-copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hicache.errors import CacheClosedError
from hicache.memory.device import IndexLike
from hicache.memory.layer_counter import LayerDoneCounter
from hicache.storage.offload import wait_out
from hicache.memory.spans import NATIVE_AVAILABLE, STREAM_KIND, SpanPair, span_pair
from hicache.memory.transfer import (
    TransferPlan,
    copy_runs_np,
    copy_units,
    copy_units_cuda,
    make_plan,
    numpy_view,
    prefers_numpy_runs,
    prefers_split,
    prefers_unitwise_split,
    widen_pair,
)

__all__ = ["INLINE_MAX_BYTES", "CopyEngine", "LayerLoadHandle", "TransferPool"]

logger = logging.getLogger(__name__)


def _dropped() -> CacheClosedError:
    """The error of a copy job its executor dropped unrun (a shared executor shut down with
    ``cancel_futures``). Not a ``CancelledError``: nobody cancelled the caller, and a worker
    that took it for its own cancellation stopped for good, silently."""
    return CacheClosedError("the copy engine's executor dropped a queued copy (shut down?): the copy did not run")


#: A CPU step of at most this many bytes (all layers of a backup, all layers of a load) runs on
#: the caller's thread when the engine is idle: about 20-30 us of memcpy, less than the loop loses
#: to the two GIL hand-overs of a hop to the copy thread.
INLINE_MAX_BYTES = 256 * 1024


class TransferPool(Protocol):
    """What a pool offers the copy engine (KV pools, host pools and the Mamba pools do)."""

    size: int

    @property
    def transfer_unit(self) -> int: ...

    @property
    def transfer_layer_num(self) -> int: ...

    def transfer_views(self) -> list[torch.Tensor]: ...


class LayerLoadHandle:
    """A running load. ``counter`` reports layers; ``await wait()`` waits for all of them.

    The device pages being loaded must not be read (beyond completed layers) or freed before the
    handle is done; cancelling ``wait()`` does not stop the copy.
    """

    def __init__(
        self,
        counter: LayerDoneCounter,
        future: concurrent.futures.Future[None] | None,
        events: list[Any] | None = None,
        enqueued: LayerDoneCounter | None = None,
    ) -> None:
        self.counter: LayerDoneCounter = counter
        self.num_layers: int = counter.num_layers
        self._future = future
        self._events = events
        self._enqueued = enqueued

    async def wait(self) -> None:
        """Until every layer is on the device (raises the copy's error, if any)."""
        await self.counter.wait_all()

    def wait_sync(self, timeout: float | None = None) -> None:
        """Blocking :meth:`wait` for threads without an event loop."""
        self.counter.wait_all_sync(timeout)

    async def wait_layer(self, layer: int) -> None:
        await self.counter.wait(layer)

    def wait_layer_sync(self, layer: int, timeout: float | None = None) -> None:
        self.counter.wait_sync(layer, timeout)

    def done(self) -> bool:
        """Whether the whole load finished (raises its error if it failed)."""
        return self.counter.all_done()

    def wait_on_stream(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for ``layer`` without blocking
        the host, as SGLang's forward does. On CPU this is :meth:`wait_layer_sync`."""
        if self._events is None or self._enqueued is None:
            self.counter.wait_sync(layer)
            return
        self._enqueued.wait_sync(layer)  # an event waited on before it is recorded is a no-op
        stream = stream if stream is not None else torch.cuda.current_stream()
        stream.wait_event(self._events[layer])


class CopyEngine:
    """Copies between ``device_pool`` and ``host_pool`` (KV pools, or the Mamba state pools).

    ``executor``: where copies (CPU) or event waits (CUDA) run; by default the engine owns a
    one-thread executor and shuts it down in :meth:`close`. A shared executor is used as given
    and never shut down here; give it one worker if FIFO order between operations matters.

    ``native``: CPU copies through the compiled span copier: ``None`` (default) where it is built
    and can describe the pools' views, ``False`` never (numpy/torch only), ``True`` required
    (``RuntimeError`` if it cannot serve these pools). Ignored on CUDA.

    ``inline_max_bytes``: CPU steps up to this size run on the caller's thread while the engine
    is idle (see :data:`INLINE_MAX_BYTES`); 0 sends every copy to the copy thread.
    """

    def __init__(
        self,
        device_pool: TransferPool,
        host_pool: TransferPool,
        *,
        executor: concurrent.futures.Executor | None = None,
        native: bool | None = None,
        inline_max_bytes: int = INLINE_MAX_BYTES,
    ) -> None:
        dev_views, host_views = device_pool.transfer_views(), host_pool.transfer_views()
        if device_pool.transfer_unit != host_pool.transfer_unit:
            raise ValueError(
                f"page sizes differ: device {device_pool.transfer_unit}, host {host_pool.transfer_unit}"
            )
        dev_dtype, host_dtype = getattr(device_pool, "dtype", None), getattr(host_pool, "dtype", None)
        if dev_dtype != host_dtype:
            raise ValueError(f"dtypes differ: device {dev_dtype}, host {host_dtype}")
        if len(dev_views) != len(host_views) or any(
            d.shape[1:] != h.shape[1:] for d, h in zip(dev_views, host_views)
        ):
            raise ValueError(
                "device and host pools have different geometry: "
                f"{[tuple(d.shape[1:]) for d in dev_views]} vs {[tuple(h.shape[1:]) for h in host_views]}"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.unit: int = device_pool.transfer_unit
        self.num_layers: int = device_pool.transfer_layer_num
        # (device, host) view pairs, widened once: all layers (backup) and per layer (load)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
            widen_pair(d, h) for d, h in zip(dev_views, host_views)
        ]
        self._layer_pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [(d[:, :, layer], h[:, :, layer]) for d, h in self._pairs] for layer in range(self.num_layers)
        ]
        self.device: torch.device = dev_views[0].device
        self.is_cuda: bool = self.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        # CPU: the same pairs as numpy arrays (None where numpy cannot view them) and the bytes
        # of one unit of each pair, all layers (backup) and one layer (load)
        self._np_pairs: list[tuple[Any, Any] | None] = []
        self._layer_np_pairs: list[list[tuple[Any, Any] | None]] = []
        self._unit_bytes: list[int] = [d[0].numel() * d.element_size() for d, _ in self._pairs]
        self._layer_unit_bytes: list[int] = [
            d[0].numel() * d.element_size() for d, _ in (self._layer_pairs[0] if self._layer_pairs else [])
        ]
        if not self.is_cuda:
            self._np_pairs = [self._np_pair(d, h) for d, h in self._pairs]
            self._layer_np_pairs = [[self._np_pair(d, h) for d, h in pairs] for pairs in self._layer_pairs]
        # CPU: the native span copier's view of the pairs, all layers (backup) and per layer
        # (load: one table per load, shifted layer by layer), or None for the numpy/torch path
        self._spans: list[SpanPair] | None = None
        self._layer_spans: list[SpanPair] | None = None
        if not self.is_cuda:
            if native is not False:
                self._spans, self._layer_spans = self._native_spans(dev_views, host_views)
            if native and self._spans is None:
                why = "is not built" if not NATIVE_AVAILABLE else "cannot describe these pools' views"
                raise RuntimeError(f"native=True but the span copier (hicache.memory._spancopy) {why}")
            self._log_cpu_path(native)
        self._owns_executor = executor is None
        self._executor: concurrent.futures.Executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hicache-copy"
        )
        self._closed = False
        self._lock = threading.Lock()
        self._close_done = threading.Event()  # set once the first close() has finished
        # CPU: a second copy thread, started on first use, that copies half of a step of big
        # scattered units (see ``prefers_unitwise_split``)
        self._split_ok: bool = not self.is_cuda and (os.cpu_count() or 1) >= 2
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        # jobs handed to the copy thread and not finished: the engine is idle when there are none
        # (also what a close waits for on an executor it does not own)
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._step_bytes: int = sum(self._unit_bytes)
        #: CPU steps of at most this many bytes run on the caller's thread when the engine is
        #: idle (0: every copy goes to the copy thread, as a test that makes copies slow needs)
        self.inline_max_bytes: int = inline_max_bytes

    @staticmethod
    def _native_spans(
        dev_views: list[torch.Tensor], host_views: list[torch.Tensor]
    ) -> tuple[list[SpanPair] | None, list[SpanPair] | None]:
        whole = [span_pair(d, h) for d, h in zip(dev_views, host_views)]
        per_layer = [span_pair(d, h, layer_dim=2) for d, h in zip(dev_views, host_views)]
        if any(p is None for p in whole + per_layer):
            return None, None
        return whole, per_layer  # type: ignore[return-value]

    def _log_cpu_path(self, native: bool | None) -> None:
        if self._spans is not None:
            logger.debug("CPU copies: native span copier, %s streaming stores", STREAM_KIND)
            return
        if native is False:
            why = "disabled (native=False)"
        elif not NATIVE_AVAILABLE:
            why = "not built; reinstall hicache where a C compiler is present"
        else:
            why = "not usable for these pools' views"
        logger.info("CPU copies: numpy/torch, span copier %s (scattered loads ~0.6x instead of ~1x)", why)

    @property
    def native(self) -> bool:
        """Whether CPU copies go through the native span copier."""
        return self._spans is not None

    # -- lifecycle
    def close(self) -> None:
        """Finish queued copies and release the owned executor. Idempotent: a close while
        another thread's is still draining returns when that one is done, so no caller gets
        back from a close with a copy still writing into its pages."""
        with self._lock:
            closing = self._closed
            self._closed = True
        if closing:
            self._close_done.wait()
            return
        try:
            self._drain()
        finally:
            self._close_done.set()

    def _drain(self) -> None:
        """Wait for the queued copies and stop the copy threads (the first close's work)."""
        if self._owns_executor:
            self._executor.shutdown(wait=True)
        else:  # a shared executor outlives the engine: its queued copies must still land first
            with self._lock:
                pending = list(self._pending)
            concurrent.futures.wait(pending)
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)  # a step of a shared executor's job may still use it

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> CopyEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- planning (caller's thread: misuse fails at the call site)
    def plan_backup(self, device_indices: IndexLike, host_indices: IndexLike) -> TransferPlan:
        return make_plan(
            device_indices, self.device_pool.size, host_indices, self.host_pool.size, self.unit,
            src_what="device_indices", dst_what="host_indices",
        )

    def plan_load(self, host_indices: IndexLike, device_indices: IndexLike) -> TransferPlan:
        return make_plan(
            host_indices, self.host_pool.size, device_indices, self.device_pool.size, self.unit,
            src_what="host_indices", dst_what="device_indices",
        )

    # -- backup
    async def backup(self, device_indices: IndexLike, host_indices: IndexLike) -> None:
        """Copy all layers of the pages at ``device_indices`` to ``host_indices``; returns when
        the host pages hold the data."""
        plan = self.plan_backup(device_indices, host_indices)
        if plan.num_units == 0:
            return
        if self._runs_here(plan):
            self._backup_cpu(plan)
            return
        job = self._backup_job(plan)
        queued = self._submit(job)
        fut = asyncio.wrap_future(queued)
        # a cancelled caller (once or many times: a shutdown cancels every task) still waits:
        # the copy writes host pages the caller's side frees once it unwinds
        if await wait_out(fut):
            raise asyncio.CancelledError
        if queued.cancelled():  # dropped by the executor, not cancelled by our caller
            raise _dropped()
        fut.result()

    def backup_sync(self, device_indices: IndexLike, host_indices: IndexLike) -> None:
        """Blocking :meth:`backup` (queued behind earlier operations of this engine)."""
        plan = self.plan_backup(device_indices, host_indices)
        if self._runs_here(plan):
            self._backup_cpu(plan)
        elif plan.num_units:
            queued = self._submit(self._backup_job(plan))
            try:
                queued.result()
            except concurrent.futures.CancelledError:
                if queued.cancelled():  # dropped by the executor
                    raise _dropped() from None
                raise

    def _runs_here(self, plan: TransferPlan) -> bool:
        """Whether ``plan`` is a small CPU step to copy on the caller's thread (see
        :data:`INLINE_MAX_BYTES`): nothing of this engine queued or running, so no earlier job
        is overtaken, and the engine open."""
        if self.is_cuda or self._closed or not 0 < plan.num_units * self._step_bytes <= self.inline_max_bytes:
            return False
        return not self._pending

    def _backup_job(self, plan: TransferPlan) -> Callable[[], None]:
        if not self.is_cuda:
            return lambda: self._backup_cpu(plan)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return lambda: self._backup_cuda(plan, ready)

    @staticmethod
    def _np_pair(dev: torch.Tensor, host: torch.Tensor) -> tuple[Any, Any] | None:
        d, h = numpy_view(dev), numpy_view(host)
        return None if d is None or h is None else (d, h)

    def _copy_cpu(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        np_pairs: list[tuple[Any, Any] | None],
        unit_bytes: list[int],
        plan: TransferPlan,
        *,
        to_host: bool,
    ) -> None:
        """One CPU copy step: every ``(device, host)`` pair, in the direction given. Runs go
        through ``np.copyto`` where numpy can view both sides and runs are small, big scattered
        units through ``np.copyto`` unit by unit on two threads (two or more CPUs), else through
        :func:`copy_units` (big runs: torch's threaded copy; tiny ones: index gather/scatter).
        Returns only when every byte of the step is copied."""
        segments: list[tuple[Any, Any]] = []  # numpy, run by run
        unit_segments: list[tuple[Any, Any]] = []  # numpy, unit by unit, split over two threads
        for (dev, host), np_pair, nbytes in zip(pairs, np_pairs, unit_bytes):
            if np_pair is not None and prefers_numpy_runs(plan, nbytes):
                segments.append(np_pair[::-1] if to_host else np_pair)
            elif np_pair is not None and self._split_ok and prefers_unitwise_split(plan, nbytes):
                unit_segments.append(np_pair[::-1] if to_host else np_pair)
            elif to_host:
                copy_units(host, dev, plan)
            else:
                copy_units(dev, host, plan)
        if segments:
            copy_runs_np(segments, plan.run_list())
        if unit_segments:
            first, second = plan.unit_halves()
            self._copy_np_split(unit_segments, (first, second), first + second)

    def _copy_np_split(
        self,
        segments: list[tuple[Any, Any]],
        halves: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]],
        runs: list[tuple[int, int, int]],
    ) -> None:
        """:func:`copy_runs_np` of ``halves[0]`` here and ``halves[1]`` on the second copy thread
        at once (``runs``: all of them, copied here alone if the second thread is gone)."""
        self._run_split(
            lambda: copy_runs_np(segments, halves[0]),
            lambda: copy_runs_np(segments, halves[1]),
            lambda: copy_runs_np(segments, runs),
        )

    def _run_split(self, here: Callable[[], object], there: Callable[[], object], alone: Callable[[], object]) -> None:
        """Run ``here`` on this thread and ``there`` on the second copy thread at once; returns
        when both are done (also when ``here`` failed: no copy outlives the step). If the second
        thread is gone because the engine closed, ``alone`` runs here instead."""
        helper = self._split_helper()
        if helper is not None:
            try:
                fut = helper.submit(there)
            except RuntimeError:  # shut down by a concurrent close()
                helper = None
        if helper is None:
            alone()
            return
        try:
            here()
        finally:
            concurrent.futures.wait([fut])
        fut.result()

    def _split_helper(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The second copy thread (started on first use), or ``None`` once closed."""
        helper = self._helper
        if helper is not None:
            return helper
        with self._lock:
            if self._closed:
                return None
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="hicache-copy-split"
                )
            return self._helper

    def _copy_native(
        self, pairs: list[SpanPair], plan: TransferPlan, *, to_host: bool, layer: int = 0, split: bool = False
    ) -> None:
        """One CPU step through the span copier. With ``split``, a big step (two or more CPUs) is
        copied half on this thread and half on the second copy thread, as torch splits a big
        copy. Measured for 256 MiB backups on a 2-core box against a contiguous torch copy, the
        median went from 0.94-0.98x to 1.04-1.06x and the worst rep from about 0.6x to 0.8x. Loads are
        not split: per layer, pipelined across layers, or even whole, two threads measured no
        better than one with streaming stores (0.9-1.0x: the memory bus is the limit), and one
        thread leaves a core to the event loop."""

        def copy(half: int | None) -> None:
            for pair in pairs:
                pair.copy(plan, to_host=to_host, layer=layer, half=half)

        if split and self._split_ok and prefers_split(plan, sum(p.unit_bytes for p in pairs)):
            self._run_split(lambda: copy(0), lambda: copy(1), lambda: copy(None))
        else:
            copy(None)

    def _backup_cpu(self, plan: TransferPlan) -> None:
        if self._spans is not None:
            self._copy_native(self._spans, plan, to_host=True, split=True)
            return
        self._copy_cpu(self._pairs, self._np_pairs, self._unit_bytes, plan, to_host=True)

    def _backup_cuda(self, plan: TransferPlan, ready: Any) -> None:
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for dev, host in self._pairs:
                    copy_units_cuda(host, dev, plan)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()
        except BaseException:
            self._settle_stream()
            raise

    def _settle_stream(self) -> None:
        """After an enqueue failed part way (an out-of-memory on a temporary, say): wait for
        the copies already queued on the stream. The caller fails the job next, and its slots
        are freed and handed out again; a copy still queued would then write into another
        request's pages."""
        with contextlib.suppress(Exception):
            self._stream.synchronize()

    # -- load
    def load(self, host_indices: IndexLike, device_indices: IndexLike) -> LayerLoadHandle:
        """Start copying the pages at ``host_indices`` to ``device_indices`` layer by layer and
        return at once; the handle's counter reports each layer as it lands."""
        plan = self.plan_load(host_indices, device_indices)
        counter = LayerDoneCounter(self.num_layers)
        if plan.num_units == 0:
            counter.mark_all_done()
            return LayerLoadHandle(counter, None)
        if self._runs_here(plan):
            with contextlib.suppress(Exception):  # the counter holds the failure for the waiters
                self._load_cpu(plan, counter)
            return LayerLoadHandle(counter, None)
        if not self.is_cuda:
            fut = self._submit(self._load_cpu, plan, counter, on_dropped=counter.fail)
            return LayerLoadHandle(counter, fut)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        events = [torch.cuda.Event() for _ in range(self.num_layers)]
        enqueued = LayerDoneCounter(self.num_layers)

        def dropped(exc: BaseException) -> None:
            enqueued.fail(exc)
            counter.fail(exc)

        fut = self._submit(self._load_cuda, plan, counter, ready, events, enqueued, on_dropped=dropped)
        return LayerLoadHandle(counter, fut, events, enqueued)

    def load_sync(self, host_indices: IndexLike, device_indices: IndexLike) -> None:
        """Blocking load of all layers."""
        self.load(host_indices, device_indices).wait_sync()

    def _load_layer(self, plan: TransferPlan, layer: int) -> None:
        """Copy one layer of every segment (CPU). Separate so tests can observe ordering."""
        if self._layer_spans is not None:
            self._copy_native(self._layer_spans, plan, to_host=False, layer=layer)
            return
        self._copy_cpu(
            self._layer_pairs[layer], self._layer_np_pairs[layer], self._layer_unit_bytes, plan, to_host=False
        )

    def _load_cpu(self, plan: TransferPlan, counter: LayerDoneCounter) -> None:
        try:
            for layer in range(self.num_layers):
                self._load_layer(plan, layer)
                counter.mark_done(layer)
        except BaseException as exc:
            counter.fail(exc)
            raise

    def _load_cuda(
        self,
        plan: TransferPlan,
        counter: LayerDoneCounter,
        ready: Any,
        events: list[Any],
        enqueued: LayerDoneCounter,
    ) -> None:
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for layer in range(self.num_layers):
                    for dev, host in self._layer_pairs[layer]:
                        copy_units_cuda(dev, host, plan)
                    events[layer].record(self._stream)
                    enqueued.mark_done(layer)
            for layer in range(self.num_layers):
                events[layer].synchronize()
                counter.mark_done(layer)
        except BaseException as exc:
            self._settle_stream()  # before the failure frees the device slots being written
            enqueued.fail(exc)
            counter.fail(exc)
            raise

    def _submit(
        self, fn: Callable[..., Any], *args: Any, on_dropped: Callable[[BaseException], object] | None = None
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn`` on the copy thread; :class:`CacheClosedError` once closed, also when
        a close on another thread lands between the check and the submit.

        ``on_dropped(error)`` runs if the executor drops the job unrun (a shared executor shut
        down with ``cancel_futures``): nothing else would settle what the job was to settle
        (a load's layer counter, whose waiters would wait forever)."""
        # the check, the submit and the entry in ``_pending`` under one lock hold, the one
        # close() sets ``_closed`` under: either close() sees the job (a shared executor's
        # close waits for ``_pending``) or this call sees the close. Checked outside it, a close
        # on another thread between the check and the entry returned with the job still to run
        with self._lock:
            if self._closed:
                raise CacheClosedError("CopyEngine is closed")
            try:
                fut = self._executor.submit(fn, *args)
            except RuntimeError as exc:  # the executor shut down meanwhile
                if self._closed:
                    raise CacheClosedError("CopyEngine is closed") from exc
                raise
            self._pending.add(fut)
        # (after the lock: ``settled`` takes it, and runs at once on a job already done)

        def settled(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._pending.discard(f)
            if f.cancelled() and on_dropped is not None:
                on_dropped(_dropped())

        fut.add_done_callback(settled)
        return fut

    def __repr__(self) -> str:
        return f"CopyEngine(device={self.device}, unit={self.unit}, layers={self.num_layers}, closed={self._closed})"
