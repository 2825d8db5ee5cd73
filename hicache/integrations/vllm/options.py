"""The connector's options, read from vLLM's ``kv_connector_extra_config``.

One frozen object for both sides of the connector, so the scheduler process and the worker
processes agree on the store and the namespace. A typo in a key is an error that names the
allowed keys (a silently ignored option would be a cache that never hits).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from hicache.controller.config import ControllerConfig
from hicache.errors import ConfigError
from hicache.options import options_from_dict
from hicache.prefix_cache.policy import eviction_key

__all__ = ["ConnectorOptions", "close_timeout_in_grace"]

_FIXED = {"prefetch_threshold": 0, "prefetch_policy": "wait_complete"}

#: The longest a timeout may be: threads wait on these (plus a few seconds of margin) and a
#: wait past ``threading.TIMEOUT_MAX`` raises OverflowError instead of waiting.
MAX_WAIT_S = threading.TIMEOUT_MAX / 2


def close_timeout_in_grace(close_timeout_s: float) -> float:
    """How long a shutdown in a vLLM process may drain its storage work: ``close_timeout_s``,
    capped below vLLM's shutdown grace (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, after which
    vLLM sends SIGKILL to its worker processes, and to the engine core that its client sent
    SIGTERM): a drain cut by a signal loses the pages silently, a drain that stops in time logs
    what it gave up. A quarter of the grace: closing the store and stopping its loop thread may
    take as long again each (a store that hangs in its close), and the whole close must end
    inside the grace."""
    try:
        from vllm import envs

        grace = float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
    except Exception:  # noqa: BLE001 - no vLLM, or no such setting in this one: no cap
        return close_timeout_s
    return max(0.0, min(close_timeout_s, grace / 4))


@dataclass(frozen=True, kw_only=True)
class ConnectorOptions:
    """What the connector needs beyond vLLM's own config.

    - ``backend``/``backend_options``: the hicache storage backend and its options, exactly as
      :func:`hicache.storage.create_async_storage` takes them (``{"root": ...}`` for ``file``).
    - ``host_pages``: pages of each worker's host pool (L2, hicache's ``HostKVPool``). Every
      saved page goes through it, and pages still there are hits without touching storage.
    - ``eviction_policy``: which host pages go first when the pool is full (``lru``, ``lfu``,
      ``slru``, ``priority``: the radix tree's policies).
    - ``controller``: options of the worker's :class:`~hicache.controller.ControllerConfig`
      (storage queue size, retries, I/O timeout, health probes, ...).
    - ``lookup_wait_s``: how long the scheduler waits inline for storage lookups in one
      scheduler step, all of that step's lookups together (vLLM asks about every waiting
      request each step: a wait per request would stall the step by the queue length), before
      it answers "not yet" and asks again next step (vLLM skips the request meanwhile).
    - ``lookup_timeout_s``: a lookup still pending after this counts as a miss (recompute).
    - ``load_timeout_s``: the longest a forward pass waits for a page read; then the page's
      blocks are reported failed (vLLM fails the request, or recomputes them under
      ``kv_load_failure_policy: recompute``).
    - ``close_timeout_s``: how long shutdown waits for queued writes to reach storage; a
      worker drains for at most a quarter of vLLM's ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
      (closing its store takes the rest; after it vLLM's multiprocess executor kills the
      worker), and logs the pages it gave up.
    - ``namespace_salt``: set it to keep deployments that must not share pages apart.
    - ``recompute_bound``: claim storage hits only while reading a page is no slower than the
      engine recomputing it (the workers time their reads, the scheduler the engine's steps;
      see :mod:`.scheduler_side`); ``False`` claims every hit, however slow the store.
    - ``recompute_tokens_per_s``: the engine's prefill throughput, when it is known; ``None``
      learns it from the steps.
    """

    backend: str = "file"
    backend_options: dict[str, Any] = field(default_factory=dict)
    host_pages: int = 4096
    eviction_policy: str = "lru"
    controller: dict[str, Any] = field(default_factory=dict)
    lookup_wait_s: float = 0.005
    lookup_timeout_s: float = 5.0
    load_timeout_s: float = 30.0
    close_timeout_s: float = 30.0
    namespace_salt: str | None = None
    recompute_bound: bool = True
    recompute_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a backend name, got {self.backend!r}")
        if not isinstance(self.backend_options, dict):
            raise ConfigError(f"backend_options must be a mapping, got {self.backend_options!r}")
        if isinstance(self.host_pages, bool) or not isinstance(self.host_pages, int) or self.host_pages < 1:
            raise ConfigError(f"host_pages must be an integer >= 1, got {self.host_pages!r}")
        for name in ("lookup_wait_s", "lookup_timeout_s", "load_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not 0 <= value <= MAX_WAIT_S):
                raise ConfigError(f"{name} must be a number of seconds from 0 to {MAX_WAIT_S:.0f}, got {value!r}")
        if self.load_timeout_s == 0:
            # no time for any storage read: every page the scheduler claimed would fail its load,
            # and under vLLM's default kv_load_failure_policy ("fail") so would its request
            raise ConfigError("load_timeout_s must be above 0: a storage read given no time fails the load, "
                              "and the request, of every storage hit")
        if not isinstance(self.recompute_bound, bool):
            raise ConfigError(f"recompute_bound must be true or false, got {self.recompute_bound!r}")
        rate = self.recompute_tokens_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not math.isfinite(rate) or rate <= 0):
            raise ConfigError(f"recompute_tokens_per_s must be a positive number, got {rate!r}")
        if self.namespace_salt is not None and not isinstance(self.namespace_salt, str):
            raise ConfigError(f"namespace_salt must be a string, got {self.namespace_salt!r}")
        eviction_key(self.eviction_policy)  # an unknown policy is a ConfigError naming the known ones
        if not isinstance(self.controller, dict):
            raise ConfigError(f"controller must be a mapping, got {self.controller!r}")
        self.controller_config()

    def controller_config(self) -> ControllerConfig:
        """The worker's controller settings: ``controller`` plus what the connector fixes (a
        scheduled load reads every page it was given, and waits for all of them)."""
        fixed = sorted(k for k in _FIXED if k in self.controller)
        if fixed:
            raise ConfigError(f"controller options {fixed} are set by the connector")
        return ControllerConfig.from_dict({**self.controller, **_FIXED})

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        return options_from_dict(cls, dict(extra or {}), "HiCacheConnector")
