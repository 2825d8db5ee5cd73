"""Trace replay: drive the real cache stack with a request trace, verify every reused page, and
compare hits with a nested inclusive block LRU of the same capacities.

Entry point: :func:`run_replay` (``scripts/replay.py`` wraps it)."""

from hicache.replay.config import ReplayConfig, load_replay_config
from hicache.replay.driver import OutOfDeviceMemory, RequestOutcome, serve_request
from hicache.replay.reference import reference_lru, unique_blocks
from hicache.replay.runner import arun_replay, replay_requests, run_replay
from hicache.stack import CacheStack, StackConfig, build_stack
from hicache.replay.synthetic import synthetic_kv, verify_kv, write_synthetic_kv
from hicache.replay.trace import TraceRequest, find_trace, load_trace, request_tokens

__all__ = [
    "CacheStack",
    "OutOfDeviceMemory",
    "ReplayConfig",
    "RequestOutcome",
    "StackConfig",
    "TraceRequest",
    "arun_replay",
    "build_stack",
    "find_trace",
    "load_replay_config",
    "load_trace",
    "reference_lru",
    "replay_requests",
    "request_tokens",
    "run_replay",
    "serve_request",
    "synthetic_kv",
    "unique_blocks",
    "verify_kv",
    "write_synthetic_kv",
]
