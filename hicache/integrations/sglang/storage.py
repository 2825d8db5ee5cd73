"""``HiCacheSGLangStorage``: any hicache backend as SGLang's L3 storage.

SGLang loads it through its own factory (``--hicache-storage-backend dynamic``), which checks
``issubclass(cls, HiCacheStorage)`` against *SGLang's* class and builds ``cls(storage_config,
{})``; so this module imports SGLang (and only this module of hicache does). Lifecycle, as
SGLang's controller drives it:

1. construction: the extra config is validated (a bad key or option fails the factory) and
   ``interface_v1`` is switched on unless the user set it, which makes the controller use the
   zero-copy ``batch_get_v1``/``batch_set_v1`` path (it reads the key from the very dict it
   passed us, after construction);
2. ``register_mem_pool_host`` / ``register_mem_host_pool_v2``: pools are collected;
3. ``on_host_pools_registered``: the namespace is built from SGLang's config and the pools'
   geometry, the backend is created and opened (a store that cannot open fails the attach
   with an error naming the backend and the cause);
4. I/O calls from SGLang's threads, each a blocking call into the backend's event loop thread,
   bounded by ``hicache_call_timeout``; any failure is logged and answered as a miss, so no
   SGLang I/O thread ever sees an exception from us;
5. ``close`` at detach (and at exit, through the facade's finalizer) drains queued writes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _SGLangStorage
from sglang.srt.mem_cache.hicache_storage import PoolName as _SGLangPoolName
from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as _SGLangResult

from hicache.errors import ConfigError, HiCacheError
from hicache.integrations.sglang.config import AdapterSettings, namespace_for
from hicache.integrations.sglang.hits import resolve_hits
from hicache.integrations.sglang.pages import CanonicalPagePool, LogicalIndexPool, adapt_host_pool, is_mla_pool
from hicache.integrations.sglang.transfer import PageMover
from hicache.storage import (
    AsyncHiCacheStorage,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    create_async_storage,
)
from hicache.storage.key_screen import first_unstorable
from hicache.storage.pages import page_nbytes
from hicache.storage.stats import CallCounts, counting_call

__all__ = ["HiCacheSGLangStorage", "SGLangAttachError"]

logger = logging.getLogger("hicache.integrations.sglang")

T = TypeVar("T")
KV = "kv"


class SGLangAttachError(HiCacheError, RuntimeError):
    """The store could not be opened when SGLang attached it."""


def _name(pool_name: Any) -> str:
    """Plain pool name of SGLang's ``PoolName`` (a str enum whose hash is not the str's)."""
    return str(getattr(pool_name, "value", pool_name))


#: pools SGLang keeps split by TP rank even in an MLA model, whose KV every TP rank holds whole
#: (so the MLA namespace leaves TP out): its ``HybridCacheController.should_backup`` backs them
#: up on every rank ("Kimi-K3 Mamba/KDA state is TP-sharded even when the primary MLA KV pool
#: is replicated"). Stored under a name per rank, each rank reads back its own shard.
_TP_SPLIT_UNDER_MLA = frozenset({"mamba"})


def _server_kv_cache_dtype() -> str | None:
    """SGLang's ``--kv-cache-dtype`` from the server's published settings, if it has any
    (none in a process that did not start a server, such as a test or a tool)."""
    return (_server_settings("kv_cache_dtype") or {}).get("kv_cache_dtype")


def _kv_cache_dtype(configured: str | None) -> str | None:
    """The KV cache dtype the pages are stored in: the server's own ``--kv-cache-dtype`` when
    its settings can be read, ``hicache_kv_cache_dtype`` (``configured``) only when they cannot.

    Why the server's first: the key is the fallback for a server whose settings cannot be read,
    and an extra config shared across a fleet may name another format than a server runs (e4m3
    in the config, e5m2 on the server): taken first, that server filed its e5m2 bytes under the
    e4m3 namespace, where e4m3 servers read them as valid KV. Both known and different is an
    error naming both. A server on ``auto`` (an fp8 checkpoint's own format) names no format:
    the key, when set, says which."""
    served = _server_kv_cache_dtype()
    if served is None or (served == "auto" and configured is not None):
        return configured
    if configured is not None and configured != served:
        raise SGLangAttachError(
            f"hicache_kv_cache_dtype is {configured!r} but the server runs --kv-cache-dtype {served!r}: "
            "the pages would be filed under a format they are not in; remove the key (the server's "
            "setting is read) or make it match"
        )
    return served


def _with_logical_dtype(signature: dict[str, Any], configured: str | None) -> dict[str, Any]:
    """``signature`` with the KV cache dtype when the pool stores its KV as raw bytes.

    Why: SGLang stores every fp8 KV format (e4m3, e5m2) and fp4 in ``uint8`` buffers, so pages
    of two servers with different formats have the same size and pass every check, and a
    namespace built from the pool alone would serve one's bytes to the other as valid KV.
    Unknown (no extra-config key, no readable server settings) is an error, never a guess."""
    if signature.get("dtype") != "uint8":
        return signature
    logical = _kv_cache_dtype(configured)
    if logical is None:
        raise SGLangAttachError(
            "the KV host pool stores its KV as uint8 (an fp8 or fp4 KV cache), and its format could not "
            "be read from the server's settings: set hicache_kv_cache_dtype in the storage backend's "
            "extra config to the server's --kv-cache-dtype (e.g. fp8_e4m3), so that pages of "
            "different formats never share a namespace"
        )
    return {**signature, "kv_cache_dtype": logical}


def _server_settings(*keys: str) -> dict[str, str] | None:
    """The string settings ``keys`` from the server's published settings (those it has);
    ``None`` when there are none to read (a process that did not start a server)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # noqa: BLE001 - not published, or another SGLang version's API
        return None
    out: dict[str, str] = {}
    for key in keys:
        value = getattr(args, key, None)
        if isinstance(value, str) and value:
            out[key] = value
    return out


def _draft_settings() -> dict[str, str]:
    """The draft model's KV format and identity from the server's published settings (none
    in a process that did not start a server)."""
    return _server_settings("speculative_draft_kv_cache_dtype", "speculative_draft_model_path",
                            "speculative_draft_model_revision") or {}


def _target_settings() -> dict[str, str] | None:
    """The served model's identity from the server's published settings: ``model_path`` and
    ``revision`` (those it has); ``None`` when there are none to read."""
    return _server_settings("model_path", "revision")


def _weights_quantization() -> str | None:
    """The server's ``--quantization`` (``None``: unset, or no settings to read). Weights
    quantized as they load are other weights than the checkpoint's: servers of one
    ``--model-path`` with and without it restored each other's KV, as valid."""
    return (_server_settings("quantization") or {}).get("quantization")


_DRAFT_DTYPE = "speculative_draft_kv_cache_dtype"


def _is_draft_pool(name: str) -> bool:
    """Whether SGLang's pool ``name`` is the draft model's own (``draft``, ``draft_swa``,
    ``draft_indexer``): every other pool (``swa``, ``indexer``, ...) is the target's."""
    return name.startswith("draft")


def _packs_draft_layers(pool: Any) -> bool:
    """Whether SGLang's host ``pool`` holds MTP draft layers after the target's: SGLang packs
    them into the target's KV, SWA and Mamba host pools (``packed_draft_device_pools``), so
    those pages are draft KV too."""
    layers, target = getattr(pool, "layer_num", None), getattr(pool, "target_layer_num", None)
    if isinstance(layers, int) and isinstance(target, int) and layers > target:
        return True
    return bool(getattr(pool, "mtp_draft_buffer_infos", None))


def _sidecar_format(signature: dict[str, Any], logical_kv: str | None, draft: dict[str, str],
                    packed: bool = False) -> str | None:
    """A canonical sidecar pool's format, as a digest its stored pool name carries: its
    geometry and element type, with its logical KV format when it stores bytes, and the draft
    model it holds the KV of. ``draft``: :func:`_draft_settings` for a pool that holds draft
    KV, empty for a target's own pool (its SWA: the same target with another draft, or none,
    shares it). A draft pool's bytes are in the server's draft dtype, else the target's (as
    SGLang chooses it); a target pool with ``packed`` draft layers keeps the target's and
    carries the draft's beside it. ``None``: bytes of a format nothing says."""
    facts = dict(signature)
    if facts.get("dtype") == "uint8":
        logical = logical_kv if packed else (draft.get(_DRAFT_DTYPE) or logical_kv)
        if logical is None:
            return None
        facts["kv_cache_dtype"] = logical
    facts.update({k: v for k, v in draft.items() if packed or k != _DRAFT_DTYPE})
    text = ";".join(f"{k}={facts[k]}" for k in sorted(facts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hicache_config(cfg: Any) -> HiCacheStorageConfig:
    """hicache's storage config with the fields SGLang's config shares with it."""
    return HiCacheStorageConfig(
        tp_rank=int(getattr(cfg, "tp_rank", 0)),
        tp_size=int(getattr(cfg, "tp_size", 1)),
        pp_rank=int(getattr(cfg, "pp_rank", 0)),
        pp_size=int(getattr(cfg, "pp_size", 1)),
        attn_cp_rank=int(getattr(cfg, "attn_cp_rank", 0)),
        attn_cp_size=int(getattr(cfg, "attn_cp_size", 1)),
        is_mla_model=bool(getattr(cfg, "is_mla_model", False)),
        enable_storage_metrics=bool(getattr(cfg, "enable_storage_metrics", False)),
        is_page_first_layout=bool(getattr(cfg, "is_page_first_layout", False)),
        model_name=getattr(cfg, "model_name", None),
        extra_config=None,
    )


def _kv_read_from_another_rank(cfg: Any) -> bool:
    """Whether SGLang writes the KV from some TP ranks only, for the others to read: an MLA
    model's KV is whole on every TP rank, and SGLang backs it up from one rank per DCP shard
    (``HiCacheStorageConfig.is_storage_writer``: ``tp_rank == dcp_rank``)."""
    tp_size, dcp_size = int(getattr(cfg, "tp_size", 1)), int(getattr(cfg, "dcp_size", 1) or 1)
    return bool(getattr(cfg, "is_mla_model", False)) and tp_size > dcp_size


def _check_ranks_share(backend: AsyncHiCacheStorage, name: str, cfg: Any) -> None:
    """Refuse a store that keeps its pages in one process (``process_local``: the memory store)
    where SGLang's ranks, each a process, read the KV another rank wrote: they never found a
    page, and as SGLang takes the least hit over the ranks, no rank ever had an L3 hit while
    every page was still stored."""
    if backend.process_local and _kv_read_from_another_rank(cfg):
        raise ConfigError(
            f"hicache backend {name!r} keeps its pages in the memory of the process that wrote them, but "
            f"SGLang writes an MLA model's KV from one of its {int(cfg.tp_size)} TP ranks (each a process) "
            "for the others to read: they would never find a page, and as a hit is the least over the "
            "ranks, no rank would have one; use a store the ranks share (file, s3)"
        )


def _no_flat_pages(pool: Any) -> str | None:
    """Why SGLang gives no flat pages of ``pool`` (what a pass-through pool's pages are stored
    as), or ``None`` where it does. A pool whose page methods raise ``NotImplementedError``
    has none (SGLang's MXFP8 pool), nor one whose ``get_data_page`` raises ``ValueError``: SGLang
    raises that for a layout its page methods do not know ("Unsupported layout"), which
    ``get_dummy_flat_data_page`` (the same for every layout) never showed, so such a pool
    attached and every write failed. Nor one whose flat page is empty: SGLang's DeepSeek V4 KV
    anchor (``LogicalHostPool``) holds no bytes, and every write of it failed ("cannot say its
    page size"), so that server never stored a KV page nor had a hit. The first page is asked
    for (a page's copy at most)."""
    try:
        dummy = pool.get_dummy_flat_data_page()
    except NotImplementedError as exc:
        return f"{type(pool).__name__} has no flat storage pages in SGLang" + (f" ({exc})" if str(exc) else "")
    except Exception:  # noqa: BLE001 - anything else is for the page path to report
        return None
    if isinstance(dummy, torch.Tensor) and dummy.numel() == 0:
        return f"{type(pool).__name__} holds no bytes (its flat storage pages are empty: a logical pool)"
    try:
        pool.get_data_page(0, flat=True)
    except (NotImplementedError, ValueError) as exc:
        return (f"{type(pool).__name__} has no flat storage pages in SGLang for layout "
                f"{getattr(pool, 'layout', None)!r} ({type(exc).__name__}: {exc})")
    except Exception:  # noqa: BLE001 - anything else is for the page path to report
        return None
    return None


class HiCacheSGLangStorage(_SGLangStorage):
    """SGLang's ``HiCacheStorage`` backed by a hicache backend (file, s3, fsspec, memory, plugins).

    Pages are stored in hicache's canonical byte order whatever SGLang's host layout, with
    hicache's page format (verified checksum, key and namespace in every page).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.extra_config is None:
            storage_config.extra_config = {}
        extra = storage_config.extra_config
        self.settings = AdapterSettings.from_extra_config(extra)
        extra.setdefault("interface_v1", 1)
        self.storage_config = storage_config
        self.enable_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        # fails the factory on an unknown backend or option, before any pool exists
        probe = create_async_storage(self.settings.backend, _hicache_config(storage_config), **self.settings.options)
        _check_ranks_share(probe, self.settings.backend, storage_config)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self._adapted: dict[str, Any] = {}
        self._tags: dict[str, str] = {}
        #: a canonical sidecar's stored pool name, by SGLang's: its format rides in the name
        self._names: dict[str, str] = {}
        #: pools SGLang gives no flat storage pages (see :meth:`_register`): stored nowhere
        self._refused: dict[str, str] = {}
        #: a pool whose format is in the namespace packs MTP draft layers (see :meth:`_register`)
        self._packed_in_namespace = False
        self._facade: HiCacheStorage | None = None
        self._backend: AsyncHiCacheStorage | None = None
        self._kv: CanonicalPagePool | None = None
        self._mover: PageMover | None = None
        self._open_lock = threading.Lock()
        self._closed = False
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {k: [] for k in ("prefetch_pgs", "backup_pgs", "prefetch_bw", "backup_bw")}
        self._page_bytes: dict[str, int] = {}

    # ------------------------------------------------------------------ pools and opening

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._register(mem_pool_host, KV)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[host_pool_name] = host_pool
        self._register(host_pool, host_pool_name)

    def _pool(self, pool_name: Any) -> str:
        """The name a pool's pages are stored under: SGLang's, with this TP rank for a pool
        that TP splits while the namespace does not (:data:`_TP_SPLIT_UNDER_MLA`), and with a
        canonical sidecar's format (see :meth:`_register`)."""
        name = self._base_name(pool_name)
        return self._names.get(name, name)

    def _base_name(self, pool_name: Any) -> str:
        name = _name(pool_name)
        cfg = self.storage_config
        if name in _TP_SPLIT_UNDER_MLA and getattr(cfg, "is_mla_model", False) and int(getattr(cfg, "tp_size", 1)) > 1:
            return f"{name}.tp{int(getattr(cfg, 'tp_rank', 0))}-{int(cfg.tp_size)}"
        return name

    def _register(self, pool: Any, pool_name: Any) -> None:
        """Adapt ``pool`` and hold it under the name its pages are stored under (:meth:`_pool`);
        its byte-format tag goes by SGLang's name, so that every TP rank's namespace is one."""
        name = self._base_name(pool_name)
        prior = self._adapted.get(self._names.get(name, name))
        if prior is not None and getattr(prior, "pool", prior) is pool:
            return  # the same SGLang pool again (KV: once as the anchor, once by name)
        adapted, tag = adapt_host_pool(pool)
        no_pages = _no_flat_pages(pool) if tag is not None else None
        if no_pages is not None:
            # SGLang refuses storage pages for it (its MXFP8 pool keeps scales outside the
            # page; a layout its page methods do not know): every one of its writes would
            # fail. The KV pool fails the attach (a store that can hold nothing); a sidecar is
            # a miss, said once here.
            self._refuse(name, no_pages)
            return
        cfg = self.storage_config
        if (name != KV and isinstance(adapted, CanonicalPagePool) and not is_mla_pool(pool)
                and getattr(cfg, "is_mla_model", False) and int(getattr(cfg, "tp_size", 1)) > 1):
            # an MHA sidecar (a Llama-style draft of an MLA target) is split over TP while the
            # namespace is not, and SGLang backs it up on the writer rank only: every other
            # rank read that rank's head shard as its own
            self._refuse(name, "an MHA pool under an MLA model with TP > 1 (SGLang stores one rank's shard)")
            return
        # the draft's identity only where its KV is: a draft pool, or a target pool that packs
        # MTP draft layers; the target's own SWA with it was never found by the same target
        # run with another draft or none (every TRAILING_PAGES hit was 0)
        packed = name != KV and not _is_draft_pool(name) and _packs_draft_layers(pool)
        draft = _draft_settings() if name != KV and (packed or _is_draft_pool(name)) else {}
        if name != KV and tag is None and callable(getattr(adapted, "storage_signature", None)):
            # a canonical sidecar (a draft model's KV, SWA) carries its own format and geometry,
            # in its pool's stored name: left out, two servers whose drafts differ (fp8 e4m3 and
            # e5m2, both bytes; other draft weights) read each other's draft pages as valid. In
            # the name, not the namespace: SGLang registers its draft after the store opened
            # (at start-up) or before (a runtime attach), and the KV namespace must not change
            # with that, nor the draft's pages
            signature = adapted.storage_signature()
            stored_as_bytes = signature.get("dtype") == "uint8"  # only then is the format needed
            fmt = _sidecar_format(signature, _kv_cache_dtype(self.settings.kv_cache_dtype) if stored_as_bytes else None,
                                  draft, packed)
            if fmt is None:
                self._refuse(name, "its KV is stored as bytes and its format is unknown (no server settings, "
                                   "no hicache_kv_cache_dtype)")
                return
            self._names[name] = name = f"{name}@{fmt}"
        if self._facade is not None:  # a dynamic sidecar, after the store opened
            if tag is not None:
                self._refuse(name, f"it keeps SGLang's own byte order ({tag}), which must be part of the "
                                   "namespace, but it was registered after the store opened")
                return
            self._facade.register_mem_host_pool_v2(adapted, name)
        self._adapted[name] = adapted
        if tag is not None:
            self._tags[_name(pool_name)] = tag
            # a pool in SGLang's own bytes is named in the namespace: one that packs draft
            # layers (Mamba under MTP) puts the draft there too
            self._packed_in_namespace |= packed

    def _refuse(self, name: str, why: str) -> None:
        """Store nothing of pool ``name`` (its pages are misses); said once for a sidecar (the
        KV pool's refusal fails the attach instead)."""
        self._refused[name] = why
        if name != KV:
            logger.warning("hicache SGLang storage: pool %r is not stored (%s); its pages are misses", name, why)

    def on_host_pools_registered(self) -> None:
        """Open the store now that every pool is known; raising fails SGLang's attach."""
        self._ensure_open()

    def _ensure_open(self) -> HiCacheStorage:
        facade = self._facade
        if facade is not None:
            return facade
        with self._open_lock:
            if self._facade is not None:
                return self._facade
            if self._closed:
                raise SGLangAttachError("the hicache SGLang storage is closed")
            if KV in self._refused:
                raise SGLangAttachError(f"the KV host pool cannot be stored: {self._refused[KV]}")
            kv = self._adapted.get(KV)
            if kv is None:
                raise SGLangAttachError("no KV host pool registered (register_mem_pool_host first)")
            tags = dict(self._tags)
            signature = kv.storage_signature() if callable(getattr(kv, "storage_signature", None)) else {}
            signature = _with_logical_dtype(signature, self.settings.kv_cache_dtype)
            model, revision = self._model_identity()
            # MTP draft layers packed into the KV pool (or a pool in SGLang's own bytes): its
            # pages are draft KV too, and servers of one target with other drafts must not
            # share them
            sglang_pool = kv.pool if isinstance(kv, (CanonicalPagePool, LogicalIndexPool)) else kv
            packed = self._packed_in_namespace or _packs_draft_layers(sglang_pool)
            draft = _draft_settings() if packed else {}
            namespace = namespace_for(
                self.storage_config,
                signature=signature,
                kv_format=tags.pop(KV, None),
                pool_formats=tags,
                salt=self.settings.namespace_salt,
                model=model,
                revision=revision,
                draft=draft,
                quantization=_weights_quantization(),
            )
            options = dict(self.settings.options)
            options["namespace"] = namespace
            backend = create_async_storage(self.settings.backend, _hicache_config(self.storage_config), **options)
            facade = HiCacheStorage(backend, call_timeout=self.settings.call_timeout)
            try:
                for name, pool in self._adapted.items():
                    if name == KV:
                        facade.register_mem_pool_host(pool)
                    else:
                        facade.register_mem_host_pool_v2(pool, name)
                facade.open()  # not cut at call_timeout (one I/O's limit): a slow first touch fails no launch
            except BaseException as exc:
                try:
                    facade.close()
                except Exception:  # noqa: BLE001 - the open error is the one to report
                    pass
                raise SGLangAttachError(
                    f"hicache backend {self.settings.backend!r} could not open its store "
                    f"(options {sorted(self.settings.options)}): {type(exc).__name__}: {exc}"
                ) from exc
            self._backend = backend
            if isinstance(kv, CanonicalPagePool):
                self._kv = kv
                self._mover = PageMover(backend, kv, KV, self.settings.staging_bytes)
            logger.info("hicache SGLang storage: backend %r, namespace %s", self.settings.backend, namespace.digest)
            self._facade = facade
            return facade

    def _model_identity(self) -> tuple[str | None, str | None]:
        """The weights this server's pages are KV of: ``hicache_model_id``, else the server's
        ``--model-path`` and ``--revision``; ``(None, None)`` leaves SGLang's ``model_name``.

        Why not ``model_name``: SGLang fills it from ``--served-model-name``, an API alias that
        deployments often set alike (``default``), and page keys are token hashes alone, so
        base and instruct models, two fine-tunes, or one path at two revisions restored each
        other's KV. The alias is the only identity only where no server settings can be read.
        SGLang tags ``model_name`` with the KV host pool's own page format; kept here too."""
        model, revision = self.settings.model_id, None
        if model is None:
            target = _target_settings()
            if not target or "model_path" not in target:
                logger.warning(
                    "hicache SGLang storage: the server's --model-path could not be read; the served model "
                    "name %r is the only model identity in the namespace (set hicache_model_id to name "
                    "the weights)", getattr(self.storage_config, "model_name", None))
                return None, None
            model, revision = target["model_path"], target.get("revision")
        tag = getattr(self.mem_pool_host, "storage_format_tag", None)
        return (f"{model}-{tag}" if isinstance(tag, str) and tag else model), revision

    @property
    def backend(self) -> AsyncHiCacheStorage | None:
        """The hicache backend (``None`` until the store opened)."""
        return self._backend

    # ------------------------------------------------------------------ guarded calls

    def _do(self, what: str, fn: Callable[[HiCacheStorage], T], fallback: T) -> T:
        """Run ``fn`` against the open facade; any failure is logged and becomes ``fallback``
        (SGLang's I/O threads must not die, and a failed read must read as a miss)."""
        try:
            return fn(self._ensure_open())
        except Exception as exc:  # noqa: BLE001
            logger.error("hicache SGLang storage: %s failed (%s: %s); answering with misses", what, type(exc).__name__, exc)
            return fallback

    def _record(self, kind: str, pages: int, t0: float, pool: str = KV) -> None:
        """One call's pages and bandwidth of ``pool`` (its own page size: an extra pool's pages
        are not KV pages), in the same lists for every pool, as SGLang's HF3FS backend records
        its extra pools. Bandwidth in GiB/s (bytes / 2**30), the unit SGLang's own backends
        report, so a dashboard mixing them reads one scale."""
        if not self.enable_metrics or not pages:
            return
        seconds = max(time.perf_counter() - t0, 1e-9)
        nbytes = self._pool_page_bytes(pool)
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bw"].append(pages * nbytes / seconds / (1 << 30))

    def _pool_page_bytes(self, pool: str) -> int:
        nbytes = self._page_bytes.get(pool)
        if nbytes is None:
            adapted = self._kv if pool == KV and self._kv is not None else self._adapted.get(pool)
            try:
                nbytes = page_nbytes(adapted) if adapted is not None else 0
            except Exception:  # noqa: BLE001 - a pool that cannot say: pages are still counted
                nbytes = 0
            self._page_bytes[pool] = nbytes
        return nbytes

    @staticmethod
    def _written(stored: int, call: CallCounts) -> int:
        """Pages a write call really wrote, for SGLang's backup metrics. A page the store
        already held is answered True (SGLang must see it stored) but not written: the file
        store's ``skip_existing`` counts it as ``write_skipped_pages``, and it is left out, as
        SGLang's Mooncake backend leaves out the keys it finds existing. The pages written are
        the store's own count for this call (``write_ok``, which includes pages written past a
        failure that SGLang's flags drop) when the call went through hicache's counted write
        path, else ``stored`` (the pages reported stored). A store that does not tell a skip
        from a write (counts no ``write_skipped_pages``) has every stored page counted."""
        done = int(call.counts["write_ok"]) if "write_pages" in call.counts else stored
        return max(0, done - int(call.counts["write_skipped_pages"]))

    # ------------------------------------------------------------------ hit queries

    def exists(self, key: str) -> bool:
        return self._do("exists", lambda f: f.exists(key), False)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        def run(f: HiCacheStorage) -> int:
            assert self._backend is not None
            return f.exists_prefix(list(keys), KV)  # stops at the first miss; on this thread where it can

        return self._do("batch_exists", run, 0)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None) -> Any:
        transfers = [t for t in (pool_transfers or ()) if _name(t.name) != KV]

        def resolve(kv_pages: int, flags: dict[Any, list[bool]]) -> Any:
            return resolve_hits([True] * kv_pages + [False] * (len(keys) - kv_pages), flags, transfers,
                                kv_name=_SGLangPoolName.KV)

        async def query(backend: AsyncHiCacheStorage, lookup: list[str], kv_now: int | None) -> Any:
            # the KV prefix in as few round trips as the backend allows (S3: it stops at the
            # first miss instead of one HEAD per page); extra pools only over that prefix
            kv_pages = kv_now if kv_now is not None else await backend.exists_prefix(lookup, KV)
            flags: dict[Any, list[bool]] = {}
            if kv_pages:
                for t in transfers:
                    name = self._pool(t.name)
                    flags[t.name] = ([False] * kv_pages if name in self._refused
                                     else await backend.exists_pages(lookup[:kv_pages], name))
            return resolve(kv_pages, flags)

        def run(f: HiCacheStorage) -> Any:
            assert self._backend is not None
            lookup = f.storable_prefix(list(keys))  # a bad key is a miss from there, not a failed batch
            # one call_timeout for the whole call: the KV prefix on this thread and the extra
            # pools on the loop were bounded one after the other, twice it on a hung store
            deadline = f.call_deadline()
            kv_now = f.exists_prefix_now(lookup, KV, screened=True, deadline=deadline)  # on this thread where it can
            if kv_now is not None and (not transfers or not kv_now):
                hits = resolve(kv_now, {})  # nothing left to ask the loop
            else:
                try:
                    hits = f.run(query(self._backend, lookup, kv_now), lookup=True, deadline=deadline)
                except TimeoutError:  # counted and logged by the facade
                    if kv_now is None:
                        raise
                    hits = resolve(kv_now, {})  # the KV prefix was answered; the pools not are misses
            return _SGLangResult(hits.kv_hit_pages, hits.extra_pool_hit_pages, hits.restorable_prefix_pages)

        return self._do("batch_exists_v2", run, _SGLangResult(0, {}, []))

    # ------------------------------------------------------------------ v1 (zero-copy path)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        t0 = time.perf_counter()
        out = self._do("batch_get_v1", lambda f: self._get_kv(f, list(keys), host_indices), [False] * len(keys))
        self._record("prefetch", sum(out), t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        t0 = time.perf_counter()
        prefix = getattr(extra_info, "prefix_keys", None)
        with counting_call() as call:
            out = self._do("batch_set_v1", lambda f: self._set_kv(f, list(keys), host_indices, prefix), [False] * len(keys))
        self._record("backup", self._written(sum(out), call), t0)
        return out

    def _get_kv(self, facade: HiCacheStorage, keys: list[str], host_indices: torch.Tensor,
                deadline: float | None = None) -> list[bool]:
        # as for writes: a batch with a key no store takes goes through the facade, which
        # misses that key alone (the mover's batch failed whole, the stored pages before it too)
        if self._mover is not None and not self._mover.moves_directly and first_unstorable(keys) is None:
            return facade.run(self._mover.get(keys, host_indices), deadline=deadline)  # through the mover's staging
        return facade.batch_get_v1(keys, host_indices, deadline=deadline)  # on this thread where the store can read there

    def _set_kv(self, facade: HiCacheStorage, keys: list[str], host_indices: torch.Tensor, prefix: Any,
                deadline: float | None = None) -> list[bool]:
        # a batch with a key no store takes goes through the facade, which fails that key
        # alone; the mover sends its batches to the backend as they are
        if self._mover is not None and first_unstorable(keys) is None:
            return facade.run(self._mover.set(keys, host_indices, prefix), deadline=deadline)
        return facade.batch_set_v1(keys, host_indices, _extra(prefix), deadline=deadline)

    # ------------------------------------------------------------------ v2 (hybrid models)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._v2("batch_get_v2", transfers, extra_info, write=False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._v2("batch_set_v2", transfers, extra_info, write=True)

    def _v2(self, what: str, transfers: list[Any], extra_info: Any, *, write: bool) -> dict[Any, list[bool]]:
        prefix = getattr(extra_info, "prefix_keys", None)
        out: dict[Any, list[bool]] = {}
        # one call_timeout for the whole call: each pool bounded on its own, SGLang's I/O
        # thread waited once per pool on a stalled store
        facade = self._facade  # read once: a close beside this call sets it to None
        deadline = facade.call_deadline() if facade is not None else None
        for t in transfers:
            keys = list(t.keys or [])

            def one(f: HiCacheStorage, t: Any = t, keys: list[str] = keys) -> list[bool]:
                name = self._pool(t.name)
                if name == KV:
                    if write:
                        return self._set_kv(f, keys, t.host_indices, prefix, deadline)
                    return self._get_kv(f, keys, t.host_indices, deadline)
                if name in self._refused:
                    return [False] * len(keys)
                call = f.batch_set_v2 if write else f.batch_get_v2
                ours = PoolTransfer(name, t.host_indices, keys=keys)
                return call([ours], _extra(prefix), deadline=deadline)[name]

            # each pool's I/O is recorded on its own, like a KV batch (SGLang's own backends
            # record the extra pools of the v2 calls too)
            t0 = time.perf_counter()
            with counting_call() as call:
                flags = out[t.name] = self._do(f"{what}[{_name(t.name)}]", one, [False] * len(keys))
            pages = self._written(sum(flags), call) if write else sum(flags)
            self._record("backup" if write else "prefetch", pages, t0, self._pool(t.name))
        return out

    # ------------------------------------------------------------------ v0 (SGLang's flat pages)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        kv = self._kv

        def run(f: HiCacheStorage) -> list[torch.Tensor | None]:
            if kv is None:
                return f.batch_get(keys, targets)
            # every page is read as canonical bytes and handed back as SGLang's flat page of
            # this layout (what ``set`` took): into the target, or a new one where none is given
            # (the stored bytes were returned there, in another dtype and order)
            staged = [kv.new_staging(1)[0] for _ in targets]
            got = f.batch_get(keys, staged)
            out: list[torch.Tensor | None] = []
            for t, page in zip(targets, got):
                if page is None:
                    out.append(None)
                    continue
                t = t if t is not None else kv.get_dummy_flat_data_page()
                kv.canonical_into_native(page, t)
                out.append(t)
            return out

        t0 = time.perf_counter()
        misses: list[torch.Tensor | None] = [None] * len(keys)
        out = self._do("batch_get", run, misses)
        self._record("prefetch", sum(o is not None for o in out), t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        keys = list(keys)
        vals = list(values if values is not None else (target_locations or []))
        kv = self._kv

        def run(f: HiCacheStorage) -> bool:
            pages = vals if kv is None else [kv.native_to_canonical(v) for v in vals]
            return f.batch_set(keys, pages)

        t0 = time.perf_counter()
        with counting_call() as call:
            ok = self._do("batch_set", run, False)
        self._record("backup", self._written(len(keys) if ok else 0, call), t0)
        return ok

    # ------------------------------------------------------------------ the rest of SGLang's surface

    def clear(self) -> bool:
        return self._do("clear", lambda f: f.clear(), False)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` with the pages and GB/s of each call since the last call
        (what SGLang's metrics logger expects); ``None`` when metrics are off."""
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(int(x) for x in self._metrics["prefetch_pgs"])
            m.backup_pgs.extend(int(x) for x in self._metrics["backup_pgs"])
            m.prefetch_bandwidth.extend(self._metrics["prefetch_bw"])
            m.backup_bandwidth.extend(self._metrics["backup_bw"])
            for v in self._metrics.values():
                v.clear()
        return m

    def hicache_stats(self) -> dict[str, Any]:
        """hicache's own counters (reads, hits, verification failures, bytes, evictions); ``{}``
        once closed. The facade is read once: a close on another thread between a check and
        its use made this raise ``AttributeError`` on ``None``."""
        facade = self._facade
        return facade.get_stats() if facade is not None else {}

    def close(self) -> None:
        """Drain queued writes and release the store (idempotent)."""
        with self._open_lock:
            self._closed = True
            facade, self._facade = self._facade, None
        if facade is not None:
            try:
                facade.close()
            except Exception as exc:  # noqa: BLE001 - detach must go on
                logger.error("hicache SGLang storage: close failed: %s: %s", type(exc).__name__, exc)


def _extra(prefix: Any) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix) if prefix else None)
