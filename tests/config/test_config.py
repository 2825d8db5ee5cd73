"""Every shipped config loads; bad values, unknown keys and missing backends are actionable."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from hicache.config import HiCacheConfig, env_overrides, load_config
from hicache.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_configs_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"default.toml", "memory.toml", "s3.toml", "hybrid.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path: Path) -> None:
    config = load_config(path, environ={}, check=path.name != "s3.toml" or _has_s3())
    assert isinstance(config, HiCacheConfig)


def _has_s3() -> bool:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


def test_default_is_the_embedded_file_backend() -> None:
    config = load_config(CONFIGS[0].parent / "default.toml", environ={}, check=False)
    assert config.storage.backend == "file"


def test_json_and_yaml_equivalents(tmp_path: Path) -> None:
    data = {"device": {"page_size": 32, "size_tokens": 1024}, "storage": {"backend": "memory"}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    a = load_config(tmp_path / "c.json", environ={})
    b = load_config(tmp_path / "c.yaml", environ={})
    assert a == b and a.device.page_size == 32


def test_bad_values_name_field_and_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"cache": {"eviction_policy": "fifo"}, "device": {"page_size": -2}}, environ={}, check=False)
    msg = str(info.value)
    assert "cache.eviction_policy" in msg and "'lru'" in msg and "fifo" in msg
    assert "device.page_size" in msg


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"devise: unknown key; allowed here: .*device"):
        load_config({"devise": {}}, environ={}, check=False)
    with pytest.raises(ConfigError, match=r"host.layuot: unknown key; allowed here: .*layout"):
        load_config({"host": {"layuot": "page_first"}}, environ={}, check=False)


def test_cross_field_validation() -> None:
    with pytest.raises(ConfigError, match="multiple of device.page_size"):
        load_config({"device": {"size_tokens": 100, "page_size": 16}}, environ={}, check=False)
    with pytest.raises(ConfigError, match="reserved"):
        load_config({"extra_pools": [{"name": "kv"}]}, environ={}, check=False)


def test_missing_backend_and_bad_options() -> None:
    with pytest.raises(ConfigError, match=r"no storage backend named 'nope'; available: .*memory"):
        load_config({"storage": {"backend": "nope"}}, environ={})
    with pytest.raises(ConfigError, match=r"no option\(s\) \['bogus'\]"):
        load_config({"storage": {"backend": "memory", "options": {"bogus": 1}}}, environ={})


def test_environment_overrides() -> None:
    env = {
        "HICACHE__DEVICE__PAGE_SIZE": "64",
        "HICACHE__STORAGE__BACKEND": "memory",
        "HICACHE__STORAGE__OPTIONS__MAX_BYTES": "1024",
        "HICACHE__CACHE__PREFETCH__POLICY": "best_effort",
        "UNRELATED": "x",
    }
    assert env_overrides(env)["storage"]["options"] == {"max_bytes": 1024}
    config = load_config({"device": {"page_size": 16}}, environ=env)
    assert config.device.page_size == 64
    assert config.storage.backend == "memory" and config.storage.options == {"max_bytes": 1024}
    assert config.cache.prefetch.policy == "best_effort"
    with pytest.raises(ConfigError, match="device.page_size"):
        load_config(None, environ={"HICACHE__DEVICE__PAGE_SIZE": "many"}, check=False)


def test_environment_switches_the_backend_of_the_default_config(caplog: pytest.LogCaptureFixture) -> None:
    """The loader's own example (``HICACHE__STORAGE__BACKEND=s3`` + ``..__OPTIONS__URL``) on the
    shipped default was refused: the file backend's ``root`` and ``max_bytes`` came along to a
    backend without them, and ``HICACHE__STORAGE__OPTIONS={}`` merged into them, changing nothing."""
    default = Path(__file__).parents[2] / "configs" / "default.toml"
    caplog.set_level(logging.INFO, logger="hicache.config")
    config = load_config(default, environ={"HICACHE__STORAGE__BACKEND": "memory",
                                           "HICACHE__STORAGE__OPTIONS__MAX_BYTES": "1024"})
    assert config.storage.backend == "memory" and config.storage.options == {"max_bytes": 1024}
    assert any("'file' to 'memory'" in r.getMessage() and "['max_bytes', 'root']" in r.getMessage()
               for r in caplog.records)
    config = load_config(default, environ={"HICACHE__STORAGE__BACKEND": "s3", "HICACHE__STORAGE__OPTIONS__URL": "s3://b/p"},
                         check=_has_s3())
    assert config.storage.backend == "s3" and config.storage.options == {"url": "s3://b/p"}
    for empty in ("{}", "null"):  # an empty table replaces the file's
        config = load_config(default, environ={"HICACHE__STORAGE__OPTIONS": empty})
        assert config.storage.backend == "file" and config.storage.options == {}
    # the same backend still merges into the file's options
    config = load_config(default, environ={"HICACHE__STORAGE__BACKEND": "file", "HICACHE__STORAGE__OPTIONS__ROOT": "/srv/kv"})
    assert config.storage.options == {"root": "/srv/kv", "max_bytes": 4294967296}


@pytest.mark.parametrize("text", ["2024", "true", "1e3", "[1]"])
def test_text_backend_options_from_the_environment_stay_text(text: str) -> None:
    """``HICACHE__STORAGE__OPTIONS__ROOT=2024`` (the README's variable, a folder named by a
    year) was read as JSON into the number 2024 and the file backend refused it; ``true`` and
    ``1e3`` changed type too. An option the backend annotates as text or a path keeps the text;
    a number option is still read as one."""
    default = str(Path(__file__).resolve().parents[2] / "configs" / "default.toml")
    config = load_config(default, environ={"HICACHE__STORAGE__OPTIONS__ROOT": text,
                                           "HICACHE__STORAGE__OPTIONS__MAX_BYTES": "1024"})
    assert config.storage.options["root"] == text and config.storage.options["max_bytes"] == 1024
    config = load_config({"storage": {"backend": "memory"}}, environ={"HICACHE__STORAGE__OPTIONS__STORE_ID": text})
    assert config.storage.options == {"store_id": text}


def test_takes_str_reads_text_and_path_annotations() -> None:
    import inspect
    import os

    from hicache.storage.options import takes_str

    def param(ann: object) -> inspect.Parameter:
        return inspect.Parameter("x", inspect.Parameter.KEYWORD_ONLY, annotation=ann)

    for ann in (str, str | None, str | os.PathLike[str] | None, Path, "str", "str | os.PathLike[str] | None", "Path | None"):
        assert takes_str(param(ann)), ann
    for ann in (int, bool, "int | None", "str | int", str | int, "dict[str, Any] | None", None, inspect.Parameter.empty):
        assert not takes_str(param(ann)), ann


def test_boolean_backend_options_from_the_environment_are_read_as_booleans(tmp_path: Path) -> None:
    """``HICACHE__STORAGE__OPTIONS__SHARED=False`` stayed the string ``"False"`` (not JSON) and the
    file store took it as true, where ``HICACHE__SESSION__ENABLED=False`` was read as false."""
    env = {"HICACHE__STORAGE__OPTIONS__SHARED": "False", "HICACHE__STORAGE__OPTIONS__FSYNC": "no",
           "HICACHE__STORAGE__OPTIONS__SKIP_EXISTING": "0", "HICACHE__STORAGE__OPTIONS__REMOVAL_JOURNAL": "YES",
           "HICACHE__SESSION__ENABLED": "False"}
    config = load_config({"storage": {"backend": "file", "options": {"root": str(tmp_path)}}}, environ=env)
    assert config.session.enabled is False
    assert config.storage.options == {"root": str(tmp_path), "shared": False, "fsync": False,
                                      "skip_existing": False, "removal_journal": True}
    with pytest.raises(ConfigError, match=r"storage\.options: .*option shared must be true or false, got 'maybe'"):
        load_config(None, environ={"HICACHE__STORAGE__OPTIONS__SHARED": "maybe"})
    # a file has real booleans: a string there is an error at load, not true at the first write
    path = tmp_path / "c.toml"
    path.write_text('[storage]\nbackend = "file"\noptions = { fsync = "false" }\n')
    with pytest.raises(ConfigError, match="option fsync must be true or false, got 'false'"):
        load_config(path, environ={})


async def test_a_loaded_config_object_is_taken_as_it_is() -> None:
    """A config loaded once (environment applied) and then changed by its caller keeps the
    changes when it is handed on: the environment is not layered a second time."""

    from hicache.config.loader import aload_config

    env = {"HICACHE__STORAGE__NAMESPACE_SALT": "tenant1", "HICACHE__DEVICE__SIZE_TOKENS": "8192"}
    loaded = load_config({"storage": {"backend": "memory"}}, environ=env)
    assert loaded.storage.namespace_salt == "tenant1" and loaded.device.size_tokens == 8192
    changed = loaded.model_copy(update={
        "device": loaded.device.model_copy(update={"size_tokens": 1024}),
        "storage": loaded.storage.model_copy(update={"namespace_salt": "tenant1:run-7"}),
    })
    for again in (load_config(changed, environ=env), await aload_config(changed, environ=env)):
        assert again.device.size_tokens == 1024 and again.storage.namespace_salt == "tenant1:run-7"


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", environ={})
    (tmp_path / "bad.toml").write_text("[device\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml", environ={})
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_config(tmp_path / "c.ini", environ={})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
async def test_async_load_matches_sync_load(path: Path) -> None:
    """``aload_config`` (aiofiles, for code on a running loop) builds the same config."""
    from hicache.config import aload_config

    assert await aload_config(path, environ={}) == load_config(path, environ={})


async def test_async_load_errors_are_config_errors(tmp_path: Path) -> None:
    from hicache.config import aload_config
    from hicache.facade import HiCache

    with pytest.raises(ConfigError, match="cannot read config file"):
        await aload_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigError, match="cannot read config file"):
        await aload_config(bad)
    bad.write_text("[device\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        await HiCache.afrom_config(bad)


def test_every_section_model_is_exported() -> None:
    """``[events]`` and ``[tracing]`` are sections of every deployment config, but their models
    were missing from ``hicache.config`` (and ``TracingConfig`` from the schema's ``__all__``)."""
    import hicache.config as pkg
    import hicache.config.schema as schema

    for name, field in HiCacheConfig.model_fields.items():
        model = field.annotation
        model = getattr(model, "__args__", (model,))[0]  # list[ExtraPoolConfig]
        assert model.__name__ in pkg.__all__ and getattr(pkg, model.__name__) is model, name
        assert model.__name__ in schema.__all__, name


def test_a_plugin_backend_that_passes_kwargs_on_takes_its_base_options(tmp_path: Path) -> None:
    """A plugin subclassing a bundled backend with ``**kwargs`` passed on (hicache's own
    ``slow-file`` is one) had its base's options refused by the config check: ``root`` was
    'no option', though the backend takes it. Options of neither class are still refused."""
    from hicache.storage.registry import backend_options
    from hicache.testing.slow_store import register_slow_file

    register_slow_file()
    assert {"root", "max_bytes", "latency_ms"} <= set(backend_options("slow-file"))
    good = {"storage": {"backend": "slow-file", "options": {"root": str(tmp_path), "latency_ms": 5}}}
    assert load_config(good).storage.options["root"] == str(tmp_path)
    with pytest.raises(ConfigError, match="no option"):
        load_config({"storage": {"backend": "slow-file", "options": {"rooot": str(tmp_path)}}})
