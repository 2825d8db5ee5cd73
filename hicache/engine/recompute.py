"""``RecomputeCache``: the facade's request API with no reuse at all - the no-cache baseline.

Why a stand-in instead of a flag on ``HiCache``: a baseline must not share a single code path
that could reuse a prefix (a radix match, a session, a storage prefetch). This class owns a
device pool of the same geometry and size and an allocator, hands every request fresh slots and
frees them when the request ends, so every prompt is prefilled from token 0. The engine and the
server run unchanged on top of it, which makes the comparison "same model, same scheduler, same
pool, only hicache removed". The reference recompute (:func:`hicache.engine.runner.reference_generate`)
uses the same forward calls, so baseline answers are the reference answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.config.schema import HiCacheConfig
from hicache.errors import CacheClosedError, ConfigError, OutOfKVSlotsError, quoted
from hicache.memory.allocator import PagedTokenAllocator
from hicache.memory.device import device_for
from hicache.memory.device_pool import MHATokenToKVPool
from hicache.engine.model import kv_dtype_of
from hicache.observability.metrics import InstanceMetrics, exposition_text

__all__ = ["OutOfKVSlotsError", "RecomputeCache", "RecomputeHandle"]

logger = logging.getLogger("hicache.engine")


@dataclass(eq=False)
class RecomputeHandle:
    """Mirrors :class:`hicache.facade.RequestHandle`; ``prefix_len`` is always 0."""

    rid: str
    session_id: str | None
    token_ids: list[int]
    kv_indices: torch.Tensor
    prefix_len: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    _slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64), repr=False)

    async def wait_layer(self, layer: int) -> None:
        """Nothing is ever loaded: every layer is ready."""

    def wait_layer_sync(self, layer: int) -> None:
        """Nothing is ever loaded: every layer is ready."""

    async def wait_loaded(self) -> None:
        """Nothing is ever loaded: every layer is ready."""


class RecomputeCache:
    """A device pool plus allocator behind ``begin/extend/commit/abort``; no prefix reuse."""

    def __init__(self, config: HiCacheConfig) -> None:
        m, d = config.model, config.device
        if m.attention != "mha":  # a ConfigError (a ValueError): the CLI says it in one line
            raise ConfigError(f"model.attention = {m.attention!r}: RecomputeCache models MHA/GQA pools only ('mha')")
        self.config: HiCacheConfig = config
        device = device_for(None if d.device == "auto" else d.device)
        self.device_pool: MHATokenToKVPool = MHATokenToKVPool(
            d.size_tokens, d.page_size, kv_dtype_of(m.kv_dtype), m.num_kv_heads, m.head_dim, m.num_layers, device
        )
        self._alloc = PagedTokenAllocator(d.size_tokens, d.page_size, device)
        self._page = d.page_size
        self._live: dict[int, RecomputeHandle] = {}
        self._closed = False
        self._requests = 0
        self._prefill_tokens = 0
        self._metrics = InstanceMetrics()
        self._metrics.gauge("recompute_device_free_tokens", self._alloc.available_size,
                            "free slots in the baseline's device pool")

    @property
    def metrics_label(self) -> str:
        """The ``cache`` label of this baseline's metric families."""
        return self._metrics.label

    @classmethod
    def from_config(cls, config: HiCacheConfig) -> RecomputeCache:
        return cls(config)

    async def __aenter__(self) -> RecomputeCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Free every slot still held (requests that never committed)."""
        for handle in list(self._live.values()):
            self._free(handle)
        self._closed = True
        await self._metrics.aclose()

    # -- request API (same shapes as HiCache)
    async def begin(self, rid: str, token_ids: list[int], *, session_id: str | None = None) -> RecomputeHandle:
        if self._closed:
            raise CacheClosedError("RecomputeCache is closed")
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("begin() needs at least one token")
        slots = self._grab(len(tokens))
        handle = RecomputeHandle(rid=rid, session_id=session_id, token_ids=tokens, kv_indices=slots[: len(tokens)], _slots=slots)
        self._live[id(handle)] = handle
        self._requests += 1
        self._prefill_tokens += len(tokens)
        return handle

    async def extend(self, handle: RecomputeHandle, new_token_ids: list[int]) -> torch.Tensor:
        self._check_live(handle)
        n_old, n_new = len(handle.token_ids), len(new_token_ids)
        if n_old + n_new > handle._slots.numel():
            more = self._grab(n_old + n_new - handle._slots.numel())
            handle._slots = torch.cat([handle._slots, more])
        handle.token_ids.extend(int(t) for t in new_token_ids)
        handle.kv_indices = handle._slots[: n_old + n_new]
        return handle.kv_indices[n_old:]

    async def commit(self, handle: RecomputeHandle, *, finished: bool = True) -> None:
        """``finished=False`` (a prefill chunk, as in ``CacheLike``): the request goes on and
        keeps its slots (freed, the next request was given them while this one still wrote its
        KV there); nothing is cached either way."""
        if finished:
            self._free(handle)

    def _check_live(self, handle: RecomputeHandle) -> None:
        # slots grabbed for a handle no longer tracked would never be freed (not even by aclose)
        if self._closed:
            raise CacheClosedError("RecomputeCache is closed")
        if self._live.get(id(handle)) is not handle:
            raise ValueError(f"request {quoted(handle.rid)} was already committed or aborted")

    async def abort(self, handle: RecomputeHandle) -> None:
        self._free(handle)

    async def release_session(self, session_id: str) -> None:
        """Sessions keep nothing here: whether one existed cannot be told (``None``)."""

    def metrics(self) -> dict[str, Any]:
        return {
            "mode": "recompute",
            "requests": self._requests,
            "prefill_tokens": self._prefill_tokens,
            "device_free_tokens": self._alloc.available_size(),
        }

    def prometheus_text(self) -> str:
        """The process's Prometheus scrape (see :mod:`hicache.observability.metrics`)."""
        return exposition_text()

    # -- internals
    def _grab(self, tokens: int) -> torch.Tensor:
        want = -(-tokens // self._page) * self._page
        slots = self._alloc.alloc(want)
        if slots is None:
            raise OutOfKVSlotsError(
                f"need {want} KV slots, {self._alloc.available_size()} free of {self._alloc.capacity}"
            )
        return slots

    def _free(self, handle: RecomputeHandle) -> None:
        if self._live.pop(id(handle), None) is not None and handle._slots.numel():
            self._alloc.free(handle._slots)
            handle._slots = handle._slots[:0]
