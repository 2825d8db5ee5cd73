"""``HiCacheConnector``: hicache as a vLLM v1 KV connector.

vLLM builds one instance in its scheduler (engine core) process and one in every worker
process. This class only translates vLLM's objects into the engine-free halves:
:class:`~.scheduler_side.SchedulerSide` (lookup in hicache's radix tree over the host tier, then
in storage; which pages to load and save, and into which host slots) and
:class:`~.worker_side.WorkerSide` (moving them, through hicache's host pool and controller).
Metadata from the first to the second is :class:`HiCacheConnectorMetadata`, plain lists of page
loads and saves; the way back is :class:`HiCacheWorkerMetadata` (writes that ended, host slots
that did not hold their page), which vLLM hands to ``update_connector_output``.

Loads are synchronous in vLLM's sense (``load_kv_async=False``): a hit is loaded inside the
forward pass of the step that schedules it, layer by layer, overlapped with attention through
``wait_for_layer_load``. Saves copy whole pages out at the end of the step, so vLLM frees
blocks when it wants (``request_finished`` never holds them).

Failed loads are reported through ``get_block_ids_with_load_errors`` (docs/vllm-connector.md,
"Which kv_load_failure_policy"). vLLM 0.32 can leave a failed block in its own prefix cache as
computed (under ``"recompute"``, and under ``"fail"`` for a request preempted before the
failure's report), so the scheduler side evicts every reported block from it; under
``"recompute"`` it also rolls back every request sharing a failed block, where vLLM rolls back
only the first, and it refuses ``"recompute"`` with steps in flight (async scheduling, pipeline
parallelism), where vLLM's own rollback leaves wrong KV. Either way vLLM runs the step first,
so what that step computes over a failed load is never saved (see :mod:`.scheduler_side`).

``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, and a pause that clears
the caches, e.g. for new weights) empties the host tier and rotates the cache epoch, so that no
page stored before is matched again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from hicache.errors import quoted
from hicache.integrations.vllm.block_format import block_format, check_block_format
from hicache.integrations.vllm.naming import KVGeometry, deployment_namespace
from hicache.integrations.vllm.options import ConnectorOptions, close_timeout_in_grace
from hicache.integrations.vllm.host_tree import HostPageTree
from hicache.integrations.vllm.scheduler_side import SchedulerSide
from hicache.integrations.vllm.store_io import StoreIO, make_backend
from hicache.integrations.vllm.transfers import PageLoad, PageSave, WorkerReport
from hicache.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HiCacheConnector", "HiCacheConnectorMetadata", "HiCacheWorkerMetadata"]

logger = logging.getLogger("hicache.integrations.vllm")


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    """One step's page loads and saves, from the scheduler to the workers, with the word on
    held storage writes (``commit``/``abort``, job ids), the scheduler's cache epoch, the
    step's number and the last step whose outcome the scheduler has seen."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    commit: list[int] = field(default_factory=list)
    abort: list[int] = field(default_factory=list)
    epoch: int = 0
    step: int = 0
    resolved: int = 0


@dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """A step's report from the workers to the scheduler (storage writes ended, slots that did
    not hold their page); vLLM merges the workers' reports with :meth:`aggregate`."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, HiCacheWorkerMetadata):
            return self
        return HiCacheWorkerMetadata(self.report.merge(other.report))


#: how long start-up waits for the store to open: an unusable one (a root that cannot be
#: made) fails start-up with its error, one slow to answer (an object store that is down) goes
#: on opening after it, and calls wait for it
STORE_OPEN_WAIT_S = 5.0

#: full-attention spec classes whose manager still swaps blocks for vLLM's null block (by name:
#: not every vLLM version has them)
_DROPS_BLOCKS = frozenset({"RSWASpec"})


def _geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[KVGeometry, list[str]]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"HiCacheConnector supports models with one KV cache group; this one has {len(groups)} "
            "(hybrid models need --disable-hybrid-kv-cache-manager or another connector)"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or _DROPS_BLOCKS & {c.__name__ for c in type(spec).__mro__}:
        # a sliding-window (or chunked-local) group has vLLM put its null block in place of
        # the blocks that left the window, and so does R-SWA (a FullAttentionSpec subclass)
        # for the decode blocks between the prompt and its window: saved, their pages would
        # hold that block's bytes under real keys, and a later prompt would load them as its KV
        raise ValueError(
            f"HiCacheConnector stores full-attention KV; this model's KV cache is {type(spec).__name__} "
            "(for a sliding-window model, --disable-hybrid-kv-cache-manager keeps every block as full attention)"
        )
    if getattr(spec, "non_causal", False):
        # a prefix-LM's prefill attends both ways: a page's KV depends on the whole prompt,
        # not on its prefix, so a page found by its prefix holds another prompt's KV (vLLM
        # turns its own prefix caching off for these models for the same reason)
        raise ValueError(
            "HiCacheConnector stores KV by token prefix, and this model attends non-causally (a prefix LM): "
            "its KV of a prefix depends on the rest of the prompt, so stored pages would be another prompt's KV"
        )
    for attr in ("num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise ValueError(f"HiCacheConnector needs an attention KV cache, got {type(spec).__name__}")
    dtype = vllm_config.cache_config.cache_dtype
    if dtype == "auto":
        dtype = str(spec.dtype).removeprefix("torch.")
    geometry = KVGeometry(
        block_size=int(spec.block_size),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=str(dtype),
        block_nbytes=int(spec.page_size_bytes),
    )
    return geometry, list(groups[0].layer_names)


def _refuse_kernel_blocks(layer: str, kv_cache: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Refuse KV caches that vLLM split into kernel blocks.

    When the attention backend takes only blocks smaller than the KV cache manager's (vLLM's
    ``prepare_kernel_block_sizes``: FlashInfer's 16/32/64 under ``--block-size 128``, say),
    vLLM splits every block into ``r`` kernel blocks and registers ``[num_blocks * r, H,
    N / r, C]`` tensors, while the scheduler's block ids, and so this connector's, count the
    manager's blocks. Mapping the ids (block ``b`` is kernel blocks ``b * r .. b * r + r - 1``)
    is not enough: a block's bytes are then ``r`` kernel blocks in the backend's own format,
    not the page an unsplit engine stores for the same tokens (the CPU backend, for one, keeps
    a block's K of all its tokens before their V), so such pages need a namespace of their
    own, and the scheduler, which names the pages it looks up, cannot know the kernel block
    size: the workers' attention backends choose it."""
    rows = int(kv_cache.shape[0])
    if kv_cache.dim() != 4 or num_blocks < 1 or rows == num_blocks or rows % num_blocks:
        return
    kernel = block_size * num_blocks // rows
    raise ValueError(
        f"HiCacheConnector does not support vLLM's kernel blocks: the attention backend takes "
        f"{kernel}-token blocks, so vLLM split every {block_size}-token block into {rows // num_blocks} "
        f"(layer {layer}: {rows} kernel blocks for {num_blocks} blocks). A split block's bytes are not "
        f"the page an unsplit engine stores for its tokens, and the scheduler cannot know the split to "
        f"keep those pages apart. Start vLLM with --block-size {kernel} (a size the backend takes whole)"
    )


def request_salt(request: Any) -> str | None:
    """What besides its tokens decides a request's KV, as the root of its page-key chain: the
    cache salt, the LoRA adapter, and each multimodal input (an image's placeholder tokens are
    the same for every image, so without its identifier two images would share pages). A
    request with only a cache salt keeps the salt alone, so its keys stay what they were."""
    salt = getattr(request, "cache_salt", None)
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    for feature in getattr(request, "mm_features", None) or []:
        pos = feature.mm_position
        parts.append(f"mm={feature.identifier}@{pos.offset}+{pos.length}")
    if not parts:
        return salt
    return "\x00".join([f"salt={salt or ''}", *parts])


def _refuse_context_parallel(parallel: Any) -> None:
    """Refuse prefill or decode context parallelism. Under it a block's tokens are spread over
    the context-parallel ranks (each holds its interleaved share) and the scheduler counts
    blocks of ``block_size`` times the ranks, while a worker's page is its own share; and
    prefill ranks that share a tensor-parallel rank would store under one namespace: a rank
    would load another's share as its KV. vLLM's offloading route (``hicache`` as an
    offloading tier, docs/vllm-tier.md) keys each rank's share itself."""
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    if pcp > 1 or dcp > 1:
        raise ValueError(
            f"HiCacheConnector does not support context parallelism (prefill {pcp}, decode {dcp}): "
            "use hicache as vLLM's offloading tier (docs/vllm-tier.md), which maps each rank's slice"
        )


def _refuse_recompute_with_steps_in_flight(vllm_config: VllmConfig) -> None:
    """Refuse ``kv_load_failure_policy: recompute`` where vLLM plans a step before the output
    of the one before (async scheduling, on by default, or pipeline parallelism: vLLM's
    ``max_concurrent_batches`` above 1). vLLM 0.32 then drops the token sampled by the step
    whose load failed while the step planned after it already fed that token to the model:
    the request's tokens and its KV part ways (a position vLLM counts as computed was never
    written), and the request that shared the failed block in that next step keeps what it
    computed over it. No connector report undoes that; under ``fail`` those requests fail."""
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1) or 1)
    if policy == "recompute" and in_flight > 1:
        raise ValueError(
            f"HiCacheConnector does not support kv_load_failure_policy='recompute' with {in_flight} steps in "
            "flight (async scheduling or pipeline parallelism): vLLM then serves KV computed over a failed load. "
            "Keep kv_load_failure_policy='fail' (the default), or run with --no-async-scheduling and without "
            "pipeline parallelism (docs/vllm-connector.md, \"Which kv_load_failure_policy\")"
        )


def pp_layer_counts(vllm_config: VllmConfig, stage0_layers: int) -> list[int]:
    """KV layers of each pipeline stage. The scheduler's ``KVCacheConfig`` is stage 0's, but
    each stage's workers store pages of their own layers, under a namespace with their own
    layer count: the scheduler's lookup must use that count per rank, or an uneven split
    (5 layers over 2 stages: 3 + 2) never finds what the last stage stored. The split is
    vLLM's own (``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``)."""
    pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp_size <= 1:
        return [stage0_layers]
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.get_total_num_hidden_layers())
    counts = [end - start for start, end in (get_pp_indices(total, r, pp_size) for r in range(pp_size))]
    if counts[0] != stage0_layers:
        # KV layers are not the hidden layers here (a model with layers without KV): scale
        # each stage's share; a wrong guess is a storage miss for that stage, never wrong KV
        logger.warning("hicache: stage 0 has %d KV layers, vLLM's split of %d hidden layers gives %s; "
                       "storage hits of later pipeline stages may be missed", stage0_layers, total, counts)
        counts = [max(1, round(c * stage0_layers / counts[0])) for c in counts]
        counts[0] = stage0_layers
    return counts


def _close_worker_at_exit(connector: HiCacheConnector) -> None:
    """Drain the worker's storage queue when the interpreter exits without vLLM's shutdown (an
    in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, left to the interpreter's exit):
    vLLM's own shutdown then came after Python stopped accepting thread-pool work, and the
    queued pages were lost. Runs before the thread pools stop (``threading``'s exit hooks run
    newest first, theirs was registered at import); a no-op once the worker closed."""
    ref = weakref.ref(connector)

    def drain() -> None:
        try:  # an exception here would skip the interpreter's other exit hooks (thread pools)
            conn = ref()
            worker = conn._worker if conn is not None else None
            if conn is not None and worker is not None:
                worker.close(close_timeout_in_grace(conn.options.close_timeout_s))
        except BaseException:  # noqa: BLE001
            logger.exception("hicache worker: draining at interpreter exit failed")

    try:
        threading._register_atexit(drain)  # type: ignore[attr-defined]  # (what concurrent.futures uses)
    except (AttributeError, RuntimeError):  # another Python, or already shutting down
        pass


def _worker_ranks() -> tuple[int, int]:
    """This worker's (tp_rank, pp_rank); (0, 0) where vLLM's groups are not set up."""
    try:
        from vllm.distributed import parallel_state

        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - single-process set-ups have no groups
        return 0, 0


class HiCacheConnector(KVConnectorBase_V1):
    """hicache's host pool and storage behind vLLM's KV connector interface."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.geometry, self._layer_names = _geometry(vllm_config, kv_cache_config)
        self._block_format = block_format(kv_cache_config.kv_cache_groups[0].kv_cache_spec,
                                           str(vllm_config.cache_config.cache_dtype),
                                           vllm_config.model_config.dtype)
        model = vllm_config.model_config
        par = vllm_config.parallel_config
        _refuse_context_parallel(par)
        _refuse_recompute_with_steps_in_flight(vllm_config)
        #: vLLM reschedules requests whose load failed instead of failing them
        self._recompute = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") == "recompute"
        tp_size, pp_size = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)

        def ns(tp: int, pp: int, num_layers: int | None = None) -> Any:
            geometry = self.geometry if num_layers is None else dataclasses.replace(self.geometry, num_layers=num_layers)
            return deployment_namespace(
                model=str(model.model), revision=model.revision, geometry=geometry,
                tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, block_format=self._block_format,
                salt=self.options.namespace_salt, quantization=model.quantization,
            )

        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        opts = self.options
        if role is KVConnectorRole.SCHEDULER:
            layers = pp_layer_counts(vllm_config, self.geometry.num_layers)
            namespaces = [ns(tp, pp, layers[pp]) for pp in range(pp_size) for tp in range(tp_size)]
            store = StoreIO(opts.backend, opts.backend_options, namespaces, name="hicache-vllm-sched")
            try:
                store.open(STORE_OPEN_WAIT_S)
            except BaseException:
                store.close(0)
                raise
            tree = HostPageTree(opts.host_pages, self.geometry.block_size, eviction_policy=opts.eviction_policy)
            self._scheduler = SchedulerSide(
                store, tree, lookup_wait_s=opts.lookup_wait_s, lookup_timeout_s=opts.lookup_timeout_s,
                num_workers=tp_size * pp_size, recompute_bound=opts.recompute_bound,
                recompute_tokens_per_s=opts.recompute_tokens_per_s,
            )
            self._requests: dict[str, Request] = {}
            #: multimodal inputs each request had when its salt was taken: a streaming-input
            #: session that gains an image changes its salt (see :meth:`build_connector_meta`)
            self._mm_counts: dict[str, int] = {}
            #: each request's blocks in the steps whose outcome has not been reported yet (step ->
            #: request -> block ids): a request finished or preempted before its failed load's
            #: report holds them no more (see :meth:`_uncache_failed_blocks`)
            self._step_blocks: dict[int, dict[str, list[int]]] = {}
        else:
            tp, pp = _worker_ranks()
            self._worker = WorkerSide(
                self.geometry, make_backend(opts.backend, opts.backend_options, ns(tp, pp)),
                host_pages=opts.host_pages, load_timeout_s=opts.load_timeout_s, controller=opts.controller_config(),
            )
            try:
                self._worker.open_storage(STORE_OPEN_WAIT_S)
            except BaseException:
                self._worker.close(0)
                raise
            _close_worker_at_exit(self)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load runs between layers: graphs must leave room for it

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a future miss, nothing more

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"HiCacheConnector: KV caches of layers {missing} were not registered")
        check_block_format(self._vllm_config, self._layer_names, self._block_format)
        for n in self._layer_names:
            _refuse_kernel_blocks(n, kv_caches[n], int(self._kv_cache_config.num_blocks), self.geometry.block_size)
        self._worker.register([(n, kv_caches[n]) for n in self._layer_names])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HiCacheConnectorMetadata):
                self._worker.begin_step(meta.commit, meta.abort, meta.epoch, meta.step, meta.resolved)
                self._worker.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # pages are saved whole (every layer of a block in one page) once the step is done
        return

    def wait_for_save(self) -> None:
        """End of the step: the loads are done with vLLM's blocks, then this step's saves.
        The worker drops the saves of requests whose KV read a block that failed to load (it
        knows this step's failures before vLLM does: ``get_block_ids_with_load_errors`` is
        asked after this)."""
        if self._worker is None:
            return
        self._worker.finish_step()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HiCacheConnectorMetadata):
                self._worker.begin_step(meta.commit, meta.abort, meta.epoch, meta.step, meta.resolved)  # done at start_load_kv: a no-op
                self._worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of this step that did not load. vLLM with speculative decoding asks this
        (and :meth:`build_connector_worker_meta`) right after the forward, before
        :meth:`wait_for_save`: the step's load is finished here first (idempotent; it is done
        with vLLM's blocks once the forward's layers are in), so nothing it found comes a step
        late."""
        if self._worker is None:
            return set()
        self._worker.finish_step()
        return self._worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        self._worker.finish_step()  # see get_block_ids_with_load_errors
        report = self._worker.take_report()
        return HiCacheWorkerMetadata(report) if report else None

    def shutdown(self) -> None:
        # both inside vLLM's grace: the scheduler's half runs in the engine core, which vLLM
        # kills as it kills the workers
        timeout = close_timeout_in_grace(self.options.close_timeout_s)
        if self._worker is not None:
            self._worker.close(timeout)
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close(timeout)
            self._scheduler = None

    # ================================================================== scheduler side
    def reset_cache(self) -> bool | None:
        """vLLM's connector cache reset (``reset_prefix_cache(reset_connector=True)``, a pause
        with ``clear_cache``, ``release_kv_cache_memory``): after it, nothing stored or held
        before is served (the weights may have changed). vLLM calls it on the scheduler's
        connector only; the workers learn it from the next step's metadata (its epoch), before
        any load of that step. ``True`` once done, ``False`` if it failed (vLLM then reports
        the reset as failed); ``None`` on a worker (nothing to do there)."""
        scheduler = getattr(self, "_scheduler", None)
        if scheduler is None:
            return None
        try:
            return scheduler.reset()
        except Exception:  # noqa: BLE001 - vLLM gets "failed", never an exception
            logger.exception("hicache: cache reset failed")
            return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if getattr(request, "prompt_embeds", None) is not None:
            # its KV depends on embeddings, not on token ids (every embedding position holds the
            # same placeholder token): keyed by its tokens, it would be served another request's
            # KV. Neither looked up nor saved (vLLM keys such blocks by the embeddings' hash).
            return 0, False
        self._requests[request.request_id] = request
        self._mm_counts[request.request_id] = len(getattr(request, "mm_features", None) or ())
        hit = self._scheduler.matched_tokens(
            request.request_id, request.prompt_token_ids or [], request_salt(request), num_computed_tokens
        )
        if hit is None:
            return None, False
        return hit, False

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The planned load's split: pages in the host tier (host memory) and pages read from
        storage (disk for the ``file`` backend; another store is not a known tier)."""
        sources = None if self._scheduler is None else self._scheduler.load_sources(request.request_id)
        if sources is None or sum(sources) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        stored = CacheHitSource.DISK if self.options.backend == "file" else CacheHitSource.EXTERNAL_UNSPECIFIED
        host, storage = sources
        return {k: v for k, v in ((CacheHitSource.HOST, host), (stored, storage)) if v}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens > 0:
            self._scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        manager = self._kv_cache_manager
        scheduled: list[tuple[str, int, int, Any, Any]] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n_before in computed.items():
            request = self._requests.get(req_id)
            if request is None or manager is None:
                continue
            mm = len(getattr(request, "mm_features", None) or ())
            if mm != self._mm_counts.get(req_id, mm):
                # a streaming-input update added an image since the salt was taken: the pages
                # after it are other KV than the same tokens without it
                self._mm_counts[req_id] = mm
                self._scheduler.reroot(req_id, request_salt(request))
            block_ids = manager.get_block_ids(req_id)[0]
            n_after = n_before + num_scheduled.get(req_id, 0)
            scheduled.append((req_id, n_before, n_after, request.all_token_ids, block_ids))
        plan = self._scheduler.plan_step(scheduled)
        self._step_blocks = {step: held for step, held in self._step_blocks.items() if step > plan.resolved}
        self._step_blocks[plan.step] = {req_id: block_ids for req_id, _, _, _, block_ids in scheduled}
        return HiCacheConnectorMetadata(loads=plan.loads, saves=plan.saves, commit=plan.commit, abort=plan.abort,
                                        epoch=plan.epoch, step=plan.step, resolved=plan.resolved)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._recompute:
            self._recompute_shared_failed_blocks(connector_output.invalid_block_ids)
        self._uncache_failed_blocks(connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, HiCacheWorkerMetadata):
            self._scheduler.on_report(meta.report)

    def _uncache_failed_blocks(self, blocks: set[int] | None) -> None:
        """Take the blocks whose load failed, and every block after one in a request that held
        it, out of vLLM's prefix cache (vLLM calls this after its own handling of them). vLLM
        caches a step's blocks as computed when it plans the step, those it loads and those it
        computes over them, and evicts them only for the requests running when the failure is
        reported, and only under ``kv_load_failure_policy: fail``. Under ``recompute`` it evicts
        none (the request is to compute them again in place), and with async scheduling the next
        step is planned first and may preempt the loading request: a request aborted or
        preempted before it computed them again left them cached, and any later request of the
        same prefix (once the prefix's blocks were cached again) was served what was computed
        over the failed load as its KV, and its saves stored what it computed over that. The
        blocks come from the steps not reported yet (a request preempted since holds none now).
        Evicting a block only drops its hash: a request holding it keeps it."""
        manager = self._kv_cache_manager
        if not blocks or manager is None:
            return
        evict = set(blocks)
        for held in self._step_blocks.values():
            for block_ids in held.values():
                first = next((i for i, b in enumerate(block_ids) if b in blocks), None)
                if first is not None:
                    evict.update(block_ids[first:])
        if len(evict) > len(blocks):
            logger.info("hicache: %d block(s) failed to load; %d block(s) computed over them leave vLLM's prefix cache",
                        len(blocks), len(evict) - len(blocks))
        manager.evict_blocks(evict)

    def _recompute_shared_failed_blocks(self, blocks: set[int] | None) -> None:
        """Under ``kv_load_failure_policy: recompute``, have every request that shares a block
        whose load failed compute it again itself (vLLM calls this after its own handling).
        vLLM 0.32 rolls back only the first running request holding such a block to it, and
        leaves the others of the batch counting it as computed, for the first to recompute;
        if that one is aborted, preempted, or computes only part of the block next step, the
        others attend to the failed load's bytes as their KV. Each is rolled back as vLLM rolls
        back the first: to the start of its first failed block (the blocks stay allocated; the
        requests write the same KV into the shared block)."""
        manager = self._kv_cache_manager
        if not blocks or manager is None:
            return
        bs = self.geometry.block_size
        for req_id, request in self._requests.items():
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens <= 0:
                continue
            held = manager.get_block_ids(req_id)[0][: -(-request.num_computed_tokens // bs)]
            first = next((i for i, b in enumerate(held) if b in blocks), None)
            if first is not None:
                logger.info("hicache: request %s shares a block whose load failed; recomputing from token %d",
                            quoted(req_id), first * bs)
                request.num_computed_tokens = first * bs

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
            self._requests.pop(request.request_id, None)
            self._mm_counts.pop(request.request_id, None)
        return False, None
