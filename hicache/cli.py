"""The ``hicache`` command line.

Subcommands: ``demo`` (the main job), ``serve`` (the demo server), ``replay`` (trace replay, every
placement policy side by side), ``size`` (hit ratio against tier capacity), ``workload`` (a
generated trace),
``bench`` (storage, s3, copy and eviction benchmarks), ``inspect`` (a store's namespaces and integrity),
``events`` (a cache's KV events, one per line), ``stats`` (a live view of a server's or a store's tiers),
``backends`` (what is installed). ``--json`` prints machine-readable output; otherwise a readable
summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache.bench_args import unwritable_file

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent


def _table(data: dict[str, Any], indent: int = 0) -> str:
    lines: list[str] = []
    width = max((len(str(k)) for k in data), default=0)
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(_table(value, indent + 2))
        else:
            if isinstance(value, float):
                value = f"{value:.4g}"
            lines.append(" " * indent + f"{str(key).ljust(width)}  {value}")
    return "\n".join(lines)


#: batch sequence numbers are 8 bytes on the wire, the top one the publisher's run-id probe
MAX_SEQUENCE = (1 << 63) - 1


def _sequence_number(text: str) -> int:
    """argparse type of ``--from``: a batch sequence number is a non-negative integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < MAX_SEQUENCE:
        raise argparse.ArgumentTypeError(f"a sequence number is 0 to {MAX_SEQUENCE - 1}, got {value}")
    return value


def _run_id(text: str) -> int:
    """argparse type of ``--run-id``: a publisher's run id, 16 hex digits."""
    try:
        value = int(text, 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a run id is 16 hex digits, got {text!r}") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"a run id is 16 hex digits, got {text!r}")
    return value


def _endpoint_arg(text: str) -> str:
    """argparse type of the endpoints ``hicache events`` connects to: ``transport://address``
    (the replay socket connects at the first gap, so a malformed ``--replay`` failed only then,
    mid-stream), and a TCP port must be 1..65535 (ZMQ took a larger one modulo 65536 and
    listened on another port, silently, as the publisher's config check says)."""
    if "://" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZMQ endpoint (transport://address, "
                                         "e.g. tcp://127.0.0.1:5557)")
    if text.startswith("tcp://"):
        port = text.rpartition(":")[2]
        if not (port.isdigit() and 0 < int(port) <= 65535):
            raise argparse.ArgumentTypeError(f"{text!r}: a TCP endpoint's port must be 1..65535")
    return text


def _emit(result: Any, as_json: bool) -> None:
    if as_json or not isinstance(result, dict):
        print(json.dumps(result, indent=2, default=str))
    else:
        print(_table(result))


def _config_arg(p: argparse.ArgumentParser, default: str | None = "configs/default.toml") -> None:
    p.add_argument("--config", "-c", default=default, help="config file (TOML/JSON/YAML); HICACHE__* env vars override")


def _load(path: str | None):
    from hicache.config import load_config

    if path and not Path(path).exists() and (REPO / path).exists():
        path = str(REPO / path)
    return load_config(path)


def _cmd_backends(args: argparse.Namespace) -> Any:
    from hicache.storage.registry import available_backends, backend_options

    out: dict[str, Any] = {}
    for name in available_backends():
        try:
            out[name] = ", ".join(sorted(k for k in backend_options(name) if k != "namespace")) or "-"
        except Exception as exc:  # noqa: BLE001 - report, keep listing
            out[name] = f"unavailable: {exc}"
    return out


class _Failed(Exception):
    """A command that ran to its end and found what it checks failed: its result is printed
    as ever, then ``message`` on stderr, and the process exits with ``status``."""

    def __init__(self, result: Any, status: int, message: str) -> None:
        super().__init__(message)
        self.result, self.status = result, status


def _cmd_demo(args: argparse.Namespace) -> Any:
    from hicache.demo import format_report, run_demo

    report = run_demo(_load(args.config), quick=args.quick, echo=False)
    result = report if args.json else None
    if not args.json:
        print(format_report(report))
    if not report["all_answers_match"]:
        # the demo checks every cached answer against the recompute: like ``replay``, a job
        # running it (scripts/demo.sh in CI) must not pass on wrong KV or failed requests
        failed = len(report.get("failed_requests", []))
        raise _Failed(result, 1, f"not every cached answer equals the no-cache recompute: {report['answers_mismatched']} "
                                 f"differ, {report.get('answers_missing', 0)} missing, {failed} request(s) failed "
                                 f"({report['answers_compared']} answers compared)")
    return result


def _cmd_serve(args: argparse.Namespace) -> Any:
    from hicache.server import serve

    config = _load(args.config)
    server = {name: value for name, value in (("port", args.port), ("shutdown_timeout_s", args.shutdown_timeout))
              if value is not None}
    if server:
        config = config.model_copy(update={"server": config.server.model_copy(update=server)})
    serve(config)
    return None


def _cmd_replay(args: argparse.Namespace) -> Any:
    from hicache.replay.compare import format_comparison, run_comparison

    policies = _policy_names(args.policies) if args.policies is not None else None
    report = run_comparison(_replay_config_path(args.config), args.trace, policies, max_requests=args.limit,
                            progress=not args.no_progress)
    result = report if args.json else None
    if not args.json:
        print(format_comparison(report))
    failed = {name: row["verification_failures"] for name, row in report["policies"].items() if row["verification_failures"]}
    if failed:
        # the replay is the bit-exact check: a job gating on it must not pass on corrupted KV.
        # The count is of tokens (verify_kv's): named pages, one bad page read as 512
        raise _Failed(result, 1, "KV restored from the tiers differed from the KV computed, bit for bit: "
                                 + ", ".join(f"{name} {n} token(s)" for name, n in failed.items()))
    return result


def _policy_names(text: str) -> list[str]:
    """The names ``--policies`` lists: ``"lru, reuse"`` is two names (the space made
    ``' reuse'`` an unknown policy), and a list of none (``""``, ``","``) is an error, not
    every policy replayed as if it had not been given."""
    from hicache.errors import ConfigError
    from hicache.placement import PLACEMENT_POLICIES

    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ConfigError(f"--policies {text!r} names no placement policy; allowed: {sorted(PLACEMENT_POLICIES)}")
    return names


def _replay_config_path(path: str) -> str:
    return str(REPO / path) if not Path(path).exists() and (REPO / path).exists() else path


def _count_arg(text: str, minimum: int = 0) -> int:
    """An argparse type: an integer >= ``minimum`` (a negative count would silently drop
    requests from the end, as a Python slice does)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _positive_arg(text: str) -> int:
    return _count_arg(text, 1)


def _seconds_arg(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (a negative poll waited forever, inf
    and nan reached sleep() as a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _drain_seconds_arg(text: str) -> float:
    """An argparse type for ``serve --shutdown-timeout``: seconds > 0, at most the config
    field's bound (an hour)."""
    value = _seconds_arg(text)
    if value > 3600:
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {text}")
    return value


def _json_object_arg(text: str) -> dict[str, Any]:
    """An argparse type: backend options as a JSON object (JSON nested deeper than the parser's
    stack is refused as not JSON too: argparse would let its ``RecursionError`` through as a
    traceback)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of backend options, got {type(value).__name__}")
    return value


#: file types a plot named so would be expected in, which are not what ``hicache size`` writes
#: (``.svgz`` is gzip-compressed SVG: a viewer gunzips it, and plain text is no gzip)
_NOT_SVG = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".pdf", ".eps", ".bmp", ".tif", ".tiff", ".svgz")


def _svg_path(text: str) -> str | None:
    """An argparse type for ``--plot``: ``''`` is no plot; a raster or PDF name is refused
    rather than filled with SVG text a viewer of that type cannot open, and so is a name the
    plot cannot be written to (a folder, or in one that is missing or not writable): found
    now, not when the plot is written after the whole trace was read and sized."""
    if not text:
        return None
    path = Path(text)
    if path.suffix.lower() in _NOT_SVG:
        raise argparse.ArgumentTypeError(f"{text!r}: the plot is written as SVG; give it a .svg name")
    problem = unwritable_file(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem} for the plot, or --no-plot")
    return text


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file (``hicache size T --plot T`` read
    the trace, then wrote the SVG over it)."""
    try:
        return Path(a).samefile(b)
    except OSError:  # either is missing (or unreadable): not the same file
        return False


def _cmd_size(args: argparse.Namespace) -> Any:
    """Errors exit 2 through :func:`_run` like every command's (they exited 1 with a prefix of
    their own): a trace that is not one is a ``TraceFormatError`` naming the file and line, a
    file that cannot be read an ``OSError`` naming it."""
    from hicache.errors import ConfigError
    from hicache.replay.size_report import format_size_report, size_report

    if args.plot is not None and _same_file(args.plot, args.trace):
        raise ConfigError(f"size: the plot {args.plot!r} is the trace; name another file for it")
    report = size_report(args.trace, plot=args.plot, kv_bytes_per_token=args.kv_bytes_per_token,
                         progress=not args.no_progress)
    if args.json:
        return report
    print(format_size_report(report))
    return None


def _cmd_workload(args: argparse.Namespace) -> Any:
    from hicache.replay.workloads import WORKLOADS, write_trace

    requests = WORKLOADS[args.kind](seed=args.seed)
    write_trace(args.out, requests)
    return {"workload": args.kind, "out": args.out, "requests": len(requests),
            "unique_blocks": len({h for r in requests for h in r.hash_ids})}


def _cmd_bench(args: argparse.Namespace) -> Any:
    scripts = {"storage": "bench_storage.py", "s3": "bench_s3.py", "copy": "bench_copy.py", "evict": "bench_evict.py"}
    script = REPO / "scripts" / scripts[args.what]
    if not script.exists():
        raise SystemExit(f"benchmark script {script} not found (installed without the repo?)")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return None


def _cmd_inspect(args: argparse.Namespace) -> Any:
    from hicache.inspect import inspect_store

    options = args.options or {}
    root = args.root if args.backend == "file" else None
    if args.backend != "file" and args.root:
        options.setdefault("url", args.root)
    return asyncio.run(
        inspect_store(root, backend=args.backend, options=options, verify=args.verify, sample=args.sample, progress=not args.json)
    )


def _cmd_events(args: argparse.Namespace) -> Any:
    import zmq

    from hicache.errors import ConfigError
    from hicache.events.cli import run

    try:
        stats = run(args.url, args.replay, topic=args.topic, start_seq=args.from_seq, start_run_id=args.run_id,
                    as_json=args.json, count=args.count, timeout_s=args.timeout)
    except zmq.ZMQError as exc:
        raise ConfigError(f"events: cannot connect to {args.url!r} / {args.replay!r}: {exc}") from None
    return stats if args.stats else None


def _cmd_stats(args: argparse.Namespace) -> Any:
    from hicache.observability.stats_view import is_url, run_stats

    options = args.options or {}
    if args.backend != "file" and not is_url(args.target):
        options.setdefault("url", args.target)
    code = run_stats(args.target, interval=args.interval, once=args.once, backend=args.backend, options=options)
    if code:
        raise SystemExit(code)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="start the demo server, run a multi-turn chat workload, report hit rates and TTFT")
    _config_arg(p)
    p.add_argument("--quick", action="store_true", help="a shorter workload")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("serve", help="run the demo HTTP server")
    _config_arg(p)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--shutdown-timeout", type=_drain_seconds_arg, default=None, metavar="SECONDS",
                   help="the whole drain on SIGTERM, requests then the cache's close (default: server.shutdown_timeout_s, "
                        "20 s; env HICACHE__SERVER__SHUTDOWN_TIMEOUT_S); keep it under the container's grace period")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the real cache")
    _config_arg(p, default="configs/replay-20pct.toml")
    p.add_argument("--trace", default=None,
                   help="trace file (default: $HICACHE_TRACE, else ../shared/traces/ beside the repository)")
    p.add_argument("--limit", type=_count_arg, default=None, help="replay only the first N requests")
    p.add_argument("--policies", default=None,
                   help="comma-separated placement policies to compare (default: all: lru,reuse,tiered)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("size", help="hit ratio against tier capacity for a Mooncake-format trace (one pass), with a plot")
    p.add_argument("trace", help="trace file (JSON lines: timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--plot", type=_svg_path, default="hicache-size.svg",
                   help="SVG file for the curve (default: hicache-size.svg; '' for none)")
    p.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="write no plot")
    p.add_argument("--kv-bytes-per-token", type=_positive_arg, default=None, help="your model's KV bytes per token: capacities in bytes too")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (shown on a terminal only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_size)

    p = sub.add_parser("workload", help="write a generated trace in the Mooncake format")
    p.add_argument("kind", choices=["agents", "chat"],
                   help="agents: many short agent turns over a few long shared prefixes; chat: conversations "
                   "with think time over long shared system prompts, some opening with a private document")
    p.add_argument("out", help="output file (JSON lines; gzip-compressed when it ends in .gz)")
    p.add_argument("--seed", type=_count_arg, default=0, help="generator seed (>= 0; default: 0)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_workload)

    p = sub.add_parser("bench", help="run a benchmark script (JSON output); extra args go to the script")
    p.add_argument("what", choices=["storage", "s3", "copy", "evict"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("inspect", help="a store's namespaces, pages, bytes and integrity")
    p.add_argument("root", help="the file backend's root folder (or, with --backend, the URL of a store whose "
                   "backend can list its namespaces)")
    p.add_argument("--backend", default="file", help="backend name (default: file)")
    p.add_argument("--options", type=_json_object_arg, default=None, help="backend options as a JSON object")
    p.add_argument("--verify", choices=["none", "sample", "all"], default="sample")
    p.add_argument("--sample", type=_count_arg, default=256, help="pages to verify with --verify sample")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("events", help="print a cache's KV events (vLLM schema over ZMQ), one per line")
    p.add_argument("url", type=_endpoint_arg, help="the publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", type=_endpoint_arg, default=None, help="its replay endpoint (e.g. tcp://127.0.0.1:5558): catch up on gaps")
    p.add_argument("--from", dest="from_seq", type=_sequence_number, default=None,
                   help="replay from this sequence first")
    p.add_argument("--run-id", type=_run_id, default=None,
                   help="the publisher run that --from belongs to (16 hex digits, as the last run printed): "
                        "a restarted publisher is then replayed from 0")
    p.add_argument("--topic", default="")
    p.add_argument("--count", type=_positive_arg, default=None, help="exit after this many events")
    p.add_argument("--timeout", type=_seconds_arg, default=None, help="exit after this many seconds without a batch")
    p.add_argument("--stats", action="store_true", help="print the counters (gaps, replayed, lost) at the end")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.set_defaults(func=_cmd_events)

    p = sub.add_parser("stats", help="a live one-screen view of a server's tiers (URL) or a store's (ROOT)")
    p.add_argument("target", help="a server URL (its /metrics is scraped) or a store root")
    p.add_argument("--interval", type=_seconds_arg, default=2.0, help="seconds between refreshes (default: 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.add_argument("--backend", default="file", help="backend of a store ROOT (default: file)")
    p.add_argument("--options", type=_json_object_arg, default=None, help="backend options as a JSON object")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("backends", help="list installed storage backends and their options")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_backends)
    return parser


#: the exit status of a command whose reader went away (128 + SIGPIPE, as a shell reports it)
_EXIT_PIPE_CLOSED = 141
#: the exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
_EXIT_INTERRUPTED = 130


def _stdout_closed() -> int:
    """The reader of our output went away (``hicache size T | head``): stop quietly, as a
    command killed by SIGPIPE does. It was one 'Broken pipe' error line, or a traceback when
    the report was being printed; stdout goes to devnull so the flush at exit cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return _EXIT_PIPE_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        # Ctrl-C stops a replay, an inspect or a size run: each command's own clean-up has run
        # as the interrupt unwound it (a replay's pages removed, a plot's temp file deleted), so
        # one line says why it ended; it was a traceback through asyncio's and our frames
        print("hicache: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names and print its result; operator errors are one line."""
    from hicache.errors import HiCacheError

    try:
        result = args.func(args)
    except BrokenPipeError:
        raise
    except _Failed as failed:
        if failed.result is not None:
            _emit(failed.result, getattr(args, "json", False))
        print(f"hicache: failed: {failed}", file=sys.stderr)
        return failed.status
    except HiCacheError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or port of the operator's: one line, the trace at debug level
        logging.getLogger("hicache").debug("command failed", exc_info=True)
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        _emit(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
