#!/usr/bin/env bash
# The main job on the embedded default (file backend in ./.hicache): see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${HICACHE_VENV:-.venv}/bin/hicache" demo "$@"
