"""``hicache size TRACE``: hit ratio against tier capacity, to choose host and storage sizes.

One pass over the trace (:func:`~hicache.replay.sizing.lru_miss_ratio_curve`) gives the LRU
curve; the infinite-cache ceiling and Belady at a few sizes show how much a smarter policy could
add. The report lists capacities in blocks, pages-worth of tokens and as a share of the trace's
unique blocks, and writes the curve as an SVG.
"""

from __future__ import annotations

import os
from typing import Any

from hicache.errors import TraceFormatError
from hicache.replay.bounds import belady, infinite_cache
from hicache.replay.plot import write_svg_plot
from hicache.replay.sizing import lru_miss_ratio_curve
from hicache.replay.trace import BLOCK_TOKENS, block_references, load_trace, progress_bar, shown_name

__all__ = ["format_size_report", "size_report"]

_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


def size_report(
    trace: str | os.PathLike[str],
    *,
    plot: str | os.PathLike[str] | None = None,
    belady_fractions: tuple[float, ...] = (0.01, 0.05, 0.2),
    points: int = 64,
    kv_bytes_per_token: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The sizing table of ``trace`` (Mooncake format); writes the SVG to ``plot`` if given.
    ``kv_bytes_per_token`` adds each capacity in bytes (a model's KV size per token).

    ``progress`` shows bars on stderr when it is a terminal: reading, then the passes over the
    block references (the curve's one, and two per Belady size), which took half a minute
    without a sign on a trace of 100k requests. The references are listed once for all of them."""
    requests = load_trace(trace, progress=progress)
    if not requests:
        raise TraceFormatError(f"{trace}: no requests")
    refs = block_references(requests)
    unique = len(set(refs[0]))
    if not unique:
        raise TraceFormatError(f"{trace}: its requests reference no blocks of {BLOCK_TOKENS} tokens; nothing to size")
    # Belady at each requested fraction of the unique blocks; the blocks that makes and the share
    # of the unique blocks they really are go beside it: on a small trace "1%" is one block, 50%
    # of two, and its figure stood beside LRU's 1% row under that name. The keys stay the
    # fractions asked for, so that reports of different traces line up.
    bel_caps = {f"{f:g}": max(1, int(unique * f)) for f in belady_fractions}
    sizes = sorted(set(bel_caps.values()))
    with progress_bar(progress, leave=False, unit_scale=True, total=len(refs[0]) * (1 + 2 * len(sizes)), desc="sizing", unit="ref") as bar:
        mrc = lru_miss_ratio_curve(requests, references=refs, tick=bar.update)
        by_cap = {cap: round(belady(requests, cap, references=refs, tick=bar.update)["hit_ratio_tokens"], 4)
                  for cap in sizes}
    bel = {key: by_cap[cap] for key, cap in bel_caps.items()}
    bel_rows = [{"fraction": float(key), "blocks": cap, "share_of_unique": round(cap / unique, 4),
                 "hit_tokens": by_cap[cap]} for key, cap in bel_caps.items()]
    ideal = infinite_cache(requests, references=refs)
    rows = []
    caps = sorted({max(1, int(unique * f)) for f in _FRACTIONS})
    for cap, hit in mrc.curve(caps):
        row: dict[str, Any] = {"share_of_unique": round(cap / unique, 4), "blocks": cap, "tokens": cap * BLOCK_TOKENS,
                               "lru_hit_tokens": round(hit, 4), "lru_hit_blocks": round(mrc.hit_ratio(cap, tokens=False), 4)}
        if kv_bytes_per_token:
            row["bytes"] = cap * BLOCK_TOKENS * kv_bytes_per_token
        rows.append(row)
    out: dict[str, Any] = {
        "trace": str(trace),
        "requests": len(requests),
        "block_references": mrc.references,
        "unique_blocks": unique,
        "infinite_cache_hit_tokens": round(ideal["hit_ratio_tokens"], 4),
        "belady_hit_tokens_by_share": bel,
        "belady": bel_rows,
        "lru_curve": rows,
    }
    if plot is not None:
        n = max(2, points)
        grid = sorted({max(1, round(unique ** (i / (n - 1)))) for i in range(n)})
        bel_pts = sorted(by_cap.items())
        write_svg_plot(
            plot,
            {"LRU (one pass, stack distances)": mrc.curve(grid),
             "Belady (offline bound)": bel_pts,
             "infinite cache": [(1, ideal["hit_ratio_tokens"]), (unique, ideal["hit_ratio_tokens"])]},
            title=f"Hit ratio of prompt tokens vs cache size: {os.path.basename(str(trace))}",
            x_label="cache capacity (blocks of 512 tokens, log scale)",
            y_label="hit ratio (tokens)",
            markers=[(cap, f"{cap / unique:.0%}") for cap in sizes],
        )
        out["plot"] = str(plot)
    return out


def _belady_label(row: dict[str, Any]) -> str:
    """``1%: 0.5619``, or with the blocks it really is where that is another share of the
    unique blocks (a small trace: ``1% (1 block = 50%): 0.4000``)."""
    asked, real = f"{row['fraction']:.0%}", f"{row['share_of_unique']:.0%}"
    blocks = f"{row['blocks']} block{'s' if row['blocks'] != 1 else ''}"
    return f"{asked}: {row['hit_tokens']:.4f}" if asked == real else f"{asked} ({blocks} = {real}): {row['hit_tokens']:.4f}"


def format_size_report(report: dict[str, Any]) -> str:
    """The sizing report as text: one line per capacity."""
    lines = [
        f"{shown_name(report['trace'])}: {report['requests']} requests, {report['block_references']} block references, "
        f"{report['unique_blocks']} unique blocks of {BLOCK_TOKENS} tokens",
        f"infinite cache: {report['infinite_cache_hit_tokens']:.4f} of prompt tokens; Belady (offline bound) at "
        + ", ".join(_belady_label(b) for b in report["belady"]),
        f"{'share':>8}{'blocks':>10}{'tokens':>14}{'LRU hit (tokens)':>18}{'LRU hit (blocks)':>18}"
        + (f"{'bytes':>16}" if report["lru_curve"] and "bytes" in report["lru_curve"][0] else ""),
    ]
    for row in report["lru_curve"]:
        line = (f"{row['share_of_unique']:>8.1%}{row['blocks']:>10,}{row['tokens']:>14,}"
                f"{row['lru_hit_tokens']:>18.4f}{row['lru_hit_blocks']:>18.4f}")
        if "bytes" in row:
            line += f"{row['bytes']:>16,}"
        lines.append(line)
    if "plot" in report:
        lines.append(f"plot: {shown_name(report['plot'])}")
    return "\n".join(lines)
