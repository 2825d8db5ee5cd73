"""hicache as a secondary tier of vLLM's native KV offloading (``TieringOffloadingSpec``).

vLLM's ``TieringOffloadingManager`` keeps offloaded KV chunks in a CPU primary tier and cascades
each stored chunk to its secondary tiers; a chunk missing from the primary tier is looked up in
them and promoted back. :class:`HiCacheTier` is such a tier over any hicache storage backend,
loaded by vLLM from its config alone::

    vllm serve MODEL
    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "HiCacheTier",
                             "module_path": "hicache.integrations.vllm.tier",
                             "backend": "file",
                             "options": {"root": "/var/cache/kv", "max_bytes": 107374182400}}]}}'

What it adds over vLLM's own ``fs``/``obj`` tiers (see FIELD-NOTES):

* verified pages - every page carries hicache's header (namespace, key, length, xxh3) and is
  checked on every load; a torn, flipped or foreign page fails that chunk alone (vLLM
  recomputes it), never reaches the model;
* bounded disk - the ``file`` backend's ``max_bytes`` (64 GiB unless set) and free-space floor,
  leaf-first LRU eviction that keeps a prefix's first pages longer than its tail, restored after
  a restart;
* any backend - ``file``, ``s3``/``fsspec`` (retries, circuit breaker, an outage is misses),
  ``memory`` or a plugin, by name;
* zero copy - pages move straight between storage and the primary tier's mmap
  (:class:`~hicache.integrations.vllm.tier_pool.ChunkPool`);
* KV events (``enable_kv_events``) - stored chunks as vLLM's ``fs`` tier reports them, and
  every chunk the store drops after (evicted, corrupt, gone, another engine's eviction or
  clear) (:mod:`~hicache.integrations.vllm.tier_kv_events`);
* namespaces - model, dtype, chunk geometry, layers, parallel layout and the chunks' byte format
  (KV cache layout, and the attention backend's block format) separate stores that share a root
  (:func:`~hicache.integrations.vllm.tier_keys.tier_namespace`); a configuration whose bytes the
  scheduler cannot know (direct mode in a head-major layout with blocks over 16 tokens, where a
  kernel-block split reorders them; a platform other than NVIDIA GPUs, whose backends pack
  blocks their own ways) is refused at start (:func:`~hicache.integrations.vllm.tier_keys.chunk_format`,
  :func:`~hicache.integrations.vllm.block_format.offload_block_format`).

Every method runs in vLLM's scheduler thread and returns at once: lookups are answered by
vLLM's ``AsyncLookupManager`` thread (RETRY until known), jobs run on the tier's own event loop
(:class:`~hicache.integrations.vllm.tier_runner.TierRunner`) and are polled.

This module imports vLLM; only vLLM imports it (through ``module_path``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager, LookupPhase
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache.errors import ConfigError
from hicache.integrations.vllm.block_format import offload_block_format
from hicache.integrations.vllm.options import close_timeout_in_grace
from hicache.integrations.vllm.tier_chains import PrefixChains
from hicache.integrations.vllm.tier_keys import page_key, tier_namespace
from hicache.integrations.vllm.tier_kv_events import DEFAULT_MAX_HELD_KEYS, DEFAULT_MAX_QUEUED_KEYS, TierKVEvents
from hicache.integrations.vllm.tier_pool import ChunkPool
from hicache.integrations.vllm.tier_runner import CLOSE_DRAIN_TIMEOUT_S, TierRunner
from hicache.storage import AsyncHiCacheStorage, create_async_storage

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["HiCacheTier"]

logger = logging.getLogger("hicache.integrations.vllm.tier")


class _Lookups(AsyncLookupManager):
    """vLLM's batched, per-step existence checks, answered by hicache's ``exists``."""

    def __init__(self, runner: TierRunner, tier_type: str) -> None:
        self._runner = runner
        # keys this tier stored while a lookup of them was in flight (its answer may predate
        # the write): made hits once that answer is in
        self._stored_in_flight: set[OffloadKey] = set()
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._runner.exists([page_key(k) for k in keys])

    def mark_stored(self, keys: Iterable[OffloadKey]) -> None:
        """This tier just stored ``keys``: a remembered miss for one of them is a hit now.

        vLLM keeps a verdict while any request that asked for it is alive, and every later
        request that asks joins it. The request that missed a prompt is the one that computes
        and stores it, and it lives on (decoding): without this, once the primary tier evicts
        the chunks, every request with that prompt is told "miss" while it or a later one runs.
        """
        for key in keys:
            state = self._lookup_state.get(key)
            if state is None:
                continue
            if state.phase is LookupPhase.RESOLVED:
                state.result = True
            elif state.phase is LookupPhase.IN_FLIGHT:
                self._stored_in_flight.add(key)

    def drain_results(self) -> None:
        super().drain_results()
        for key in list(self._stored_in_flight):
            state = self._lookup_state.get(key)
            if state is not None and state.phase is LookupPhase.RESOLVED:
                state.result = True
            if state is None or state.phase is not LookupPhase.IN_FLIGHT:
                self._stored_in_flight.discard(key)


class HiCacheTier(SecondaryTierManager):
    """A vLLM secondary tier over one hicache storage backend (see the module docstring).

    Config keys (besides vLLM's ``type``, ``module_path`` and ``backpressure``):
        backend: hicache backend name - ``file`` (default), ``s3``, ``fsspec``, ``memory`` or
            a plugin's.
        options: that backend's options (``hicache backends`` lists them), e.g. ``root`` and
            ``max_bytes`` for ``file``, ``url`` and ``storage_options`` for ``s3``.
        namespace_salt: a tenant label; engines with different salts never share pages.
        model_revision: the weights' revision, when one model name has several.
        lookup_timeout: seconds one batched existence check may take (then: misses).
        open_timeout: seconds start-up waits for the store to open (then it opens in the
            background; a bad option still fails start-up when the backend says so in time).
        locality: ``LOCAL`` or ``REMOTE`` (vLLM's per-request tier filters use it).
        enable_kv_events: report the chunks this tier stores and the store removes as vLLM KV
            events (as vLLM's ``fs`` tier's option of that name, effective only with vLLM's
            ``--kv-events-config`` enabling KV cache events; see
            :mod:`~hicache.integrations.vllm.tier_kv_events`).
        kv_events_queue_size: stored keys queued between two steps before stores are dropped
            from the events (counted in :attr:`kv_events_dropped`).
        kv_events_held_keys: stored keys remembered to report their removal; past it the oldest
            are forgotten (counted in :attr:`kv_events_forgotten`) and their removals go
            unreported (a store that never evicts would grow the set for the engine's life).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backend: str = "file",
        options: dict[str, Any] | None = None,
        namespace_salt: str | None = None,
        model_revision: str | None = None,
        lookup_timeout: float = 5.0,
        open_timeout: float = 5.0,
        locality: str | None = None,
        enable_kv_events: bool = False,
        kv_events_queue_size: int = DEFAULT_MAX_QUEUED_KEYS,
        kv_events_held_keys: int = DEFAULT_MAX_HELD_KEYS,
        backpressure_detector: BackpressureDetector | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"HiCacheTier has no option(s) {sorted(unknown)}; allowed: backend, options, "
                "namespace_salt, model_revision, lookup_timeout, open_timeout, locality, "
                "enable_kv_events, kv_events_queue_size, kv_events_held_keys, backpressure"
            )
        if not isinstance(enable_kv_events, bool):
            raise ConfigError(f"HiCacheTier: enable_kv_events must be true or false, got {enable_kv_events!r}")
        for name, value in (("kv_events_queue_size", kv_events_queue_size), ("kv_events_held_keys", kv_events_held_keys)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"HiCacheTier: {name} must be a positive integer, got {value!r}")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"HiCacheTier: options must be a mapping of backend options, got {options!r:.80}")
        options = dict(options or {})
        if "namespace" in options:
            raise ConfigError("HiCacheTier: the namespace comes from vLLM's config; use namespace_salt instead")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError as exc:
            raise ConfigError(f"HiCacheTier: locality must be LOCAL or REMOTE, got {locality!r}") from exc
        self.namespace = tier_namespace(
            offloading_spec.config, self.block_size_bytes, block_format=offload_block_format(offloading_spec.config),
            salt=namespace_salt, model_revision=model_revision,
        )
        storage = create_async_storage(backend, None, namespace=self.namespace, **options)
        self._runner = TierRunner(
            storage,
            ChunkPool(primary_kv_view),
            name=f"hicache-vllm-{tier_type}",
            lookup_timeout=lookup_timeout,
            open_timeout=open_timeout,
        )
        self._lookups = _Lookups(self._runner, tier_type)
        self._chains = PrefixChains()
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._store_keys: dict[int, list[OffloadKey]] = {}
        self._events = self._kv_events(enable_kv_events, kv_events_queue_size, kv_events_held_keys)
        logger.info(
            "hicache tier %r: backend %s, namespace %s, %d-byte chunks",
            tier_type, backend, self.namespace.digest, self.block_size_bytes,
        )

    def _kv_events(self, enabled: bool, queue_size: int, held_keys: int) -> TierKVEvents | None:
        """The event queue, when asked for and vLLM publishes KV events (it drains
        ``take_events`` only then: a queue it never drains would only fill)."""
        if not enabled:
            return None
        if not self._offloading_spec.kv_events_config.enable_kv_cache_events:
            logger.warning("enable_kv_events is set on secondary tier %r but KV cache events are disabled "
                           "globally; the tier will not emit events.", self.tier_type)
            return None
        events = TierKVEvents(self.medium, self.locality, queue_size, held_keys)
        events.subscribe(self._runner.storage.tier_changes)
        return events

    @property
    def kv_events_dropped(self) -> int:
        """Stored keys left out of the KV events because vLLM did not take them in time."""
        return self._events.dropped_keys if self._events is not None else 0

    @property
    def kv_events_forgotten(self) -> int:
        """Announced stored keys forgotten (past ``kv_events_held_keys``): their removals go unreported."""
        return self._events.forgotten_keys if self._events is not None else 0

    @property
    def storage(self) -> AsyncHiCacheStorage:
        """The hicache backend (for its ``get_stats()``)."""
        return self._runner.storage

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._chains.record((key,), req_context)
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._chains.record(keys, req_context)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        self._chains.forget(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._store_keys[job_metadata.job_id] = keys
        if self._events is not None:
            self._events.watch(keys)  # before the job runs: a removal meanwhile is seen
        ctx = job_metadata.req_context
        try:
            self._chains.record(keys, ctx)
            parents = [self._chains.parent(k, ctx) for k in keys]
            names = [page_key(k) for k in keys]
            chunks = [int(c) for c in job_metadata.chunk_ids]
            parent_names = [page_key(p) if p is not None else None for p in parents]
        except (ConfigError, TypeError, ValueError) as exc:  # a malformed job fails alone
            self._runner.fail(job_metadata.job_id, False, len(keys), f"{type(exc).__name__}: {exc}")
            return
        self._runner.submit_store(job_metadata.job_id, names, chunks, parent_names)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        try:
            names = [page_key(k) for k in keys]
            chunks = [int(c) for c in job_metadata.chunk_ids]
        except (ConfigError, TypeError, ValueError) as exc:
            self._runner.fail(job_metadata.job_id, True, len(keys), f"{type(exc).__name__}: {exc}")
            return
        self._runner.submit_load(job_metadata.job_id, names, chunks)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for outcome in self._runner.finished():
            successful = None
            if outcome.is_load:
                keys = self._load_keys.pop(outcome.job_id, [])
                failed = [k for k, ok in zip(keys, outcome.ok) if not ok]
                if failed:
                    # a cached HIT for a page that failed to load (gone, corrupt) would make
                    # vLLM promote it again every step
                    self._lookups.mark_miss(failed)
                if not outcome.success:
                    successful = tuple(k for k, ok in zip(keys, outcome.ok) if ok) or None
            else:
                keys = self._store_keys.pop(outcome.job_id, [])
                # only pages this job wrote: one it found stored already may be the very object
                # a failed load marked a miss (a store that keeps an object it cannot prove
                # damaged), and a hit again, every request sharing it would pay that load
                self._lookups.mark_stored(k for k, wrote in zip(keys, outcome.wrote) if wrote)
                if self._events is not None:
                    self._events.stored(keys, outcome.ok)
            results.append(
                JobResult(
                    job_id=outcome.job_id,
                    success=outcome.success,
                    successful_keys=successful,
                    transfer_time=outcome.seconds,
                    transfer_bytes=outcome.nbytes or None,
                )
            )
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take() if self._events is not None else ()

    def has_pending_work(self) -> bool:
        return self._runner.pending() > 0

    def drain_jobs(self) -> None:
        self._runner.drain()

    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
        # inside vLLM's grace: past it the engine core is killed and the chunks of jobs still
        # running are lost without a word; stopping in time logs them
        self._runner.close(close_timeout_in_grace(CLOSE_DRAIN_TIMEOUT_S))
        # after the runner: its lookups are misses now, so vLLM's lookup thread, which this
        # joins, does not wait out lookup_timeout for each lookup queued on a hung store
        self._lookups.shutdown()
