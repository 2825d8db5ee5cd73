#!/usr/bin/env bash
# The SGLang integration's tests, against the real SGLang code on CPU, in their own virtual
# environment (./.venv-sglang, made on first use and reused later; the main suite never needs it).
#
# SGLang is installed without its dependencies: its full set pins a CUDA torch and GPU kernels.
# What its mem_cache and managers modules import at module level is installed explicitly
# below, under a torch==2.13.0 constraint so that nothing can swap the CPU torch for a CUDA one.
# The GPU-only kernel modules are replaced by test doubles (tests/engines/sglang/sgl_doubles.py),
# in the tests' import setup: conftest.py, and engine_run.py for the engine's own processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
SGLANG_VERSION=${HICACHE_SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${HICACHE_TORCH_VERSION:-2.13.0}
# pure-Python (or CPU-wheel) modules that sglang.srt.mem_cache / sglang.srt.managers import
DEPS=(orjson psutil pybase64 triton pillow starlette msgspec pyzmq ipython apache-tvm-ffi
      transformers dill sentencepiece compressed-tensors gguf
      openai partial_json_parser  # these two: only scripts/bench_radix.py's SGLang hierarchical cache
      uvloop uvicorn fastapi setproctitle einops xgrammar==0.2.7)  # these: SGLang's engine (test_e2e_engine.py)
# a venv left without pip (a first run interrupted while it was made, a python3 without
# its venv package) is made again: every later run failed on it, "No module named pip"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  "$PY" -m venv --clear "$VENV"
fi
VPY="$VENV/bin/python"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==${TORCH_VERSION}" > "$pin"
stamp="$VENV/.hicache-sglang-installed"
want=$( (cat pyproject.toml setup.py hicache/memory/_spancopy.c; echo "$SGLANG_VERSION ${DEPS[*]}") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pipi() { "$VPY" -m pip install -q --disable-pip-version-check -c "$pin" "$@"; }
  pipi "torch==${TORCH_VERSION}"
  pipi -e ".[dev]"
  pipi --no-deps "sglang==${SGLANG_VERSION}"
  pipi "${DEPS[@]}"
  "$VPY" -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"
  echo "$want" > "$stamp"
fi
export HICACHE_ENGINE_TESTS=sglang
exec "$VPY" -m pytest tests/engines/sglang -p no:cacheprovider "$@"
