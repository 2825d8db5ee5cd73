"""Finding storage backends through the ``hicache.backends`` entry-point group.

Discovery reads entry-point metadata without importing anything; a backend is imported on first
use. Our own backends are registered exactly like a third-party plugin::

    [project.entry-points."hicache.backends"]
    mybackend = "my_package.module:MyStorage"

A plugin registering a built-in name (``file``, ``s3``...) is ignored, with a warning, wherever
it is installed. ``register_backend`` adds one at run time (for applications that do not install a package).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from hicache.errors import BackendLoadError, BackendNotFoundError, ConfigError, HiCacheError
from hicache.storage.base import AsyncHiCacheStorage
from hicache.storage.sync import HiCacheStorage
from hicache.storage.types import HiCacheStorageConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_backends",
    "backend_class",
    "backend_options",
    "create_async_storage",
    "create_storage",
    "refresh_backends",
    "register_backend",
]

ENTRY_POINT_GROUP = "hicache.backends"
logger = logging.getLogger("hicache.storage")

_lock = threading.Lock()
_discovered: dict[str, EntryPoint] | None = None
_runtime: dict[str, type[AsyncHiCacheStorage] | str] = {}
_loaded: dict[str, type[AsyncHiCacheStorage]] = {}
_EXTRA_HINT = {"s3": "s3", "fsspec": "s3"}


def _discover() -> dict[str, EntryPoint]:
    global _discovered
    with _lock:
        if _discovered is None:
            found: dict[str, EntryPoint] = {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                first = found.get(ep.name)
                if first is not None and first.value != ep.value:
                    # a built-in name stays hicache's: which came first was sys.path's order, and
                    # a plugin installed ahead of hicache replaced its store for every config
                    # naming it (a plugin must register a name of its own)
                    if _built_in(ep) and not _built_in(first):
                        found[ep.name] = ep
                    logger.warning(
                        "two distributions register backend %r (%s and %s); using %s",
                        ep.name, first.value, ep.value,
                        f"the built-in {found[ep.name].value}" if _built_in(found[ep.name]) else "the first",
                    )
                    continue
                found[ep.name] = ep
            _discovered = found
        return _discovered


def _built_in(ep: EntryPoint) -> bool:
    """Whether ``ep`` is one of hicache's own backends (registered by the ``hicache`` distribution).

    A distribution whose metadata names none (a ``.dist-info`` without ``METADATA``, or one
    without a ``Name``) is not hicache: its name was ``None``, and ``.lower()`` of it an
    ``AttributeError`` out of every backend lookup, ``file`` included, once it registered a
    name another distribution registers."""
    if ep.dist is None:
        return False
    try:
        name = ep.dist.metadata["Name"]
    except Exception:  # noqa: BLE001 - metadata that cannot be read names no distribution
        return False
    return isinstance(name, str) and name.lower() == "hicache"


def refresh_backends() -> None:
    """Forget what was discovered and loaded (after installing a plugin at run time)."""
    global _discovered
    with _lock:
        _discovered = None
        _loaded.clear()


def available_backends() -> list[str]:
    """Names of every registered backend, installed plugins included."""
    return sorted(set(_discover()) | set(_runtime))


def register_backend(name: str, target: type[AsyncHiCacheStorage] | str) -> None:
    """Register a backend class (or ``"module:Class"``) under ``name`` for this process."""
    _runtime[name] = target
    _loaded.pop(name, None)


def _import_target(name: str, value: str) -> Any:
    # parsed as the entry-point syntax has it, not split at ":" by hand: a value may name extras
    # ("mod:Class [fast]") and put spaces around the colon, and such valid plugins were refused
    # ("... does not exist", "No module named 'mod '")
    match = EntryPoint.pattern.match(value)
    if match is None:
        raise BackendLoadError(f"storage backend {name!r}: {value!r} is not a 'module:attribute' reference")
    module_name, attr = match.group("module"), match.group("attr") or ""
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        hint = _EXTRA_HINT.get(name)
        extra = f" (pip install 'hicache[{hint}]')" if hint else ""
        raise BackendLoadError(f"storage backend {name!r} could not be imported: {exc}{extra}") from exc
    except Exception as exc:  # noqa: BLE001 - a plugin that crashes on import, or a bad target
        raise BackendLoadError(
            f"storage backend {name!r}: importing {value!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise BackendLoadError(f"storage backend {name!r}: {value} does not exist") from exc
    return obj


def backend_class(name: str) -> type[AsyncHiCacheStorage]:
    """The class registered under ``name``, imported now if it was not yet."""
    if name in _loaded:
        return _loaded[name]
    target: Any
    if name in _runtime:
        target = _runtime[name]
        if isinstance(target, str):
            target = _import_target(name, target)
    else:
        eps = _discover()
        if name not in eps:
            raise BackendNotFoundError(
                f"no storage backend named {name!r}; available: {available_backends()} "
                f"(plugins register in the {ENTRY_POINT_GROUP!r} entry-point group)"
            )
        target = _import_target(name, eps[name].value)
    if not (isinstance(target, type) and issubclass(target, AsyncHiCacheStorage)):
        raise BackendLoadError(
            f"storage backend {name!r} is {target!r}, which is not an AsyncHiCacheStorage subclass"
        )
    missing = sorted(getattr(target, "__abstractmethods__", ()))
    if missing:
        # such a class can never be built: refused here, where a config is checked at start,
        # not when built (a TypeError then, reported as a ConfigError blaming the options)
        raise BackendLoadError(
            f"storage backend {name!r} ({target.__module__}.{target.__qualname__}) does not implement {missing}"
        )
    _loaded[name] = target
    return target


def backend_options(name: str) -> dict[str, inspect.Parameter]:
    """The keyword options a backend's constructor accepts: its own, and where it takes
    ``**kwargs``, those of the base class it passes them on to (the usual subclass: a plugin
    that wraps ``file`` with ``def __init__(self, *args, latency_ms=0, **kwargs)``).

    Why the bases: read from the class's own signature alone, such a backend's base options
    (``root``, ``max_bytes``...) were refused by the config check as unknown, though the
    backend takes them."""
    options: dict[str, inspect.Parameter] = {}
    for klass in backend_class(name).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        params = inspect.signature(init).parameters
        for k, p in params.items():
            if k not in ("self", "storage_config") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                options.setdefault(k, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return options


def create_async_storage(
    name: str, storage_config: HiCacheStorageConfig | None = None, /, **options: Any
) -> AsyncHiCacheStorage:
    """Build the backend registered as ``name``; unknown or missing options are clear errors.

    ``name`` and ``storage_config`` are positional only: options come from users' configs
    (``storage.options``, a vLLM tier's ``options``), and one called ``name`` or
    ``storage_config`` was a raw ``TypeError`` ("got multiple values") instead of an option
    the backend does not have."""
    cls = backend_class(name)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = backend_options(name)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(
                f"storage backend {name!r} has no option(s) {unknown}; allowed: {sorted(allowed)}"
            )
        missing = sorted(
            k for k, p in allowed.items() if p.default is p.empty and k not in options
        )
        if missing:
            raise ConfigError(f"storage backend {name!r} needs option(s) {missing}")
    try:
        return cls(storage_config, **options)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"storage backend {name!r}: {exc}") from exc
    except (HiCacheError, OSError):
        raise  # said already (a root that cannot be made names itself)
    except Exception as exc:  # noqa: BLE001 - a plugin whose constructor crashes, as at import
        raise BackendLoadError(f"storage backend {name!r} could not be created: {type(exc).__name__}: {exc}") from exc


def create_storage(
    name: str,
    storage_config: HiCacheStorageConfig | None = None,
    /,
    *,
    call_timeout: float | None = None,
    **options: Any,
) -> HiCacheStorage:
    """Like :func:`create_async_storage`, wrapped in the blocking :class:`HiCacheStorage`."""
    return HiCacheStorage(create_async_storage(name, storage_config, **options), call_timeout=call_timeout)
