#!/usr/bin/env bash
# The main job on the embedded default (file backend in ./.hicache): see README.md.
# It runs in the caller's folder, as `hicache demo` does: a config (-c my.toml) and the store
# (./.hicache) are the caller's paths, which a cd to the repository made its own (my.toml was
# "cannot read config file"). Only the set-up runs in the repository.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
(cd "$repo" && bash scripts/bootstrap.sh)
venv="${HICACHE_VENV:-.venv}"
[[ "$venv" == /* ]] || venv="$repo/$venv"  # a relative venv is the repository's, as bootstrap.sh reads it
exec "$venv/bin/hicache" demo "$@"
