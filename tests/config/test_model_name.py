"""``model.name`` is part of the storage namespace: a store that outlives the process (``file``,
S3, a plugin) refuses a config that names no model, with one line saying what to set; the
in-process ``memory`` store, and no store at all, take an unnamed model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hicache.cli import main
from hicache.config import load_config
from hicache.config.schema import UNNAMED_MODEL
from hicache.errors import ConfigError
from hicache.facade import HiCache
from hicache.stack import config_namespace
from hicache.storage import register_backend
from hicache_backends.memory import MemoryStorage

UNNAMED = r"model\.name is not set.*'{backend}'.*HICACHE__MODEL__NAME"


def config(tmp_path: Path, backend: str | None = "file", name: str | None = None) -> dict[str, Any]:
    """A small CPU deployment on ``backend`` (a file store under ``tmp_path``), naming the model
    ``name`` (``None``: leaving it unset)."""
    model: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}
    if name is not None:
        model["name"] = name
    storage: dict[str, Any] = {"backend": backend}
    if backend == "file":
        storage["options"] = {"root": str(tmp_path / "store"), "max_bytes": 1 << 24, "min_free_bytes": 0}
    return {"model": model, "device": {"device": "cpu", "size_tokens": 256, "page_size": 16}, "storage": storage}


class _SharedPlugin(MemoryStorage):
    """A third-party backend: hicache cannot know that its pages stay in this process."""


def test_an_unnamed_model_on_a_file_store_is_one_config_error(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path), environ={})
    with pytest.raises(ConfigError, match=UNNAMED.format(backend="file")) as err:
        HiCache(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()  # refused before the store was opened


@pytest.mark.parametrize("name", ["", "  ", UNNAMED_MODEL])
def test_a_blank_name_or_the_placeholder_is_no_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=UNNAMED.format(backend="file")):
        HiCache(load_config(config(tmp_path, name=name), environ={}))


def test_an_unnamed_model_on_a_plugin_store_is_refused_too(tmp_path: Path) -> None:
    register_backend("model-name-shared-plugin", _SharedPlugin)
    cfg = load_config(config(tmp_path, backend="model-name-shared-plugin"), environ={})
    with pytest.raises(ConfigError, match=UNNAMED.format(backend="model-name-shared-plugin")):
        HiCache(cfg)


async def test_an_unnamed_model_on_a_shared_memory_store_is_refused(tmp_path: Path) -> None:
    """Memory stores naming one ``store_id`` share a medium in this process: two caches of
    other models, one geometry and no name would read each other's KV there as on a file."""
    data = config(tmp_path, backend="memory")
    data["storage"]["options"] = {"store_id": f"model-name-{tmp_path.name}"}
    with pytest.raises(ConfigError, match=r"model\.name is not set.*'memory'.*store_id.*HICACHE__MODEL__NAME"):
        HiCache(load_config(data, environ={}))
    data["model"]["name"] = "org/model-a"
    async with HiCache(load_config(data, environ={})) as cache:
        assert cache.storage is not None


@pytest.mark.parametrize("backend", ["memory", None])
async def test_an_unnamed_model_in_memory_or_without_storage_runs(tmp_path: Path, backend: str | None) -> None:
    cfg = load_config(config(tmp_path, backend=backend), environ={})
    assert cfg.model.name == UNNAMED_MODEL and config_namespace(cfg).model == UNNAMED_MODEL
    async with HiCache(cfg) as cache:
        assert (cache.storage is None) == (backend is None)


async def test_a_named_model_opens_its_file_store_and_models_stay_apart(tmp_path: Path) -> None:
    a = load_config(config(tmp_path, name="org/model-a"), environ={})
    b = load_config(config(tmp_path, name="org/model-b"), environ={})
    assert config_namespace(a).digest != config_namespace(b).digest  # one geometry, two namespaces
    async with HiCache(a) as cache:
        assert cache.storage is not None and cache.storage.namespace.model == "org/model-a"


def test_the_environment_names_the_model(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path), environ={"HICACHE__MODEL__NAME": "org/from-env"})
    assert config_namespace(cfg).model == "org/from-env"


def test_the_environment_moving_an_unnamed_model_to_memory_runs(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path), environ={"HICACHE__STORAGE__BACKEND": "memory"})
    assert config_namespace(cfg).model == UNNAMED_MODEL


def test_serve_with_an_unnamed_model_on_a_file_store_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.upper().startswith("HICACHE__")]:
        monkeypatch.delenv(name)
    path = tmp_path / "unnamed.toml"
    path.write_text(f'[device]\ndevice = "cpu"\nsize_tokens = 256\n\n[storage]\nbackend = "file"\n'
                    f'options = {{ root = "{tmp_path / "store"}" }}\n')
    assert main(["serve", "-c", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache: error: model.name is not set") and err.count("\n") == 1 and "Traceback" not in err


def test_replay_of_an_unnamed_file_deployment_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay stores under a namespace of its own per run (removed at its end), never the
    deployment's: the model's name is not needed there."""
    for name in [n for n in os.environ if n.upper().startswith("HICACHE__")]:
        monkeypatch.delenv(name)
    path = tmp_path / "unnamed.toml"
    path.write_text(f'[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 2\n\n'
                    f'[device]\ndevice = "cpu"\npage_size = 512\nsize_tokens = 4096\nmax_requests = 4\n'
                    f'max_context_len = 4096\n\n[host]\nsize_bytes = 1048576\n\n[storage]\nbackend = "file"\n'
                    f'options = {{ root = "{tmp_path / "store"}", max_bytes = 1048576, min_free_bytes = 0 }}\n')
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i}, "input_length": 1024, "output_length": 1, "hash_ids": [1, {i + 2}]}}\n'
                             for i in range(4)))
    assert main(["replay", "-c", str(path), "--trace", str(trace), "--no-progress", "--policies", "lru", "--json"]) == 0
    assert "error" not in capsys.readouterr().err
