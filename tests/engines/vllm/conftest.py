"""vLLM tests run in ./.venv-vllm (scripts/test_vllm.sh) with the CPU build of vLLM.

The environment is set before anything imports vLLM: vLLM reads these variables once, at
import time, and the engines the end-to-end tests start inherit them.
"""

from __future__ import annotations

import os

import pytest

# A small CPU KV cache (GiB) and no thread pinning: CI has two cores and several engines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vLLM (scripts/test_vllm.sh)")
