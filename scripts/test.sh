#!/usr/bin/env bash
# Runs the whole test suite in ./.venv (created and filled on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${HICACHE_VENV:-.venv}/bin/python" -m pytest "$@"
