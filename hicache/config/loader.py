"""Loading a :class:`~hicache.config.schema.HiCacheConfig` from files, dicts and the environment.

Layers, last wins: defaults, then the file (TOML, JSON or YAML by extension), then environment
variables named ``HICACHE__<SECTION>__<FIELD>`` (double underscores separate levels, case does
not matter, values are parsed as JSON when they parse, else taken as strings)::

    HICACHE__DEVICE__PAGE_SIZE=64
    HICACHE__STORAGE__BACKEND=s3
    HICACHE__STORAGE__OPTIONS__URL=s3://bucket/prefix

A value is parsed as JSON unless the field it sets is a string field (``HICACHE__MODEL__REVISION=2024``
is the string ``"2024"``; ``null`` still means none). A variable that sets a field and another that sets a field *inside*
it (``..__PAGE_SIZE`` and ``..__PAGE_SIZE__X``) is an error whatever their order. Storage options
from the environment that the configured backend does not take are dropped with a warning (one
global ``HICACHE__STORAGE__OPTIONS__ROOT`` must not break a config whose backend has no root);
in a file they stay errors. A ``HICACHE__STORAGE__BACKEND`` that names another backend than the
file's leaves the file's storage options out (logged at info: they were the other backend's),
and ``HICACHE__STORAGE__OPTIONS={}`` (or ``null``) empties them; the same backend merges.

Every problem becomes one :class:`~hicache.errors.ConfigError` listing each bad field by its
dotted path, with what was given (shortened: an alias bomb must not take minutes to print) and
what is allowed. A file nested deeper than the parser can follow is an error too.
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiofiles
import yaml
from pydantic import TypeAdapter, ValidationError

from hicache.config.schema import HiCacheConfig, storage_backend_name, union_args
from hicache.errors import BackendLoadError, BackendNotFoundError, ConfigError, quoted
from hicache.json_keys import DuplicateKeyError, unique_keys

__all__ = ["ENV_PREFIX", "load_config", "aload_config", "config_from_dict", "env_overrides", "env_variables", "check_backend"]

logger = logging.getLogger("hicache.config")

ENV_PREFIX = "HICACHE__"


def _read_file(path: Path) -> dict[str, Any]:
    try:
        # utf-8-sig: a byte-order mark (a Windows editor's UTF-8) is no part of the text; TOML
        # refused it as an "Invalid statement" at line 1, column 1
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    return _parse_file(path, text)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's contents as read, before defaults, environment and checks (for callers
    that accept another layout beside the deployment config's, such as ``hicache replay``);
    an unreadable or malformed file is a :class:`ConfigError` naming it."""
    return _read_file(Path(path))


async def _aread_file(path: Path) -> dict[str, Any]:
    """The file read without blocking the loop: a config on a network filesystem (a shared
    deployment folder) can take seconds to open, and a server reloading it must keep serving."""
    try:
        async with aiofiles.open(path, encoding="utf-8-sig") as f:  # as _read_file
            text = await f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    return _parse_file(path, text)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping: it kept the last,
    silently, so a section pasted twice lost everything the first one set (TOML refuses them).
    A merge (``<<: *base``) is no such key: a key beside it overrides the merged one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the constructor refuses it itself
                continue
            if repeated:
                raise DuplicateKeyError(f"key {key!r} is given twice in one mapping (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_file(path: Path, text: str) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: unknown extension {suffix!r}; use .toml, .json, .yaml or .yml")
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=unique_keys)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except (ValueError, yaml.YAMLError) as exc:
        # ValueError: the parsers' own errors, a key given twice, and an integer of more than
        # 4,300 digits, which Python refuses to read (every format's parser let it through)
        raise ConfigError(f"config file {path} is not valid {suffix[1:].upper()}: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config file {path} nests too deeply to be a configuration") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object at the top level")
    return data


def _parse_env_value(raw: str, as_string: bool) -> Any:
    if as_string:
        return None if raw.strip() == "null" else raw  # null still clears an optional field
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return raw


def _is_string_field(path: list[str]) -> bool:
    """Whether ``path`` names a field of the schema typed ``str`` (or ``str | None``)."""
    model: Any = HiCacheConfig
    for part in path[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        args = getattr(field.annotation, "__args__", ())
        model = next((a for a in (field.annotation, *args) if hasattr(a, "model_fields")), None)
        if model is None:
            return False
    field = getattr(model, "model_fields", {}).get(path[-1])
    if field is None:
        return False
    ann = field.annotation
    # str, str | None; not dict[str, Any], whose arguments name str too (its JSON from the
    # environment was kept as a string and refused)
    args = union_args(ann)
    return str in args and all(a in (str, type(None)) for a in args)


def _env_path(name: str) -> list[str] | None:
    """The config path a ``HICACHE__...`` variable sets (lower case), or ``None`` for another
    variable."""
    if not name.upper().startswith(ENV_PREFIX):
        return None
    return [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]


def env_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``HICACHE__...`` variables set that name a config field, sorted."""
    environ = os.environ if environ is None else environ
    return sorted(name for name in environ if _env_path(name))


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nested dict that ``HICACHE__...`` variables describe."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    leaves: dict[tuple[str, ...], str] = {}  # path -> the variable that set it
    for name, raw in sorted(environ.items()):
        path = _env_path(name)
        if not path:
            continue
        for i in range(1, len(path)):
            if tuple(path[:i]) in leaves:
                raise ConfigError(f"environment variables {leaves[tuple(path[:i])]} and {name} conflict: "
                                  f"one sets {'.'.join(path[:i])}, the other a field inside it")
        twin = leaves.get(tuple(path))
        if twin is not None and environ[twin] != raw:
            # case does not matter in a name: two spellings of one field, and the one sorted last
            # won silently
            raise ConfigError(f"environment variables {twin} and {name} conflict: both set {'.'.join(path)}, "
                              "to different values")
        inside = next((v for p, v in leaves.items() if len(p) > len(path) and list(p[: len(path)]) == path), None)
        if inside is not None:
            raise ConfigError(f"environment variables {name} and {inside} conflict: "
                              f"one sets {'.'.join(path)}, the other a field inside it")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _parse_env_value(raw, _is_string_field(path))
        leaves[tuple(path)] = name
    return out


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<top level>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            parent = _allowed_fields(err["loc"][:-1])
            msg = f"unknown key; allowed here: {', '.join(parent)}" if parent else "unknown key"
        elif "input" in err and err["type"] not in ("missing",):
            msg = f"{msg} (got {quoted(err['input'])})"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = HiCacheConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next((a for a in (ann, *args) if hasattr(a, "model_fields")), None)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def config_from_dict(data: Mapping[str, Any], *, source: str = "dict") -> HiCacheConfig:
    """Validate a plain dict into a config (no environment layer)."""
    try:
        return HiCacheConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    except RecursionError:
        raise ConfigError(f"invalid configuration ({source}): nested too deeply") from None


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | HiCacheConfig | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    use_env: bool = True,
    check: bool = True,
) -> HiCacheConfig:
    """Defaults <- file or dict <- ``HICACHE__*`` environment; validated.

    With ``check`` the storage backend is also looked up and its options checked, so a missing
    plugin or a misspelt option fails at start-up rather than at the first write. A
    :class:`HiCacheConfig` is taken as it is (validated again, no environment): it was loaded
    already, environment included, and a caller may have changed it since (the demo sizes its
    pools and salts its namespace); layering the environment again would undo those changes.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return _finish(_read_file(path), str(path), environ, use_env, check)
    return _finish(*_in_memory(source), environ, use_env and not isinstance(source, HiCacheConfig), check)


async def aload_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | HiCacheConfig | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    use_env: bool = True,
    check: bool = True,
) -> HiCacheConfig:
    """:func:`load_config` for code on a running event loop: the file is read with ``aiofiles``
    so a slow filesystem never stalls the loop; layering and checks are the same."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return _finish(await _aread_file(path), str(path), environ, use_env, check)
    return _finish(*_in_memory(source), environ, use_env and not isinstance(source, HiCacheConfig), check)


def _in_memory(source: Mapping[str, Any] | HiCacheConfig | None) -> tuple[dict[str, Any], str]:
    if isinstance(source, HiCacheConfig):
        return source.model_dump(), "config object"
    if isinstance(source, Mapping):
        return dict(source), "dict"
    if source is None:
        return {}, "defaults"
    raise ConfigError(f"a config source is a path, a dict or a HiCacheConfig, not {type(source).__name__}")


def _finish(
    data: dict[str, Any], label: str, environ: Mapping[str, str] | None, use_env: bool, check: bool
) -> HiCacheConfig:
    """Environment overrides on top of ``data``, then validation (and the backend check)."""
    if use_env:
        env = env_overrides(environ)
        if env:
            data = _storage_options_under_env(data, env)
            if check:
                _fit_env_options(data, env, os.environ if environ is None else environ)
            data = _merge(data, env)
            label += " + HICACHE__ environment"
    config = config_from_dict(data, source=label)
    if check:
        try:
            check_backend(config)
        except ConfigError as exc:
            # named like the schema's errors: which file (and whether the environment) set the
            # backend or option was not said, and a HICACHE__STORAGE__BACKEND that named a
            # missing plugin read as a fault of a file that names none
            raise ConfigError(f"invalid configuration ({label}): {exc}") from None
    return config


def _storage_options_under_env(data: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the file's ``storage.options`` where the environment does not build on them.

    Options belong to a backend: when the environment switches ``storage.backend`` to another
    one, the file's options (``root`` of the default ``file`` backend) would be refused by the
    new backend and no variable could remove them, so they are left out (logged) and only the
    environment's options apply. An empty or null ``HICACHE__STORAGE__OPTIONS`` means "no
    options" and replaces the file's table (merged, it changed nothing). The same backend keeps
    merging the environment's options into the file's."""
    env_storage = env.get("storage")
    if not isinstance(env_storage, dict):
        return data
    if "options" in env_storage and env_storage["options"] is None:
        env_storage["options"] = {}  # null: no options (the field is a table, never null)
    storage = data.get("storage")
    if not isinstance(storage, Mapping) or not isinstance(storage.get("options"), Mapping) or not storage["options"]:
        return data
    if env_storage.get("options", None) == {}:
        return {**data, "storage": {k: v for k, v in storage.items() if k != "options"}}
    if "backend" not in env_storage:
        return data
    before = storage_backend_name(storage.get("backend", "file"))  # the schema's default backend
    after = storage_backend_name(env_storage["backend"])
    if after == before:
        return data
    logger.info("HICACHE__STORAGE__BACKEND switches the storage backend from %r to %r: the configured "
                "storage options %s (the other backend's) are left out", before, after, sorted(storage["options"]))
    return {**data, "storage": {k: v for k, v in storage.items() if k != "options"}}


def _fit_env_options(data: Mapping[str, Any], env: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Remove from ``env`` the storage options the configured backend does not take (and the
    file did not set): a global override such as ``..__OPTIONS__ROOT`` is meant for the
    backends that have that option. Options the backend annotates ``bool`` are read from their
    usual spellings (``False``, ``no``, ``0``...): a variable's text is not JSON, so it stayed
    the string ``"False"``, where a typed field spelt the same way was read as false. Options
    it annotates as text (``str``, a path, optionally ``None``) keep their variable's text
    (from ``environ``), as string fields of the schema do: read as JSON, a root folder named
    ``2024`` became the number 2024 and the backend refused it."""
    options = env.get("storage", {}).get("options") if isinstance(env.get("storage"), dict) else None
    if not isinstance(options, dict) or not options:
        return
    storage = _merge(dict(data.get("storage") or {}) if isinstance(data.get("storage"), Mapping) else {},
                     {k: v for k, v in env["storage"].items() if k != "options"})
    name = storage.get("backend", "file")
    if not isinstance(name, str) or not name:
        return
    from hicache.storage.options import takes_bool, takes_str
    from hicache.storage.registry import backend_options

    try:
        params = backend_options(name)
    except (BackendNotFoundError, BackendLoadError):
        return  # check_backend reports the backend itself
    allowed = set(params) - {"namespace"}
    file_options = storage.get("options") if isinstance(storage.get("options"), Mapping) else {}
    for key in sorted(set(options) - allowed - set(file_options or {})):
        logger.warning("ignoring HICACHE__STORAGE__OPTIONS__%s: backend %r has no option %r", key.upper(), name, key)
        del options[key]
    texts = {path[2]: raw for name, raw in sorted(environ.items())
             if (path := _env_path(name)) is not None and len(path) == 3 and path[:2] == ["storage", "options"]}
    for key in options.keys() & allowed:
        if takes_bool(params[key]):
            options[key] = _as_bool(options[key])
        elif takes_str(params[key]) and key in texts:
            options[key] = _parse_env_value(texts[key], True)  # null still clears an optional one


def _as_bool(value: Any) -> Any:
    """``value`` read as a boolean the way a typed field of the schema reads it (pydantic's lax
    booleans: ``False``, ``no``, ``0``, ``off``... in any case), or unchanged when it is none, for
    the backend's own check to refuse."""
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return value


def check_backend(config: HiCacheConfig) -> None:
    """Fail early if the storage backend does not exist or its options are wrong."""
    name = config.storage.backend
    if not name:
        return
    from hicache.storage.registry import available_backends, backend_options

    try:
        allowed = backend_options(name)
    except BackendNotFoundError as exc:
        raise ConfigError(f"storage.backend: {exc}") from None
    except BackendLoadError as exc:
        raise ConfigError(f"storage.backend: {exc}") from None
    if "namespace" in config.storage.options:
        # every backend takes ``namespace``, but a deployment's is made from [model] and
        # storage.namespace_salt (stack.config_namespace): one given here replaced it, so
        # neither the model nor the salt kept pages apart any more (and a string crashed the
        # start with an AttributeError)
        raise ConfigError("storage.options.namespace: the storage namespace comes from [model] and "
                          "storage.namespace_salt; set storage.namespace_salt to keep pages apart")
    unknown = sorted(set(config.storage.options) - set(allowed) - {"namespace"})
    if unknown:
        raise ConfigError(
            f"storage.options: backend {name!r} has no option(s) {unknown}; allowed: "
            f"{sorted(k for k in allowed if k != 'namespace')} (backends: {available_backends()})"
        )
    from hicache.storage.options import bool_option, takes_bool

    for key, value in config.storage.options.items():
        if key in allowed and takes_bool(allowed[key]):  # a string "false" is refused here, not taken as true later
            try:
                bool_option(name, key, value)
            except ConfigError as exc:
                raise ConfigError(f"storage.options: {exc}") from None
