#!/usr/bin/env python
"""Replay a request trace through the real hicache stack and print the result as JSON.

    python scripts/replay.py --config configs/replay-20pct.toml [--trace PATH] [--max-requests N]
                             [--no-progress] [--output result.json]

The trace is found via --trace, $HICACHE_TRACE, or ../shared/traces/ next to the repository.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.bench_args import non_negative_int  # noqa: E402
from hicache.errors import HiCacheError  # noqa: E402
from hicache.replay import run_replay  # noqa: E402


def _output_path(text: str) -> str:
    """An argparse type for ``--output``: a file that can be written, checked before the run
    (a missing folder was a traceback after the whole trace had been replayed)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file for the result")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {str(path.parent)!r} to write the result in")
    return text


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, or 1 when restored KV differed from the KV computed (the bit-exact check
    failed), or 2 for an operator error (a config, trace or argument that cannot be used),
    reported in one line: a traceback with status 1 read as corrupted KV to a job gating on it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "replay-20pct.toml"))
    parser.add_argument("--trace", default=None, help="trace file (default: $HICACHE_TRACE or ../shared/traces/)")
    parser.add_argument("--max-requests", type=non_negative_int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--output", type=_output_path, default=None, help="also write the JSON result here")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    try:
        result = run_replay(args.config, args.trace, max_requests=args.max_requests, progress=not args.no_progress)
    except (HiCacheError, OSError) as exc:
        print(f"replay.py: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    return 0 if result["verification_failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
