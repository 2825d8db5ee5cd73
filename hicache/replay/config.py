"""Replay configuration: tier capacities, KV geometry, storage and controller options.

A replay config file is a deployment config (:class:`hicache.config.HiCacheConfig`, the same
TOML schema as every file in ``configs/``): ``device.size_tokens``, ``host.size_bytes`` and the
storage backend's ``options.max_bytes`` give each tier's capacity, ``model`` the (tiny) KV
geometry, ``cache`` the policies. ``configs/replay-20pct.toml`` sizes the tiers at 1% / 5% / 20%
of the Mooncake trace's 43,924 unique blocks.

For programs, :meth:`ReplayConfig.from_dict` also takes capacities relative to the trace::

    {"tiers": {"device_fraction": 0.01, "host_fraction": 0.05, "storage_fraction": 0.2},
     "kv": {"page_size": 512, "layer_num": 1, "head_num": 1, "head_dim": 2, "dtype": "float32"},
     "storage": {"backend": "memory"}, "controller": {"prefetch_policy": "wait_complete"}}

``storage.backend`` ``""`` or ``"none"`` is no storage tier (capacity 0, as a deployment config
reads them); ``storage.options.max_bytes`` bounds the store, so it sizes the storage tier when
``tiers`` does not, and must agree with ``storage_blocks`` when both are given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from hicache.config.schema import storage_backend_name
from hicache.controller.config import ControllerConfig
from hicache.errors import ConfigError
from hicache.placement import PLACEMENT_POLICIES, make_placement
from hicache.stack import controller_options, mha_page_nbytes, stack_config_from, stored_page_nbytes

__all__ = ["ReplayConfig", "load_replay_config"]

logger = logging.getLogger(__name__)

_TIERS = ("device", "host", "storage")
#: KV dtypes that hold the synthetic KV of :mod:`hicache.replay.synthetic` exactly
_EXACT_DTYPES = ("float32", "float16", "bfloat16")
#: why a storage tier needs a host tier: a replay ran a one-page host in its place, the storage
#: tier never held a page, and the report and the nested LRU still counted it
NO_HOST_TIER = ("the host tier holds no page, but every page moves between device and storage through it: "
                "the storage tier would hold nothing; give [tiers] a host_blocks or host_fraction that holds "
                "a page, or no storage tier")
_REPLAY_KEYS = (
    "eviction_policy", "placement", "placement_options", "drain_between_requests", "verify", "max_requests",
    "attribution_ledger_pages", "explain_misses",
)


@dataclasses.dataclass(kw_only=True)
class ReplayConfig:
    """Everything one replay needs (see the module docstring for the TOML layout)."""

    fractions: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"device": 0.01, "host": 0.05, "storage": 0.20}
    )
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    pages: dict[str, int] = dataclasses.field(default_factory=dict)
    capacity_basis: str = "trace"
    device: str = "cpu"
    host_layout: str = "page_first"
    load_back_quota_tokens: int | None = None
    page_size: int = 512
    layer_num: int = 1
    head_num: int = 1
    head_dim: int = 2
    dtype: str = "float32"
    storage_backend: str | None = "memory"
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    eviction_policy: str = "lru"
    placement: str = "lru"
    placement_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    drain_between_requests: bool = True
    verify: bool = True
    max_requests: int | None = None
    #: page keys the miss attribution remembers (``None``: the stack's default) and its explain
    #: mode, as a deployment's ``cache`` section sets them: the README has the replay raise
    #: the ledger to explain ``unknown`` misses, and the replay dropped both
    attribution_ledger_pages: int | None = None
    explain_misses: bool = False
    controller: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"write_policy": "write_through", "prefetch_policy": "wait_complete"}
    )

    def __post_init__(self) -> None:
        # "" and "none" say "no storage tier", as in a deployment config (whose schema reads
        # them so): "none" was a backend name not found after the whole trace was read
        self.storage_backend = storage_backend_name(self.storage_backend)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of this geometry's KV (what ``max_bytes`` is counted in)."""
        return mha_page_nbytes(self.page_size, self.layer_num, self.head_num, self.head_dim, self.dtype)

    def storage_bound_pages(self) -> int | None:
        """Pages ``[storage] options.max_bytes`` bounds the store to (``None``: not set, or no
        storage tier). The store is built with that bound whatever ``[tiers]`` says, so it is
        the tier's size: the report and the reference LRU count this, not another."""
        if self.storage_backend is None or "max_bytes" not in self.storage_options:
            return None
        return _bound_pages(self.storage_backend, self.storage_options["max_bytes"], self.page_nbytes,
                            "[storage] options.max_bytes")

    def controller_config(self) -> ControllerConfig:
        return ControllerConfig.from_dict(dict(self.controller))

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a value of the wrong type or range: found here, before
        the trace is read, and not as a ``TypeError`` or ``ZeroDivisionError`` mid-replay (or
        a result thrown away by a check after it)."""
        for name in ("page_size", "layer_num", "head_num", "head_dim"):
            _check_int(getattr(self, name), name, minimum=1)
        if 512 % self.page_size:
            raise ConfigError(f"page_size must divide the trace block (512), got {self.page_size}")
        if self.dtype not in _EXACT_DTYPES:
            # the synthetic KV is exact only in these; in float8 most tokens share a value, so
            # bit-exact verification would pass pages of the wrong tokens
            raise ConfigError(f"dtype {self.dtype!r} cannot hold exact synthetic KV; allowed: {list(_EXACT_DTYPES)}")
        for tier, value in self.fractions.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ConfigError(f"[tiers] {tier}_fraction must be a number >= 0, got {value!r}")
        for kind, table in (("blocks", self.blocks), ("pages", self.pages)):
            for tier, value in table.items():
                _check_int(value, f"{tier} {kind}", minimum=0)
        if self.max_requests is not None:
            _check_int(self.max_requests, "max_requests", minimum=0)
        if self.load_back_quota_tokens is not None:
            _check_int(self.load_back_quota_tokens, "load_back_quota_tokens", minimum=0)
        if self.attribution_ledger_pages is not None:
            _check_int(self.attribution_ledger_pages, "attribution_ledger_pages", minimum=0)
        for name in ("drain_between_requests", "verify", "explain_misses"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("eviction_policy", "placement"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.placement not in PLACEMENT_POLICIES:
            # found here, not by the stack: a comparison replays its own list and reads this only
            # to know whose placement_options apply, so a misspelt name ran without them, silently
            raise ConfigError(f"unknown placement policy {self.placement!r}; allowed: {sorted(PLACEMENT_POLICIES)}")
        if self.storage_backend is not None and (not isinstance(self.storage_backend, str) or not self.storage_backend):
            raise ConfigError(f"[storage] backend must be a backend's name (a string), got {self.storage_backend!r}")
        for name in ("placement_options", "storage_options", "controller"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a table, got {type(getattr(self, name)).__name__}")
        self._check_storage_bound()
        if self._storage_sized() and self._host_unsized():
            raise ConfigError(NO_HOST_TIER)
        self.controller_config()
        # built once now: a comparison applies the options to this policy's replay only, and a
        # bad one was found when its turn came, after the other policies' replays had run
        make_placement(self.placement, self.placement_options)

    def _host_unsized(self) -> bool:
        """Whether the host tier is 0 pages whatever the trace (sized 0, or not sized in a
        ``[tiers]`` table that sizes the others)."""
        for table in (self.pages, self.blocks):
            if "host" in table:
                return int(table["host"]) == 0
        return not self.fractions.get("host", 0.0)

    def _storage_sized(self) -> bool:
        """Whether the storage tier may hold pages (by the order :meth:`capacity_blocks` sizes it)."""
        if self.storage_backend is None:
            return False
        for table in (self.pages, self.blocks):
            if "storage" in table:
                return int(table["storage"]) > 0
        return self.storage_bound_pages() is not None or bool(self.fractions.get("storage", 0.0))

    def _check_storage_bound(self) -> None:
        """A :class:`ConfigError` for a ``max_bytes`` that is no size, or that says another
        size than the storage tier's pages or blocks: the store was bounded by it while the
        tiers line and the reference LRU counted the tier (20 blocks named, 4 replayed)."""
        bound = self.storage_bound_pages()  # (a bound that is no size is refused there)
        if bound is None:
            return
        if "storage" in self.pages:
            tier, what = int(self.pages["storage"]), f"{self.pages['storage']} pages"
        elif "storage" in self.blocks:
            tier, what = int(self.blocks["storage"]) * (512 // self.page_size), f"storage_blocks = {self.blocks['storage']}"
        else:
            return  # sized by max_bytes alone (a fraction gives way to it, see capacity_blocks)
        if tier != bound:
            raise ConfigError(f"[storage] options.max_bytes ({self.storage_options['max_bytes']}) bounds the store "
                              f"to {bound} pages but "
                              f"[tiers] {what} is {tier} pages; set one of them")

    def capacity_blocks(self, unique: int) -> dict[str, int]:
        """Capacity of each tier in trace blocks for ``unique`` unique blocks. No storage
        backend is no storage tier; a storage tier not sized in pages or blocks is the store's
        ``max_bytes`` when it has one (that is the bound it runs with), else its fraction."""
        out = {}
        bound = self.storage_bound_pages()
        for tier in _TIERS:
            if tier == "storage" and self.storage_backend is None:
                out[tier] = 0
            elif tier in self.pages:
                out[tier] = int(self.pages[tier]) * self.page_size // 512
            elif tier in self.blocks:
                out[tier] = int(self.blocks[tier])
            elif tier == "storage" and bound is not None:
                out[tier] = bound * self.page_size // 512
            else:
                out[tier] = _fraction_blocks(tier, float(self.fractions.get(tier, 0.0)), unique)
        return out

    def sized_by_trace(self) -> bool:
        """Whether a tier is a fraction of the trace's unique blocks (as :meth:`capacity_blocks`
        sizes it) and the basis is the whole trace: only then must a replay of its first
        requests read all of it."""
        if self.capacity_basis != "trace":
            return False
        bound = self.storage_bound_pages()
        for tier in _TIERS:
            if tier in self.pages or tier in self.blocks:
                continue
            if tier == "storage" and (self.storage_backend is None or bound is not None):
                continue
            if self.fractions.get(tier, 0.0):
                return True
        return False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayConfig:
        data = dict(data)
        cfg = cls()
        sections = {"tiers", "kv", "storage", "controller", "replay"}
        unknown = sorted(set(data) - sections)
        if unknown:
            raise ConfigError(f"unknown replay config section(s) {unknown}; allowed: {sorted(sections)}")
        tiers = _table(data, "tiers")
        # basis first: it sizes no tier, so a table of it alone keeps the default fractions
        # (tested for emptiness before it was popped, every tier was 0 blocks)
        basis = tiers.pop("basis", "trace")
        if tiers:
            cfg.fractions, cfg.blocks = {}, {}
        if basis not in ("trace", "replayed"):
            raise ConfigError(f"[tiers] basis must be 'trace' or 'replayed', got {basis!r}")
        cfg.capacity_basis = basis
        for key, value in tiers.items():
            tier, _, kind = str(key).partition("_")  # a YAML key may be a number
            if tier not in _TIERS or kind not in ("fraction", "blocks"):
                raise ConfigError(
                    f"[tiers] {key!r} unknown; use <tier>_fraction or <tier>_blocks with tier in {list(_TIERS)}"
                )
            (cfg.fractions if kind == "fraction" else cfg.blocks)[tier] = value
        kv = _table(data, "kv")
        for key, value in kv.items():
            if key not in ("page_size", "layer_num", "head_num", "head_dim", "dtype"):
                raise ConfigError(f"[kv] {key!r} unknown; allowed: page_size, layer_num, head_num, head_dim, dtype")
            setattr(cfg, key, value)
        storage = _table(data, "storage")
        for key in storage:
            if key not in ("backend", "options"):
                raise ConfigError(f"[storage] {key!r} unknown; allowed: backend, options")
        if "backend" in storage:
            cfg.storage_backend = storage_backend_name(storage["backend"] or None)
        cfg.storage_options = _table(storage, "options", "[storage] options")
        if "storage_fraction" in tiers and cfg.storage_backend is not None and "max_bytes" in cfg.storage_options:
            # a fraction of a trace not read yet cannot be checked against the bound
            raise ConfigError("[tiers] storage_fraction and [storage] options.max_bytes both size the storage "
                              "tier; set one of them (or storage_blocks equal to max_bytes)")
        replay = _table(data, "replay")
        for key, value in replay.items():
            if key not in _REPLAY_KEYS:
                raise ConfigError(f"[replay] {key!r} unknown; allowed: {', '.join(_REPLAY_KEYS)}")
            setattr(cfg, key, value)
        if "controller" in data:
            if not isinstance(data["controller"], dict):
                raise ConfigError("[controller] must be a table")
            cfg.controller = {**cfg.controller, **dict(data["controller"])}
        cfg.validate()  # now, not mid-replay
        return cfg


    def capacity_pages(self, unique: int) -> dict[str, int]:
        """Capacity of each tier in pages (absolute pages win over blocks and fractions)."""
        per_block = 512 // self.page_size
        blocks = self.capacity_blocks(unique)
        out = {tier: int(self.pages[tier]) if tier in self.pages else blocks[tier] * per_block for tier in _TIERS}
        bound = self.storage_bound_pages()
        if self.storage_backend is None:
            out["storage"] = 0
        elif bound is not None and "storage" not in self.pages and "storage" not in self.blocks:
            out["storage"] = bound  # whole pages, not the whole blocks of capacity_blocks
        return out

    @classmethod
    def from_hicache_config(cls, config: Any) -> ReplayConfig:
        """Replay settings from a deployment config (``hicache.config.HiCacheConfig``): the
        same geometry and capacities the facade would build (:func:`stack_config_from`)."""
        model = config.model
        if model.attention != "mha":
            raise ConfigError("replay: only MHA geometry is supported (model.attention = 'mha')")
        if model.kv_dtype not in _EXACT_DTYPES:
            raise ConfigError(f"replay: model.kv_dtype {model.kv_dtype!r} cannot hold exact synthetic KV")
        st = stack_config_from(config, namespace=False)  # each run's pages have a namespace of their own
        ps = st.page_size
        pages = {"device": st.device_pages, "host": st.host_pages}
        if st.storage_backend and "max_bytes" in st.storage_options:
            # checked here: the replay sizes the tier from it before the backend sees it, and
            # int() made nan or a string a traceback, true or a size under one page a replay
            # with no storage at all
            pages["storage"] = _bound_pages(st.storage_backend, st.storage_options["max_bytes"], st.page_nbytes,
                                            "replay: storage.options.max_bytes")
        else:
            pages["storage"] = 0
            if st.storage_backend:
                _warn_unsized_storage(st.storage_backend)
        cfg = cls(
            fractions={},
            pages=pages,
            page_size=ps,
            layer_num=st.layer_num,
            head_num=st.head_num,
            head_dim=st.head_dim,
            dtype=st.dtype,
            storage_backend=st.storage_backend,
            storage_options=dict(st.storage_options),
            eviction_policy=st.eviction_policy,
            placement=st.placement,
            placement_options=dict(st.placement_options),
            controller=controller_options(config),
            device=st.device,
            host_layout=st.host_layout,
            load_back_quota_tokens=config.cache.load_back_quota_tokens,
            attribution_ledger_pages=st.attribution_ledger_pages,
            explain_misses=st.explain_misses,
        )
        if 512 % ps:
            raise ConfigError(f"replay: device.page_size must divide the trace block (512), got {ps}")
        cfg.validate()
        return cfg


def _fraction_blocks(tier: str, fraction: float, unique: int) -> int:
    """The whole blocks ``fraction`` of ``unique`` blocks is; a :class:`ConfigError` where that
    is more than a float counts (``1e308`` of the trace's blocks: ``int(inf)`` was an
    ``OverflowError`` traceback mid-replay, where a large but countable tier is refused by
    the memory check, naming it)."""
    blocks = unique * fraction
    if not math.isfinite(blocks):
        raise ConfigError(f"[tiers] {tier}_fraction {fraction:g} of the trace's {unique} unique blocks is more "
                          "blocks than can be counted; size the tier with a fraction of about 1 or less")
    return int(blocks)


def _warn_env_ignored(path: str | os.PathLike[str]) -> None:
    """One warning naming the ``HICACHE__`` variables set, which a replay-native config does not
    take (its fields are not the deployment schema's): ``--config`` says they override the file,
    and ``HICACHE__STORAGE__BACKEND=none`` was ignored without a word."""
    from hicache.config import env_variables

    names = env_variables()
    if names:
        logger.warning("replay: %s is a replay config ([tiers], [kv], ...), which %s do not apply to; they are "
                       "ignored (they override a deployment config's fields)", path, ", ".join(names))


def _warn_unsized_storage(backend: str) -> None:
    """One warning line for a deployment's store the replay cannot size: the replay then runs
    the device and host tiers alone, and the tiers line's ``storage 0`` was the only sign. A
    warning, not an error: those tiers and the policies' host placement are the deployment's
    own and still measured; a store with no bound (``s3``, ``fsspec``) has no size to replay."""
    from hicache.storage.registry import backend_options

    try:
        sizable = "max_bytes" in backend_options(backend)
    except Exception:  # noqa: BLE001 - not installed: the stack names it when it is built
        sizable = False
    how = ("set storage.options.max_bytes (its capacity in bytes)" if sizable else
           f"{backend!r} takes no max_bytes: replay a copy with backend = \"memory\" and options.max_bytes")
    logger.warning("replay: storage backend %r has no max_bytes to size the storage tier from, so this replay "
                   "has no storage tier; to replay one, %s", backend, how)


def _bound_pages(backend: str, max_bytes: Any, page_nbytes: int, what: str) -> int:
    """The pages a store of ``backend`` bounded to ``max_bytes`` holds, counted as the store
    counts a page (a file store each page file whole, header and footer too); a
    :class:`ConfigError` naming ``what`` for a bound that is no size or holds no page (nan or
    a string was an ``int()`` traceback, true or a size under one page a replay that silently
    had no storage tier)."""
    one = stored_page_nbytes(backend, page_nbytes)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < one:
        raise ConfigError(f"{what} must be an integer of at least one page ({one} bytes as the {backend} "
                          f"store counts it), got {max_bytes!r}")
    return max_bytes // one


def _table(data: dict[str, Any], key: str, what: str | None = None) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{what or f'[{key}]'} must be a table, got {type(value).__name__}")
    return dict(value)


def _check_int(value: object, what: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")


def load_replay_config(path: str | os.PathLike[str]) -> ReplayConfig:
    """A replay config from a file: a deployment config (``configs/*.toml``), or the
    replay-native layout of :meth:`ReplayConfig.from_dict` (sections ``tiers``/``kv``/...)."""
    from hicache.config import load_config
    from hicache.config.loader import read_config_file

    data = read_config_file(path)  # TOML, JSON or YAML; unreadable or malformed: ConfigError
    if set(data) & {"tiers", "kv", "replay", "controller"}:
        _warn_env_ignored(path)
        return ReplayConfig.from_dict(data)
    return ReplayConfig.from_hicache_config(load_config(path))
