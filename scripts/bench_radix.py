#!/usr/bin/env python3
"""Radix tree hot path: match then insert of each prompt, hicache against SGLang's ``RadixCache``.

The tree runs on the server's event loop for every request, so its cost is loop time. One run
replays the first ``--requests`` prompts of the Mooncake trace (``--trace``, ``$HICACHE_TRACE``
or ``../shared/traces/`` beside the repository) through, on the same token streams:

* ``hicache``: :class:`hicache.prefix_cache.RadixCache` (device tier only), keys from the
  token lists (the tree packs them itself), and ``hicache_prebuilt``: keys packed beforehand
  (``array('I')``, kept by ``RadixKey`` as they are);
* ``hicache_tiers``: :class:`hicache.prefix_cache.HiRadixCache` with a host pool and a
  ``memory`` storage tier attached (write-through: every insert also starts a backup); its
  ``loop_cpu_ms_per_request`` is the loop thread's CPU over the whole replay divided by the
  requests: match+insert *and* the backups and storage writes that run on the loop between
  requests (the timed figures count only match+insert);
* ``sglang``: SGLang's own ``sglang.srt.mem_cache.radix_cache.RadixCache`` when it is
  importable, its ``array('q')`` keys built from the same token lists inside the timed region
  (and ``sglang_prebuilt``: built beforehand, as its server pays it: SGLang's ``Req`` holds
  its tokens in ``array('q')`` already);
* ``sglang_tiers_prebuilt``: SGLang's own hierarchical cache, what a server started with
  ``--enable-hierarchical-cache --hicache-write-policy write_through`` builds (its factory
  ``registry.create_tree_cache``: a ``UnifiedRadixCache`` with its default Rust tree core, an
  ``MHATokenToKVPoolHost`` and a ``HybridCacheController``), with the same ``memory`` store as
  ``hicache_tiers`` attached through SGLang's ``dynamic`` backend (hicache's SGLang adapter).
  Timed: ``match_prefix`` and ``insert`` (which queues the write-through); between requests,
  untimed but counted in its ``loop_cpu_ms_per_request``, what SGLang's scheduler calls after
  a batch and before the next (``flush_pending_backups``, ``check_hicache_events``). On CPU
  two things are supplied in this process only: the host pool's copy op (a CUDA kernel from
  ``sgl_kernel``, imported only on CUDA; here a torch index copy with its semantics) and an
  unpinned host pool (pinning needs CUDA).

Ratios pair like with like (``hicache_vs_sglang``: both convert inside the timed region;
``hicache_prebuilt_vs_sglang_prebuilt``: neither does) plus the harshest mix
(``hicache_vs_sglang_prebuilt``), each as the ratio of medians and per interleaved repeat;
the hierarchical trees against each other in ``hicache_tiers_prebuilt_vs_sglang_tiers_prebuilt``.

Each request is ``match_prefix`` of the page-aligned prompt, then ``insert`` of it with fresh
device slots after the matched part; no eviction. Every implementation must report the same
matched tokens for every request (the script fails otherwise). Methods are interleaved per
repeat on fresh trees; medians are reported. SGLang's hierarchical cache runs its repeats last,
after the 16k prompt (the process it leaves behind slowed whatever ran after it). Then the loop time of one 16k-token prompt
(shares half with a cached prompt, the rest new) is measured on warm trees.

Getting SGLang (never needed by hicache itself), into a venv of your choice (``VENV``)::

    python3.11 -m venv $VENV
    $VENV/bin/pip install torch==2.13.0
    $VENV/bin/pip install -e .   # this repository
    $VENV/bin/pip install --no-deps sglang==0.5.23
    echo torch==2.13.0 > pin.txt
    $VENV/bin/pip install -c pin.txt numpy orjson psutil pybase64 pillow \\
        starlette msgspec pyzmq ipython apache-tvm-ffi transformers torchvision dill requests \\
        pydantic aiohttp tqdm triton torchvision sentencepiece compressed-tensors gguf \\
        openai partial_json_parser
    $VENV/bin/python scripts/bench_radix.py

Without SGLang the ``sglang`` columns are skipped with a message saying so. Example::

    .venv/bin/python scripts/bench_radix.py --requests 2000 --repeats 3 --out radix.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import importlib
import importlib.machinery
import importlib.util
import statistics
import sys
import time
import types
from array import array
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache.bench_args import non_negative_int, output_file, positive_int  # noqa: E402
from hicache.bench_output import emit_report  # noqa: E402
from hicache.controller import ControllerConfig  # noqa: E402
from hicache.prefix_cache import InsertParams, MatchPrefixParams, RadixCache, RadixKey  # noqa: E402
from hicache.prefix_cache.tokens import pack_tokens  # noqa: E402
from hicache.replay.trace import find_trace, load_trace, request_tokens  # noqa: E402
from hicache.stack import StackConfig, build_stack  # noqa: E402

# ---------------------------------------------------------------------- SGLang, if installed


#: Packages SGLang imports while loading that cannot load with the CPU torch here: the
#: registry's torchvision is built against the CUDA torch (its ops fail to register). The radix
#: tree never calls them; for this process only they become inert modules.
_CPU_UNLOADABLE = ("torchvision",)


class _UnusableType(type):
    def __getattr__(cls, name: str) -> Any:  # InterpolationMode.BILINEAR and the like
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Unusable(metaclass=_UnusableType):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a CUDA-built module was used by the radix benchmark")

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable


class _InertFinder:
    """Resolves every module under the :data:`_CPU_UNLOADABLE` packages to an inert one."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in _CPU_UNLOADABLE:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _inert_unloadable() -> None:
    try:  # transformers decides at import which optional packages exist: let it look first
        importlib.import_module("transformers.utils.import_utils")
    except Exception:  # noqa: BLE001
        pass
    broken = []
    for top in _CPU_UNLOADABLE:
        try:
            importlib.import_module(top)  # loadable here (a CPU build): the real one
        except Exception:  # noqa: BLE001 - missing, or built for CUDA
            broken.append(top)
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
    if broken:
        sys.meta_path.insert(0, _InertFinder())


def import_sglang() -> tuple[Any, str | None]:
    """SGLang's radix module and parameter classes, or ``(None, why)``. The radix tree is
    SGLang's own code, unchanged; see :data:`_CPU_UNLOADABLE` for what is made inert."""
    if importlib.util.find_spec("sglang") is None:
        return None, "sglang is not installed"
    try:
        import torch._dynamo  # noqa: F401 - torch settles its optional backends first

        _inert_unloadable()
        import sglang.srt.mem_cache.radix_cache as radix
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams as SInsert
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams as SMatch
    except Exception as exc:  # noqa: BLE001 - any failure means: no SGLang column
        return None, f"{type(exc).__name__}: {exc}"
    return (radix, SInsert, SMatch), None


# ---------------------------------------------------------------------- one pass over the streams


class _Slots:
    """Fresh fake device slots (never freed: the benchmark does not evict)."""

    def __init__(self, total: int) -> None:
        self.all = torch.arange(total, dtype=torch.int64)
        self.at = 0

    def take(self, n: int) -> torch.Tensor:
        out = self.all[self.at : self.at + n]
        self.at += n
        return out


class _NoFree:
    device = torch.device("cpu")

    def free(self, indices: Any) -> None:  # pragma: no cover - no eviction here
        raise AssertionError("the benchmark must not evict")

    def available_size(self) -> int:
        return 0


#: Memory read between two requests of every method, untimed (``--sweep-kib``): it stands in
#: for what a server does between requests (the forward pass, the tiers' copies), which takes
#: the tree's working set out of the CPU caches. ``None``: nothing.
_SWEEP: np.ndarray | None = None


def _between() -> None:
    if _SWEEP is not None:
        _SWEEP.sum()


def _time_match_insert(
    streams: list[list[int]],
    key_of: Callable[[list[int]], Any],
    step: Callable[[Any, Any], int],
    prebuilt_key_of: Callable[[list[int]], Any] | None = None,
) -> tuple[float, list[int], list[float]]:
    """Time ``step(key, slots)`` (one match then insert, returning the matched tokens) per
    stream. Keys are built inside the timed region by ``key_of``, or beforehand by
    ``prebuilt_key_of`` when given (what a server holding packed tokens pays)."""
    slots = _Slots(sum(len(s) for s in streams))
    keys = [prebuilt_key_of(s) for s in streams] if prebuilt_key_of is not None else None
    matched: list[int] = []
    lat: list[float] = []
    clock = time.perf_counter
    for i, tokens in enumerate(streams):
        value = slots.take(len(tokens))
        t0 = clock()
        matched.append(step(keys[i] if keys is not None else key_of(tokens), value))
        lat.append(clock() - t0)
        _between()
    return sum(lat), matched, lat


def run_hicache(streams: list[list[int]], page_size: int, prebuilt: bool = False) -> tuple[float, list[int], list[float]]:
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=_NoFree(), page_size=page_size)

    def step(key: RadixKey, value: Any) -> int:
        m = cache.match_prefix(MatchPrefixParams(key=key))
        cache.insert(InsertParams(key=key, value=value))
        return int(m.device_indices.numel())

    return _time_match_insert(streams, RadixKey, step, (lambda s: RadixKey(pack_tokens(s))) if prebuilt else None)


def run_sglang(sgl: Any, streams: list[list[int]], page_size: int, prebuilt: bool) -> tuple[float, list[int], list[float]]:
    radix, SInsert, SMatch = sgl
    cache = radix.RadixCache.create_simulated(page_size=page_size)

    def key_of(tokens: list[int]) -> Any:
        return radix.RadixKey(array("q", tokens))

    def step(key: Any, value: Any) -> int:
        m = cache.match_prefix(SMatch(key=key))
        cache.insert(SInsert(key=key, value=value))
        return int(m.device_prefix_len)

    return _time_match_insert(streams, key_of, step, key_of if prebuilt else None)


def _tier_stack(streams: list[list[int]], page_size: int, write_policy: str = "write_through") -> Any:
    unique = sum(len(s) for s in streams) // page_size + 16
    cfg = StackConfig(
        page_size=page_size, layer_num=1, head_num=1, head_dim=1, dtype="float16",
        device_pages=unique, host_pages=unique, storage_backend="memory", storage_pages=unique,
        controller=ControllerConfig(write_policy=write_policy), req_slots=2, max_context_len=1 << 17,
    )
    return build_stack(cfg)


#: CPU seconds of the loop's thread over each tiered replay, per method (see :func:`_run_tiers`)
LOOP_CPU: dict[bool, list[float]] = {False: [], True: []}


async def _run_tiers(streams: list[list[int]], page_size: int, prebuilt: bool,
                     write_policy: str) -> tuple[float, list[int], list[float]]:
    """The tiered replay. Besides the timed match+insert it records in :data:`LOOP_CPU` the
    CPU time of the loop's thread from the first request until every copy has landed, less
    the benchmark's own device slot allocation: the backups and storage writes the inserts
    start run on the same loop, between requests, outside the timed region (the storage
    backend's own work runs on its I/O thread)."""
    stack = _tier_stack(streams, page_size, write_policy)
    cache = stack.cache
    keys = [RadixKey(pack_tokens(s)) for s in streams] if prebuilt else None
    matched: list[int] = []
    lat: list[float] = []
    clock = time.perf_counter
    cpu = time.thread_time
    cpu0 = cpu()
    own = 0.0  # the benchmark's own device slot allocation and frees (a server's scheduler work)
    try:
        for i, tokens in enumerate(streams):
            n = len(tokens)
            c0 = cpu()
            value = stack.allocator.alloc(n)
            own += cpu() - c0
            assert value is not None, "device pool too small: the benchmark must not evict"
            t0 = clock()
            key = keys[i] if keys is not None else RadixKey(tokens)
            m = cache.match_prefix(MatchPrefixParams(key=key))
            res = cache.insert(InsertParams(key=key, value=value))
            lat.append(clock() - t0)
            matched.append(int(m.device_indices.numel()))
            if res.prefix_len:
                c0 = cpu()
                stack.allocator.free(value[: res.prefix_len])
                own += cpu() - c0
            await asyncio.sleep(0)  # the controller's backups run between requests
            c0 = cpu()
            _between()
            own += cpu() - c0
        await cache.drain()
        LOOP_CPU[prebuilt].append(cpu() - cpu0 - own)
    finally:
        await stack.aclose()
    return sum(lat), matched, lat


def run_tiers(streams: list[list[int]], page_size: int, prebuilt: bool = False,
              write_policy: str = "write_through") -> tuple[float, list[int], list[float]]:
    return asyncio.run(_run_tiers(streams, page_size, prebuilt, write_policy))


# ---------------------------------------------------------------------- SGLang's hierarchical cache


def _transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                        page_size: int) -> None:
    """CPU stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct`` (a CUDA kernel SGLang's host
    pool imports only on CUDA/HIP): per layer, token rows ``src[src_indices]`` to ``dst[dst_indices]``."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def import_sglang_tiers(page_size: int) -> tuple[Any, str | None]:
    """What :func:`run_sglang_tiers` needs of SGLang, or ``(None, why)``: its server arguments
    published for a hierarchical cache with write-through and the ``memory`` store, its factory,
    pools and parameter classes. Call after :func:`import_sglang`."""
    try:
        import functools
        import json

        import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa
        import sglang.srt.mem_cache.pool_host.mha as mha
        import sglang.srt.mem_cache.radix_cache as radix
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams as SInsert
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams as SMatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
        from sglang.srt.runtime_context import get_context, get_parallel
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # noqa: BLE001 - any failure means: no SGLang tiers column
        return None, f"{type(exc).__name__}: {exc}"
    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = _transfer_kv_direct
    if not getattr(hpa.get_mha_host_pool_cls, "_unpinned", False):
        pinned_cls = hpa.get_mha_host_pool_cls

        def unpinned(info: Any) -> Any:
            return functools.partial(pinned_cls(info), pin_memory=False)

        unpinned._unpinned = True  # type: ignore[attr-defined]
        hpa.get_mha_host_pool_cls = unpinned
    extra = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
             "class_name": "HiCacheSGLangStorage", "hicache_backend": "memory", "hicache_options": {}}
    args = ServerArgs(
        model_path="bench/tiny-model", device="cpu", page_size=page_size, enable_hierarchical_cache=True,
        hicache_write_policy="write_through", hicache_io_backend="direct", hicache_mem_layout="layer_first",
        hicache_ratio=2.0, hicache_size=0, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    get_context().set_server_args(args)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    return types.SimpleNamespace(
        args=args, radix=radix, SInsert=SInsert, SMatch=SMatch, CacheInitParams=CacheInitParams,
        MHATokenToKVPool=MHATokenToKVPool, ReqToTokenPool=ReqToTokenPool, Allocator=PagedTokenToKVPoolAllocator,
        TreeCacheBuildContext=TreeCacheBuildContext, create_tree_cache=create_tree_cache,
    ), None


class _TpWorker:
    """What SGLang's cache factory asks of the TP worker: a hand-off of the layer-done counter
    to the model runner (there is no forward pass here)."""

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


#: CPU seconds of the loop's thread over each SGLang tiered replay (see :func:`run_sglang_tiers`)
SGLANG_LOOP_CPU: list[float] = []


def run_sglang_tiers(sgt: Any, streams: list[list[int]], page_size: int) -> tuple[float, list[int], list[float]]:
    """SGLang's hierarchical cache over the streams, keys prebuilt (``array('q')``, as its
    ``Req`` holds them). The request's KV row (its matched prefix's slots and fresh ones) is
    built between match and insert, outside the timed region and the loop CPU, as
    :func:`_run_tiers` leaves its slot allocation out."""
    ps = page_size
    total = sum(len(s) for s in streams) + ps  # every stream fits: nothing is evicted
    dev = sgt.MHATokenToKVPool(total, ps, torch.float16, 1, 1, 1, "cpu", enable_memory_saver=False,
                               start_layer=0, end_layer=0)
    allocator = sgt.Allocator(total, ps, torch.int64, "cpu", dev, need_sort=False)
    params = sgt.CacheInitParams(disable=False, req_to_token_pool=sgt.ReqToTokenPool(4, 1 << 17, "cpu", False),
                                 token_to_kv_pool_allocator=allocator, page_size=ps)
    cache = sgt.create_tree_cache(sgt.TreeCacheBuildContext(
        server_args=sgt.args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
        enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=_TpWorker(), model_config=None,
        tp_size=1, tp_rank=0, tp_group=None,
    ))
    cc = cache.cache_controller
    keys = [sgt.radix.RadixKey(array("q", s)) for s in streams]
    empty = torch.empty(0, dtype=torch.int64)
    matched: list[int] = []
    lat: list[float] = []
    clock, cpu = time.perf_counter, time.thread_time
    own = 0.0
    cpu0 = cpu()
    try:
        for key in keys:
            t0 = clock()
            m = cache.match_prefix(sgt.SMatch(key=key))
            t1 = clock()
            c0 = cpu()
            hit = int(m.device_prefix_len)
            n = len(key) - hit
            new = allocator.alloc(n) if n else empty
            assert new is not None, "device pool too small: the benchmark must not evict"
            value = torch.cat([cache.path_device_indices(m.last_device_node)[:hit], new]) if hit else new
            own += cpu() - c0
            t2 = clock()
            cache.insert(sgt.SInsert(key=key, value=value, prev_prefix_len=hit))
            lat.append((t1 - t0) + (clock() - t2))
            matched.append(hit)
            cache.flush_pending_backups()  # the scheduler, after a batch's results
            cache.check_hicache_events()  # the scheduler, before the next batch
            c0 = cpu()
            _between()
            own += cpu() - c0
        deadline = clock() + 600
        while cache.ongoing_write_through or cache.ongoing_backup or cc.write_queue or cc.ack_write_queue:
            assert clock() < deadline, "SGLang's write-through or storage backups never completed"
            time.sleep(0.002)  # the storage thread works; the loop checks as a scheduler step would
            cache.check_hicache_events()
        SGLANG_LOOP_CPU.append(cpu() - cpu0 - own)
    finally:
        cache.shutdown()
    return sum(lat), matched, lat


# ---------------------------------------------------------------------- one 16k-token prompt


Step = Callable[[list[int], torch.Tensor], int]


class LongCase:
    """One tree for :func:`long_prompt_ms`: ``step(tokens, slots)`` matches and inserts and
    returns the matched tokens; ``slots(n)`` gives device slots (outside the timed step);
    ``settle()`` runs between the seeding request and the timed one (the tiers' copies land,
    as they do between requests on a server); ``close()`` releases the tree."""

    def __init__(self, step: Step, slots: Callable[[int], torch.Tensor] | None = None,
                 settle: Callable[[], Awaitable[None]] | None = None,
                 close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.step, self.slots, self.settle, self.close = step, slots, settle, close


async def long_prompt_ms(make: Callable[[], LongCase], tokens: int, page_size: int, reps: int) -> dict[str, float]:
    """Loop time of match+insert of a ``tokens``-token prompt whose first half is cached.

    Two samples per repeat, on two trees built alike: ``p50_ms`` with the garbage collector
    run before the tree is built and paused while the step runs (a server's steady state),
    and ``after_gc_p50_ms`` with a full ``gc.collect()`` just before the step (as the earlier
    versions of this script measured). The second includes refaulting the memory that the
    collection handed back: on this sandboxed machine a first touch of a page costs ~16 us,
    so it measures the allocator as much as the tree.
    """
    warm: list[float] = []
    cold: list[float] = []
    for r in range(reps):
        for samples in (warm, cold) if r % 2 == 0 else (cold, warm):
            gc.collect()
            case = make()
            slots = case.slots or (lambda n: torch.arange(n, dtype=torch.int64))
            base = 10_000_000 + r * 4 * tokens
            cached = list(range(base, base + tokens))
            case.step(cached, slots(tokens))
            if case.settle is not None:
                await case.settle()
            prompt = cached[: tokens // 2] + list(range(base + 2 * tokens, base + 2 * tokens + tokens - tokens // 2))
            value = slots(tokens)
            if samples is cold:
                gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                got = case.step(prompt, value)
                samples.append(time.perf_counter() - t0)
            finally:
                gc.enable()
            assert got == tokens // 2 // page_size * page_size, got
            if case.close is not None:
                await case.close()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 4)  # noqa: E731
    return {"p50_ms": ms(warm), "max_ms": round(max(warm) * 1e3, 4),
            "after_gc_p50_ms": ms(cold), "after_gc_max_ms": round(max(cold) * 1e3, 4)}


def hicache_case(page_size: int) -> LongCase:
    cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=_NoFree(), page_size=page_size)

    def step(tokens: list[int], value: torch.Tensor) -> int:
        key = RadixKey(tokens)
        m = cache.match_prefix(MatchPrefixParams(key=key))
        cache.insert(InsertParams(key=key, value=value))
        return int(m.device_indices.numel())

    return LongCase(step)


def sglang_case(sgl: Any, page_size: int) -> LongCase:
    radix, SInsert, SMatch = sgl
    cache = radix.RadixCache.create_simulated(page_size=page_size)

    def step(tokens: list[int], value: torch.Tensor) -> int:
        key = radix.RadixKey(array("q", tokens))
        m = cache.match_prefix(SMatch(key=key))
        cache.insert(SInsert(key=key, value=value))
        return int(m.device_prefix_len)

    return LongCase(step)


def tiers_case(page_size: int, tokens: int, write_policy: str = "write_through") -> LongCase:
    """The hierarchical tree (host pool, ``memory`` storage, write-through); run inside a loop."""
    stack = _tier_stack([[0] * (4 * tokens)], page_size, write_policy)

    def step(toks: list[int], value: torch.Tensor) -> int:
        key = RadixKey(toks)
        m = stack.cache.match_prefix(MatchPrefixParams(key=key))
        stack.cache.insert(InsertParams(key=key, value=value))
        return int(m.device_indices.numel())

    def slots(n: int) -> torch.Tensor:
        got = stack.allocator.alloc(n)
        assert got is not None
        return got

    async def close() -> None:
        await stack.cache.drain()
        await stack.aclose()

    return LongCase(step, slots, stack.cache.drain, close)


# ---------------------------------------------------------------------- main


def summarize(name: str, totals: list[float], lats: list[float], tokens: int) -> dict[str, Any]:
    med = statistics.median(totals)
    s = sorted(lats)
    return {
        "total_s_runs": [round(t, 4) for t in totals],
        "total_s": round(med, 4),
        "mtokens_per_s": round(tokens / med / 1e6, 3),
        "request_p50_ms": round(statistics.median(s) * 1e3, 4),
        "request_p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="trace file (default: $HICACHE_TRACE or ../shared/traces/)")
    p.add_argument("--requests", type=positive_int, default=2000)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of each method; medians reported")
    p.add_argument("--long-tokens", type=positive_int, default=16384)
    p.add_argument("--long-reps", type=positive_int, default=15)
    p.add_argument("--no-tiers", action="store_true", help="skip the hierarchical tree")
    p.add_argument("--no-sglang", action="store_true", help="skip SGLang even if installed")
    p.add_argument("--no-sglang-tiers", action="store_true", help="skip SGLang's hierarchical cache")
    p.add_argument("--torch-threads", type=positive_int, default=1,
                   help="torch intra-op threads (default 1: SGLang's clone of a long slot tensor runs on "
                        "torch's pool, whose threads spin on a shared machine and slow SGLang 3-7x; hicache "
                        "copies slots with numpy either way)")
    p.add_argument("--tiers-write-policy", choices=("write_through", "write_back"), default="write_through",
                   help="the tiered tree's write policy (write_back: no copies during the replay, since "
                        "nothing is evicted: what the tiers' bookkeeping costs without them)")
    p.add_argument("--sweep-kib", type=non_negative_int, default=0,
                   help="read this many KiB of memory between requests, untimed, in every method: the "
                        "cache pressure of a server's work between requests (0: none)")
    p.add_argument("--one-cpu", action="store_true",
                   help="run the whole process, every thread it starts included, on one CPU (Linux): "
                        "what the tiered tree costs without its copy and storage I/O threads running "
                        "on another core while the loop matches and inserts")
    p.add_argument("--out", type=output_file, default=None)
    args = p.parse_args(argv)
    if args.one_cpu:
        if not hasattr(os, "sched_setaffinity"):
            raise SystemExit("--one-cpu needs os.sched_setaffinity (Linux)")
        # threads inherit their creator's affinity: the stacks' threads start later, on it too
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(args.torch_threads)
    global _SWEEP
    _SWEEP = np.ones(args.sweep_kib * 128) if args.sweep_kib > 0 else None  # float64: 8 bytes each
    wp = args.tiers_write_policy
    ps = args.page_size
    reqs = load_trace(find_trace(args.trace), limit=args.requests)
    streams = [t[: len(t) // ps * ps] for t in (request_tokens(r) for r in reqs)]
    total_tokens = sum(len(s) for s in streams)

    sgl, why = (None, "--no-sglang") if args.no_sglang else import_sglang()
    methods: dict[str, Callable[[], tuple[float, list[int], list[float]]]] = {
        "hicache": lambda: run_hicache(streams, ps),
        "hicache_prebuilt": lambda: run_hicache(streams, ps, prebuilt=True),
    }
    if not args.no_tiers:
        methods["hicache_tiers"] = lambda: run_tiers(streams, ps, write_policy=wp)
        methods["hicache_tiers_prebuilt"] = lambda: run_tiers(streams, ps, prebuilt=True, write_policy=wp)
    sgt, sgt_why = None, "no SGLang" if sgl is None else "--no-tiers"
    if sgl is not None:
        methods["sglang"] = lambda: run_sglang(sgl, streams, ps, prebuilt=False)
        methods["sglang_prebuilt"] = lambda: run_sglang(sgl, streams, ps, prebuilt=True)
        if not args.no_tiers and not args.no_sglang_tiers:
            sgt, sgt_why = import_sglang_tiers(ps)
            if sgt is not None:
                methods["sglang_tiers_prebuilt"] = lambda: run_sglang_tiers(sgt, streams, ps)
            else:
                print(f"SGLang's hierarchical cache could not be built ({sgt_why}); its column is skipped.",
                      file=sys.stderr)
    else:
        print(f"SGLang not importable ({why}); its columns are skipped. See this script's docstring "
              "for how to install it.", file=sys.stderr)
    # The inputs (millions of token ids in lists) and SGLang's imports live for the whole run:
    # frozen, as SGLang's servers freeze their start-up objects (its `freeze_gc` API), so that a
    # full collection - triggered wherever allocation happens to cross the threshold - does not
    # walk them inside whichever method's timed region it lands in (measured: 0.7 s in one
    # 0.3 s run of the plain tree). Each method's own objects are still collected as they come.
    gc.collect()
    gc.freeze()

    totals: dict[str, list[float]] = {m: [] for m in methods}
    lats: dict[str, list[float]] = {}
    matched_ref: list[int] | None = None

    def measure(name: str) -> None:
        nonlocal matched_ref
        gc.collect()
        total, matched, lat = methods[name]()
        if matched_ref is None:
            matched_ref = matched
        elif matched != matched_ref:
            bad = next(i for i, (a, b) in enumerate(zip(matched, matched_ref)) if a != b)
            raise SystemExit(f"{name} matched {matched[bad]} tokens of request {bad}, another method {matched_ref[bad]}")
        totals[name].append(total)
        lats[name] = lat

    # SGLang's hierarchical cache runs after everything else (its repeats last, once the other
    # methods and the 16k prompt are measured), not in the rotation: its host pools and
    # controller allocate about 1.4 GB, and the process they leave behind ran every later
    # method 30-50% slower (the plain tree's prebuilt replay 0.096 s after one such run, 0.141 s
    # after two), so whichever methods the rotation put after it paid for it. It still runs in
    # this warm process, as before.
    names = [m for m in methods if m != "sglang_tiers_prebuilt"]
    for rep in range(args.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            measure(name)
    lt, lr = args.long_tokens, args.long_reps
    long: dict[str, Any] = {"hicache": asyncio.run(long_prompt_ms(lambda: hicache_case(ps), lt, ps, lr))}
    if not args.no_tiers:
        long["hicache_tiers"] = asyncio.run(long_prompt_ms(lambda: tiers_case(ps, lt, wp), lt, ps, lr))
    if sgl is not None:
        long["sglang"] = asyncio.run(long_prompt_ms(lambda: sglang_case(sgl, ps), lt, ps, lr))
    if "sglang_tiers_prebuilt" in methods:
        for _ in range(args.repeats):
            measure("sglang_tiers_prebuilt")
    assert matched_ref is not None
    results = {m: summarize(m, totals[m], lats[m], total_tokens) for m in methods}
    for name, prebuilt in (("hicache_tiers", False), ("hicache_tiers_prebuilt", True)):
        if name in results and LOOP_CPU[prebuilt]:
            cpu = LOOP_CPU[prebuilt]
            results[name]["loop_cpu_s_runs"] = [round(c, 3) for c in cpu]
            results[name]["loop_cpu_ms_per_request"] = round(statistics.median(cpu) / len(streams) * 1e3, 4)
    if "sglang_tiers_prebuilt" in results and SGLANG_LOOP_CPU:
        results["sglang_tiers_prebuilt"]["loop_cpu_s_runs"] = [round(c, 3) for c in SGLANG_LOOP_CPU]
        results["sglang_tiers_prebuilt"]["loop_cpu_ms_per_request"] = round(
            statistics.median(SGLANG_LOOP_CPU) / len(streams) * 1e3, 4)

    # (ours, theirs): both build their keys from the token lists inside the timed region (what
    # a server holding lists pays), both with keys built beforehand (what a server holding
    # packed tokens pays: SGLang's Req holds array('q')), and the harshest mix
    pairs = [("hicache", "sglang"), ("hicache_prebuilt", "sglang_prebuilt"), ("hicache", "sglang_prebuilt"),
             ("hicache_tiers", "sglang"), ("hicache_tiers_prebuilt", "sglang_prebuilt"),
             ("hicache_tiers", "sglang_prebuilt"), ("hicache_tiers_prebuilt", "sglang_tiers_prebuilt")]
    ratios: dict[str, Any] = {}
    for ours, theirs in pairs:
        if ours in totals and theirs in totals:
            per_run = sorted(b / a for a, b in zip(totals[ours], totals[theirs]))
            ratios[f"{ours}_vs_{theirs}"] = {
                "of_medians": round(results[theirs]["total_s"] / results[ours]["total_s"], 3),
                "per_run": [round(r, 3) for r in per_run],
                "median_per_run": round(statistics.median(per_run), 3),
            }
    report = {
        "benchmark": "radix match+insert per prompt",
        "requests": len(streams), "page_size": ps, "prompt_tokens": total_tokens,
        "matched_tokens": sum(matched_ref), "repeats": args.repeats, "torch_threads": args.torch_threads,
        "tiers_write_policy": args.tiers_write_policy, "sweep_kib_between_requests": args.sweep_kib,
        "one_cpu": args.one_cpu,
        "sglang": None if sgl is None else "sglang.srt.mem_cache.radix_cache.RadixCache",
        "sglang_skipped": why,
        "sglang_tiers": None if sgt is None else "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache "
                        "(HybridCacheController, MHATokenToKVPoolHost, memory store via its dynamic backend)",
        "sglang_tiers_skipped": sgt_why if sgt is None else None,
        "results": results, "ratios": ratios,
        f"prompt_{args.long_tokens}_match_insert": long,
    }
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
