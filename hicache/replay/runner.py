"""``run_replay``: drive the real cache stack with a trace and compare with the reference LRU.

Each request is matched, prefetched from storage, loaded back, verified bit for bit against the
synthetic KV, completed ("computed") and inserted; the controller then backs pages up to host
and storage and evicts. With ``drain_between_requests`` every copy finishes before the next
request, so results are deterministic and comparable with the reference LRU, which has no
notion of time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from collections.abc import Sequence
from typing import Any, cast

from collections import Counter

from hicache.config.budget import MemoryNeed, check_memory, system_memory_bytes
from hicache.errors import ConfigError, TraceFormatError
from hicache.keys import Namespace
from hicache.observability.tier_events import ChangeKind, Tier
from hicache.observability.attribution import AttributionTotals
from hicache.replay.config import NO_HOST_TIER, ReplayConfig, load_replay_config
from hicache.replay.driver import serve_request
from hicache.replay.reference import reference_lru, unique_blocks
from hicache.stack import StackConfig, build_stack
from hicache.replay.trace import BLOCK_TOKENS, TraceRequest, find_trace, load_trace, progress_bar, request_tokens

__all__ = ["run_replay", "arun_replay", "replay_inputs", "replay_requests"]

logger = logging.getLogger("hicache.controller")


def run_replay(
    config: ReplayConfig | str | os.PathLike[str] | dict[str, Any] | None = None,
    trace_path: str | os.PathLike[str] | None = None,
    *,
    max_requests: int | None = None,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Replay a trace file (blocking; runs its own event loop). See :func:`arun_replay`;
    ``limit`` is another name for ``max_requests``."""
    return asyncio.run(
        arun_replay(config, trace_path, max_requests=max_requests if max_requests is not None else limit,
                    progress=progress)
    )


async def arun_replay(
    config: ReplayConfig | str | os.PathLike[str] | dict[str, Any] | None = None,
    trace_path: str | os.PathLike[str] | None = None,
    *,
    max_requests: int | None = None,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Replay the first ``max_requests`` (or ``limit``) requests of a trace; returns the result
    dict. ``config``: a path (a ``configs/*.toml`` deployment config), a ``HiCacheConfig``, a
    :class:`ReplayConfig`, a replay-native dict, or ``None`` (1% / 5% / 20% of the trace).
    ``trace_path``: default ``$HICACHE_TRACE`` or ``../shared/traces/`` next to the repo."""
    cfg, requests, basis, path = replay_inputs(config, trace_path, max_requests if max_requests is not None else limit,
                                               progress=progress)
    result = await replay_requests(cfg, requests, progress=progress, basis_unique_blocks=basis)
    result["trace"] = str(path)
    return result


async def _remove_run_pages(stack: Any) -> None:
    """Remove the pages this run wrote to a persistent store (its own namespace, see
    :func:`replay_requests`), after the queued writes have landed; a store that cannot clear
    leaves them, with a warning naming the namespace. A ``file`` store's whole namespace
    folder goes after the close instead (:func:`_remove_run_folder`): a clear first would only
    rename it aside to be deleted in the background."""
    storage = stack.storage
    if storage is None or stack.config.storage_backend in ("memory", "file"):
        return
    await stack.cache.drain()
    if not await storage.clear():
        logger.warning("replay: could not remove this run's pages from %s (namespace %s)",
                       storage.backend_name, stack.config.namespace)


def _remove_run_folder(stack: Any) -> None:
    """This run's namespace folder in a ``file`` store, pages and all (the namespace is the
    run's own, :func:`replay_requests`; the store is closed). The root is the store's own:
    without ``options.root`` it is ``$HICACHE_FILE_ROOT`` or the backend's default, and a
    root read from the options alone left every such run's pages there."""
    config: StackConfig = stack.config
    if config.storage_backend != "file" or config.namespace is None:
        return
    root = getattr(stack.storage, "root", None) or config.storage_options.get("root")
    if root:
        shutil.rmtree(os.path.join(os.fspath(root), config.namespace.digest), ignore_errors=True)


def replay_inputs(
    config: ReplayConfig | str | os.PathLike[str] | dict[str, Any] | None,
    trace_path: str | os.PathLike[str] | None,
    max_requests: int | None = None,
    *,
    progress: bool = False,
) -> tuple[ReplayConfig, list[TraceRequest], int | None, Path]:
    """The config, the requests to replay, the unique blocks capacities are fractions of, and
    the trace's path, from what :func:`arun_replay` takes. ``progress``: the reading's bar, on
    a terminal (as ``hicache size`` shows it: a large trace takes minutes to read)."""
    if config is None:
        cfg = ReplayConfig()
    elif isinstance(config, ReplayConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = ReplayConfig.from_dict(config)
    elif hasattr(config, "model_fields"):  # a hicache.config.HiCacheConfig
        cfg = ReplayConfig.from_hicache_config(config)
    else:
        cfg = load_replay_config(config)
    path = find_trace(trace_path)
    limit = max_requests if max_requests is not None else cfg.max_requests
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConfigError(f"the number of requests to replay must be an integer >= 0, got {limit!r}")
    # tiers of their own size need only the requests replayed: the whole file (all of it in
    # memory, a last line still being written) for a few requests was read to be sliced
    read = None if limit is None or cfg.sized_by_trace() else max(limit, 1)
    everything = load_trace(path, read, progress=progress)
    if not everything:
        raise TraceFormatError(f"{path}: no requests")
    requests = everything[:limit] if limit is not None else everything
    basis = unique_blocks(everything) if cfg.sized_by_trace() else None
    return cfg, requests, basis, path


async def replay_requests(
    cfg: ReplayConfig,
    requests: Sequence[TraceRequest],
    *,
    progress: bool = False,
    basis_unique_blocks: int | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` through a fresh stack sized by ``cfg``. Fractions apply to
    ``basis_unique_blocks`` (default: the unique blocks of ``requests``).

    Every replay starts from an empty store: its pages go to a namespace of their own (one
    per run), removed when the run ends. A persistent store (``file``, S3) shared by the
    policies of one comparison, or by runs before, would otherwise serve one run's pages to
    the next (measured: 0.99 total hit where the infinite cache allows 0.06), and a replay
    must never touch the pages a deployment keeps under its own namespace."""
    cfg.validate()
    unique = unique_blocks(requests)
    basis = basis_unique_blocks if basis_unique_blocks is not None else unique
    caps = cfg.capacity_blocks(basis)
    pages = cfg.capacity_pages(basis)
    if pages["host"] == 0 and pages["storage"] > 0:  # a fraction of this trace that holds no page
        raise ConfigError(NO_HOST_TIER)
    largest = max((r.input_length for r in requests), default=0)
    if pages["device"] * cfg.page_size < largest:
        raise ConfigError(
            f"the device tier holds {pages['device'] * cfg.page_size} tokens but a request needs "
            f"{largest}; give the device tier more room"
        )
    stack_cfg = StackConfig(
        page_size=cfg.page_size,
        layer_num=cfg.layer_num,
        head_num=cfg.head_num,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
        device=cfg.device,
        host_layout=cfg.host_layout,
        device_pages=max(1, pages["device"]),
        host_pages=max(1, pages["host"]),
        storage_backend=cfg.storage_backend if pages["storage"] > 0 else None,
        storage_pages=pages["storage"],
        storage_options=dict(cfg.storage_options),
        eviction_policy=cfg.eviction_policy,
        placement=cfg.placement,
        placement_options=dict(cfg.placement_options),
        req_slots=4,
        max_context_len=max((r.input_length for r in requests), default=1) + BLOCK_TOKENS,
        controller=cfg.controller_config(),
        attribution_ledger_pages=cfg.attribution_ledger_pages,
        explain_misses=cfg.explain_misses,
        # storage on this loop: on the I/O thread a write-back queued mid-eviction landed before
        # the next eviction or not by thread timing, and tiered's figures changed run to run
        # (0.294 to 0.336 on small tiers) where the replay promises the same numbers twice
        storage_thread=False,
        namespace=Namespace(model="hicache-replay", kv_dtype=cfg.dtype, page_size=cfg.page_size,
                            num_layers=cfg.layer_num, num_kv_heads=cfg.head_num, head_dim=cfg.head_dim,
                            layout=cfg.host_layout, salt=f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"),
    )
    _refuse_unbounded_storage(stack_cfg)
    _check_replay_memory(stack_cfg)
    stack = build_stack(stack_cfg)
    await _open_storage(stack)
    storage_removed: Counter[str] = Counter()  # storage pages removed, by reason (deleted, evicted)
    stack.tier_changes.subscribe(lambda c: storage_removed.update({c.reason or "unknown": len(c.keys)}),
                                 wants=frozenset({(ChangeKind.REMOVED, Tier.STORAGE)}))
    totals = {"prompt_tokens": 0, "device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0,
              "computed_tokens": 0, "verification_failures": 0}
    attribution = AttributionTotals()  # hits per tier and misses per reason, over the trace
    bar = progress_bar(True, total=len(requests), desc="replay", unit="req") if progress else None
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            out = await serve_request(stack, request_tokens(req), rid=f"r{i}", verify=cfg.verify,
                                      mem_quota=cfg.load_back_quota_tokens)
            totals["prompt_tokens"] += out.tokens
            totals["device_hit_tokens"] += out.device_hit
            totals["host_hit_tokens"] += out.host_hit
            totals["storage_hit_tokens"] += out.storage_hit
            totals["computed_tokens"] += out.computed
            totals["verification_failures"] += out.verify_failures
            attribution.add(out.attribution)
            if cfg.drain_between_requests:
                await stack.controller.wait_prefetches()
                await stack.cache.drain()
            if bar is not None:
                bar.update(1)
                if i % 64 == 0:
                    hit = totals["prompt_tokens"] - totals["computed_tokens"]
                    bar.set_postfix(hit=f"{hit / max(1, totals['prompt_tokens']):.3f}")
        stack.cache.sanity_check()
    finally:
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - t0
        snap = stack.controller.metrics.snapshot()
        try:
            await _remove_run_pages(stack)
        finally:
            report = await stack.aclose()
            await asyncio.to_thread(_remove_run_folder, stack)  # a big folder: off the loop
    ref = reference_lru(requests, [caps["device"], caps["host"], caps["storage"]])
    hit_tokens = totals["device_hit_tokens"] + totals["host_hit_tokens"] + totals["storage_hit_tokens"]
    counters = cast("dict[str, float]", snap["counters"])  # ControllerMetrics.snapshot's counters
    return {
        "requests": len(requests),
        **totals,
        # verification_failures is 0 when nothing was checked too: say which it is
        "verified": cfg.verify,
        "hit_tokens": hit_tokens,
        "hit_ratio_tokens": hit_tokens / max(1, totals["prompt_tokens"]),
        "bytes": snap["bytes"],
        "pages_moved": snap["pages"],
        "transfer_seconds": snap["seconds"],
        "failures": {k: counters[k] for k in (
            "backup_failures", "load_failures", "storage_write_failures", "storage_read_failures",
            "storage_timeouts", "backup_rejected", "storage_rejected", "worker_errors",
        )},
        "unwritten_on_close": report.unwritten_pages,
        "evicted": _evicted(counters, storage_removed, cfg.page_size, stack_cfg.page_nbytes),
        "placement": {
            **stack.cache.placement.stats(),
            **{k: counters[k] for k in ("victim_write_pages", "victim_writes_skipped_pages",
                                        "victim_write_failed_pages", "host_evicted_tokens")},
        },
        "wall_time_s": round(wall, 3),
        "capacities_blocks": caps,
        "capacities_pages": pages,
        "unique_blocks": unique,
        "capacity_basis_blocks": basis_unique_blocks if basis_unique_blocks is not None else unique,
        "page_size": cfg.page_size,
        "reference_lru": ref,
        "hit_tokens_vs_reference": hit_tokens - ref["hit_tokens"],
        "attribution": attribution.as_dict(),
    }


async def _open_storage(stack: Any) -> None:
    """Open the store before the first request, as the facade does at start: a store that
    cannot open (a ``file`` root that is a file, or cannot be written) otherwise failed every
    call of the replay, each logged with a traceback, and the run ended with exit status 0 and
    a table of misses blamed on the backend. A failed open is the run's error; nothing of the
    stack outlives it."""
    try:
        await stack.controller.open_storage()
    except BaseException:
        try:
            await stack.aclose()
        finally:
            await asyncio.to_thread(_remove_run_folder, stack)
        raise


def _refuse_unbounded_storage(config: StackConfig) -> None:
    """A :class:`ConfigError` for a store sized by the tiers that takes no bound: a store that
    takes ``max_bytes`` gets the tier's capacity from :func:`build_stack`, but an ``s3`` or
    ``fsspec`` store (or a plugin without one) would replay an unbounded tier under a report
    that names the tier's capacity."""
    from hicache.storage.registry import backend_options

    if config.storage_backend is None or not config.storage_pages or "max_bytes" in config.storage_options:
        return
    if "max_bytes" not in backend_options(config.storage_backend):
        raise ConfigError(
            f"storage backend {config.storage_backend!r} takes no max_bytes, so the replay cannot bound it to "
            f"its tier of {config.storage_pages} pages; replay the tier with backend = \"memory\" (or \"file\")")


def _check_replay_memory(config: StackConfig) -> None:
    """A :class:`ConfigError` naming the tier when a pool cannot fit this machine's memory: tier
    capacities of a replay-native config (``device_blocks``, a fraction of ``1e300``, a large
    ``[kv]`` geometry) otherwise reached torch as a ``RuntimeError`` or ``MemoryError`` traceback
    about an impossible allocation (a deployment config is checked by ``stack_config_from``)."""
    needs = [
        MemoryNeed("the device KV pool", "host", f"device tier ({config.device_pages} pages)",
                   config.device_pages * config.page_nbytes),
        MemoryNeed("the host KV pool", "host", f"host tier ({config.host_pages} pages)",
                   config.host_pages * config.page_nbytes),
    ]
    if str(config.device).startswith("cuda"):
        needs[0] = dataclasses.replace(needs[0], where="device")
    check_memory(needs, host_bytes=system_memory_bytes(), device_bytes=None)


def _evicted(counters: dict[str, float], storage_removed: Counter[str], page_size: int,
             page_nbytes: int) -> dict[str, dict[str, Any]]:
    """Pages and bytes each tier let go: device and host evictions (host copies shed for room
    included), storage removals by reason (``deleted``: a placement policy's choice through
    ``batch_delete``; ``evicted``: the backend's own bound)."""
    host_tokens = counters.get("host_evicted_tokens", 0) + counters.get("host_copies_shed_tokens", 0)
    out: dict[str, dict[str, Any]] = {}
    for tier, pages in (("device", counters.get("device_evicted_tokens", 0) // page_size),
                        ("host", host_tokens // page_size), ("storage", sum(storage_removed.values()))):
        out[tier] = {"pages": int(pages), "bytes": int(pages) * page_nbytes}
    out["storage"]["by_reason"] = dict(storage_removed)
    return out
