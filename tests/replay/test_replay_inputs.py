"""Traces and replay configs no issue names: every one replays to the right numbers or stops
with one clear error before any work, and no run sees another run's pages."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.errors import ConfigError, TraceFormatError
from hicache.replay import ReplayConfig, TraceRequest, load_trace, reference_lru, request_tokens, unique_blocks
from hicache.replay.bounds import infinite_cache
from hicache.replay.compare import compare_policies
from hicache.replay.trace import MAX_BLOCK_ID, prefix_blocks


def _record(ids: list[int], tokens: int | None = None) -> dict:
    return {"timestamp": 0, "input_length": 512 * len(ids) if tokens is None else tokens, "output_length": 1,
            "hash_ids": ids}


def _write(path: Path, *ids: list[int]) -> Path:
    text = "".join(json.dumps(_record(i)) + "\n" for i in ids)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _prefix_reuse_trace(path: Path) -> Path:
    """Twelve conversations over two shared prefixes, taking turns: a conversation comes back
    after the others' blocks pushed it out of the host tier, so every tier hits."""
    rows = []
    for turn in range(3):
        for conv in range(12):
            shared = [0, 1, 2] if conv % 2 else [10, 11]
            rows.append(shared + [100 + conv * 10 + t for t in range(turn + 1)])
    return _write(path, *rows)


# ---------------------------------------------------------------------- one store, many runs


def test_policies_on_a_persistent_store_each_start_cold_and_leave_no_pages(tmp_path) -> None:
    """The ``file`` backend keeps pages across stacks: the policies of one comparison (and
    later runs) used to read the pages earlier ones wrote (0.99 total hit where the infinite
    cache allows 0.06). Each run now has its own namespace, emptied when it ends."""
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    root = tmp_path / "store"
    cfg = ReplayConfig.from_dict({
        "tiers": {"device_blocks": 8, "host_blocks": 12, "storage_blocks": 64},
        "storage": {"backend": "file", "options": {"root": str(root)}},
    })
    first = asyncio.run(compare_policies(cfg, requests, ["lru", "tiered", "lru"]))
    ceiling = infinite_cache(requests)["hit_ratio_tokens"]
    again = asyncio.run(compare_policies(cfg, requests, ["lru"]))
    row = first["policies"]["lru"]
    assert row["storage_hit"] > 0  # storage took part
    assert row["total_hit"] <= ceiling + 1e-9
    assert again["policies"]["lru"]["total_hit"] == row["total_hit"]  # not helped by the runs before
    assert first["policies"]["tiered"]["total_hit"] <= ceiling + 1e-9
    assert not list(root.iterdir())  # nothing of the runs is left in the store



def test_a_file_store_at_its_default_root_keeps_nothing_of_the_runs(tmp_path, monkeypatch) -> None:
    """Without ``options.root`` the store writes under ``$HICACHE_FILE_ROOT`` (or its default
    folder); each run's namespace folder was removed only where the options named a root, so
    every such run left all its pages there."""
    root = tmp_path / "default-root"
    root.mkdir()
    monkeypatch.setenv("HICACHE_FILE_ROOT", str(root))
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    cfg = ReplayConfig.from_dict({
        "tiers": {"device_blocks": 8, "host_blocks": 12, "storage_blocks": 64},
        "storage": {"backend": "file"},
    })
    result = asyncio.run(compare_policies(cfg, requests, ["lru", "tiered"]))
    assert result["policies"]["lru"]["storage_hit"] > 0  # storage took part
    assert not list(root.iterdir())

# ---------------------------------------------------------------------- block ids


def test_ids_that_name_more_than_one_prefix_become_one_block_per_prefix(tmp_path, caplog) -> None:
    """A first request can hit nothing, whatever its ids repeat; an id after another prefix is
    another block to a prefix cache. The bounds used to count hits the cache cannot have."""
    with caplog.at_level(logging.WARNING):
        once = load_trace(_write(tmp_path / "a.jsonl", [5, 5, 5]))
    assert unique_blocks(once) == 3 and infinite_cache(once)["hit_ratio_tokens"] == 0
    assert "more than one prefix" in caplog.text
    crossed = load_trace(_write(tmp_path / "b.jsonl", [1, 2], [3, 2]))
    assert unique_blocks(crossed) == 4 and reference_lru(crossed, [8])["hit_blocks"] == 0
    shared = load_trace(_write(tmp_path / "c.jsonl", [1, 2], [1, 3], [1, 2]))
    assert [r.hash_ids for r in shared] == [(1, 2), (1, 3), (1, 2)]  # a well-formed trace is kept as it is
    assert prefix_blocks(shared) is shared


def test_huge_ids_are_renamed_so_tokens_neither_wrap_nor_overflow(tmp_path) -> None:
    """``h * 512`` in int64 wrapped for ids >= 2**54 (a request looked like another one: false
    hits) and overflowed past 2**63; storage keys need uint32 tokens anyway."""
    big = 1 << 55
    requests = load_trace(_write(tmp_path / "big.jsonl", [0, 1], [big, big + 1], [10**20], [0, 1]))
    assert max(h for r in requests for h in r.hash_ids) <= MAX_BLOCK_ID
    tokens = [request_tokens(r) for r in requests]
    assert tokens[0] == tokens[3] and not set(tokens[0]) & set(tokens[1])
    assert reference_lru(requests, [8])["hit_blocks"] == 2  # only the repeat hits
    with pytest.raises(ValueError, match="uint32"):
        request_tokens(TraceRequest(0, 512, 1, (MAX_BLOCK_ID + 1,)))


def test_negative_ids_of_signed_hashes_are_renamed_like_huge_ones(tmp_path) -> None:
    """Ids are opaque hashes: one above 2**54 is renamed, but a signed 64-bit hash (Python's
    ``hash()``, which an exporter of an engine's block hashes writes) was refused at line 1
    for being negative. Only equality matters: the same hits as the ids made positive."""
    signed = load_trace(_write(tmp_path / "s.jsonl", [-5, -(1 << 63)], [-5, 7], [-5, -(1 << 63)]))
    plain = load_trace(_write(tmp_path / "p.jsonl", [5, 1 << 63], [5, 7], [5, 1 << 63]))
    assert [r.hash_ids for r in signed] == [r.hash_ids for r in plain] == [(0, 1), (0, 2), (0, 1)]
    assert all(0 <= t < 1 << 32 for r in signed for t in request_tokens(r))
    assert reference_lru(signed, [8])["hit_blocks"] == reference_lru(plain, [8])["hit_blocks"] == 3
    with pytest.raises(ValueError, match="uint32"):
        request_tokens(TraceRequest(0, 512, 1, (-1,)))
    with pytest.raises(TraceFormatError, match=r"line 1: .*a hash id must be an integer, got -1\.5"):
        load_trace(_write(tmp_path / "f.jsonl", [-1.5]))


# ---------------------------------------------------------------------- files


def test_gzip_traces_are_read_and_undecodable_files_are_named(tmp_path) -> None:
    gz = _write(tmp_path / "t.jsonl.gz", [1, 2], [1, 3])
    assert [r.hash_ids for r in load_trace(gz)] == [(1, 2), (1, 3)]
    binary = tmp_path / "t.jsonl"
    binary.write_bytes(json.dumps(_record([1])).encode() + b"\n\x8b\xff\x00\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl, line 2: not UTF-8"):
        load_trace(binary)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(_record([1, 2])).encode() + b"\r\n")  # saved by a Windows editor
    assert [r.hash_ids for r in load_trace(bom)] == [(1, 2)]
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text("not gzip\n")
    with pytest.raises(TraceFormatError, match="fake.jsonl.gz: not a readable gzip file"):
        load_trace(fake)
    # a gzip file damaged inside its deflate stream (a header that reads): zlib.error was a traceback
    body = gzip.compress(b"".join(json.dumps(_record([i, i + 1])).encode() + b"\n" for i in range(2000)))
    damaged = tmp_path / "damaged.jsonl.gz"
    damaged.write_bytes(body[:40] + bytes(b ^ 0x5A for b in body[40:80]) + body[80:])
    with pytest.raises(TraceFormatError, match="damaged.jsonl.gz: not a readable gzip file"):
        load_trace(damaged)
    assert load_trace(gz, limit=0) == []
    with pytest.raises(ValueError):
        load_trace(gz, limit=-1)


def test_traces_of_a_windows_tool_concatenated_are_read(tmp_path) -> None:
    """A byte-order mark was read past before the first record only: two traces saved by a
    Windows tool and concatenated (``cat day1.jsonl day2.jsonl``, the logs of several servers
    the timestamp warning expects) were refused at the first line of the second."""
    day = b"\xef\xbb\xbf" + json.dumps(_record([1, 2])).encode() + b"\r\n"
    trace = tmp_path / "week.jsonl"
    trace.write_bytes(day + day)
    assert [r.hash_ids for r in load_trace(trace)] == [(1, 2), (1, 2)]


@pytest.mark.parametrize("name", ["t.jsonl", "T.JSONL.GZ", "t.jsonl.gzip", "t"])
def test_a_gzip_trace_is_read_whatever_its_name(tmp_path, name) -> None:
    """Only a name ending in ``.gz`` was read through gzip: a compressed trace saved as
    ``.GZ``, ``.gzip`` or with the name it was downloaded under was refused as "not UTF-8
    text" at line 1. The first bytes say gzip; a plain trace under any name reads as ever."""
    path = _write(tmp_path / "x.jsonl.gz", [1, 2], [1, 3]).rename(tmp_path / name)
    assert [r.hash_ids for r in load_trace(path)] == [(1, 2), (1, 3)]
    plain = _write(tmp_path / "plain", [4])
    assert [r.hash_ids for r in load_trace(plain)] == [(4,)]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_field_given_twice_in_a_record_is_refused(tmp_path, suffix) -> None:
    """``json`` keeps the last of two equal keys: a record of an exporter that wrote
    ``hash_ids`` twice was read with the second list, silently, and every hit ratio from it
    was of ids nobody meant. It is a line-numbered error like any malformed record; a key's
    name inside a value (an extra field's text) is no second key."""
    good = json.dumps({**_record([1]), "note": 'says "hash_ids" twice: "hash_ids"'})
    twice = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7], "hash_ids": [8]}'
    path = tmp_path / f"t{suffix}"
    text = f"{good}\n{twice}\n"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    with pytest.raises(TraceFormatError, match=r"line 2: .*'hash_ids' is given twice"):
        load_trace(path)
    assert load_trace(path, limit=1)[0].hash_ids == (1,)


def test_timestamps_that_go_back_are_served_in_file_order_with_a_warning(tmp_path, caplog) -> None:
    """Requests are served in file order and timestamps were never looked at: a trace of
    concatenated logs replayed in an order it never arrived in, without a word."""
    rows = [dict(_record(ids), timestamp=ts) for ids, ts in (([1], 5), ([2], 5), ([1], 3), ([3], 9), ([4], 0))]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="hicache.replay.trace"):
        requests = load_trace(trace)
    assert [r.hash_ids for r in requests] == [(1,), (2,), (1,), (3,), (4,)]  # as written
    [record] = caplog.records
    assert "t.jsonl: 2 request(s) with a timestamp earlier" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.replay.trace"):
        load_trace(_write(tmp_path / "same.jsonl", [1], [2], [1]))  # equal timestamps: in order
    assert not caplog.records


def test_timestamps_with_a_fraction_are_read_and_their_order_checked(tmp_path, caplog) -> None:
    """Timestamps are read only to warn when they go back; an exporter that writes them with a
    fraction (``1733.25`` ms, or seconds as floats) had its whole trace refused, line 1, for a
    field no figure uses. They are kept as written, and a fraction going back still counts."""
    rows = [dict(_record(ids), timestamp=ts) for ids, ts in (([1], 1733.25), ([2], 1733.5), ([1], 1733.375))]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="hicache.replay.trace"):
        requests = load_trace(trace)
    assert [(r.timestamp, r.hash_ids) for r in requests] == [(1733.25, (1,)), (1733.5, (2,)), (1733.375, (1,))]
    assert "1 request(s) with a timestamp earlier" in caplog.text
    for bad in ("-1.5", "NaN", "Infinity", '"1733"', "true"):
        trace.write_text(json.dumps(_record([1])).replace('"timestamp": 0', f'"timestamp": {bad}') + "\n")
        with pytest.raises(TraceFormatError, match="line 1: .*timestamp must be a non-negative number"):
            load_trace(trace)


# ---------------------------------------------------------------------- configs


@pytest.mark.parametrize(("data", "match"), [
    ({"kv": {"page_size": 0}}, "page_size"),
    ({"kv": {"page_size": "64"}}, "page_size"),
    ({"kv": {"page_size": -512}}, "page_size"),
    ({"kv": {"head_dim": 1.5}}, "head_dim"),
    ({"tiers": {"device_fraction": "abc"}}, "device_fraction"),
    ({"tiers": {"host_fraction": -0.1}}, "host_fraction"),
    ({"tiers": {"host_blocks": -3}}, "host blocks"),
    ({"tiers": 5}, r"\[tiers\] must be a table"),
    ({"replay": {"max_requests": "5"}}, "max_requests"),
    ({"replay": {"verify": "yes"}}, "verify"),
    ({"storage": {"backend": "memory", "options": []}}, "options"),
    ({"controller": "fast"}, "controller"),
    # YAML keys need not be strings: an AttributeError and a TypeError (sorting 1 and "a") traceback
    ({"tiers": {1: 0.5}}, r"\[tiers\] 1 unknown"),
    ({"controller": {1: 2, "write_polcy": "write_back"}}, r"unknown controller option\(s\) \[1, 'write_polcy'\]"),
    ({"kv": {"dtype": "float8_e4m3fn"}}, "cannot hold exact synthetic KV"),  # 55 values for 8,192 KV: blind
    ({"replay": {"placement": "bogus"}}, r"unknown placement policy 'bogus'; allowed: \['lru'"),  # compare ignored it
    # found when the policy's replay came, after the others had run (and were thrown away)
    ({"replay": {"placement": "tiered", "placement_options": {"tail_tokens": "x"}}}, "tail_tokens.*an integer"),
    ({"replay": {"placement": "reuse", "placement_options": {"no_such": 1}}}, r"unknown option\(s\) \['no_such'\]"),
])
def test_replay_config_values_of_the_wrong_type_or_range_are_config_errors(data, match) -> None:
    with pytest.raises(ConfigError, match=match):
        ReplayConfig.from_dict(data)


@pytest.mark.parametrize(("backend", "max_bytes"), [
    *(("memory", v) for v in ("nan", '"big"', "true", "0", "100")),
    ("file", "8192"),  # one page of KV, but a page file is bigger (header, footer): 0 pages
])
def test_a_storage_bound_that_is_no_size_is_a_config_error(tmp_path, backend, max_bytes) -> None:
    """A deployment config's ``storage.options.max_bytes`` sizes the replay's storage tier: nan
    or a string was a ``ValueError`` traceback from ``int()``, true or a size under one page
    (as the store counts it) a replay that silently had no storage tier."""
    from hicache.replay import load_replay_config

    cfg = tmp_path / "c.toml"
    root = f'root = "{tmp_path / "store"}", ' if backend == "file" else ""
    cfg.write_text('[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 2\nkv_dtype = "float32"\n'
                   '[device]\npage_size = 512\nsize_tokens = 8192\n[host]\nsize_bytes = 262144\n'
                   f'[storage]\nbackend = "{backend}"\noptions = {{ {root}max_bytes = {max_bytes} }}\n')
    with pytest.raises(ConfigError, match="max_bytes must be an integer of at least one page"):
        load_replay_config(cfg)


@pytest.mark.parametrize(("storage", "how"), [
    ('backend = "file"\noptions = { root = "store" }', "set storage.options.max_bytes"),
    ('backend = "s3"\noptions = { url = "s3://bucket/kv" }', 'backend = "memory" and options.max_bytes'),
])
def test_a_store_the_replay_cannot_size_is_a_warning_saying_how(tmp_path, caplog, storage, how) -> None:
    """A deployment's ``file`` store without ``max_bytes``, or an ``s3``/``fsspec`` one (no
    bound at all), replayed with no storage tier and the tiers line's ``storage 0`` the only sign."""
    from hicache.replay import load_replay_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 2\nkv_dtype = "float32"\n'
                   '[device]\npage_size = 512\nsize_tokens = 8192\n[host]\nsize_bytes = 262144\n'
                   f'[storage]\n{storage}\n')
    with caplog.at_level(logging.WARNING, logger="hicache.replay.config"):
        replay = load_replay_config(cfg)
    assert replay.capacity_pages(100)["storage"] == 0
    [record] = [r for r in caplog.records if r.name == "hicache.replay.config"]
    assert "has no storage tier" in record.getMessage() and how in record.getMessage()
    assert "\n" not in record.getMessage()


def test_environment_overrides_a_replay_native_config_ignores_are_a_warning(tmp_path, caplog, monkeypatch) -> None:
    """``--config``'s help says ``HICACHE__*`` variables override the file: they do for a
    deployment config, but a replay-native one (``[tiers]``, ``[kv]``...) has none of those
    fields, and ``HICACHE__STORAGE__BACKEND=none`` was ignored without a word."""
    from hicache.replay import load_replay_config

    cfg = tmp_path / "native.toml"
    cfg.write_text('[tiers]\ndevice_blocks = 4\nhost_blocks = 8\nstorage_blocks = 16\n[storage]\nbackend = "memory"\n')
    monkeypatch.setenv("HICACHE__STORAGE__BACKEND", "none")
    with caplog.at_level(logging.WARNING, logger="hicache.replay.config"):
        replay = load_replay_config(cfg)
    assert replay.storage_backend == "memory"
    [record] = [r for r in caplog.records if r.name == "hicache.replay.config"]
    assert "HICACHE__STORAGE__BACKEND" in record.getMessage() and "ignored" in record.getMessage()
    assert str(cfg) in record.getMessage()


def test_a_policy_named_twice_replays_once_and_no_ratio_to_lru_prints_a_dash(tmp_path, monkeypatch) -> None:
    """``--policies lru,lru`` replayed ``lru`` twice for one row; "vs lru" printed ``nanx``
    where ``lru`` wrote nothing to storage (no storage tier) or was not replayed."""
    from hicache.replay import compare

    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 8, "host_blocks": 12}})
    replayed: list[str] = []
    real = compare.replay_requests

    async def counting(run_cfg, *args, **kwargs):
        replayed.append(run_cfg.placement)
        return await real(run_cfg, *args, **kwargs)

    monkeypatch.setattr(compare, "replay_requests", counting)
    report = asyncio.run(compare_policies(cfg, requests, ["reuse", "lru", "reuse"]))
    assert replayed == ["reuse", "lru"] and list(report["policies"]) == ["reuse", "lru"]
    assert report["policies"]["lru"]["storage_written_bytes"] == 0
    text = compare.format_comparison(report)
    assert "nan" not in text
    rows = [line.split() for line in text.splitlines()[3:5]]  # the policies' rows, under the header
    assert [row[0] for row in rows] == ["reuse", "lru"] and [row[7] for row in rows] == ["-", "-"]


def test_tiers_larger_than_memory_are_a_config_error_naming_the_tier(tmp_path) -> None:
    """Replay-native capacities reached torch unchecked: a RuntimeError or MemoryError traceback
    about a 700,000 GiB allocation instead of an error naming the tier."""
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    for tiers, tier in (({"device_blocks": 10**11}, "device tier"), ({"host_blocks": 10**12}, "host tier")):
        cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 8, "host_blocks": 12, **tiers}})
        with pytest.raises(ConfigError, match=f"{tier} .* needs .* GiB"):
            asyncio.run(compare_policies(cfg, requests, ["lru"]))


def test_a_fraction_too_large_to_count_is_a_config_error_naming_the_tier(tmp_path, capsys) -> None:
    """A finite fraction whose share of the trace overflows a float (``device_fraction =
    1e308``) passed the config check and reached ``int(inf)`` mid-replay: an
    ``OverflowError`` traceback, exit status 1, instead of one line naming the tier."""
    trace = _prefix_reuse_trace(tmp_path / "t.jsonl")
    config = tmp_path / "big.toml"
    config.write_text("[tiers]\ndevice_fraction = 1e308\nhost_fraction = 0.5\n")
    assert main(["replay", "--config", str(config), "--trace", str(trace), "--policies", "lru"]) == 2
    assert "device_fraction" in capsys.readouterr().err


def test_a_file_store_sized_by_tiers_is_bounded_to_them(tmp_path) -> None:
    """``[tiers] storage_blocks`` bounded only the ``memory`` store: a ``file`` store kept every
    page (its default bound is 64 GiB) and the report's storage capacity was not the one run."""
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    rows = {}
    for backend in ("memory", "file"):
        cfg = ReplayConfig.from_dict({
            "tiers": {"device_blocks": 8, "host_blocks": 4, "storage_blocks": 6},
            "storage": {"backend": backend, "options": {"root": str(tmp_path / "store")} if backend == "file" else {}},
        })
        rows[backend] = asyncio.run(compare_policies(cfg, requests, ["lru"]))["policies"]["lru"]
    assert rows["memory"]["evicted"]["storage"]["pages"] > 0
    assert rows["file"]["evicted"]["storage"]["pages"] > 0  # 0: the store never reached a bound
    assert rows["file"]["storage_hit"] <= rows["memory"]["storage_hit"] + 1e-9  # headers: a few pages less


def test_tiers_that_do_not_nest_replay_and_get_their_reference(tmp_path) -> None:
    """A host smaller than the device is a valid deployment: the replay used to run it through
    and then fail in the reference LRU, throwing the results away."""
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    ref = reference_lru(requests, [6, 3, 0])
    assert ref["host_hit_blocks"] == 0 and ref["hit_blocks"] == reference_lru(requests, [6])["hit_blocks"]
    with pytest.raises(ValueError, match=">= 0"):
        reference_lru(requests, [6, -1])


# ---------------------------------------------------------------------- the command line


def test_the_command_line_refuses_a_negative_limit_and_a_raster_plot_name(tmp_path, capsys, monkeypatch) -> None:
    trace = _write(tmp_path / "t.jsonl", [1, 2], [1, 3])
    with pytest.raises(SystemExit) as stop:
        main(["replay", "--trace", str(trace), "--limit=-1", "--no-progress"])
    assert stop.value.code == 2 and "must be >= 0" in capsys.readouterr().err
    for name in ("curve.png", "curve.svgz"):  # .svgz: a viewer gunzips it, and plain SVG text is no gzip
        with pytest.raises(SystemExit):
            main(["size", str(trace), "--plot", str(tmp_path / name)])
        assert "written as SVG" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["size", str(trace), "--no-plot", "--kv-bytes-per-token=-5"])
    assert "must be >= 1" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["size", str(trace), "--no-plot"]) == 0
    assert main(["size", str(trace), "--plot", ""]) == 0
    assert not list(tmp_path.glob("*.svg*")) and not (tmp_path / "curve.png").exists()


@pytest.mark.parametrize("backend, options", [("fsspec", {"url": "memory://replay-kv"}),
                                              ("s3", {"url": "s3://bucket/kv"})])
def test_a_store_sized_by_tiers_that_takes_no_bound_is_a_config_error(tmp_path, backend, options) -> None:
    """An ``s3`` or ``fsspec`` store sized by ``[tiers] storage_blocks`` has no ``max_bytes`` to
    bound it: ``lru`` replayed an unbounded tier under a report naming the tier's capacity."""
    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    cfg = ReplayConfig.from_dict({
        "tiers": {"device_blocks": 8, "host_blocks": 4, "storage_blocks": 6},
        "storage": {"backend": backend, "options": options},
    })
    with pytest.raises(ConfigError, match=rf"{backend}.*takes no max_bytes.*6 pages"):
        asyncio.run(compare_policies(cfg, requests, ["lru"]))


@pytest.mark.parametrize("backend", [["memory"], {"x": 1}, 5, True])
def test_a_storage_backend_that_is_not_a_name_is_a_config_error(backend) -> None:
    """A list or table as ``[storage] backend`` passed validation and failed with a TypeError
    traceback after the whole trace was read."""
    with pytest.raises(ConfigError, match=r"\[storage\] backend must be a backend's name"):
        ReplayConfig.from_dict({"storage": {"backend": backend}})


def test_a_tiers_table_of_basis_alone_keeps_the_default_fractions() -> None:
    """``[tiers] basis = "replayed"`` alone emptied the default 1% / 5% / 20% (every tier 0
    blocks, then an error that the device tier holds 0 tokens): it sizes no tier."""
    default = ReplayConfig.from_dict({})
    only_basis = ReplayConfig.from_dict({"tiers": {"basis": "replayed"}})
    assert only_basis.capacity_basis == "replayed"
    assert only_basis.fractions == default.fractions
    assert only_basis.capacity_blocks(43924) == default.capacity_blocks(43924) == \
        {"device": 439, "host": 2196, "storage": 8784}


def _cycle_trace(path: Path) -> Path:
    """20 one-block requests, then the same 20 again: a store of 20 blocks hits the second round."""
    return _write(path, *([i % 20] for i in range(40)))


_PAGE = 512 * 2 * 4 * 2  # one 512-token page of the default replay geometry (float32, K and V)


def test_a_storage_bound_that_contradicts_the_tier_is_a_config_error_before_the_trace(tmp_path, capsys) -> None:
    """``[storage] options.max_bytes`` of 4 pages bounded the store while ``[tiers]`` said 20
    blocks: the tiers line said storage 20, the nested LRU 0.5000, and ``lru`` replayed 0."""
    bad = {"tiers": {"device_blocks": 2, "host_blocks": 2, "storage_blocks": 20},
           "storage": {"backend": "memory", "options": {"max_bytes": 4 * _PAGE}}}
    with pytest.raises(ConfigError, match=r"max_bytes \(32768\) bounds the store to 4 pages but \[tiers\] "
                                          r"storage_blocks = 20 is 20 pages"):
        ReplayConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="storage_fraction and .*max_bytes both size"):
        ReplayConfig.from_dict({**bad, "tiers": {"device_blocks": 2, "host_blocks": 2, "storage_fraction": 0.5}})
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tiers]\ndevice_blocks = 2\nhost_blocks = 2\nstorage_blocks = 20\n'
                   '[storage]\nbackend = "memory"\noptions = { max_bytes = 32768 }\n')
    # before the trace is read: a trace that is not there is not what it reports
    assert main(["replay", "-c", str(cfg), "--trace", str(tmp_path / "absent.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "max_bytes (32768) bounds the store to 4 pages" in err and err.count("\n") == 1


@pytest.mark.parametrize("tiers", [{"storage_blocks": 20}, {}])
def test_a_storage_bound_sizes_the_tier_the_report_and_reference_count(tmp_path, tiers) -> None:
    """A ``max_bytes`` that agrees with ``storage_blocks``, or sizes the tier alone, is the
    tier's size in the report and the reference, and the replay matches the reference."""
    requests = load_trace(_cycle_trace(tmp_path / "t.jsonl"))
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 2, "host_blocks": 2, **tiers},
                                  "storage": {"backend": "memory", "options": {"max_bytes": 20 * _PAGE}}})
    report = asyncio.run(compare_policies(cfg, requests, ["lru"]))
    assert report["capacities_blocks"] == {"device": 2, "host": 2, "storage": 20}
    row = report["policies"]["lru"]
    assert row["total_hit"] == row["nested_lru_hit"] == 0.5


@pytest.mark.parametrize("backend", ["", "none", "None"])
def test_no_storage_backend_is_no_storage_tier_in_the_report_and_reference(tmp_path, backend) -> None:
    """``backend = ""`` switched storage off but the tiers line still said storage 20 and the
    nested LRU counted storage hits (0.5000 against 0 replayed); ``"none"``, which a deployment
    config reads as no storage, was a BackendNotFoundError after the trace was read."""
    requests = load_trace(_cycle_trace(tmp_path / "t.jsonl"))
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 2, "host_blocks": 2, "storage_blocks": 20},
                                  "storage": {"backend": backend}})
    assert cfg.storage_backend is None and cfg.capacity_pages(20)["storage"] == 0
    report = asyncio.run(compare_policies(cfg, requests, ["lru"]))
    assert report["capacities_blocks"]["storage"] == 0
    row = report["policies"]["lru"]
    assert row["total_hit"] == row["nested_lru_hit"] == 0.0
    assert ReplayConfig(storage_backend="none").capacity_blocks(100)["storage"] == 0


def test_without_draining_a_request_waits_for_copies_in_flight_before_running_out(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """``drain_between_requests = false``: device pages whose copies were still in flight
    could not be evicted yet, and the replay died with an ``OutOfDeviceMemory`` traceback,
    exit 1 (the status of "restored KV differs"), though the room was there once they landed.
    A request now waits for them first; a real shortage is one line, exit status 2."""
    from hicache.replay import runner
    from hicache.replay.driver import OutOfDeviceMemory

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 1024 + (i % 3) * 100, "output_length": 1,
                    "hash_ids": [i % 7, 100 + i % 5] + ([200 + i % 3] if i % 3 else [])}) + "\n"
        for i in range(60)))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tiers]\ndevice_blocks = 4\nhost_blocks = 4\nstorage_blocks = 8\n[storage]\nbackend = "memory"\n'
                   '[replay]\ndrain_between_requests = false\n[controller]\nprefetch_policy = "best_effort"\n')
    args = ["replay", "-c", str(cfg), "--trace", str(trace), "--policies", "lru", "--no-progress"]
    assert main(args) == 0
    assert "verify" in capsys.readouterr().out

    async def short(*_args, rid: str, **_kwargs):
        raise OutOfDeviceMemory(f"request {rid}: 1536 tokens do not fit on device")

    monkeypatch.setattr(runner, "serve_request", short)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == "hicache: error: request r0: 1536 tokens do not fit on device\n"


def test_the_attribution_ledger_and_explain_mode_of_a_config_reach_the_replay(tmp_path, monkeypatch) -> None:
    """``cache.attribution_ledger_pages`` (the README: raise it to explain ``unknown`` misses)
    and ``cache.explain_misses`` of a deployment config were dropped by the replay: a ledger of
    no pages explained the misses as well as the default one."""
    from hicache.replay import load_replay_config, runner

    requests = load_trace(_prefix_reuse_trace(tmp_path / "t.jsonl"))
    base = ('[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 2\nkv_dtype = "float32"\n'
            '[device]\npage_size = 512\nsize_tokens = 4096\n[host]\nsize_bytes = 32768\n'
            '[storage]\nbackend = "memory"\noptions = { max_bytes = 65536 }\n[cache]\n')
    built, real = [], runner.build_stack
    monkeypatch.setattr(runner, "build_stack", lambda sc, **kw: built.append(sc) or real(sc, **kw))
    unknown = {}
    for ledger in (None, 0):
        path = tmp_path / f"c{ledger}.toml"
        path.write_text(base + ("" if ledger is None else f"attribution_ledger_pages = {ledger}\nexplain_misses = true\n"))
        cfg = load_replay_config(path)
        assert (cfg.attribution_ledger_pages, cfg.explain_misses) == (ledger, ledger is not None)
        row = asyncio.run(compare_policies(cfg, requests, ["lru"]))["policies"]["lru"]
        assert (built[-1].attribution_ledger_pages, built[-1].explain_misses) == (ledger, ledger is not None)
        unknown[ledger] = row["miss_tokens"].get("unknown", 0)
    assert unknown[None] == 0 < unknown[0]
    native = ReplayConfig.from_dict({"replay": {"attribution_ledger_pages": 64, "explain_misses": True}})
    assert (native.attribution_ledger_pages, native.explain_misses) == (64, True)
    with pytest.raises(ConfigError, match="attribution_ledger_pages must be an integer >= 0"):
        ReplayConfig.from_dict({"replay": {"attribution_ledger_pages": -1}})


def test_a_replay_without_verification_says_so_in_the_table_and_json(tmp_path, capsys) -> None:
    """``verify = false`` printed 0 in the verify column (and the JSON's 0 failures), read as
    every restored page checked out, though none was checked."""
    trace = _prefix_reuse_trace(tmp_path / "t.jsonl")
    rows = {}
    for verify in ("true", "false"):
        cfg = tmp_path / f"{verify}.toml"
        cfg.write_text(f'[tiers]\ndevice_blocks = 8\nhost_blocks = 12\n[replay]\nverify = {verify}\n')
        args = ["replay", "-c", str(cfg), "--trace", str(trace), "--policies", "lru", "--no-progress"]
        assert main(args) == 0
        table = capsys.readouterr().out.splitlines()
        row = next(line.split() for line in table if line.startswith("lru "))  # the hit table's, not the misses'
        assert main([*args, "--json"]) == 0
        rows[verify] = (row[-1], json.loads(capsys.readouterr().out)["policies"]["lru"])
    assert rows["true"][0] == "0" and rows["true"][1]["verified"] is True
    assert rows["false"][0] == "off" and rows["false"][1]["verified"] is False


def test_a_file_store_bound_counts_as_the_pages_the_store_holds() -> None:
    """A deployment config's ``max_bytes`` sizes the storage tier in the pages the store really
    holds: a file store counts each page file whole (header and footer too), so counting
    ``max_bytes`` in bare pages reported (and gave the reference LRU) ~2% more room than the
    store had."""
    from hicache.config import load_config
    from hicache_backends.file import FileStorage

    repo = Path(__file__).resolve().parents[2]
    cfg = ReplayConfig.from_hicache_config(load_config(repo / "configs" / "replay-20pct-file.toml", environ={}))
    max_bytes = cfg.storage_options["max_bytes"]
    assert cfg.pages["storage"] == max_bytes // FileStorage.stored_page_nbytes(cfg.page_nbytes)
    assert cfg.pages["storage"] < max_bytes // cfg.page_nbytes
    assert cfg.storage_bound_pages() == cfg.pages["storage"]



@pytest.mark.parametrize("tiers", [{"host_blocks": 0}, {}])
def test_a_storage_tier_without_a_host_tier_is_a_config_error_before_the_trace(tmp_path, capsys, tiers) -> None:
    """A host tier of 0 blocks (``host_blocks = 0``, or no host entry in a ``[tiers]`` table)
    was replayed with a one-page host: every page moves to storage through host, so the storage
    tier of 20 blocks never held a page, while the tiers line said storage 20 and the nested
    LRU 0.5000 against 0 replayed, for every policy. A deployment config refuses a host that
    holds no page; the replay says so too, before the trace is read."""
    data = {"tiers": {"device_blocks": 2, "storage_blocks": 20, **tiers}, "storage": {"backend": "memory"}}
    with pytest.raises(ConfigError, match="host tier holds no page"):
        ReplayConfig.from_dict(data)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[tiers]\ndevice_blocks = 2\nstorage_blocks = 20\n" + "".join(f"{k} = {v}\n" for k, v in tiers.items()))
    assert main(["replay", "-c", str(cfg), "--trace", str(tmp_path / "absent.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "host tier holds no page" in err and err.count("\n") == 1
    requests = load_trace(_cycle_trace(tmp_path / "t.jsonl"))
    # a fraction that holds no page of this trace (5% of 20 blocks): found once the trace is known
    small = ReplayConfig.from_dict({**data, "tiers": {"device_blocks": 2, "storage_blocks": 20, "host_fraction": 0.04}})
    with pytest.raises(ConfigError, match="host tier holds no page"):
        asyncio.run(compare_policies(small, requests, ["lru"]))
    # without a storage tier a device-only replay runs as before
    no_storage = ReplayConfig.from_dict({**data, "tiers": {"device_blocks": 2, **tiers}})
    report = asyncio.run(compare_policies(no_storage, requests, ["lru"]))
    assert report["capacities_blocks"] == {"device": 2, "host": 0, "storage": 0}


def test_a_write_back_replay_gives_the_same_numbers_every_time() -> None:
    """``tiered`` writes back at host eviction, in the middle of a request; with storage calls
    on the controller's I/O thread whether such a write had landed by the next eviction was
    thread timing, so the same trace and tiers gave 0.294 to 0.336 from one run to the next
    (the runner promises deterministic results with ``drain_between_requests``)."""
    import random

    rng = random.Random(1)
    docs = [[d * 100 + i for i in range(rng.randint(2, 6))] for d in range(40)]
    requests = [TraceRequest(t, 512 * len(d), 1, tuple(d)) for t, d in
                enumerate(rng.choice(docs) for _ in range(300))]
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 8, "host_blocks": 16, "storage_blocks": 40},
                                  "storage": {"backend": "memory"}, "replay": {"placement": "tiered"}})

    async def figures() -> tuple:
        from hicache.replay.runner import replay_requests

        r = await replay_requests(cfg, requests)
        return (r["hit_tokens"], r["storage_hit_tokens"], r["bytes"]["h2s"], r["placement"]["victim_write_pages"],
                r["placement"]["victim_writes_skipped_pages"])

    runs = [asyncio.run(figures()) for _ in range(4)]
    assert runs[0][3] > 0  # write-backs happened (what the timing decided)
    assert all(r == runs[0] for r in runs), runs


def test_a_limited_replay_on_tiers_of_fixed_size_reads_only_the_requests_it_replays(tmp_path, capsys) -> None:
    """``--limit N`` with a deployment config (tiers in bytes, no fraction of the trace) read
    and held the whole trace only to slice its first N requests: the memory of a trace of
    millions of requests for a replay of a few, and a trace still being written (its last
    line cut off) was refused for a line it never replays. Tiers that are fractions of the
    whole trace still read all of it: its unique blocks size them."""
    from _replay_paths import CONFIG

    from hicache.replay.runner import replay_inputs

    trace = _prefix_reuse_trace(tmp_path / "t.jsonl")
    with trace.open("a") as f:
        f.write('{"timestamp": 9, "input_length": 10')  # the writer is still at it
    cfg, requests, basis, _ = replay_inputs(str(CONFIG), trace, 5)
    assert [r.hash_ids for r in requests] == [r.hash_ids for r in load_trace(trace, limit=5)]
    assert basis is None  # the deployment's tiers are its own sizes
    assert main(["replay", "--trace", str(trace), "--limit", "5", "--policies", "lru", "--no-progress"]) == 0
    assert "5 requests" in capsys.readouterr().out
    with pytest.raises(TraceFormatError, match=r"t\.jsonl, line 37"):  # fractions of the whole trace
        replay_inputs({"tiers": {"device_fraction": 0.5, "host_fraction": 0.5}}, trace, 5)
