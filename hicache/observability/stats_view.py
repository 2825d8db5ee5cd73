"""``hicache stats URL|ROOT``: one screen about a running server's tiers, or a store's.

Given a URL it scrapes the server's ``/metrics`` (every cache and worker the scrape holds,
summed) and shows per tier the hit tokens, bytes read and written (and their rates between two
refreshes), latency percentiles per operation from the histograms, the queue depths, whether the
store answers and its breaker, and the server's requests and TTFT. Given a store root it shows
what :func:`hicache.inspect.inspect_store` finds without verifying pages: namespaces, pages,
bytes, free space against the floor, and writes refused for space.

Why a text screen and not only the dashboard: on a machine without Grafana (a benchmark box, a
CI log, an incident over ssh) one command answers "is the cache working".
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from hicache.observability.scrape import Scrape

__all__ = ["is_url", "render_scrape", "render_store", "run_stats", "scrape_url"]

_TIERS = ("device", "host", "storage")
_OPS = (("exists", "storage"), ("get", "storage"), ("set", "storage"), ("prefetch", "storage"),
        ("backup", "host"), ("backup", "storage"), ("load_back", "host"))
_QUEUES = (("backup", "hicache_backup_queue_depth"), ("storage", "hicache_storage_queue_depth"),
           ("prefetches", "hicache_prefetch_inflight"), ("loads", "hicache_loads_inflight"),
           ("server queue", "hicache_server_queue_depth"), ("active", "hicache_server_active_requests"))
_BREAKER = {0.0: "closed", 1.0: "half open", 2.0: "open"}


def is_url(target: str) -> bool:
    """Whether ``target`` names a server (``http://``, ``https://``) rather than a store root.
    By its scheme alone: a malformed URL (``http://[bad``) is still one, so that its scrape
    reports it in one line; ``urlsplit`` raised its ``ValueError`` here, as a traceback."""
    scheme, sep, _ = target.partition(":")
    return bool(sep) and scheme.lower() in ("http", "https")


def scrape_url(url: str, timeout: float = 5.0) -> str:
    """The text of ``url`` (``/metrics`` is added to a bare server address)."""
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http(s) only, checked above
        return resp.read().decode("utf-8")


def _n(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1 << 30, "Gi"), (1 << 20, "Mi"), (1 << 10, "Ki")):
        if unit == "B" and abs(value) >= scale:
            return f"{value / scale:.1f} {suffix}B"
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.3g}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def render_scrape(scrape: Scrape, source: str, previous: tuple[float, Scrape] | None = None,
                  now: float | None = None) -> str:
    """The screen for one scrape; rates come from ``previous`` ``(time, scrape)`` when given."""
    now = time.monotonic() if now is None else now
    dt = now - previous[0] if previous is not None and now > previous[0] else None

    def rate(name: str, **labels: str) -> str:
        if dt is None or previous is None:
            return "-"
        cur, old = scrape.value(name, **labels), previous[1].value(name, **labels)
        if cur is None or old is None:
            return "-"
        return _n(max(0.0, cur - old) / dt, "B") + "/s"

    lines = [f"hicache stats  {source}  {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    prompt = scrape.value("hicache_prompt_tokens_total")
    hits = scrape.by("hicache_hit_tokens_total", "tier")
    total_hit = sum(hits.values())
    server = scrape.value("hicache_server_requests_total", outcome="ok")
    ttft50 = scrape.quantile(0.5, "hicache_server_ttft_seconds")
    ttft99 = scrape.quantile(0.99, "hicache_server_ttft_seconds")
    lines.append(
        f"requests {_n(scrape.value('hicache_requests_total'))}   prompt tokens {_n(prompt)}   "
        f"hit {100 * total_hit / prompt:.1f}%" if prompt else
        f"requests {_n(scrape.value('hicache_requests_total'))}   prompt tokens {_n(prompt)}   hit -"
    )
    if server is not None:
        lines.append(f"server: ok requests {_n(server)}   TTFT p50 {_ms(ttft50)} ms   p99 {_ms(ttft99)} ms")
    lines.append("")
    lines.append(f"{'tier':<8} {'hit tokens':>12} {'hit %':>7} {'read':>11} {'written':>11} {'read/s':>12} {'write/s':>12}")
    for tier in _TIERS:
        read = scrape.value("hicache_tier_bytes_total", tier=tier, io="read")
        written = scrape.value("hicache_tier_bytes_total", tier=tier, io="written")
        share = f"{100 * hits.get(tier, 0) / prompt:.1f}" if prompt else "-"
        lines.append(
            f"{tier:<8} {_n(hits.get(tier)):>12} {share:>7} {_n(read, 'B'):>11} {_n(written, 'B'):>11} "
            f"{rate('hicache_tier_bytes_total', tier=tier, io='read'):>12} "
            f"{rate('hicache_tier_bytes_total', tier=tier, io='written'):>12}"
        )
    lines.append("")
    lines.append(f"{'op':<10} {'tier':<8} {'count':>9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}")
    for op, tier in _OPS:
        count = scrape.value("hicache_operation_seconds_count", op=op, tier=tier)
        if not count:
            continue
        q = [scrape.quantile(p, "hicache_operation_seconds", op=op, tier=tier) for p in (0.5, 0.9, 0.99)]
        lines.append(f"{op:<10} {tier:<8} {_n(count):>9} {_ms(q[0]):>9} {_ms(q[1]):>9} {_ms(q[2]):>9}")
    lines.append("")
    queues = [f"{label} {_n(scrape.value(name))}" for label, name in _QUEUES if scrape.value(name) is not None]
    lines.append("queues: " + ("   ".join(queues) if queues else "-"))
    up = [s.value for s in scrape.select_live("hicache_storage_up")]
    store = "no storage" if not up else ("up" if min(up) >= 1 else "DOWN")
    breaker = [s.value for s in scrape.select_live("hicache_backend_breaker_state")]
    worst = max(breaker, default=None)
    lines.append(
        f"storage: {store}   breaker {_BREAKER.get(worst, '-') if worst is not None else '-'}   "
        f"trips {_n(scrape.value('hicache_storage_trips_total'))}   "
        f"backend errors {_n(scrape.value('hicache_backend_backend_errors_total'))}   "
        # a store several caches share is each one's whole store: counted once
        f"stored {_n(scrape.once_per('hicache_backend_stored_pages', 'store'))} pages "
        f"({_n(scrape.once_per('hicache_backend_stored_bytes', 'store'), 'B')})   "
        f"evicted {_n(scrape.value('hicache_backend_evicted_pages_total'))}   "
        f"refused for space {_n(scrape.value('hicache_backend_rejected_pages_no_space_total'))}"
    )
    return "\n".join(lines)


def render_store(report: dict[str, Any], source: str) -> str:
    """The screen for a store: :func:`~hicache.inspect.inspect_store`'s report, unverified."""
    lines = [f"hicache stats  {source}  {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"backend {report.get('backend')}   namespaces {len(report['namespaces'])}   "
             f"pages {_n(report['pages'])}   bytes {_n(report['bytes'], 'B')}"]
    if "free_bytes" in report:
        lines.append(
            f"free {_n(report.get('free_bytes'), 'B')} of {_n(report.get('fs_bytes'), 'B')}   "
            f"floor (min_free_bytes) {_n(report.get('min_free_bytes'), 'B')}   "
            f"writes refused for free space {_n(report.get('writes_refused_for_free_space'))}"
        )
    lines.append("")
    lines.append(f"{'namespace':<14} {'model':<24} {'page':>5} {'pages':>9} {'bytes':>11} {'refused':>8}  last refused")
    for digest, ns in report["namespaces"].items():
        if "corrupt_manifest" in ns:  # listed by inspect, never opened: no model, no counts
            lines.append(f"{digest[:12]:<14} corrupt manifest: {ns['corrupt_manifest']}")
            continue
        if "damaged" in ns:  # listed by inspect, never opened: its pages could not be listed
            lines.append(f"{digest[:12]:<14} {str(ns.get('model'))[:24]:<24} damaged: {ns['damaged']}")
            continue
        lines.append(
            f"{digest[:12]:<14} {str(ns.get('model'))[:24]:<24} {ns.get('page_size') or '-':>5} {_n(ns['pages']):>9} "
            f"{_n(ns['bytes'], 'B'):>11} {_n(ns.get('refused_pages_no_space')):>8}  {ns.get('last_refused_at') or '-'}"
        )
    return "\n".join(lines)


def run_stats(target: str, *, interval: float = 2.0, once: bool = False, backend: str = "file",
              options: dict[str, Any] | None = None, out: TextIO | None = None,
              rounds: int | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """Print the screen for ``target`` once, or every ``interval`` seconds until interrupted
    (``rounds`` bounds the loop, for tests). Returns the exit status."""
    out = out or sys.stdout
    if not is_url(target) and backend == "file" and not os.path.isdir(target):
        print(f"hicache stats: {target!r} is neither a store root (no such folder) nor a server URL "
              f"(those start with http:// or https://)", file=sys.stderr)
        return 2
    live = not once and out.isatty()
    previous: tuple[float, Scrape] | None = None
    n = 0
    try:
        while True:
            if is_url(target):
                try:
                    scrape, now = Scrape(scrape_url(target)), time.monotonic()
                except (OSError, ValueError, UnicodeDecodeError) as exc:  # not a metrics page
                    screen = f"hicache stats  {target}: cannot scrape: {exc}"
                    if once:
                        print(screen, file=out)
                        return 1
                else:
                    screen = render_scrape(scrape, target, previous, now)
                    previous = (now, scrape)
            else:
                from hicache.inspect import inspect_store

                report = asyncio.run(inspect_store(target if backend == "file" else None, backend=backend,
                                                   options=options, verify="none", progress=False))
                screen = render_store(report, target)
            print(("\x1b[H\x1b[2J" if live else "") + screen, file=out, flush=True)
            n += 1
            if once or (rounds is not None and n >= rounds):
                return 0
            sleep(interval)
    except KeyboardInterrupt:
        return 0
