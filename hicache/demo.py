"""The main job: serve a multi-turn chat workload with and without hicache and report the gain.

``run_demo(config)`` starts the demo server in-process on a loopback port (port 0), drives it
over real HTTP with the load generator, and compares three runs of one fixed, seeded workload:

1. **baseline** - the same server, model, scheduler and pool size with the cache replaced by
   :class:`~hicache.engine.recompute.RecomputeCache`: every prompt is prefilled from token 0.
   Its answers are, by construction, the no-cache reference answers.
2. **cached** - hicache as configured (device, host, storage), starting empty: its storage
   namespace gets a salt unique to this run, so pages of earlier runs cannot make it look better.
3. **restart** (when a storage backend is configured) - the cached server is stopped (its
   controller drains write-backs) and a fresh one on the same storage replays every
   conversation's first turn: those prefixes can only come from storage.

It reports hit rates per tier, prefill tokens saved, TTFT p50/mean with and without the cache,
and whether every cached answer equals the no-cache answer (greedy decoding of a seeded model,
so any wrong KV slot, layer or page would change tokens). An answer that is missing because its
request failed is counted apart from one that differs: only the latter could mean wrong KV.

What "equal" can promise: KV made one token at a time (decode) and KV made by a prefill of
many tokens differ in their last bits (different matmul shapes round differently), so cached
and recomputed logits differ by ~1e-5; the model's logit scale keeps every greedy choice of
the demo workloads far wider apart than that (``tests/engine/test_engine_kv_provenance.py``),
so equal tokens are what a correct cache must give, and bit-equal KV is not.

Budget: about a minute on two CPU cores; ``quick`` is a smaller workload (~15 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hicache.errors import ConfigError
from hicache.config.schema import HiCacheConfig
from hicache.server.loadgen import Workload, run_load
from hicache.server.run import running_server

__all__ = ["AnswerCheck", "CachedRuns", "run_cached_phases", "DEMO_DEVICE_TOKENS", "FULL_WORKLOAD", "QUICK_WORKLOAD", "baseline_config", "demo_config", "format_report", "run_demo", "run_demo_async"]

logger = logging.getLogger("hicache.demo")

#: 8 conversations x 4 turns sharing a 1k-token system prompt: ~32 requests of 1.1k-1.4k tokens.
FULL_WORKLOAD = Workload(clients=8, turns=4, system_tokens=1024, user_tokens=64, max_new_tokens=16, seed=0)
#: 4 conversations x 3 turns sharing a 512-token system prompt.
QUICK_WORKLOAD = Workload(clients=4, turns=3, system_tokens=512, user_tokens=48, max_new_tokens=8, seed=0)


def _say(msg: str) -> None:
    print(f"[hicache demo] {msg}", file=sys.stderr, flush=True)


#: Device pool of each preset: about two conversations' worth, so the running requests fit but
#: the history of the others is evicted to host and later turns are served from there too (a
#: pool that holds everything shows one tier only). Never more than the configured pool.
DEMO_DEVICE_TOKENS = {FULL_WORKLOAD: 2688, QUICK_WORKLOAD: 1024}


def _longest_request(w: Workload) -> int:
    return w.system_tokens + w.turns * (w.user_tokens + w.max_new_tokens)


def demo_config(config: HiCacheConfig, workload: Workload, *, salt: str) -> HiCacheConfig:
    """``config`` adapted to an in-process demo.

    - loopback on a free port; every conversation admitted at once (``max_batch`` >= clients);
    - a device pool of :data:`DEMO_DEVICE_TOKENS` (other workloads: twice the longest request),
      capped by the configured size, so history spills to host;
    - a storage namespace salt unique to this run, so no page of an earlier run is reused.
    """
    page = config.device.page_size
    longest = _longest_request(workload)
    if config.device.max_context_len < longest + workload.max_new_tokens:
        raise ConfigError(f"the demo's conversations grow to {longest + workload.max_new_tokens} tokens; "
                          f"device.max_context_len is {config.device.max_context_len}")
    want = DEMO_DEVICE_TOKENS.get(workload, 2 * longest)
    floor = -(-(longest + page) // page) * page  # one request must always fit
    tokens = max(floor, -(-min(config.device.size_tokens, want) // page) * page)
    device = config.device.model_copy(update={"size_tokens": tokens})
    server = config.server.model_copy(update={"host": "127.0.0.1", "port": 0, "max_batch": max(config.server.max_batch, workload.clients)})
    old = config.storage.namespace_salt
    storage = config.storage.model_copy(update={"namespace_salt": f"{old}:{salt}" if old else salt})
    return config.model_copy(update={"device": device, "server": server, "storage": storage})


def baseline_config(config: HiCacheConfig, workload: Workload) -> HiCacheConfig:
    """The baseline runs on the same pool and batch as the cached run: only hicache is taken
    away. (Without prefix sharing every running request holds its own copy of the system
    prompt, so fewer requests fit at once: that memory saving is part of what is compared.)"""
    return config


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def _phase(report: dict[str, Any]) -> dict[str, Any]:
    s = report["summary"]
    return {
        "requests": s["requests"],
        "errors": s["errors"],
        "wall_s": round(report["wall_s"], 3),
        "ttft_p50_ms": _ms(s["ttft_p50_s"]),
        "ttft_mean_ms": _ms(s["ttft_mean_s"]),
        "ttft_p90_ms": _ms(s["ttft_p90_s"]),
        "client_ttft_p50_ms": _ms(s["client_ttft_p50_s"]),
        "prompt_tokens": s["prompt_tokens"],
        "prefill_tokens": s["prefill_tokens"],
        "prefill_tokens_saved": s["cached_tokens"],
        "saved_fraction": round(s["saved_fraction"], 4),
        "hit_tokens": s["hit_tokens"],
        "hit_rate": {k: round(v, 4) for k, v in s["hit_rate"].items()},
        "memory_retries": report.get("memory_retries", 0),
    }


def _answers(report: dict[str, Any]) -> dict[tuple[int, int], list[int]]:
    return {(r["client"], r["turn"]): r["tokens"] for r in report["records"] if r["error"] is None}


def _failures(phase: str, report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The requests of ``phase`` that failed: an answer missing for this reason is a server
    error (for example a device too small for the load), not wrong KV, so the report names it."""
    if report is None:
        return []
    return [{"phase": phase, "client": r["client"], "turn": r["turn"], "error": r["error"]}
            for r in report["records"] if r["error"] is not None]


@dataclass(frozen=True)
class AnswerCheck:
    """How one phase's answers compare with the no-cache ones.

    Why ``missing`` is apart from ``differing``: an answer is missing when its request failed
    (or a later turn of its conversation was never sent), and that is a server error, not
    wrong KV. The demo's totals once counted both as "differed" and a failed request (the
    prompt-token total short by exactly one last-turn prompt) was read as a changed answer.
    """

    compared: int
    differing: int
    missing: int

    def __add__(self, other: AnswerCheck) -> AnswerCheck:
        return AnswerCheck(self.compared + other.compared, self.differing + other.differing,
                           self.missing + other.missing)


def _compare(got: dict[tuple[int, int], list[int]], want: dict[tuple[int, int], list[int]]) -> AnswerCheck:
    """Answers present on both sides that differ, and answers present on one side only."""
    keys = set(got) | set(want)
    both = set(got) & set(want)
    return AnswerCheck(len(keys), sum(1 for k in both if got[k] != want[k]), len(keys) - len(both))


@dataclass(frozen=True)
class CachedRuns:
    """The load reports of the phases that use the cache: ``cached`` (the workload on a fresh
    namespace) and ``restart`` (a fresh server on the same storage replaying every first turn;
    ``None`` without storage). Shared by the demo and ``scripts/demo_stress.py``, so the
    stress runs repeat exactly what the demo checks."""

    cached: dict[str, Any]
    restart: dict[str, Any] | None
    cache_metrics: dict[str, Any]

    def check(self, reference: dict[tuple[int, int], list[int]]) -> AnswerCheck:
        """Every answer against ``reference`` (the no-cache answers by (conversation, turn)):
        the cached run's all, the restart's first turns."""
        check = _compare(_answers(self.cached), reference)
        if self.restart is not None:
            first_turns = {k: v for k, v in reference.items() if k[1] == 0}
            check = check + _compare(_answers(self.restart), first_turns)
        return check

    def failures(self) -> list[dict[str, Any]]:
        """The requests of both phases that failed (see :func:`_failures`)."""
        return _failures("cached", self.cached) + _failures("restart", self.restart)


async def run_cached_phases(cfg: HiCacheConfig, w: Workload, tag: str, *, say: Callable[[str], None] | None = None) -> CachedRuns:
    """Run the cached phase, then (with storage) the restart phase, each on its own server.
    ``say``: an optional progress callback taking one line.

    The pages both phases stored are removed at the end (however the run ends): they are under
    a namespace of this run's own (``cfg``'s salt, :func:`demo_config`), which no later run
    reads, so each run left one more namespace of dead pages in the store."""
    namespace: Any = None
    try:
        async with running_server(cfg, mode="hicache") as srv:
            namespace = getattr(getattr(srv.cache, "storage", None), "namespace", None)
            cached = await run_load(srv.url, w, run_tag=f"{tag}-cached")
            cached["memory_retries"] = srv.state.metrics.memory_retries
            cache_metrics = srv.cache.metrics() if hasattr(srv.cache, "metrics") else {}
        if say:
            say(f"cached done in {cached['wall_s']:.1f} s")
        restart = None
        if cfg.storage.backend is not None:
            if say:
                say("restart: a fresh server on the same storage replays every first turn")
            async with running_server(cfg, mode="hicache") as srv:
                restart = await run_load(srv.url, replace(w, first_turn_only=True, warmup=False), run_tag=f"{tag}-restart")
                restart["memory_retries"] = srv.state.metrics.memory_retries
            if say:
                say(f"restart done in {restart['wall_s']:.1f} s")
    finally:
        if namespace is not None:
            await _remove_run_pages(cfg, namespace)
    return CachedRuns(cached, restart, cache_metrics)


async def _remove_run_pages(cfg: HiCacheConfig, namespace: Any) -> None:
    """Remove the pages of this run's ``namespace`` once its servers are closed (their close
    writes sessions' KV back to storage): a ``file`` store's namespace folder goes whole (its
    ``clear`` only renames the pages aside for a later sweep), another store is cleared. A
    store that cannot be cleared is a warning naming the namespace, never the demo's error."""
    from hicache.stack import stack_config_from
    from hicache.storage import create_async_storage

    backend = cfg.storage.backend
    assert backend is not None
    options = stack_config_from(cfg).storage_options
    try:
        store = create_async_storage(backend, None, namespace=namespace, **options)
        layout = getattr(store, "layout", None)
        if layout is not None:  # file: the folder holds the namespace's pages, ledger and manifest
            await store.aclose()
            await asyncio.to_thread(shutil.rmtree, layout.ns_dir, ignore_errors=True)
            return
        async with store:
            if not await store.clear():
                raise RuntimeError("clear() failed")
    except Exception as exc:  # noqa: BLE001 - the demo's result stands; the leftover is named
        logger.warning("demo: could not remove this run's pages from the %s store (namespace %s): %s",
                       backend, getattr(namespace, "digest", namespace), exc)


async def run_demo_async(config: HiCacheConfig, *, quick: bool = False, workload: Workload | None = None) -> dict[str, Any]:
    """The demo as a coroutine (see the module docstring); returns the report dict."""
    t_start = time.perf_counter()
    w = workload or (QUICK_WORKLOAD if quick else FULL_WORKLOAD)
    salt = f"demo-{uuid.uuid4().hex[:12]}"
    cfg = demo_config(config, w, salt=salt)
    tag = salt

    _say(f"baseline (no cache): {w.clients} conversations x {w.turns} turns, system prompt {w.system_tokens} tokens")
    async with running_server(baseline_config(cfg, w), mode="recompute") as srv:
        base = await run_load(srv.url, w, run_tag=f"{tag}-base")
        base["memory_retries"] = srv.state.metrics.memory_retries
    _say(f"baseline done in {base['wall_s']:.1f} s")

    _say(f"cached (hicache, storage={cfg.storage.backend or 'none'}, fresh namespace {salt})")
    runs = await run_cached_phases(cfg, w, tag, say=_say)
    cached, restart, cache_metrics = runs.cached, runs.restart, runs.cache_metrics
    check = runs.check(_answers(base))

    b, c = _phase(base), _phase(cached)

    def ratio(key: str) -> float | None:
        return round(b[key] / c[key], 2) if b[key] and c[key] else None

    report: dict[str, Any] = {
        "workload": {k: getattr(w, k) for k in ("clients", "turns", "system_tokens", "user_tokens", "max_new_tokens", "seed")},
        "config": {
            "device_tokens": cfg.device.size_tokens,
            "device_tokens_configured": config.device.size_tokens,
            "max_batch": cfg.server.max_batch,
            "page_size": cfg.device.page_size,
            "host": f"ratio {cfg.host.ratio}",
            "storage": cfg.storage.backend or "none",
            "namespace_salt": cfg.storage.namespace_salt,
        },
        "baseline": b,
        "cached": c,
        "restart": _phase(restart) if restart is not None else None,
        "ttft_speedup_p50": ratio("ttft_p50_ms"),
        "ttft_speedup_mean": ratio("ttft_mean_ms"),
        "answers_compared": check.compared,
        "answers_mismatched": check.differing,
        "answers_missing": check.missing,
        "failed_requests": _failures("baseline", base) + runs.failures(),
        "all_answers_match": check.differing == 0 and check.missing == 0 and check.compared > 0
        and not (base["summary"]["errors"] or cached["summary"]["errors"] or (restart and restart["summary"]["errors"])),
        "cache_metrics": cache_metrics,
        "elapsed_s": round(time.perf_counter() - t_start, 2),
    }
    return report


def _verdict_no(r: dict[str, Any]) -> str:
    """Why the answers do not all match: answers that differ (wrong KV would show here) are
    told apart from answers missing because their request failed (named on the lines below)."""
    differ, missing = r["answers_mismatched"], r.get("answers_missing", 0)
    parts = [f"{differ} differ"]
    if missing:
        parts.append(f"{missing} missing: a request failed (see below), so there is no answer to compare")
    return f"NO ({'; '.join(parts)})"


def format_report(r: dict[str, Any]) -> str:
    """A short human-readable summary of a demo report."""
    w, b, c, rs = r["workload"], r["baseline"], r["cached"], r["restart"]
    lines = [
        f"workload: {w['clients']} conversations x {w['turns']} turns, shared system prompt {w['system_tokens']} tokens, "
        f"{w['user_tokens']} user tokens/turn, {w['max_new_tokens']} new tokens/answer",
        f"cache: device {r['config']['device_tokens']} tokens (configured {r['config']['device_tokens_configured']}; "
        f"the demo keeps ~2 conversations on device so history spills to host), host {r['config']['host']}, "
        f"storage {r['config']['storage']}; {r['config']['max_batch']} requests generate at once",
        "",
        f"{'':24}{'no cache':>12}{'hicache':>12}",
        f"{'TTFT p50 (ms)':24}{b['ttft_p50_ms']:>12}{c['ttft_p50_ms']:>12}",
        f"{'TTFT mean (ms)':24}{b['ttft_mean_ms']:>12}{c['ttft_mean_ms']:>12}",
        f"{'prefill tokens':24}{b['prefill_tokens']:>12}{c['prefill_tokens']:>12}",
        f"{'wall time (s)':24}{b['wall_s']:>12}{c['wall_s']:>12}",
        "",
        f"prefill tokens saved: {c['prefill_tokens_saved']} of {c['prompt_tokens']} ({100 * c['saved_fraction']:.1f}%)",
        "hit rate by tier: " + ", ".join(f"{t} {100 * v:.1f}%" for t, v in c["hit_rate"].items()),
        f"TTFT speed-up: p50 x{r['ttft_speedup_p50']}, mean x{r['ttft_speedup_mean']}",
    ]
    if c["memory_retries"]:
        lines.append(
            f"device full: {c['memory_retries']} request starts waited for another request to finish "
            f"(the small demo pool; these waits count in TTFT, in both runs)"
        )
    if rs is not None:
        h = rs["hit_tokens"]
        # device and host hits after a restart are what an earlier first turn brought in: from
        # storage, or recomputed when the store did not outlive the server (``memory``)
        where = ("pages an earlier request had just loaded from storage" if h["storage"] else
                 "nothing came from storage: a store that does not outlive its server holds nothing after a restart")
        lines.append(
            f"after restart (fresh server, same storage): {rs['requests']} first turns, {100 * rs['saved_fraction']:.1f}% of "
            f"prompt tokens cached - storage {h['storage']}, host {h['host']}, device {h['device']} ({where}); "
            f"TTFT p50 {rs['ttft_p50_ms']} ms"
        )
    verdict = "yes" if r["all_answers_match"] else _verdict_no(r)
    lines.append(f"every cached answer equals the no-cache recompute: {verdict} ({r['answers_compared']} answers)")
    for f in r.get("failed_requests", []):
        lines.append(f"  failed ({f['phase']} run, conversation {f['client']} turn {f['turn']}; its answer counts as missing): {f['error']}")
    lines.append(f"elapsed: {r['elapsed_s']} s")
    return "\n".join(lines)


def run_demo(config: HiCacheConfig, *, quick: bool = False, json_out: bool = False, echo: bool = True) -> dict[str, Any]:
    """Run the demo (blocking; not from inside an event loop) and return the report dict.

    With ``echo`` the readable summary goes to stderr (next to the progress lines), so stdout
    carries only machine output: the report as JSON when ``json_out``, else nothing - a caller
    that prints the returned dict itself (the CLI) does not print it twice.
    """
    report = asyncio.run(run_demo_async(config, quick=quick))
    if echo:
        print(format_report(report), file=sys.stderr, flush=True)
    if json_out:
        print(json.dumps(report, indent=2, default=str), flush=True)
    return report
