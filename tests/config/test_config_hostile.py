"""Configs built to break the loader: each is one ConfigError that names the field (and, for
sizes, the memory it would need), never a raw RuntimeError, OverflowError or RecursionError."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from hicache.config import env_overrides, load_config
from hicache.config.loader import read_config_file
from hicache.errors import ConfigError
from hicache.stack import stack_config_from


def _stack(data: dict) -> None:  # type: ignore[type-arg]
    stack_config_from(load_config(data, environ={}, check=False))


@pytest.mark.parametrize(
    "data, words",
    [
        ({"device": {"max_context_len": 10**9}}, r"device\.max_context_len \(1000000000\) needs 476\.8 GiB"),
        ({"device": {"size_tokens": 16 * 10**10}}, r"device\.size_tokens .* needs .* GiB for the device KV pool"),
        ({"host": {"ratio": 1e9}}, r"host\.ratio .* needs .* GiB for the host KV pool"),
        # finite, but its product with the device pages is not: int(inf) was an OverflowError
        ({"host": {"ratio": 1e308}}, r"host\.ratio \(1e\+308\) .* more pages than can be counted"),
        ({"extra_pools": [{"slots": 10**9, "state_shapes": {"s": [1 << 20]}}]}, r"extra_pools\[0\]\.slots"),
    ],
)
def test_absurd_sizes_name_the_field_and_the_memory(data: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=words):
        _stack(data)


@pytest.mark.parametrize(
    "data, words",
    [
        ({"host": {"ratio": float("inf")}}, r"host\.ratio: .*finite"),
        ({"cache": {"prefetch": {"timeout_base_s": float("nan")}}}, r"timeout_base_s: .*finite"),
        ({"extra_pools": [{"state_shapes": {"conv": [4, -1]}}]}, r"state_shapes\.conv\.1: .*greater than 0"),
        ({"extra_pools": [{"state_shapes": {"conv": []}}]}, r"state_shapes\.conv"),
        # lax mode read true as 1: a pool of the wrong size, silently
        ({"extra_pools": [{"state_shapes": {"conv": [True, 64]}}]}, r"state_shapes\.conv\.0: .*must be a number, got true"),
        ({"extra_pools": [{"name": "m"}, {"name": "m"}]}, r"\['m'\] given more than once"),
        # a deque's length and ZMQ's high-water mark are C integers: an OverflowError traceback at
        # start (buffer_steps), or a socket error that named neither field (hwm)
        ({"events": {"buffer_steps": 10**20}}, r"events\.buffer_steps: .*less than or equal to 2147483647"),
        ({"events": {"hwm": 10**11}}, r"events\.hwm: .*less than or equal to 2147483647"),
    ],
)
def test_bad_values_are_field_named_errors(data: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=words):
        load_config(data, environ={}, check=False)


def test_deeply_nested_files_are_config_errors(tmp_path: Path) -> None:
    for name, text in [("deep.json", '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                       ("deep.yaml", "model: " + "[" * 3_000 + "]" * 3_000 + "\n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match="nest"):
            load_config(tmp_path / name, environ={})
    with pytest.raises(ConfigError):
        nested: dict = {}  # type: ignore[type-arg]
        node = nested
        for _ in range(3000):
            node["x"] = {}
            node = node["x"]
        load_config({"storage": {"options": nested}, "model": nested}, environ={}, check=False)


@pytest.mark.parametrize(("name", "text", "words"), [
    # a second [storage] pasted below the first: the first one's backend and root were dropped
    ("dup.yaml", "storage:\n  backend: file\n  options: {root: /data/kv}\ndevice:\n  page_size: 16\n"
                 "storage:\n  namespace_salt: tenant-a\n", r"dup\.yaml.*'storage'.*twice.*line 6"),
    ("dup.yaml", "device:\n  page_size: 16\n  page_size: 32\n", r"'page_size'.*twice.*line 3"),
    ("dup.json", '{"device": {"page_size": 16, "size_tokens": 1024, "page_size": 32}}', r"dup\.json.*'page_size'.*twice"),
])
def test_a_key_given_twice_in_a_file_is_an_error(tmp_path: Path, name: str, text: str, words: str) -> None:
    """JSON and YAML kept the last of two equal keys, silently (TOML refuses them): a repeated
    section lost everything the first one set, as a misspelt key would have."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(tmp_path / name, environ={}, check=False)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    """A merge (``<<: *base``) and a key that overrides one of it are not a key given twice."""
    (tmp_path / "merge.yaml").write_text("base: &base {page_size: 16, size_tokens: 1024}\n"
                                         "device:\n  <<: *base\n  page_size: 32\n")
    assert read_config_file(tmp_path / "merge.yaml")["device"] == {"page_size": 32, "size_tokens": 1024}


@pytest.mark.parametrize(("name", "text"), [
    ("bom.toml", "[device]\r\npage_size = 32\r\n"),
    ("bom.json", '{"device": {"page_size": 32}}\r\n'),
    ("bom.yaml", "device:\r\n  page_size: 32\r\n"),
])
async def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path: Path, name: str, text: str) -> None:
    """Windows editors save UTF-8 with a byte-order mark (and CRLF): TOML refused such a file as
    "Invalid statement (at line 1, column 1)", JSON as "Unexpected UTF-8 BOM", though nothing
    shows there. The mark is no part of the text, as a trace's reader already takes it."""
    from hicache.config import aload_config

    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(path, environ={}, check=False).device.page_size == 32
    assert (await aload_config(path, environ={}, check=False)).device.page_size == 32


@pytest.mark.parametrize(("name", "text"), [
    ("big.toml", "[device]\npage_size = {digits}\n"),
    ("big.json", '{{"device": {{"page_size": {digits}}}}}'),
    ("big.yaml", "device:\n  page_size: {digits}\n"),
])
def test_an_integer_of_thousands_of_digits_in_a_file_is_a_config_error(tmp_path: Path, name: str, text: str) -> None:
    """Python refuses to read an integer of more than 4,300 digits (a ``ValueError``, not the
    parsers' own errors): every format ended ``hicache`` in a traceback. The variable of the
    same value was already an error naming the field."""
    (tmp_path / name).write_text(text.format(digits="9" * 5000))
    with pytest.raises(ConfigError, match=rf"config file .*{name} is not valid .*4300 digits"):
        load_config(tmp_path / name, environ={}, check=False)


def test_a_yaml_alias_bomb_is_reported_quickly(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("model:\n  name: *a8")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "bomb.yaml", environ={})
    assert time.monotonic() - t0 < 5  # the message shows a few items, not 9**9
    assert "model.name" in str(err.value) and len(str(err.value)) < 5000


def test_two_spellings_of_one_variable_that_disagree_are_an_error() -> None:
    """Case does not matter in a variable's name, so two spellings set one field: the one that
    sorted last won, silently (a deployment's ``HICACHE__DEVICE__PAGE_SIZE=16`` lost to a stray
    lower-case ``hicache__device__page_size=64``). Spellings that agree are the same setting."""
    with pytest.raises(ConfigError, match=r"HICACHE__DEVICE__PAGE_SIZE and hicache__device__page_size .*device\.page_size"):
        env_overrides({"HICACHE__DEVICE__PAGE_SIZE": "16", "hicache__device__page_size": "64"})
    assert env_overrides({"HICACHE__DEVICE__PAGE_SIZE": "16", "Hicache__Device__Page_Size": "16"}) == \
        {"device": {"page_size": 16}}


def test_environment_strings_conflicts_and_foreign_options(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(None, environ={"HICACHE__MODEL__REVISION": "2024"}, check=False)
    assert cfg.model.revision == "2024"  # a string field takes the text, not the JSON number
    assert load_config(None, environ={"HICACHE__STORAGE__BACKEND": "null"}).storage.backend is None
    for order in ([("HICACHE__DEVICE__PAGE_SIZE", "64"), ("HICACHE__DEVICE__PAGE_SIZE__X", "1")],
                  [("HICACHE__DEVICE__PAGE_SIZE__X", "1"), ("HICACHE__DEVICE__PAGE_SIZE", "64")]):
        with pytest.raises(ConfigError, match="conflict"):
            env_overrides(dict(order))
    caplog.set_level(logging.WARNING)
    cfg = load_config({"storage": {"backend": "memory"}}, environ={"HICACHE__STORAGE__OPTIONS__ROOT": "/srv/kv"})
    assert cfg.storage.options == {}
    assert any("OPTIONS__ROOT" in r.getMessage() for r in caplog.records)
    cfg = load_config({"storage": {"backend": "file"}}, environ={"HICACHE__STORAGE__OPTIONS__ROOT": "/srv/kv"})
    assert cfg.storage.options == {"root": "/srv/kv"}  # the backends that have it still get it
    with pytest.raises(ConfigError, match="no option"):  # in a file it stays an error
        load_config({"storage": {"backend": "memory", "options": {"root": "/x"}}}, environ={})


@pytest.mark.parametrize(
    "data, words",
    [
        # lax mode made these 1, 1 and 0 (a random port), silently
        ({"device": {"max_requests": True}}, r"max_requests must be a number, got true"),
        ({"events": {"buffer_steps": True}}, r"buffer_steps must be a number"),
        ({"server": {"port": False}}, r"port must be a number, got false"),
        ({"host": {"ratio": True}}, r"ratio must be a number"),
        # ignored: the pool was made anyway, and its size never checked against memory
        ({"host": {"enabled": False}}, r"enabled = false is not supported"),
        # ZMQ took the port modulo 65536 and bound another one
        ({"events": {"enabled": True, "endpoint": "tcp://*:99999"}}, r"endpoint 'tcp://\*:99999': the port"),
        ({"events": {"replay_endpoint": "tcp://127.0.0.1:70000"}}, r"replay_endpoint .* the port"),
        ({"events": {"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6000"}}, r"give each its own address"),
    ],
)
def test_values_that_used_to_pass_for_something_else_are_errors(data: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=words):
        load_config(data, environ={}, check=False)


def test_environment_sets_a_dict_field_from_json() -> None:
    """``storage.options`` (a dict) was treated as a string field: its JSON was never parsed."""
    cfg = load_config({}, environ={"HICACHE__STORAGE__OPTIONS": '{"root": "/tmp/x"}'}, check=False)
    assert cfg.storage.options == {"root": "/tmp/x"}
    cfg = load_config({}, environ={"HICACHE__STORAGE__NAMESPACE_SALT": "123"}, check=False)
    assert cfg.storage.namespace_salt == "123"  # a string field keeps its text


@pytest.mark.parametrize("host, words", [({"ratio": 1e-5}, r"host\.ratio \(1e-05\) of 1024 device pages holds no page"),
                                         ({"size_bytes": 1}, r"host\.size_bytes \(1\) holds no page")])
def test_a_host_pool_of_no_page_names_what_sized_it(host: dict, words: str) -> None:  # type: ignore[type-arg]
    """A ratio too small for one page read "host: None bytes hold no page"."""
    with pytest.raises(ConfigError, match=words):
        _stack({"host": host})


@pytest.mark.parametrize("spelling", ['""', '"none"', '"None"', '" none "'])
async def test_toml_says_no_storage_tier_with_none_or_empty(tmp_path: Path, spelling: str) -> None:
    """TOML has no null: ``"none"`` or ``""`` is how a file turns L3 off, and the cache then runs
    host-only (``""`` used to reach the cache as a backend name that some readers, like the demo's
    restart step, took for a real backend)."""
    from hicache.facade import HiCache

    path = tmp_path / "hostonly.toml"
    path.write_text(f"[device]\npage_size = 16\nsize_tokens = 1024\n[host]\nsize_bytes = 1048576\n"
                    f"[storage]\nbackend = {spelling}\n")
    config = load_config(path, environ={})
    assert config.storage.backend is None
    assert load_config(None, environ={"HICACHE__STORAGE__BACKEND": spelling.strip('"')}).storage.backend is None
    async with HiCache.from_config(config) as cache:
        assert cache.storage is None


def test_a_max_context_len_of_no_whole_pages_is_refused() -> None:
    """A row holds whole pages: a request near a limit that is no multiple of the page would
    need a page past its row (it crashed mid-allocation and leaked the pages it had taken)."""
    from hicache.config import load_config

    with pytest.raises(ConfigError, match="max_context_len"):
        load_config({"device": {"size_tokens": 1024, "page_size": 16, "max_context_len": 100}})


@pytest.mark.parametrize("namespace", ["tenant-a", {"model": "other/model"}])
def test_a_namespace_among_the_storage_options_is_refused(tmp_path: Path, namespace: object) -> None:
    """``storage.options.namespace`` was let through (hidden from the allowed options, never
    refused): a string crashed the start with ``'str' object has no attribute 'with_signature'``,
    and a table replaced the deployment's namespace, so ``[model]`` and ``namespace_salt`` no
    longer kept pages apart (two salts read each other's pages). The namespace is the config's."""
    data = {"storage": {"backend": "file", "options": {"root": str(tmp_path), "namespace": namespace},
                        "namespace_salt": "tenant-b"}}
    with pytest.raises(ConfigError, match=r"storage\.options\.namespace.*namespace_salt"):
        load_config(data, environ={})


@pytest.mark.parametrize("pages, ratio, want", [(100, 0.29, 29), (100, 0.57, 57), (1000, 1.1, 1100), (100, 0.295, 29)])
def test_a_host_ratio_gives_the_pages_it_says(pages: int, ratio: float, want: int) -> None:
    """``int(100 * 0.29)`` is 28 (the product is 28.999999999999996): a ratio that names whole
    pages lost one to float rounding; only a real fraction of a page is rounded down."""
    config = load_config({"device": {"size_tokens": 16 * pages, "page_size": 16}, "host": {"ratio": ratio},
                          "storage": {"backend": None}}, environ={})
    assert stack_config_from(config).host_pages == want


def test_a_backend_or_option_error_names_the_file_and_the_environment(tmp_path: Path) -> None:
    """The schema's errors say which file (and whether the environment) they come from; the
    storage backend's check did not: an option the backend lacks gave no file, and a
    ``HICACHE__STORAGE__BACKEND`` naming a plugin that is not installed read as the fault of a
    file that names ``file``. Both now name their source as the schema's errors do."""
    path = tmp_path / "deploy.toml"
    path.write_text(f'[storage]\nbackend = "file"\noptions = {{ root = "{tmp_path}", rot = "typo" }}\n')
    with pytest.raises(ConfigError, match=r"storage\.options: backend 'file' has no option\(s\) \['rot'\]") as info:
        load_config(path, environ={})
    assert str(path) in str(info.value)
    path.write_text(f'[storage]\nbackend = "file"\noptions = {{ root = "{tmp_path}" }}\n')
    with pytest.raises(ConfigError, match="no storage backend named 'not-installed'") as info:
        load_config(path, environ={"HICACHE__STORAGE__BACKEND": "not-installed"})
    assert str(path) in str(info.value) and "HICACHE__ environment" in str(info.value)
