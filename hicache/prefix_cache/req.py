"""The request object the prefix cache reads and writes.

It carries the fields SGLang's ``Req`` exposes to its caches (and that the session-aware cache
seed saves and restores between turns), so caches written for SGLang's scheduler work on it
unchanged. Fields a cache never touches (sampling, logprobs, ...) are left out on purpose: a
server keeps its own request object and either subclasses this one or copies these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Req", "Session"]


def _empty_indices() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


@dataclasses.dataclass
class Session:
    """The session a request belongs to; ``streaming`` sessions keep their KV between turns."""

    session_id: str
    streaming: bool = False


@dataclasses.dataclass(eq=False)
class Req:
    """One generation request as the prefix cache sees it.

    Lengths are in tokens. ``kv_committed_len`` counts tokens whose KV is computed and valid;
    ``kv_allocated_len`` counts token slots reserved in ``req_to_token`` (at least the committed
    ones, possibly more: a whole last page, speculative tokens).
    """

    rid: str
    origin_input_ids: list[int] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    fill_ids: list[int] = dataclasses.field(default_factory=list)
    session: Session | None = None
    extra_key: str | None = None
    priority: int = 0

    # slot in req_to_token_pool and what the tree handed out
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = dataclasses.field(default_factory=_empty_indices)
    last_node: Any = None
    last_host_node: Any = None
    best_match_node: Any = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    last_matched_prefix_len: int = 0
    logprob_start_len: int = -1
    is_chunked: int = 0
    finished_reason: Any = None

    # hits per tier of the latest match (tokens)
    host_hit_length: int = 0
    storage_hit_length: int = 0
    storage_prior_hash: str | None = None
    #: (ours) the admitted request's RequestAttribution (hits per tier, misses per reason)
    attribution: Any = None
    #: (ours) whoever admits this request awaits the attributor's explain step (the facade)
    explain_misses: bool = False
    #: (ours) admit leaves its request and hit counts in ``pending_counts`` until the caller's
    #: ``count_admitted(req)``: a caller that may still give the request up (no device room
    #: for its new tokens: retried later) counts it once, when it really starts
    defer_counts: bool = False
    pending_counts: Any = None

    # sliding-window attention state (kept for interface parity)
    swa_evicted_seqlen: int = 0
    swa_uuid_for_lock: Any = None

    # mamba state (kept for interface parity)
    mamba_pool_idx: Any = None
    mamba_ping_pong_track_buffer: Any = None
    mamba_next_track_idx: Any = None
    mamba_last_track_seqlen: Any = None
    mamba_branching_seqlen: Any = None

    def __post_init__(self) -> None:
        if not self.fill_ids:
            self.fill_ids = list(self.origin_input_ids) + list(self.output_ids)

    @property
    def namespace(self) -> str | None:
        """Alias of ``extra_key``: the LoRA/tenant namespace of this request's KV."""
        return self.extra_key

    @namespace.setter
    def namespace(self, value: str | None) -> None:
        self.extra_key = value

    @property
    def full_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return list(self.origin_input_ids) + list(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def record_match(self, m: Any) -> None:
        """Keep a :class:`~hicache.prefix_cache.types.MatchResult` in the fields the cache, the
        scheduler and the session cache read later (no lock is taken here)."""
        self.prefix_indices = m.device_indices
        self.last_node = m.last_device_node
        self.last_host_node = m.last_host_node
        self.best_match_node = m.best_match_node
        self.host_hit_length = m.host_hit_length
        self.storage_prior_hash = m.storage_prior_hash
        self.last_matched_prefix_len = m.full_kv_hit_length

    def pop_committed_kv_cache(self) -> int:
        """Committed KV length, as SGLang's ``Req`` reports it when the request finishes."""
        return self.kv_committed_len
