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

from hicache.replay import run_replay  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "replay-20pct.toml"))
    parser.add_argument("--trace", default=None, help="trace file (default: $HICACHE_TRACE or ../shared/traces/)")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--output", default=None, help="also write the JSON result here")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    result = run_replay(args.config, args.trace, max_requests=args.max_requests, progress=not args.no_progress)
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    return 0 if result["verification_failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
