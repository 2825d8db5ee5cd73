"""The deployment configuration: every field, its default, and what values are allowed.

One :class:`HiCacheConfig` describes a whole embedded cache: the model's KV geometry, the device
pool, the host pool, the storage backend, the prefix cache and controller policies, streaming
sessions, and the demo server. Files in ``configs/`` are instances of it (TOML, JSON or YAML).

Unknown keys are errors (a typo must not silently fall back to a default), and messages name
the field and the allowed values. Environment variables override any field, see
:mod:`hicache.config.loader`.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "EventsConfig",
    "ExtraPoolConfig",
    "HiCacheConfig",
    "HostConfig",
    "ModelConfig",
    "PrefetchConfig",
    "ServerConfig",
    "SessionConfig",
    "StorageConfig",
    "TracingConfig",
    "UNNAMED_MODEL",
    "storage_backend_name",
]


def union_args(annotation: Any) -> tuple[Any, ...]:
    """The types a field annotation admits: a union's members (``int | None``), or itself;
    ``Annotated`` members unwrapped to their type."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return tuple(typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args)


def _numeric_only(annotation: Any) -> bool:
    """Whether a field takes numbers and not booleans (``int``, ``float``, optional ones)."""
    args = union_args(annotation)
    return bool(set(args) & {int, float}) and bool not in args


class _Section(BaseModel):
    # inf and nan are never a size or a time: they reach int() and torch as OverflowError
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """``true`` is not a number here: pydantic's lax mode made ``max_requests = true`` 1 and
        ``port = false`` 0 (a random port), silently."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), bool) and _numeric_only(field.annotation):
                    raise ValueError(f"{name} must be a number, got {str(data[name]).lower()}")
        return data


def _not_bool(value: Any) -> Any:
    """``true`` is no dimension: lax mode read ``[true, 64]`` as ``[1, 64]`` (a pool of the wrong
    size, silently); the sections' own check sees only their top-level fields."""
    if isinstance(value, bool):
        raise ValueError(f"a dimension must be a number, got {str(value).lower()}")
    return value


#: one dimension of a state shape
_Dim = Annotated[int, BeforeValidator(_not_bool), Field(gt=0, le=1 << 31)]


#: ``model.name`` of a config that names no model: no model's id (it cannot be a hub id), so
#: that no real model's pages ever share its namespace. A cache whose store outlives the process
#: refuses it (:func:`hicache.stack.require_model_name`)
UNNAMED_MODEL = "(unnamed)"


class ModelConfig(_Section):
    """KV geometry of the served model; it decides the pools' shapes and the storage namespace."""

    name: str = Field(UNNAMED_MODEL, description="Model id; part of the storage namespace. Required with any storage "
                      "backend but a private 'memory' one (no store_id): unnamed models of one geometry would read "
                      "each other's KV.")
    revision: str | None = Field(None, description="Model revision; part of the namespace.")
    attention: Literal["mha", "mla"] = Field("mha", description="MHA/GQA keeps K and V; MLA one latent.")
    num_layers: int = Field(4, gt=0, description="Transformer layers (one KV buffer each).")
    num_kv_heads: int = Field(2, gt=0, description="KV heads per layer (MHA/GQA).")
    head_dim: int = Field(32, gt=0, description="Dimension of one head (MHA/GQA).")
    kv_lora_rank: int = Field(64, gt=0, description="MLA latent rank.")
    qk_rope_head_dim: int = Field(16, gt=0, description="MLA rope dimension.")
    kv_dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"] = Field(
        "float32", description="Dtype of the KV pools; part of the namespace."
    )


class DeviceConfig(_Section):
    """The L1 pool: KV slots on the accelerator (or on the CPU when there is none)."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks CUDA when present.")
    size_tokens: int = Field(16384, gt=0, description="KV slots in the device pool.")
    page_size: int = Field(16, gt=0, description="Tokens per page, on every tier.")
    max_requests: int = Field(64, gt=0, description="Request slots (req_to_token rows).")
    max_context_len: int = Field(8192, gt=0, description="Longest sequence a request slot holds.")

    @model_validator(mode="after")
    def _pages_fit(self) -> DeviceConfig:
        if self.size_tokens % self.page_size:
            raise ValueError(
                f"device.size_tokens ({self.size_tokens}) must be a multiple of device.page_size ({self.page_size})"
            )
        if self.max_context_len % self.page_size:
            # a request's row holds whole pages: the last page of a request near the limit
            # would not fit in a row of this width
            raise ValueError(
                f"device.max_context_len ({self.max_context_len}) must be a multiple of device.page_size "
                f"({self.page_size})"
            )
        return self


class HostConfig(_Section):
    """The L2 pool in host memory (pinned when CUDA is present)."""

    enabled: bool = Field(True, description="Keep an L2 host tier (required: every page moves through it).")
    size_bytes: int | None = Field(None, gt=0, description="Host pool size in bytes (wins over ratio).")
    ratio: float = Field(4.0, gt=0, description="Host pool size as a multiple of the device pool.")
    layout: Literal["layer_first", "page_first", "page_first_direct"] = Field(
        "page_first", description="Host memory layout; page_first lets storage I/O skip copies."
    )
    pin_memory: bool | None = Field(None, description="Pin host memory; default: when CUDA is present.")

    @model_validator(mode="after")
    def _required(self) -> HostConfig:
        if not self.enabled:  # it was ignored: the pool was still made, and its size not checked
            raise ValueError("enabled = false is not supported: every page moves between device and storage "
                             "through the host pool; make it small with size_bytes instead")
        return self


def storage_backend_name(value: Any) -> Any:
    """A ``storage.backend`` value as every reader takes it: ``"none"`` and ``""`` are how TOML
    and the environment, which have no null, say "no storage tier", and both become ``None``,
    so every reader asks one question (``is None``); anything else is returned as it is."""
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    return value


class StorageConfig(_Section):
    """The L3 backend, found by name through the ``hicache.backends`` entry points."""

    backend: str | None = Field(
        "file", description='Backend name (file, s3, fsspec, memory, or a plugin); null, "none" or "" disables L3.'
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the backend.")
    namespace_salt: str | None = Field(None, description="Tenant/LoRA salt: pages never mix across salts.")

    @field_validator("backend", mode="before")
    @classmethod
    def _no_backend_spelt(cls, value: Any) -> Any:
        return storage_backend_name(value)


class PrefetchConfig(_Section):
    """Storage -> host prefetch when a request arrives."""

    policy: Literal["best_effort", "wait_complete", "timeout"] = Field("timeout")
    threshold_tokens: int = Field(256, ge=0, description="Skip prefetches shorter than this.")
    timeout_base_s: float = Field(2.0, ge=0)
    timeout_per_ki_token_s: float = Field(0.1, ge=0)
    timeout_max_s: float = Field(30.0, gt=0)
    max_inflight_pages: int = Field(4096, gt=0, description="Rate limit on pages being fetched.")
    recompute_tokens_per_s: float | None = Field(
        None, gt=0,
        description="The engine's prefill throughput: under the timeout policy a request stops waiting once its "
        "missing pages would be recomputed sooner than fetched (null: learned from the engine's reported prefills).",
    )


class CacheConfig(_Section):
    """Prefix cache and controller policies."""

    eviction_policy: Literal["lru", "lfu", "slru", "priority"] = Field("lru")
    placement: Literal["lru", "reuse", "tiered"] = Field(
        "lru", description="Host eviction and storage admission (hicache.placement): lru writes every page to every tier."
    )
    placement_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the placement policy (reuse: ghost_pages, reuse_hits; tiered: also "
        "long_prompt_tokens, tail_tokens, storage_eviction, storage_capacity_pages); an unknown one is an error naming these."
    )
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field("write_through")
    write_through_threshold: int = Field(2, gt=0, description="Hits before write_through_selective backs up.")
    load_back_quota_tokens: int | None = Field(None, gt=0, description="Most tokens loaded back per request.")
    backup_batch_pages: int = Field(64, gt=0, description="Pages per host->storage batch.")
    queue_size: int = Field(1024, gt=0, description="Bound of every controller queue (backpressure).")
    backup_retries: int = Field(3, ge=0)
    close_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="How long closing the cache waits for queued writes to reach storage; "
                                         "what is left is in the close report. The server caps it to fit its drain.")
    prefetch: PrefetchConfig = Field(default_factory=PrefetchConfig)
    explain_misses: bool = Field(
        False, description="Explain mode of the miss attribution: probe other namespaces of the store (one page, "
        "at most 8 namespaces) for a page never stored here; also on while logger hicache.attribution is at DEBUG."
    )
    attribution_ledger_pages: int | None = Field(
        None, ge=0, description="Pages whose last loss the miss attribution remembers (about 100 bytes each besides its key); "
        "null: twice the pages the tiers hold (16k-256k). A miss on a page forgotten since is counted 'unknown'."
    )


class SessionConfig(_Section):
    """Streaming sessions: a conversation's KV stays on device between turns.

    A released, idle or pressured session gives its KV to the prefix tree, which writes it back
    to host (and storage) before the device pages are reused, so a later turn resumes from a
    lower tier instead of recomputing."""

    enabled: bool = Field(True, description="Keep streaming sessions' KV between turns.")
    idle_offload_s: float | None = Field(
        60.0, ge=0, description="Idle this long: KV written back, device pages freed; session stays open. null: only under pressure."
    )
    session_timeout_s: float | None = Field(
        600.0, ge=0, description="Idle this long: the session is released. null: sessions live until released."
    )
    reap_interval_s: float | None = Field(1.0, gt=0, description="Period of the reaper task. null: no task.")
    preempt_queued_turns: bool = Field(True, description="Under pressure, queued (not yet admitted) turns give their KV up too.")


class ExtraPoolConfig(_Section):
    """An extra state pool of a hybrid model (for example Mamba's recurrent state)."""

    name: str = Field("mamba", description="Pool name used in storage (kv is reserved).")
    state_shapes: dict[str, Annotated[list[_Dim], Field(min_length=1, max_length=8)]] = Field(
        default_factory=lambda: {"conv": [4, 64], "ssm": [8, 16]}, min_length=1,
        description="Per-slot shape of each state; positive dimensions.")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    slots: int = Field(64, gt=0)
    host_slots: int = Field(256, gt=0)
    hit_policy: Literal["all_pages", "trailing_pages"] = Field(
        "trailing_pages",
        description="What a prefix hit needs of this pool: every page (an indexer) or only the trailing "
                    "ones (Mamba state). Carried by the transfers HiCache.pool_transfer builds.",
    )

    @model_validator(mode="after")
    def _not_kv(self) -> ExtraPoolConfig:
        if self.name == "kv":
            raise ValueError("extra_pools[].name 'kv' is reserved for the KV pool")
        return self


class ServerConfig(_Section):
    """The demo HTTP server."""

    host: str = "127.0.0.1"
    port: int = Field(8471, ge=0, le=65535)
    max_batch: int = Field(8, gt=0, description="Requests prefilled together.")
    max_new_tokens: int = Field(16, gt=0)
    shutdown_timeout_s: float = Field(
        20.0, gt=0, le=3600,
        description="The whole drain on SIGTERM/SIGINT: requests in flight, then the cache's close (its queued "
                    "writes). Keep it under the container's grace period (Kubernetes' terminationGracePeriodSeconds, "
                    "30 s by default): a process killed mid-drain loses its queued writes unreported.")


def _all_tiers() -> list[Literal["device", "host", "storage"]]:
    return ["device", "host", "storage"]


#: the largest count the events' buffers take: ZMQ's high-water mark is a C int, and a bigger
#: replay buffer (a deque's length) was an OverflowError traceback when the publisher started
_C_INT_MAX = (1 << 31) - 1


class EventsConfig(_Section):
    """KV events for cache-aware routers (vLLM's schema over ZMQ; ``hicache.events``). Off by default."""

    enabled: bool = Field(False, description="Publish every tier's stores and removals.")
    endpoint: str | None = Field(
        "tcp://*:5557", description="ZMQ PUB address (wildcard, loopback, ipc and inproc bind; others connect); null: in-process only.")
    replay_endpoint: str | None = Field(
        "tcp://*:5558", description="ZMQ ROUTER address where consumers ask for batches since a sequence; null: no replay.")
    topic: str = Field("", description="First frame of every message.")
    buffer_steps: int = Field(10_000, gt=0, le=_C_INT_MAX, description="Batches kept for replay.")
    max_queue_events: int = Field(100_000, gt=0, description="Event lists queued before new ones are dropped (counted).")
    hwm: int = Field(100_000, gt=0, le=_C_INT_MAX, description="ZMQ high-water mark of the PUB socket.")
    hash_format: Literal["bytes", "int"] = Field("bytes", description="Block hashes: 32 sha256 bytes, or their low 64 bits.")
    tiers: list[Literal["device", "host", "storage"]] = Field(
        default_factory=_all_tiers, description="Tiers to publish.")
    data_parallel_rank: int | None = Field(None, ge=0, description="Stamped on every batch.")

    @model_validator(mode="after")
    def _endpoints(self) -> EventsConfig:
        """A TCP port outside 0..65535 is an error here: ZMQ took it modulo 65536 and bound
        another port, where no router listened."""
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address and address.startswith("tcp://"):
                port = address.rpartition(":")[2]
                if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
                    raise ValueError(f"{name} {address!r}: the port must be * or 0..65535")
        if self.endpoint and self.endpoint == self.replay_endpoint and not self.endpoint.endswith(":0"):
            raise ValueError(f"endpoint and replay_endpoint are both {self.endpoint!r}: give each its own address")
        return self


class TracingConfig(_Section):
    """OpenTelemetry spans around a request's cache work (``hicache/observability/tracing.py``)."""

    enabled: bool = Field(False, description="Emit spans through the global tracer provider (needs hicache[otel]).")


class HiCacheConfig(_Section):
    """A whole deployment. Every section is optional and has working defaults."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    host: HostConfig = Field(default_factory=HostConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    session: SessionConfig = Field(default_factory=SessionConfig)
    extra_pools: list[ExtraPoolConfig] = Field(default_factory=list)
    server: ServerConfig = Field(default_factory=ServerConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @model_validator(mode="after")
    def _unique_pools(self) -> HiCacheConfig:
        names = [p.name for p in self.extra_pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"extra_pools: pool name(s) {dup} given more than once; each pool needs its own name")
        return self
