"""Store a prompt's chunks through vLLM's tiering manager in a process of its own.

Usage: python _store_worker.py ROOT TOKENS (comma-separated token ids)
"""

from __future__ import annotations

import sys

from _tiering import Engine, block_keys, nvidia_gpu, tier_config

from hicache.integrations.vllm import block_format

if __name__ == "__main__":
    block_format._platform = nvidia_gpu  # a GPU engine's scheduler side, as conftest.py plays it
    root, tokens = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    with Engine([tier_config(options={"root": root, "min_free_bytes": 0})]) as engine:
        engine.store(block_keys(tokens))
        assert engine.tier.storage.get_stats()["write_ok"] == len(tokens) // 16
