"""What the SGLang adapter reads from ``--hicache-storage-backend-extra-config``, and the
namespace it derives from SGLang's storage config.

SGLang hands a dynamic backend one dict: its own keys (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ...) beside the backend's. Ours all start with ``hicache_``::

    hicache_backend       backend name: file (default), s3, fsspec, memory, or any plugin
    hicache_options       dict of that backend's keyword options (e.g. {"root": "/data/kv"})
    hicache_config        path of a hicache config file (TOML/JSON/YAML); its [storage]
                          section gives backend and options (the two keys above override it;
                          hicache_backend naming another backend takes none of its options)
    hicache_call_timeout  seconds one storage call may take before it is cancelled and
                          answered as a miss (default 60; null: no limit)
    hicache_staging_mib   staging memory per direction for layouts without a contiguous
                          page (default 32 MiB; two halves, so reads and copies overlap)
    hicache_namespace_salt  extra text in the namespace (tenant, LoRA set, anything that
                          makes pages of the same tokens differ)
    hicache_model_id      the model's identity in the namespace, in place of the server's
                          --model-path and --revision (servers that load the same weights
                          from different local paths share pages only with the same id)
    hicache_kv_cache_dtype  the KV cache dtype (SGLang's --kv-cache-dtype, e.g. fp8_e4m3) when
                          the server's own settings cannot be read: SGLang stores every fp8
                          format as uint8, so the pool alone cannot tell e4m3 from e5m2 (the
                          server's own setting wins; one contradicting it fails the attach)

An unknown ``hicache_*`` key is an error that lists the allowed ones; SGLang's keys are left
to SGLang (its own ``hicache_storage_pass_prefix_keys`` included, which reaches us on a PD
decode server's offload path). No SGLang import here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache.errors import ConfigError, quoted
from hicache.keys import Namespace

__all__ = ["AdapterSettings", "namespace_for", "PREFIX"]

PREFIX = "hicache_"
#: SGLang's own keys of the storage backend's extra config that share our prefix: SGLang takes
#: them out before it builds the backend, except on paths that pass the raw config on (a PD
#: decode server's KV offload manager), where they reach us and are SGLang's, not unknown
_SGLANG_KEYS = ("hicache_storage_pass_prefix_keys",)
_KEYS = (
    "hicache_backend",
    "hicache_options",
    "hicache_config",
    "hicache_call_timeout",
    "hicache_staging_mib",
    "hicache_namespace_salt",
    "hicache_kv_cache_dtype",
    "hicache_model_id",
)
DEFAULT_CALL_TIMEOUT = 60.0
DEFAULT_STAGING_MIB = 32


@dataclass(frozen=True)
class AdapterSettings:
    """The adapter's part of SGLang's extra config, validated."""

    backend: str = "file"
    options: dict[str, Any] = field(default_factory=dict)
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT
    staging_bytes: int = DEFAULT_STAGING_MIB << 20
    namespace_salt: str | None = None
    kv_cache_dtype: str | None = None
    model_id: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterSettings:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith(PREFIX)
                         and k not in _KEYS and k not in _SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"SGLang extra config: unknown key(s) {quoted(unknown)}; allowed: {list(_KEYS)}")
        backend: Any = None
        options: dict[str, Any] = {}
        file_salt: str | None = None
        path = extra.get("hicache_config")
        if path is not None:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"hicache_config must be a file path, got {quoted(path)}")
            from hicache.config.loader import load_config

            storage = load_config(path).storage
            backend, options = storage.backend, dict(storage.options)
            # the file's tenant/LoRA salt: ignored, two servers of other tenants shared pages
            file_salt = storage.namespace_salt
        if "hicache_backend" in extra:
            if extra["hicache_backend"] != backend:
                # the file's options are its own backend's: handed to another, they failed the
                # factory ('memory' has no option 'root')
                options = {}
            backend = extra["hicache_backend"]
        elif path is not None and not backend:
            raise ConfigError(f"hicache_config {quoted(path)}: storage.backend is null; SGLang needs a backend")
        if backend is None:
            backend = "file"
        if not isinstance(backend, str) or not backend:
            raise ConfigError(f"hicache_backend must be a backend name, got {quoted(backend)}")
        if "hicache_options" in extra:
            given = extra["hicache_options"]
            if not isinstance(given, Mapping):
                raise ConfigError(f"hicache_options must be a dict of backend options, got {type(given).__name__}")
            options = {**options, **dict(given)}
        if "namespace" in options:
            # the adapter builds the namespace from SGLang's config and the pools and would put
            # it over this one without a word: servers given different namespaces (tenants)
            # shared each other's pages. The salt is what keeps them apart.
            raise ConfigError("hicache_options: the namespace comes from SGLang's config and host pools; "
                              "use hicache_namespace_salt to keep pages apart")
        timeout = extra.get("hicache_call_timeout", DEFAULT_CALL_TIMEOUT)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ConfigError(f"hicache_call_timeout must be a positive number of seconds or null, got {quoted(timeout)}")
        if timeout is not None and timeout > threading.TIMEOUT_MAX:  # inf included: no limit, as null
            timeout = None  # a wait that long overflows the clock (every call raised OverflowError)
        staging = extra.get("hicache_staging_mib", DEFAULT_STAGING_MIB)
        if isinstance(staging, bool) or not isinstance(staging, int) or not 1 <= staging <= 4096:
            raise ConfigError(f"hicache_staging_mib must be an integer in 1..4096, got {quoted(staging)}")
        salt = extra.get("hicache_namespace_salt", file_salt)  # the extra config's key wins
        if salt is not None and not isinstance(salt, str):
            raise ConfigError(f"hicache_namespace_salt must be a string, got {quoted(salt)}")
        kv_dtype = extra.get("hicache_kv_cache_dtype")
        if kv_dtype is not None and (not isinstance(kv_dtype, str) or not kv_dtype):
            raise ConfigError(f"hicache_kv_cache_dtype must be SGLang's --kv-cache-dtype (e.g. fp8_e4m3), got {quoted(kv_dtype)}")
        model_id = extra.get("hicache_model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ConfigError(f"hicache_model_id must be a non-empty string naming the weights, got {quoted(model_id)}")
        return cls(
            backend=backend,
            options=options,
            call_timeout=None if timeout is None else float(timeout),
            staging_bytes=staging << 20,
            namespace_salt=salt,
            kv_cache_dtype=kv_dtype,
            model_id=model_id,
        )


def namespace_for(
    config: Any,
    *,
    signature: Mapping[str, Any] | None = None,
    kv_format: str | None = None,
    pool_formats: Mapping[str, str] | None = None,
    salt: str | None = None,
    model: str | None = None,
    revision: str | None = None,
    draft: Mapping[str, str] | None = None,
    quantization: str | None = None,
) -> Namespace:
    """The namespace of an SGLang server's pages.

    The model is ``model`` and ``revision``: the weights the server loaded (its
    ``--model-path`` and ``--revision``, or ``hicache_model_id``). Only without them is it
    SGLang's ``model_name``, which is ``--served-model-name``: an API alias that servers of
    different weights often share (``default``), and page keys are token hashes alone, so
    that alias would let one model restore another's KV. ``draft``: the speculative draft's
    settings when the KV pool (or another pool in the namespace: one in SGLang's own bytes)
    packs its MTP layers, whose KV is then in those pages. ``quantization``: the server's
    ``--quantization``, weights quantized as they load, which compute other KV for the same
    tokens; named only when set, so unquantized servers' namespaces stay what they were.

    From SGLang's ``HiCacheStorageConfig``: TP/PP ranks, attention-CP and decode-CP shards (not the
    DP-attention rank: DP groups hold the same KV), and MLA (MLA latents are replicated over TP, so TP does not split those namespaces,
    as in SGLang). From the KV host pool (``signature``): dtype, layers, heads, head size, page
    size. The host *layout* is not part of it: pages are stored in canonical order, so every
    layout shares them. Only pools stored in SGLang's own bytes (``kv_format``,
    ``pool_formats``) put their layout in, so that no other layout ever reads them.
    """
    sig = dict(signature or {})
    is_mla = bool(getattr(config, "is_mla_model", False))
    extra: dict[str, str] = {"engine": "sglang"}
    # not dp_rank: DP-attention groups hold the same KV at the same attention-TP rank, and
    # share pages as they do in SGLang's own backends (whose keys leave it out)
    for name in ("attn_cp_rank", "attn_cp_size", "dcp_rank", "dcp_size", "logical_page_size"):
        value = getattr(config, name, None)
        if value is not None:
            extra[name] = str(value)
    if getattr(config, "should_split_heads", False):
        extra["tp_lcm_size"] = str(getattr(config, "tp_lcm_size", None))
    for key in ("page_format", "kv_lora_rank", "qk_rope_head_dim", "page_nbytes", "kv_cache_dtype"):
        if key in sig:
            extra[key] = str(sig[key])
    if quantization:
        extra["quantization"] = quantization
    for key, value in sorted((draft or {}).items()):
        extra[f"draft.{key}"] = value
    for pool, tag in sorted((pool_formats or {}).items()):
        extra[f"pool.{pool}"] = tag
    tp_rank, tp_size = int(getattr(config, "tp_rank", 0)), int(getattr(config, "tp_size", 1))
    return Namespace(
        model=model or getattr(config, "model_name", None) or "",
        revision=revision or None,
        kv_dtype=None if "dtype" not in sig else str(sig["dtype"]),
        layout=kv_format,
        page_size=None if "page_size" not in sig else int(sig["page_size"]),
        num_layers=None if "layer_num" not in sig else int(sig["layer_num"]),
        num_kv_heads=None if "head_num" not in sig else int(sig["head_num"]),
        head_dim=None if "head_dim" not in sig else int(sig["head_dim"]),
        is_mla=is_mla,
        tp_rank=0 if is_mla else tp_rank,
        tp_size=1 if is_mla else tp_size,
        pp_rank=int(getattr(config, "pp_rank", 0)),
        pp_size=int(getattr(config, "pp_size", 1)),
        salt=salt,
        extra=tuple(sorted(extra.items())),
    )
