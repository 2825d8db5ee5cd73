"""Trace replay: the real stack against the nested inclusive block LRU.

The suite replays the first 800 requests of the shared Mooncake trace with the tier capacities
of the whole trace (1% / 5% / 20% of its 43,924 unique blocks); the reference LRU runs on the
same requests with the same capacities. ``scripts/replay.py`` replays the whole trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.errors import ConfigError
from hicache.replay import (
    ReplayConfig,
    TraceRequest,
    load_replay_config,
    load_trace,
    reference_lru,
    request_tokens,
    run_replay,
)

from _replay_paths import CONFIG, REPO, shared_trace as _trace


def test_reference_lru_matches_the_trace_readme() -> None:
    requests = load_trace(_trace())
    assert len(requests) == 3993
    ref = reference_lru(requests, [439, 2196, 8784])
    assert (ref["device_hit_blocks"], ref["host_hit_blocks"], ref["storage_hit_blocks"], ref["miss_blocks"]) == (
        4184, 14677, 28736, 74280,
    )
    assert ref["hit_ratio"] == pytest.approx(0.3905, abs=5e-5)
    # a single LRU of the largest capacity hits exactly as often as the nest (inclusion)
    assert reference_lru(requests, [8784])["hit_blocks"] == ref["hit_blocks"]


def test_reference_lru_small_cases() -> None:
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 1000, 1, (1, 3)), TraceRequest(0, 1024, 1, (1, 2))]
    ref = reference_lru(reqs, [1, 2, 3])
    # r2: block 1 is in host (device holds 2); r3: 1 in host again (device holds 3), 2 in storage
    assert (ref["device_hit_blocks"], ref["host_hit_blocks"], ref["storage_hit_blocks"]) == (0, 2, 1)
    assert ref["miss_tokens"] == 1024 + 488 + 0
    with pytest.raises(ValueError):
        reference_lru(reqs, [3, -1])
    assert reference_lru(reqs, [3, 1])["host_hit_blocks"] == 0  # tiers that do not nest: each its own LRU


def test_request_tokens_follow_the_readme() -> None:
    r = TraceRequest(0, 700, 1, (5, 9))
    t = request_tokens(r)
    assert len(t) == 700 and t[0] == 5 * 512 and t[511] == 5 * 512 + 511 and t[512] == 9 * 512


@pytest.mark.parametrize(("dtype", "exact"), [("float32", 1 << 24), ("float16", 1 << 11), ("bfloat16", 1 << 8)])
def test_synthetic_kv_is_exact_and_tells_every_block_apart(dtype: str, exact: int) -> None:
    """Verification passes a page only with its own block's KV. The synthetic KV was linear in
    the token id modulo a power of two: blocks ``h`` and ``h + 4`` (16-bit dtypes) or
    ``h + 16384`` (float32, within the shared trace's 43,924 blocks) had identical pages, and
    bfloat16 rounded values it claimed were exact."""
    import torch

    from hicache.replay.synthetic import synthetic_kv

    dt = getattr(torch, dtype)
    block = torch.arange(512) + 7 * 512
    for distance in (1, 4, 16384, 1 << 20):
        for layer in (0, 1):
            mine = synthetic_kv(block, layer, 2, 4, dt)
            other = synthetic_kv(block + distance * 512, layer, 2, 4, dt)
            assert not torch.equal(mine[0], other[0]) and not torch.equal(mine[1], other[1]), distance
    k, v = synthetic_kv(torch.arange(1 << 16), 3, 2, 4, dt)
    for x in (k.double(), v.double()):
        assert torch.equal(x, x.round()) and x.abs().max() <= exact  # integers the dtype holds exactly


def test_config_loading_and_errors(tmp_path: Path) -> None:
    cfg = load_replay_config(CONFIG)
    assert cfg.capacity_blocks(43924) == {"device": 439, "host": 2196, "storage": 8784}
    assert cfg.page_size == 512 and cfg.storage_backend == "memory"
    p64 = load_replay_config(REPO / "configs" / "replay-20pct-p64.toml")
    assert p64.capacity_blocks(43924) == {"device": 439, "host": 2196, "storage": 8784}
    assert p64.capacity_pages(43924) == {"device": 3512, "host": 17568, "storage": 70272}
    native = ReplayConfig.from_dict({"tiers": {"device_fraction": 0.01, "host_fraction": 0.05,
                                               "storage_fraction": 0.2}})
    assert native.capacity_blocks(43924) == {"device": 439, "host": 2196, "storage": 8784}
    bad = tmp_path / "bad.toml"
    bad.write_text("[tiers]\ndevice_fraktion = 0.1\n")
    with pytest.raises(ConfigError, match="device_fraktion"):
        load_replay_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[device]\nsize_tokenz = 512\n")
    with pytest.raises(ConfigError, match="size_tokenz"):
        load_replay_config(typo)
    with pytest.raises(ConfigError, match="allowed"):
        ReplayConfig.from_dict({"controller": {"write_policy": "never"}})


def test_replay_prefix_beats_the_reference_lru() -> None:
    """800 requests, capacities of the whole trace, controller drained between requests."""
    result = run_replay(CONFIG, _trace(), max_requests=800, progress=False)
    ref = result["reference_lru"]
    assert result["requests"] == 800
    assert result["verification_failures"] == 0
    assert result["capacities_blocks"] == {"device": 439, "host": 2196, "storage": 8784}
    hit = result["device_hit_tokens"] + result["host_hit_tokens"] + result["storage_hit_tokens"]
    assert hit == result["prompt_tokens"] - result["computed_tokens"]
    assert hit >= ref["hit_tokens"], json.dumps(result, indent=1)
    assert result["storage_hit_tokens"] > 0 and result["host_hit_tokens"] > 0 and result["device_hit_tokens"] > 0
    assert all(v == 0 for v in result["failures"].values()), result["failures"]
    assert result["unwritten_on_close"] == 0
    assert result["bytes"]["s2h"] > 0 and result["bytes"]["h2d"] > 0


def test_replay_small_pages_verifies_every_page() -> None:
    """64-token pages (8 per trace block): partial blocks are cached in whole pages."""
    cfg = load_replay_config(REPO / "configs" / "replay-20pct-p64.toml")
    result = run_replay(cfg, _trace(), max_requests=150, progress=False)
    assert result["verification_failures"] == 0
    assert result["page_size"] == 64
    assert result["hit_tokens"] > 0
    # pinned with the tree before its hot-path work: the same hits in every tier, exactly
    assert (result["device_hit_tokens"], result["host_hit_tokens"], result["storage_hit_tokens"],
            result["computed_tokens"]) == (46080, 47296, 65536, 1878858)


def test_replay_on_the_file_backend(tmp_path: Path) -> None:
    """The same path with pages on disk: every restored page still verifies."""
    from hicache.config import load_config

    config = load_config(REPO / "configs" / "replay-20pct-file.toml", environ={})
    cfg = ReplayConfig.from_hicache_config(config)
    cfg.storage_options["root"] = str(tmp_path / "store")
    result = run_replay(cfg, _trace(), max_requests=120, progress=False)
    assert result["verification_failures"] == 0
    assert result["storage_hit_tokens"] > 0
    assert all(v == 0 for v in result["failures"].values()), result["failures"]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json", "Expecting value"),
        ("[1, 2]", "a JSON object per line"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 2, "hash_ids": [1]}', "input_length must be"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": "12"}', "hash_ids must be a list"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1.5]}', "a hash id must be"),
        ('{"timestamp": true, "input_length": 10, "output_length": 2, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1], "x": '
         + "[" * 100_000 + "]" * 100_000 + "}", "maximum recursion depth"),
    ],
)
def test_a_bad_trace_line_is_an_error_naming_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    from hicache.errors import TraceFormatError
    from hicache.replay import load_trace

    trace = tmp_path / "t.jsonl"
    good = '{"timestamp": 0.0, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}'
    trace.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceFormatError, match=f"t.jsonl, line 3: .*{reason}"):
        load_trace(trace)
    assert load_trace(trace, limit=1)[0].hash_ids == (7, 8)  # the good lines before it still read


def test_replay_progress_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a log or a pipe the replay's bar wrote every redraw (100 kB of carriage returns in a
    CI log); like ``size`` and ``inspect``, it shows on a terminal only."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    cfg = load_replay_config(CONFIG)
    for stderr, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stderr)
        run_replay(cfg, _trace(), max_requests=20, progress=True)
        assert ("replay" in stderr.getvalue()) is shown, stderr.getvalue()[:200]


def test_replay_shows_its_reading_of_the_trace_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hicache size`` shows a bar while it reads a trace; the replay read it (seconds to
    minutes for a trace of millions of requests) before its first bar, without a sign."""
    import io

    from hicache.replay.compare import run_comparison

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                                         "hash_ids": [i % 3, 10 + i % 6]}) + "\n" for i in range(20)))
    cfg = ReplayConfig.from_dict({"tiers": {"device_blocks": 8, "host_blocks": 8}})
    for progress in (True, False):
        stderr = Terminal()
        monkeypatch.setattr("sys.stderr", stderr)
        run_comparison(cfg, trace, ["lru"], progress=progress)
        assert ("reading" in stderr.getvalue()) is progress, stderr.getvalue()[:200]


@pytest.mark.parametrize("args, words", [
    (["--config", "{tmp}/bad.toml"], "is not valid TOML"),
    (["--config", "{tmp}/missing.toml"], "cannot read config file"),
    (["--trace", "{tmp}/missing.jsonl"], "is not a file"),
    (["--max-requests", "-3"], "must not be negative"),
    (["--log-level", "bogus"], "invalid choice"),
    # found before the run, not by a traceback after a whole trace was replayed
    (["--output", "{tmp}/no/such/folder/out.json"], "no folder"),
])
def test_replay_script_errors_are_one_line_and_exit_2(tmp_path: Path, capsys, args: list[str], words: str) -> None:
    """``scripts/replay.py`` let every operator error out as a traceback with exit status 1,
    the status it gives a replay that restored corrupted KV: a job gating on it could not tell
    a typo from a failed bit-exact check."""
    import runpy

    (tmp_path / "bad.toml").write_text("[x\n")
    script = runpy.run_path(str(REPO / "scripts" / "replay.py"), run_name="replay_script")
    argv = [a.format(tmp=tmp_path) for a in args] + ["--no-progress"]
    try:
        code = script["main"](argv)
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert words in err.strip().splitlines()[-1]  # one error line (after argparse's usage)
