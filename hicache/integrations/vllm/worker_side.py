"""The worker half of the connector: pages between vLLM's paged KV tensors, the host pool and
storage, without stalling the forward pass.

Loads (``start``/``wait_layer``): the pages a step needs are taken from the host pool or read
from storage on the load thread, then copied into vLLM's blocks layer by layer; the forward
pass waits only for the layer it is about to attend (``wait_layer``), so the copies of layer
``i+1..`` overlap the compute of layer ``i``. A page that cannot be read (missing, torn,
foreign: storage verifies every page) fails alone with every later page of its request, and its
blocks are reported so vLLM recomputes them; garbage never reaches a block.

Saves (``save``): each newly completed block is gathered, all layers into one host page, at the
end of the step (when every layer's KV is written), then written to storage in the background.
A full pool or a failing store drops the save (a future miss), never blocks or raises.

Nothing here imports vLLM: the connector passes plain tensors and ids.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.integrations.vllm.host_pages import HostPagePool
from hicache.integrations.vllm.naming import KVGeometry
from hicache.integrations.vllm.store_io import StoreIO
from hicache.memory.layer_counter import LayerDoneCounter

__all__ = ["PageTransfer", "WorkerSide"]

logger = logging.getLogger("hicache.integrations.vllm")


@dataclass(frozen=True)
class PageTransfer:
    """Pages of one request: ``keys[i]`` lives in vLLM block ``block_ids[i]``. Loads list a
    request's pages in prefix order (a failed page fails the ones after it)."""

    req_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} blocks")


class _Load:
    """One step's load: its per-layer completion and the blocks that failed."""

    def __init__(self, num_layers: int, blocks: set[int]) -> None:
        self.counter = LayerDoneCounter(num_layers)
        self.blocks = blocks  # every block this load writes
        self.failed_blocks: set[int] = set()
        self.done = threading.Event()
        # set when the forward pass stopped waiting: the copier writes no further layer
        self.abandoned = threading.Event()


class WorkerSide:
    """Moves pages for one worker (one tp/pp rank). ``layers`` are vLLM's per-layer KV
    tensors, block-indexed on dim 0, in the order pages lay them out."""

    def __init__(self, geometry: KVGeometry, store: StoreIO, *, host_pages: int, load_timeout_s: float) -> None:
        self.geometry = geometry
        self.store = store
        self.load_timeout_s = load_timeout_s
        self.pool = HostPagePool(host_pages, geometry.page_nbytes, geometry.block_size)
        self.store.primary.register_mem_pool_host(self.pool)
        self.layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-load")
        self._load: _Load | None = None
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("pages_loaded", "pages_from_host", "pages_failed", "pages_saved", "saves_dropped", "save_errors"), 0
        )

    # ------------------------------------------------------------------ set-up
    def register(self, named_layers: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Bind vLLM's KV tensors; each must hold blocks of exactly the geometry's size."""
        if len(named_layers) != self.geometry.num_layers:
            raise ValueError(f"{len(named_layers)} KV layers registered, the geometry has {self.geometry.num_layers}")
        want = self.geometry.block_nbytes
        kv_first: list[bool] = []
        for name, t in named_layers:
            # blocks first (vLLM's CPU backend: [blocks, ...]) or K/V first (FlashAttention:
            # [2, blocks, block_size, heads, dim]); a block is the same bytes either way
            if t[0].numel() * t.element_size() == want:
                kv_first.append(False)
            elif t.dim() >= 3 and t.shape[0] == 2 and t[:, 0].numel() * t.element_size() == want:
                kv_first.append(True)
            else:
                raise ValueError(
                    f"layer {name}: KV tensor of shape {tuple(t.shape)} holds no block of the "
                    f"{want} bytes the namespace says (neither [blocks, ...] nor [2, blocks, ...])"
                )
        self._kv_first = kv_first
        self.layers = [t for _, t in named_layers]
        self._layer_index = {name: i for i, (name, _) in enumerate(named_layers)}

    def _block(self, layer: int, block: int) -> torch.Tensor:
        """Block ``block`` of layer ``layer`` as a view (two pieces when K/V come first)."""
        t = self.layers[layer]
        return t[:, block] if self._kv_first[layer] else t[block]

    # ------------------------------------------------------------------ loads
    def start(self, loads: Sequence[PageTransfer]) -> None:
        """Begin this step's loads (returns at once)."""
        self.finish_step()  # a load left from a step that never reached wait_for_save
        if not loads or not self.layers or self._closed:
            return
        job = _Load(len(self.layers), {b for spec in loads for b in spec.block_ids})
        self._load = job
        self._executor.submit(self._run_load, job, list(loads))

    def wait_layer(self, layer_name: str) -> None:
        """Block until layer ``layer_name`` of this step's loads is in place (or failed)."""
        job = self._load
        if job is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None or job.abandoned.is_set():
            return  # an abandoned load's blocks are reported failed already: no layer waits again
        try:
            job.counter.wait_sync(i, timeout=self.load_timeout_s + 5.0)
        except BaseException as exc:  # noqa: BLE001 - a failed load is reported, not raised
            # the forward goes on without this layer: every block of the load is suspect
            logger.warning("hicache: layer %s load did not complete: %r", layer_name, exc)
            job.abandoned.set()
            job.counter.fail(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            with self._lock:
                self._failed |= job.blocks

    def finish_step(self) -> None:
        """End of the step: the load thread must be done with vLLM's blocks before they are
        reused, so wait for it (it is bounded by the load timeout)."""
        job, self._load = self._load, None
        if job is not None and not job.done.wait(self.load_timeout_s + 10.0):
            logger.error("hicache: a load is still running after the step; its blocks are reported failed")
            job.abandoned.set()
            with self._lock:
                self._failed |= job.blocks

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def _run_load(self, job: _Load, loads: list[PageTransfer]) -> None:
        plan: list[tuple[int, int]] = []  # (slot, block) of every page that is good to copy
        pinned: list[int] = []
        try:
            reads: list[tuple[str, int]] = []  # (key, slot) to read from storage
            per_req: list[list[tuple[str, int, int, bool]]] = []  # key, slot, block, from_host
            for spec in loads:
                pages: list[tuple[str, int, int, bool]] = []
                for key, block in zip(spec.keys, spec.block_ids):
                    slot = self.pool.lookup_pin(key)
                    from_host = slot is not None
                    if slot is None:
                        slot = self.pool.alloc_pin()
                        if slot is None:  # every host page is busy: this page and the rest fail
                            pages.append((key, -1, block, False))
                            continue
                        reads.append((key, slot))
                    pinned.append(slot)
                    pages.append((key, slot, block, from_host))
                per_req.append(pages)
            ok_read: dict[int, bool] = {}
            if reads:
                ok_read = self._read(reads)
            for pages in per_req:
                broken = False
                for key, slot, block, from_host in pages:
                    good = not broken and slot >= 0 and (from_host or ok_read.get(slot, False))
                    if good:
                        if not from_host:
                            self.pool.publish(slot, key)
                        plan.append((slot, block))
                        self.stats["pages_from_host" if from_host else "pages_loaded"] += 1
                    else:
                        broken = True
                        if slot >= 0 and not from_host:
                            if ok_read.get(slot, False):
                                self.pool.publish(slot, key)  # valid, only not usable here
                            else:
                                self.pool.discard(slot)
                        job.failed_blocks.add(block)
                        self.stats["pages_failed"] += 1
            self._copy_layers(job, plan)
        except BaseException as exc:  # noqa: BLE001 - the load thread must never die
            logger.exception("hicache: load failed")
            job.failed_blocks.update(b for _, b in plan)
            job.counter.fail(exc)
        finally:
            for slot in pinned:
                self.pool.unpin(slot)
            with self._lock:
                self._failed |= job.failed_blocks
            job.done.set()

    def _read(self, reads: list[tuple[str, int]]) -> dict[int, bool]:
        keys = [k for k, _ in reads]
        slots = [s for _, s in reads]
        try:
            flags = self.store.call(
                self.store.primary.batch_get_v1(keys, self.pool.token_indices(slots)), self.load_timeout_s
            )
        except BaseException as exc:  # noqa: BLE001 - timeout, closed store: every page misses
            logger.warning("hicache: reading %d page(s) failed: %r", len(keys), exc)
            flags = [False] * len(keys)
        return {slot: bool(f) for slot, f in zip(slots, flags)}

    def _copy_layers(self, job: _Load, plan: list[tuple[int, int]]) -> None:
        nb = self.geometry.block_nbytes
        for i in range(len(self.layers)):
            if job.abandoned.is_set():
                return
            for slot, block in plan:
                src = self.pool.buffer[slot, i * nb : (i + 1) * nb]
                dst = self._block(i, block)
                dst.copy_(src.view(dst.dtype).view(dst.shape))
            job.counter.mark_done(i)

    # ------------------------------------------------------------------ saves
    def save(self, saves: Sequence[PageTransfer]) -> None:
        """Gather each page into the host pool now, write them to storage in the background."""
        if not saves or not self.layers or self._closed:
            return
        nb = self.geometry.block_nbytes
        keys: list[str] = []
        slots: list[int] = []
        for spec in saves:
            for key, block in zip(spec.keys, spec.block_ids):
                if self.pool.contains(key):
                    continue  # in the host pool already: written (or being written) before
                slot = self.pool.alloc_pin()
                if slot is None:
                    self.stats["saves_dropped"] += 1
                    continue
                page = self.pool.buffer[slot]
                for i in range(len(self.layers)):
                    page[i * nb : (i + 1) * nb].copy_(self._block(i, block).reshape(-1).view(torch.uint8))
                self.pool.publish(slot, key)
                keys.append(key)
                slots.append(slot)
        if not keys:
            return
        fut = self.store.submit(self.store.primary.batch_set_v1(keys, self.pool.token_indices(slots)))
        fut.add_done_callback(lambda f: self._saved(f, slots))

    def _saved(self, fut: concurrent.futures.Future[list[bool]], slots: list[int]) -> None:
        try:
            flags = [] if fut.cancelled() else fut.result()
            n = sum(1 for f in flags if f)
            self.stats["pages_saved"] += n
            self.stats["save_errors"] += len(slots) - n
        except BaseException as exc:  # noqa: BLE001 - a callback must not raise
            logger.warning("hicache: writing %d page(s) failed: %r", len(slots), exc)
            self.stats["save_errors"] += len(slots)
        finally:
            for slot in slots:
                self.pool.unpin(slot)

    # ------------------------------------------------------------------ close
    def close(self, timeout: float) -> int:
        """Finish loads, drain queued writes (up to ``timeout`` s), close storage. Returns the
        number of writes that did not make it."""
        if self._closed:
            return 0
        self._closed = True
        self.finish_step()
        self._executor.shutdown(wait=True)
        lost = self.store.close(timeout)
        logger.info("hicache worker: %s, host pool %s", self.stats, self.pool.stats())
        return lost
