#!/usr/bin/env python
"""Multi-turn chat load generator for the hicache demo server (prints a JSON report).

    python scripts/loadgen.py --url http://127.0.0.1:8471 --clients 4 --turns 3 --verify client

Importable too: ``from loadgen import run_load, Workload`` with ``scripts/`` on the path. The
implementation lives in :mod:`hicache.server.loadgen` so that ``hicache.demo`` (an installed
package, which cannot import from ``scripts/``) runs the very same code.
"""

from __future__ import annotations

import sys

from hicache.server.loadgen import RequestRecord, Workload, main, run_load, run_load_sync, summarize

__all__ = ["RequestRecord", "Workload", "main", "run_load", "run_load_sync", "summarize"]

if __name__ == "__main__":
    sys.exit(main())
