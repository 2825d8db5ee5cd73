"""Every placement policy on the same trace and tiers, side by side, with the trace's bounds.

Why one table: a hit rate alone hides what it cost (bytes written to host and storage) and how
far it is from what is possible (the infinite-cache ideal, Belady at the largest tier's
capacity). Each policy runs through a fresh stack with bit-exact verification, exactly as
``run_replay`` does.

Belady is that of one cache of the largest tier's capacity. Tiers that hold different pages
(``tiered`` writes to storage what host lets go; a store's LRU drops a page the device still
hits) can hold more distinct blocks than that, so it bounds them only on the traffic measured
(Mooncake 0.619 at 20% against ``tiered``'s 0.475; at the three tiers' sum it would be 0.641).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from hicache.errors import ConfigError
from hicache.placement import PLACEMENT_POLICIES
from hicache.replay.bounds import belady, infinite_cache
from hicache.replay.config import ReplayConfig
from hicache.replay.reference import unique_blocks
from hicache.replay.runner import replay_inputs, replay_requests
from hicache.replay.trace import TraceRequest, shown_name

__all__ = ["compare_policies", "format_comparison", "run_comparison"]


def run_comparison(
    config: Any = None,
    trace_path: str | os.PathLike[str] | None = None,
    policies: Sequence[str] | None = None,
    *,
    max_requests: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`compare_policies` on a trace file (blocking; runs its own event loop); ``config``
    and ``trace_path`` as :func:`~hicache.replay.runner.arun_replay` takes them."""
    cfg, requests, basis, path = replay_inputs(config, trace_path, max_requests, progress=progress)
    unknown = sorted(set(policies or ()) - set(PLACEMENT_POLICIES))
    if unknown:
        raise ConfigError(f"unknown placement policy {unknown}; allowed: {sorted(PLACEMENT_POLICIES)}")
    report = asyncio.run(compare_policies(cfg, requests, policies, basis_unique_blocks=basis, progress=progress))
    report["trace"] = str(path)
    return report


async def compare_policies(
    cfg: ReplayConfig,
    requests: Sequence[TraceRequest],
    policies: Sequence[str] | None = None,
    *,
    basis_unique_blocks: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Replay ``requests`` once per policy (default: all) and compute the bounds."""
    # each once, in the order given: a name listed twice replayed twice for one row
    names = list(dict.fromkeys(policies)) if policies else list(PLACEMENT_POLICIES)
    rows: dict[str, dict[str, Any]] = {}
    caps: dict[str, int] = {}
    for name in names:
        run_cfg = dataclasses.replace(cfg, placement=name,
                                      placement_options=cfg.placement_options if name == cfg.placement else {})
        result = await replay_requests(run_cfg, requests, progress=progress, basis_unique_blocks=basis_unique_blocks)
        caps = result["capacities_blocks"]
        prompt = max(1, result["prompt_tokens"])
        rows[name] = {
            "device_hit": result["device_hit_tokens"] / prompt,
            "host_hit": result["host_hit_tokens"] / prompt,
            "storage_hit": result["storage_hit_tokens"] / prompt,
            "total_hit": result["hit_ratio_tokens"],
            "prompt_tokens": result["prompt_tokens"],
            "hit_tokens": {t: result[f"{t}_hit_tokens"] for t in ("device", "host", "storage")},
            "host_written_bytes": result["bytes"]["d2h"],
            "storage_written_bytes": result["bytes"]["h2s"],
            "verification_failures": result["verification_failures"],
            "verified": result["verified"],
            "evicted": result["evicted"],
            "storage_deleted_bytes": result["evicted"]["storage"]["bytes"],
            "wall_time_s": result["wall_time_s"],
            "nested_lru_hit": result["reference_lru"]["hit_tokens"] / prompt,
            # why the rest was recomputed: tokens per miss reason (and their share of the prompts)
            "miss_tokens": result["attribution"]["miss_tokens"],
            "miss_share": {r: n / prompt for r, n in result["attribution"]["miss_tokens"].items()},
            "placement": result["placement"],
        }
    base = rows.get("lru")
    for row in rows.values():
        if base and base["storage_written_bytes"]:
            row["storage_written_vs_lru"] = row["storage_written_bytes"] / base["storage_written_bytes"]
    largest = max(caps.values()) if caps else 0
    return {
        "requests": len(requests),
        "unique_blocks": unique_blocks(requests),
        "capacities_blocks": caps,
        "policies": rows,
        "bounds": {
            "infinite_cache": infinite_cache(requests)["hit_ratio_tokens"],
            f"belady_at_{largest}_blocks": belady(requests, largest)["hit_ratio_tokens"],
        },
    }


def format_comparison(report: dict[str, Any]) -> str:
    """The comparison as a text table (token hit ratios, MiB written). "vs lru" is ``-`` where
    there is no ratio: ``lru`` not replayed, or it wrote nothing to storage (was ``nanx``);
    "verify" is ``off`` where nothing was verified (``verify = false``)."""
    cols = ("device", "host", "storage", "total", "host MiB", "storage MiB", "vs lru", "st. del MiB", "verify")
    lines = [
        f"trace {shown_name(report.get('trace', '?'))}",
        f"{report['requests']} requests, {report['unique_blocks']} unique blocks, tiers (blocks): "
        + ", ".join(f"{k} {v}" for k, v in report["capacities_blocks"].items()),
        f"{'policy':<12}" + "".join(f"{c:>12}" for c in cols),
    ]
    for name, r in report["policies"].items():
        vals = (
            f"{r['device_hit']:.4f}", f"{r['host_hit']:.4f}", f"{r['storage_hit']:.4f}", f"{r['total_hit']:.4f}",
            f"{r['host_written_bytes'] / 2**20:.1f}", f"{r['storage_written_bytes'] / 2**20:.1f}",
            f"{r['storage_written_vs_lru']:.2f}x" if "storage_written_vs_lru" in r else "-",
            f"{r['storage_deleted_bytes'] / 2**20:.1f}",
            # "off", not 0, when verify = false: 0 read as "every restored page checked out"
            str(r["verification_failures"]) if r.get("verified", True) else "off",
        )
        lines.append(f"{name:<12}" + "".join(f"{v:>12}" for v in vals))
    any_row = next(iter(report["policies"].values()), None)
    if any_row is not None:
        lines.append(f"{'nested LRU':<12}{'':>36}{any_row['nested_lru_hit']:>12.4f}   (block-level reference)")
    for name, v in report["bounds"].items():
        lines.append(f"{name:<24}{'':>24}{v:>12.4f}   (bound)")
    lines.extend(_format_misses(report["policies"]))
    return "\n".join(lines)


def _format_misses(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Why prompt tokens were not reused, per policy: share of prompt tokens per reason."""
    reasons: list[str] = []
    for r in rows.values():
        reasons += [k for k in r.get("miss_share", {}) if k not in reasons]
    if not reasons:
        return []
    reasons.sort(key=lambda k: -max(r.get("miss_share", {}).get(k, 0.0) for r in rows.values()))
    width = max(12, *(len(k) + 2 for k in reasons))
    lines = ["misses (share of prompt tokens, by reason):",
             f"{'policy':<12}" + "".join(f"{k:>{width}}" for k in reasons)]
    for name, r in rows.items():
        share = r.get("miss_share", {})
        lines.append(f"{name:<12}" + "".join(f"{share.get(k, 0.0):>{width}.4f}" for k in reasons))
    return lines
