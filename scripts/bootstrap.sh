#!/usr/bin/env bash
# Creates ./.venv (or reuses it) and installs hicache with everything the tests and the demo need.
# Torch is installed first at a fixed CPU-capable version, because a bare `torch` requirement on
# a machine without torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HICACHE_VENV:-.venv}
# a venv left without pip (a first run interrupted while it was made, a python3 without
# its venv package) is made again: every later run failed on it, "No module named pip"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  "$PY" -m venv --clear "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --disable-pip-version-check "torch==${HICACHE_TORCH_VERSION:-2.13.0}"
fi
stamp="$VENV/.hicache-installed"
want=$(cat pyproject.toml setup.py hicache/memory/_spancopy.c hicache/prefix_cache/_pagehash.c | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import hicache, hicache_backends" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --disable-pip-version-check -e ".[dev]"
  echo "$want" > "$stamp"
fi
