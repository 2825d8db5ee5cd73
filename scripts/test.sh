#!/usr/bin/env bash
# Runs the whole test suite in ./.venv (created and filled on first use), on one pytest worker
# per CPU (at most 4; pytest-xdist): most tests wait on subprocesses, sockets and deadlines, so
# two workers on CI's two cores take about 60% of one worker's time. HICACHE_TEST_WORKERS=0 runs
# the tests in this process (a debugger, -x on the first failure in order); a -n among the
# arguments wins over this default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
workers=${HICACHE_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 )))}
exec "${HICACHE_VENV:-.venv}/bin/python" -m pytest -n "$workers" "$@"
