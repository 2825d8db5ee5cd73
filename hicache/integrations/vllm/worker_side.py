"""The worker half of the connector: pages between vLLM's paged KV tensors, hicache's host pool
and storage, without stalling the forward pass.

The host tier is hicache's :class:`~hicache.memory.host_pool.HostKVPool` (:mod:`.host_pool`),
and host<->storage traffic goes through hicache's
:class:`~hicache.controller.HiCacheController` on a loop thread of its own: its bounded storage
write queue with retries, its storage health (a store that hangs or keeps failing is skipped
until a probe finds it back), its prefetcher for reads. The scheduler decides which slot holds
which page (:mod:`.host_tree`); this side moves the bytes and tells the scheduler, through
:meth:`take_report`, which writes ended and which slots did not hold what it believed.

Loads (``start``/``wait_layer``): pages the host pool holds are checked (the slot must hold the
key the scheduler names) and the others are read from storage into their slots through the
controller's prefetcher; then everything is copied into vLLM's blocks layer by layer on the
load thread. The forward pass waits only for the layer it is about to attend (``wait_layer``),
so copies of layer ``i+1..`` overlap the compute of layer ``i``. A page that cannot be had
(missing, torn, foreign: storage verifies every page; a host slot that lost it) fails alone with
every later page of its request, and its blocks are reported so vLLM recomputes them; garbage
never reaches a block.

Saves (``save``): each newly completed block is gathered, all layers into one host page, at the
end of the step (when every layer's KV is written; batched per layer, :meth:`WorkerSide._gather`),
and the pages storage may lack are queued for
storage in the background (with pages the host pool holds already and an earlier write did not
store, written from their slots). A slot that an earlier storage read or write still uses is
never overwritten: that save is dropped (a future miss) and the slot reported. A save whose
request's KV sits in a block that failed to load in the same step is dropped too (vLLM ran the
step over the garbage before rolling the request back): its slots are reported, nothing of it
is stored. A save marked ``hold`` (several workers) keeps its storage write until the scheduler's
word arrives with a later step's metadata (:meth:`WorkerSide.begin_step`).

Every write reports how many leading pages it stored (``WorkerReport.written``): the scheduler
counts a page as stored only then, and writes it again later otherwise.

Nothing here imports vLLM: the connector passes plain tensors and ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from hicache.controller import ControllerConfig, HiCacheController
from hicache.controller.jobs import StorageWriteJob
from hicache.errors import quoted
from hicache.integrations.vllm.host_pool import block_host_pool, slot_indices
from hicache.integrations.vllm.naming import KVGeometry
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.store_io import open_at_start
from hicache.integrations.vllm.transfers import PageLoad, PageSave, WorkerReport
from hicache.memory.layer_counter import LayerDoneCounter
from hicache.storage import AsyncHiCacheStorage
from hicache.storage.sync import LoopThread

__all__ = ["WorkerSide"]

logger = logging.getLogger("hicache.integrations.vllm")

@dataclasses.dataclass
class _Held:
    """A ``hold`` save's storage write, waiting for the scheduler's commit or abort."""

    job: StorageWriteJob
    spec: PageSave
    writes: list[int]  # slots the write reads
    copied: list[int]  # slots the save filled from vLLM's blocks


class _Load:
    """One step's load: its per-layer completion and the blocks that failed."""

    def __init__(self, num_layers: int, blocks: set[int]) -> None:
        self.counter = LayerDoneCounter(num_layers)
        self.blocks = blocks  # every block this load writes
        self.failed_blocks: set[int] = set()
        self.done = threading.Event()
        # set when the forward pass stopped waiting: the copier writes no further layer
        self.abandoned = threading.Event()


@dataclasses.dataclass
class _Fetch:
    """Pages of one request read from storage into their slots."""

    rid: str
    keys: list[str]
    slots: list[int]


class WorkerSide:
    """Moves pages for one worker (one tp/pp rank). ``layers`` are vLLM's per-layer KV
    tensors, block-indexed on dim 0 (or on dim 1 when K/V come first)."""

    #: the most bytes a save stages at a time (see :meth:`_gather`)
    stage_bytes = 64 << 20

    def __init__(
        self,
        geometry: KVGeometry,
        storage: AsyncHiCacheStorage | None,
        *,
        host_pages: int,
        load_timeout_s: float,
        controller: ControllerConfig | None = None,
    ) -> None:
        self.geometry = geometry
        self.load_timeout_s = load_timeout_s
        self.pool = block_host_pool(geometry, host_pages)
        self.num_pages = self.pool.num_pages
        # the pool as [pages, layers, block bytes]: page_first pools are one contiguous buffer,
        # so a save writes runs of whole pages with one copy each (see _gather)
        first = self.pool.page_view(0)
        assert first is not None
        nl, nb = geometry.num_layers, geometry.block_nbytes
        self._pages = first.as_strided((self.num_pages, nl, nb), (nl * nb, nb, 1))
        self._stage: torch.Tensor | None = None  # page-major staging for saves (see _gather)
        self.layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._kv_first: list[bool] = []
        self._num_blocks = 0
        self._lock = threading.Lock()
        # what each slot holds (the key of a complete page), and storage I/O still using it
        self._resident: list[str | None] = [None] * self.num_pages
        self._reading: Counter[int] = Counter()  # storage reads into the slot
        self._writing: Counter[int] = Counter()  # storage writes from the slot
        self._report = WorkerReport()
        self._failed: set[int] = set()  # blocks whose load failed, until vLLM takes them
        # blocks whose load failed, per scheduler step, until the scheduler saw that step's
        # outcome (vLLM rolled the requests back): saves of requests whose KV sits in one drop
        self._recent_failed: dict[int, set[int]] = {}
        self._step_seq = 0  # the scheduler's step being run (0: none announced)
        self._held: dict[int, _Held] = {}
        self._epoch = 0  # the scheduler's cache epoch this pool's pages belong to
        self._queued_pages = 0  # pages handed to the controller's write queue and not ended
        self._rids = itertools.count()
        self._loop = LoopThread(name="hicache-vllm-worker")
        self.controller = HiCacheController(
            copy_engine=None,  # device<->host copies are vLLM blocks, done here (no device pool)
            host_pool=self.pool, storage=storage, config=controller or ConnectorOptions().controller_config(),
            own_storage=True,
        )
        # the prefetcher gives back the slots of pages it did not complete: they hold nothing now
        self.controller.set_host_free(self._fetch_released)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-load")
        self._load: _Load | None = None
        self._closed = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("pages_loaded", "pages_from_host", "pages_failed", "pages_saved", "saves_dropped", "save_errors",
             "saves_tainted", "writes_held", "writes_aborted", "host_resets"), 0
        )

    # ------------------------------------------------------------------ set-up
    def open_storage(self, timeout: float) -> None:
        """Open the store now, on the controller's loop (see :meth:`.StoreIO.open`): an
        unusable one fails start-up with its error; one slow to answer goes on opening."""
        open_at_start(self._loop.loop, self.controller.open_storage(), timeout, "hicache worker")

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
        self._num_blocks = min(int(t.shape[1] if first else t.shape[0]) for (_, t), first in zip(named_layers, kv_first))
        self.layers = [t for _, t in named_layers]
        self._layer_index = {name: i for i, (name, _) in enumerate(named_layers)}

    def _block(self, layer: int, block: int) -> torch.Tensor:
        """Block ``block`` of layer ``layer`` as a view (two pieces when K/V come first)."""
        t = self.layers[layer]
        return t[:, block] if self._kv_first[layer] else t[block]

    def _page(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s page: a live 1-D byte view of the host pool."""
        view = self.pool.page_view(slot * self.pool.page_size)
        assert view is not None  # page_first pools always have one
        return view

    def _indices(self, slots: Sequence[int]) -> torch.Tensor:
        return slot_indices(slots, self.pool.page_size)

    def _valid_slot(self, slot: int) -> bool:
        return 0 <= slot < self.num_pages

    def _valid_block(self, block: int) -> bool:
        return 0 <= block < self._num_blocks

    def _busy(self, slot: int) -> bool:
        """A storage read or write still uses ``slot`` (its bytes must not change). Under the lock."""
        return bool(self._reading[slot] or self._writing[slot])

    def _free_slot(self, slot: int) -> bool:
        """``slot`` exists and no storage I/O uses it: it may be overwritten. Under the lock."""
        return self._valid_slot(slot) and not self._busy(slot)

    @staticmethod
    def _release(uses: Counter[int], slots: Sequence[int]) -> None:
        """One use of each of ``slots`` ended (a count at zero leaves). Under the lock."""
        for slot in slots:
            if uses[slot] > 1:
                uses[slot] -= 1
            else:
                uses.pop(slot, None)

    def holds(self, slot: int) -> str | None:
        """The key of the page ``slot`` holds (``None``: nothing usable)."""
        with self._lock:
            return self._resident[slot] if self._valid_slot(slot) else None

    # ------------------------------------------------------------------ loads
    def start(self, loads: Sequence[PageLoad]) -> None:
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
        t0 = time.perf_counter()
        try:
            job.counter.wait_sync(i, timeout=self.load_timeout_s + 5.0)
        except BaseException as exc:  # noqa: BLE001 - a failed load is reported, not raised
            # the forward goes on without this layer: every block of the load is suspect
            logger.warning("hicache: layer %s load did not complete: %r", layer_name, exc)
            job.abandoned.set()
            job.counter.fail(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            self._fail(job.blocks)
        finally:
            with self._lock:  # time the forward spent on loads, not on compute
                self._report.load_wait_s += time.perf_counter() - t0

    def finish_step(self) -> None:
        """End of the step: the load thread must be done with vLLM's blocks before they are
        reused, so wait for it (it is bounded by the load timeout)."""
        job, self._load = self._load, None
        if job is not None and not job.done.wait(self.load_timeout_s + 10.0):
            logger.error("hicache: a load is still running after the step; its blocks are reported failed")
            job.abandoned.set()
            self._fail(job.blocks)

    def _fail(self, blocks: set[int]) -> None:
        """``blocks`` did not load: for vLLM (``take_failed_blocks``) and for the saves of this
        step and of the next ones the scheduler planned before it saw this one's outcome."""
        if not blocks:
            return
        with self._lock:
            self._failed |= blocks
            self._recent_failed.setdefault(self._step_seq, set()).update(blocks)

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def _run_load(self, job: _Load, loads: list[PageLoad]) -> None:
        plan: list[tuple[int, int]] = []  # (slot, block) of every page that is good to copy
        published: set[int] = set()  # failed blocks reported already (each is reported once)
        try:
            fetches: list[_Fetch | None] = []
            with self._lock:
                for spec in loads:
                    keys, slots = [], []
                    for key, slot in zip(spec.keys[spec.from_host :], spec.slots[spec.from_host :]):
                        if not self._free_slot(slot):
                            break  # no room, or a storage I/O still uses the slot: this page fails
                        keys.append(key)
                        slots.append(slot)
                    for slot in slots:
                        self._resident[slot] = None  # being overwritten
                        self._reading[slot] += 1
                    fetches.append(_Fetch(f"{spec.req_id}#{next(self._rids)}", keys, slots) if keys else None)
            reads = [f for f in fetches if f is not None]
            t0 = time.perf_counter()
            fetched = self._fetch(reads)
            landed = sum(fetched.values())
            if landed:  # the store's pace, for the scheduler's choice between reading and recomputing
                # (the pages that landed: a read that failed at once says nothing of a good one)
                with self._lock:
                    self._report.reads.append((landed, time.perf_counter() - t0))
            bad: set[int] = set()
            failures: list[tuple[PageLoad, int, str]] = []  # (load, its first failed page, why)
            with self._lock:
                landed_by_spec = [fetched.get(fetch.rid, 0) if fetch is not None else 0 for fetch in fetches]
                # every page read in this step first: a request's host pages may be pages another
                # request of the same step read into new host slots (they joined the scheduler's
                # tree when that one was allocated), whatever order the step lists the two in
                for spec, got in zip(loads, landed_by_spec):
                    for key, slot in zip(spec.keys[spec.from_host :][:got], spec.slots[spec.from_host :][:got]):
                        self._resident[slot] = key
                for spec, got, fetch in zip(loads, landed_by_spec, fetches):
                    broken = False
                    for i, (key, slot, block) in enumerate(zip(spec.keys, spec.slots, spec.block_ids)):
                        if i < spec.from_host:
                            good = self._valid_slot(slot) and self._resident[slot] == key and not self._reading[slot]
                            source = "pages_from_host"
                        else:
                            good = i - spec.from_host < got
                            source = "pages_loaded"
                        good = good and not broken and self._valid_block(block)
                        if good:
                            plan.append((slot, block))
                            self.stats[source] += 1
                            continue
                        if not broken:
                            failures.append((spec, i, self._why_failed(spec, i, len(fetch.keys) if fetch else 0)))
                        broken = True
                        job.failed_blocks.add(block)
                        self.stats["pages_failed"] += 1
                        if self._valid_slot(slot) and self._resident[slot] != key:
                            bad.add(slot)  # the scheduler believes (or will believe) it holds key
                self._report.bad_slots |= bad
            for spec, first, why in failures:
                logger.warning("hicache: %d of %d page(s) of %s did not load, from page %d on: %s; their blocks go to "
                               "vLLM as load errors", len(spec.keys) - first, len(spec.keys), quoted(spec.req_id), first, why)
            # known before any byte is copied: published now, so a vLLM that asks for the step's
            # failures as soon as the forward's last layer is in (speculative decoding finalizes
            # the connector before wait_for_save) already sees them
            published = set(job.failed_blocks)
            self._fail(published)
            self._copy_layers(job, plan)
        except BaseException as exc:  # noqa: BLE001 - the load thread must never die
            logger.exception("hicache: load failed")
            job.failed_blocks.update(b for _, b in plan)
            job.counter.fail(exc)
        finally:
            self._fail(job.failed_blocks - published)
            job.done.set()

    def _why_failed(self, spec: PageLoad, i: int, asked: int) -> str:
        """Why page ``i`` of ``spec``, the first of it that fails, is not good to copy (for the
        log: under vLLM's default ``kv_load_failure_policy`` its request fails on it).
        ``asked``: how many of its storage pages were handed to the read. Under the lock."""
        if not self._valid_block(spec.block_ids[i]):
            return f"its block {spec.block_ids[i]} is outside vLLM's cache"
        if i < spec.from_host:
            return "its host slot no longer holds it"
        if i - spec.from_host >= asked:
            return "no free host slot to read it into"
        return "storage did not return it (missing, damaged or too slow)"

    def _fetch(self, fetches: list[_Fetch]) -> dict[str, int]:
        """Read each fetch's pages into its slots through the controller; how many leading
        pages of each landed (verified). Bounded by the load timeout."""
        if not fetches:
            return {}
        try:
            return self._loop.call(self._fetch_all(fetches), timeout=self.load_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - timeout, closed loop: every page misses
            logger.warning("hicache: reading %d page(s) failed: %r", sum(len(f.keys) for f in fetches), exc)
            return {}

    async def _fetch_all(self, fetches: list[_Fetch]) -> dict[str, int]:
        counts = await asyncio.gather(*(self._fetch_one(f) for f in fetches))
        return {f.rid: n for f, n in zip(fetches, counts)}

    async def _fetch_one(self, fetch: _Fetch) -> int:
        """One request's pages through the controller's prefetcher (existence, batched reads,
        health, I/O timeout). The slots it is not handed back are released here; the ones it
        hands back come through :meth:`_fetch_released`."""
        indices = self._indices(fetch.slots)
        handed = 0

        def alloc_host(num_tokens: int) -> torch.Tensor:
            nonlocal handed
            handed = min(len(fetch.slots), num_tokens // self.pool.page_size)
            self._unread(fetch.slots[handed:])
            return indices[: handed * self.pool.page_size]

        got = 0
        try:
            # promised: the scheduler counted these pages as hits, so the controller's gates for
            # optional prefetches (store marked down, in-flight budget) must not turn them into
            # failed blocks; the read stays bounded by the load timeout
            if self.controller.start_prefetch(fetch.rid, fetch.keys, alloc_host=alloc_host, promised=True) is None:
                return 0
            try:
                result = await self.controller.wait_prefetch(fetch.rid, "wait_complete")
            except asyncio.CancelledError:
                self.controller.abort_prefetch(fetch.rid)  # its slots come back once a read in flight returns
                raise
            got = result.pages if result is not None else 0
            self._unread(fetch.slots[:got])
            return got
        finally:
            if handed == 0:
                self._unread(fetch.slots)

    def _unread(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._release(self._reading, slots)

    def _fetch_released(self, indices: torch.Tensor) -> None:
        """The prefetcher is done with these slots and did not complete their pages."""
        slots = sorted({int(i) // self.pool.page_size for i in indices.reshape(-1).tolist()})
        with self._lock:
            for slot in slots:
                self._resident[slot] = None
        self._unread(slots)

    def _copy_layers(self, job: _Load, plan: list[tuple[int, int]]) -> None:
        nb = self.geometry.block_nbytes
        pages = [(self._page(slot), block) for slot, block in plan]
        for i in range(len(self.layers)):
            if job.abandoned.is_set():
                return
            for page, block in pages:
                dst = self._block(i, block)
                dst.copy_(page[i * nb : (i + 1) * nb].view(dst.dtype).view(dst.shape))
            job.counter.mark_done(i)

    # ------------------------------------------------------------------ step start
    def begin_step(
        self, commit: Sequence[int] = (), abort: Sequence[int] = (), epoch: int | None = None,
        step: int | None = None, resolved: int | None = None,
    ) -> None:
        """The scheduler's word from a step's metadata, before the step's loads: held writes to
        start or forget, its cache epoch (a new one: the host pool's pages are of before a
        reset, drop them), the step's number and the last step whose outcome it has seen
        (failed loads up to it need no remembering). Idempotent: the connector calls it at the
        step's start and again at its save."""
        if step is not None:
            self._step_seq = step
        if resolved is not None:
            with self._lock:
                for seq in [seq for seq in self._recent_failed if seq <= resolved]:
                    del self._recent_failed[seq]
        if epoch is not None and epoch != self._epoch:
            self._reset_host(epoch)
        for job in commit:
            held = self._held.pop(job, None)
            if held is not None:
                self._queue_write(held.job, held.spec, held.writes)
        for job in abort:
            held = self._held.pop(job, None)
            if held is not None:
                self._drop_held(held)

    def _reset_host(self, epoch: int) -> None:
        """Forget every page of the host pool (the scheduler's tree forgot them already); held
        writes are dropped. Storage I/O still running keeps its slots busy, as always."""
        self.finish_step()
        self._drop_all_held()
        with self._lock:
            self._resident = [None] * self.num_pages
        self._epoch = epoch
        self.stats["host_resets"] += 1
        logger.info("hicache worker: cache reset (epoch %d): host pages dropped", epoch)

    def _drop_all_held(self) -> int:
        """Drop every held write (a reset, a close: no word will come); returns their pages."""
        pages = sum(len(h.writes) for h in self._held.values())
        for held in list(self._held.values()):
            self._drop_held(held)
        self._held.clear()
        return pages

    def _drop_held(self, held: _Held) -> None:
        """A held write the scheduler aborted (another worker's load failed under it) or that
        a reset made pointless: its pages are not stored, and the copies are not served."""
        keys = dict(zip(held.spec.slots[held.spec.copy_from :], held.spec.keys[held.spec.copy_from :]))
        with self._lock:
            self._release(self._writing, held.writes)
            for slot in held.copied:
                if not self._busy(slot) and self._resident[slot] == keys.get(slot):
                    self._resident[slot] = None
        self.stats["writes_aborted"] += len(held.writes)
        self._job_done(held.spec, [], 0)

    # ------------------------------------------------------------------ saves
    def save(self, saves: Sequence[PageSave]) -> None:
        """Gather each page into its host slot now, queue the ones storage may lack (or hold
        them for the scheduler's word). Saves of requests whose KV read a block that failed
        to load are dropped. This runs on vLLM's engine thread at the end of the step: every
        page of the step is gathered with one indexed copy per layer (:meth:`_gather`), not
        one copy per block per layer."""
        if not saves or not self.layers or self._closed:
            for spec in saves:
                self._skip(spec)
            return
        with self._lock:
            failed = set().union(*self._recent_failed.values())
        planned: list[tuple[PageSave, list[int], list[int]]] = []
        claimed: dict[int, str] = {}  # slots this step's saves fill (one page each), with their key
        for spec in saves:
            if spec.depends_on and failed.intersection(spec.depends_on):
                self._drop_tainted(spec, failed)
            else:
                planned.append(self._plan_save(spec, claimed))
        # every copy of the step lands before any write starts: a save may write a page that
        # an earlier save of the step copies (see _plan_save)
        self._gather([(slot, block) for spec, copied, _ in planned
                      for slot, block in zip(copied, spec.block_ids[spec.copy_from :])])
        for spec, copied, writes in planned:
            with self._lock:
                for key, slot in zip(spec.keys[spec.copy_from :], copied):
                    self._resident[slot] = key
            self._write(spec, copied, writes)

    def _drop_tainted(self, spec: PageSave, failed: set[int]) -> None:
        """The save's request computed its pages over a block whose load failed: none of its
        pages is kept; its slots are reported (the scheduler's tree inserted them already)."""
        new = spec.slots[spec.copy_from :]
        with self._lock:
            for slot in new:
                if self._valid_slot(slot):
                    self._report.bad_slots.add(slot)
                    if not self._busy(slot):
                        self._resident[slot] = None
            if spec.job:
                self._report.tainted[spec.job] += 1
        self.stats["saves_tainted"] += len(new)
        logger.info("hicache: save of %s dropped: its KV read block(s) %s that failed to load",
                    quoted(spec.req_id), sorted(failed.intersection(spec.depends_on)))
        self._job_done(spec, [], 0)

    def _plan_save(self, spec: PageSave, claimed: dict[int, str]) -> tuple[PageSave, list[int], list[int]]:
        """Which of the save's slots it fills (``copied``) and which it writes to storage
        (``writes``: the leading run of pages that hold their page, from ``write_from`` on);
        marks them (``copied`` hold nothing until the copy, ``writes`` are busy).

        ``claimed``: the slots earlier saves of this step copy into, with their keys. A page
        the scheduler put in the tree earlier in the same step (another request copies it)
        is one this save only writes: its slot holds nothing yet, but it is kept all the same,
        as :meth:`save` gathers every copy of the step before it starts any write."""
        cf = spec.copy_from
        with self._lock:
            # pages the host pool holds already, or gets in this step's gather (only written):
            # each must still be in its slot
            kept: list[int] = []
            for key, slot in zip(spec.keys[:cf], spec.slots[:cf]):
                if claimed.get(slot) == key:
                    kept.append(slot)
                    continue
                if not (self._valid_slot(slot) and self._resident[slot] == key and not self._reading[slot]):
                    if self._valid_slot(slot) and self._resident[slot] != key:
                        self._report.bad_slots.add(slot)
                    break
                kept.append(slot)
            copied: list[int] = []
            for key, slot, block in zip(spec.keys[cf:], spec.slots[cf:], spec.block_ids[cf:]):
                if not self._free_slot(slot) or slot in claimed:
                    break
                if not self._valid_block(block):
                    logger.error("hicache: save of %s names block %d of %d; not saved", quoted(spec.req_id), block,
                                 self._num_blocks)
                    break
                copied.append(slot)
                claimed[slot] = key
                self._resident[slot] = None  # not a complete page until the copy is done
            for slot in spec.slots[cf + len(copied) :]:
                if self._valid_slot(slot):
                    self._report.bad_slots.add(slot)
                    if not self._busy(slot) and slot not in claimed:
                        self._resident[slot] = None
            leading = [*kept, *copied] if len(kept) == cf else kept
            writes = leading[spec.write_from :]
            for slot in writes:
                self._writing[slot] += 1
        self.stats["saves_dropped"] += len(spec.slots) - cf - len(copied)
        return spec, copied, writes

    def _gather(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``block`` of every layer into host page ``slot``, for each pair. Why not
        block by block: a long prefill saves thousands of pages of dozens of layers, and one
        small copy per block per layer (each a synchronous device-to-host copy on a GPU) held
        the engine thread for about a second. Here each layer's blocks are taken with one
        ``index_select`` into a page-major staging buffer (one copy per layer, to host memory
        when the cache is on a device), and the staged pages go to their slots with one copy
        per run of consecutive slots. At most ``stage_bytes`` are staged at a time."""
        if not pairs:
            return
        nl, nb = self.geometry.num_layers, self.geometry.block_nbytes
        page_nbytes = nl * nb
        chunk = max(1, self.stage_bytes // page_nbytes)
        flat = self._pages.view(self.num_pages, page_nbytes)
        for lo in range(0, len(pairs), chunk):
            part = pairs[lo : lo + chunk]
            k = len(part)
            if self._stage is None or self._stage.shape[0] < k:
                self._stage = torch.empty(min(chunk, len(pairs)), nl, nb, dtype=torch.uint8)
            stage = self._stage[:k]
            blocks = torch.tensor([block for _, block in part], dtype=torch.int64)
            for i, layer in enumerate(self.layers):
                index = blocks.to(layer.device)
                if self._kv_first[i]:  # [2, blocks, ...]: a block is its K part then its V part
                    picked = layer.index_select(1, index).transpose(0, 1)
                else:
                    picked = layer.index_select(0, index)
                # to host memory if on a device: synchronous, after the forward's writes
                stage[:, i].copy_(picked.reshape(k, -1).view(torch.uint8))
            slots = [slot for slot, _ in part]
            j = 0
            while j < k:
                e = j + 1
                while e < k and slots[e] == slots[e - 1] + 1:
                    e += 1
                flat[slots[j] : slots[j] + (e - j)].copy_(stage[j:e].view(e - j, page_nbytes))
                j = e

    def _write(self, spec: PageSave, copied: list[int], writes: list[int]) -> None:
        """Queue the save's storage write, or hold it for the scheduler's word."""
        if not writes:
            self._skip(spec)
            return
        job = StorageWriteJob(
            keys=list(spec.keys[spec.write_from : spec.write_from + len(writes)]), host_indices=self._indices(writes),
            prior_key=spec.prior_key, on_done=lambda n: self._job_done(spec, writes, n, queued=True),
        )
        if spec.hold:
            self._held[spec.job] = _Held(job, spec, writes, copied)
            with self._lock:
                self._report.held[spec.job] += 1
            self.stats["writes_held"] += len(writes)
            return
        self._queue_write(job, spec, writes)

    def _skip(self, spec: PageSave) -> None:
        """Nothing of the save is written here. A ``hold`` save still gets this worker's verdict
        (``skipped``: the scheduler aborts the write on every worker, as a page some rank lacks
        is no storage hit anyway), so the others do not hold theirs forever."""
        if spec.hold and spec.job:
            with self._lock:
                self._report.skipped[spec.job] += 1
        self._job_done(spec, [], 0)

    def _queue_write(self, job: StorageWriteJob, spec: PageSave, writes: list[int]) -> None:
        with self._lock:
            self._queued_pages += len(writes)
        try:
            self._loop.loop.call_soon_threadsafe(self._submit_write, job, spec, writes)
        except RuntimeError:  # the loop is gone (closing)
            self._job_done(spec, writes, 0, queued=True)

    def _submit_write(self, job: StorageWriteJob, spec: PageSave, writes: list[int]) -> None:
        """On the controller's loop: queue the write, or end the job at once when the queue is
        full, the store is off or the controller is closing (the scheduler learns that nothing
        was written, and writes the pages again with a later save)."""
        try:
            queued = self.controller.submit_storage_write(job)
        except Exception:  # noqa: BLE001 - a closed controller refuses by raising
            queued = False
        if not queued:
            self._job_done(spec, writes, 0, queued=True)

    def _job_done(self, spec: PageSave, writes: list[int], written: int, *, queued: bool = False) -> None:
        """A save's storage write ended (``written`` leading pages made it)."""
        with self._lock:
            self._release(self._writing, writes)
            if queued:
                self._queued_pages -= len(writes)
            if spec.job:
                self._report.jobs_done[spec.job] += 1
                self._report.written[spec.job] = min(written, self._report.written.get(spec.job, written))
        self.stats["pages_saved"] += written
        self.stats["save_errors"] += len(writes) - written

    def take_report(self) -> WorkerReport:
        """What the scheduler should learn since the last call (writes ended, bad slots)."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        report.step = self._step_seq or None
        return report

    # ------------------------------------------------------------------ close
    def close(self, timeout: float) -> int:
        """Finish loads, drain the storage queue (up to ``timeout`` s), close storage. Returns
        the number of pages that were queued for storage and not written (writes held for the
        scheduler's word included: without it they are never written). Both the pages still
        queued when the drain starts and the ones given up are logged."""
        if self._closed:
            return 0
        self._closed = True
        self.finish_step()
        self._executor.shutdown(wait=True)
        held = self._drop_all_held()
        with self._lock:
            queued = self._queued_pages
        if queued or held:
            logger.info("hicache worker: closing with %d page(s) queued for storage (draining for up to %.1f s)%s",
                        queued, timeout, f", {held} held write page(s) given up" if held else "")
        lost = 0
        try:
            # the controller bounds each part: the drain by timeout, the store's close and its
            # I/O thread's exit by max(1 s, timeout) each; a little on top for the rest
            report = self._loop.call(self.controller.aclose(timeout), timeout=timeout + 2 * max(1.0, timeout) + 1.0)
            lost = report.unwritten_pages
            if not report.drained:
                logger.warning("hicache worker: the storage queue did not drain within %.1f s", timeout)
        except BaseException as exc:  # noqa: BLE001 - closing must not raise into vLLM
            with self._lock:
                lost = self._queued_pages
            logger.warning("hicache worker: closing the controller failed: %r", exc)
        finally:
            self._loop.stop()
        if lost or held:
            logger.warning("hicache worker: gave up %d of %d page(s) queued for storage at close%s", lost, queued,
                           f" and {held} held page(s)" if held else "")
        logger.info("hicache worker: %s", self.stats)
        return lost + held
