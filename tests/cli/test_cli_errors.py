"""Operator mistakes at the command line end in one clear error line and exit status 2, never
a traceback and never a silent substitute (another trace, defaults for a config file)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.replay.trace import load_trace

RECORD = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}


def _trace(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_trace_named_that_does_not_exist_is_an_error_not_another_trace(tmp_path, capsys, monkeypatch) -> None:
    err = _error(capsys, ["replay", "--trace", str(tmp_path / "typo.jsonl"), "--no-progress", "--limit", "5"])
    assert "typo.jsonl" in err and "not a file" in err
    monkeypatch.setenv("HICACHE_TRACE", str(tmp_path / "also-missing.jsonl"))
    assert "HICACHE_TRACE" in _error(capsys, ["replay", "--no-progress", "--limit", "5"])


def test_replay_names_its_trace_and_refuses_an_empty_one(tmp_path, capsys) -> None:
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    assert main(["replay", "--trace", str(ok), "--no-progress", "--policies", "lru"]) == 0
    assert f"trace {ok}" in capsys.readouterr().out
    empty = _trace(tmp_path / "empty.jsonl")
    assert "no requests" in _error(capsys, ["replay", "--trace", str(empty), "--no-progress"])


def test_replay_reads_a_trace_from_a_pipe_as_size_does(tmp_path, capsys) -> None:
    """``hicache replay --trace <(head -n 1000 trace.jsonl)`` was refused, "not a file", where
    ``hicache size`` reads the same pipe: the trace is read once, a pipe serves. A folder and
    a missing path are still refused, never a fall back to another trace."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = "".join(json.dumps({**RECORD, "timestamp": i}) + "\n" for i in range(3))
    threading.Thread(target=fifo.write_text, args=(text,), daemon=True).start()
    assert main(["replay", "--trace", str(fifo), "--no-progress", "--policies", "lru"]) == 0
    assert "3 requests" in capsys.readouterr().out
    assert "not a file" in _error(capsys, ["replay", "--trace", str(tmp_path), "--no-progress"])


@pytest.mark.parametrize("ids", [[1, 2, 3], [1]])
def test_a_record_whose_ids_do_not_cover_its_prompt_is_refused(tmp_path, ids) -> None:
    """Three ids for 1,024 tokens would make a block of negative length (hit ratios below 0);
    one id would leave half the prompt without ids."""
    bad = _trace(tmp_path / "bad.jsonl", RECORD, {**RECORD, "hash_ids": ids})
    with pytest.raises(ValueError, match="line 2.*hash ids for input_length 1024"):
        load_trace(bad)


def test_replay_configs_in_any_format_and_their_errors(tmp_path, capsys) -> None:
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    yaml_cfg = tmp_path / "r.yaml"
    yaml_cfg.write_text("device:\n  page_size: 16\n")  # a deployment config without storage
    assert main(["replay", "-c", str(yaml_cfg), "--trace", str(ok), "--no-progress", "--policies", "lru"]) == 0
    capsys.readouterr()
    assert "No such file" in _error(capsys, ["replay", "-c", str(tmp_path / "missing.toml"), "--trace", str(ok)])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[model]\nname = "caf\xe9"\n')
    assert "utf-8" in _error(capsys, ["replay", "-c", str(latin1), "--trace", str(ok)])


def test_serve_on_a_port_in_use_is_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("HICACHE__STORAGE__BACKEND", "null")
    monkeypatch.setenv("HICACHE__SERVER__HOST", "127.0.0.1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _error(capsys, ["serve", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize("seq", ["-1", str(1 << 64), str((1 << 63) - 1)])
def test_events_from_a_sequence_out_of_range_is_a_usage_error(capsys, seq: str) -> None:
    """A number past 8 bytes failed with an OverflowError traceback inside the replay."""
    with pytest.raises(SystemExit) as exc:
        main(["events", "tcp://127.0.0.1:1", "--from", seq])
    assert exc.value.code == 2
    assert "sequence number is 0 to" in capsys.readouterr().err


def test_a_subscriber_refuses_a_start_out_of_range() -> None:
    from hicache.events.subscriber import EventSubscriber

    for bad in (-1, 1 << 64, True, 1.5):
        with pytest.raises(ValueError, match="start_seq"):
            EventSubscriber("tcp://127.0.0.1:1", start_seq=bad)  # type: ignore[arg-type]


def test_events_run_id_must_be_hex(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["events", "tcp://127.0.0.1:1", "--run-id", "not-hex"])
    assert exc.value.code == 2
    assert "16 hex digits" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["stats", "x", "--interval", "-1"], "must be a number of seconds > 0"),
        (["stats", "x", "--interval", "nan"], "must be a number of seconds > 0"),
        (["events", "tcp://127.0.0.1:1", "--timeout", "-1"], "must be a number of seconds > 0"),  # waited forever
        (["events", "tcp://127.0.0.1:1", "--count", "0"], "must be >= 1"),
        # ZMQ connected to port 99999 modulo 65536, silently; a bad --replay failed at the first gap
        (["events", "tcp://127.0.0.1:99999", "--timeout", "1"], "port must be 1..65535"),
        (["events", "tcp://127.0.0.1:1", "--replay", "127.0.0.1:5558", "--timeout", "1"], "is not a ZMQ endpoint"),
        (["inspect", "x", "--options", "notjson"], "not JSON"),
        (["inspect", "x", "--options", "[1]"], "must be a JSON object"),
        (["inspect", "x", "--options", "[" * 5000 + "]" * 5000], "not JSON"),  # was a RecursionError
        (["inspect", "x", "--sample", "-1"], "must be >= 0"),
        (["--log-level", "bogus", "backends"], "invalid choice"),
        # flags left from the CLI skeleton that changed nothing: serve prints no report, and
        # every benchmark prints JSON whatever is asked
        (["serve", "--json"], "unrecognized arguments: --json"),
        (["bench", "--json", "evict"], "unrecognized arguments: --json"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and "Traceback" not in err


def test_the_demo_refuses_a_context_too_short_for_its_conversations(tmp_path, capsys) -> None:
    cfg = tmp_path / "short.toml"
    cfg.write_text('[storage]\nbackend = "memory"\n[device]\nmax_context_len = 256\n')
    assert "device.max_context_len is 256" in _error(capsys, ["demo", "-c", str(cfg), "--quick"])


@pytest.mark.parametrize("as_json", [False, True])
def test_the_demo_fails_when_a_cached_answer_differs(capsys, monkeypatch, as_json: bool) -> None:
    """The demo printed "NO (1 differ)" for an answer wrong KV changed, and exited 0: CI ran
    scripts/demo.sh and passed. Like ``replay``, it prints its report, then one line, exit 1."""
    import hicache.demo as demo

    real = demo.run_cached_phases

    async def one_wrong_answer(*args, **kwargs):  # type: ignore[no-untyped-def]
        runs = await real(*args, **kwargs)
        rec = next(r for r in runs.cached["records"] if r["error"] is None)
        rec["tokens"] = [t + 1 for t in rec["tokens"]]  # what wrong KV does to an answer
        return runs

    monkeypatch.setattr(demo, "run_cached_phases", one_wrong_answer)
    assert main(["demo", "--quick", "-c", "configs/memory.toml", *(["--json"] if as_json else [])]) == 1
    captured = capsys.readouterr()
    if as_json:
        assert json.loads(captured.out)["answers_mismatched"] == 1
    else:
        assert "NO (1 differ)" in captured.out
    failed = [line for line in captured.err.splitlines() if line.startswith("hicache: failed: ")]
    assert len(failed) == 1 and "1 differ, 0 missing" in failed[0] and "Traceback" not in captured.err


def test_replay_on_a_file_root_it_cannot_use_is_an_error_not_a_table_of_misses(tmp_path, capsys) -> None:
    """The store was opened by its first call: every call failed (a traceback each, logged),
    and the replay exited 0 with its misses blamed on the backend."""
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    not_a_folder = tmp_path / "root"
    not_a_folder.write_text("a file, not a folder")
    cfg = tmp_path / "file.toml"
    cfg.write_text('[tiers]\ndevice_fraction = 1\nhost_fraction = 1\nstorage_fraction = 1\n'
                   f'[storage]\nbackend = "file"\noptions = {{ root = "{not_a_folder}" }}\n')
    err = _error(capsys, ["replay", "-c", str(cfg), "--trace", str(ok), "--no-progress", "--policies", "lru"])
    assert f"cannot use root {str(not_a_folder)!r}" in err
    assert not_a_folder.read_text() == "a file, not a folder"


def test_stats_on_a_malformed_server_url_is_a_line_not_a_traceback(capsys) -> None:
    """``urlsplit`` raised ValueError on telling a URL from a store root."""
    with pytest.raises(SystemExit) as stop:
        main(["stats", "http://[bad", "--once"])
    captured = capsys.readouterr()
    assert stop.value.code == 1 and "Traceback" not in captured.err
    assert "http://[bad: cannot scrape: Invalid IPv6 URL" in captured.out


def test_a_workload_written_to_a_gz_name_is_gzip_and_reads_back(tmp_path, capsys) -> None:
    """Plain text went under the .gz name, which every trace reader opens through gzip: the
    next command on it failed with 'not a readable gzip file'."""
    out = tmp_path / "agents.jsonl.gz"
    assert main(["workload", "agents", str(out), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)["requests"]
    assert out.read_bytes()[:2] == b"\x1f\x8b" and len(load_trace(out)) == written


def test_a_gzip_workload_names_itself_and_is_the_same_bytes_for_a_seed(tmp_path, capsys) -> None:
    """The gzip header named the temporary file it was written as (``gunzip -N`` restored
    ``agents.jsonl.gz.1234.tmp``) and held the time of writing, so one seed's trace was other
    bytes every run (a checksum or a data-version tool saw a new trace each time). It names the
    trace, as gzip does, with no time: the same bytes for the same seed."""
    out = tmp_path / "agents.jsonl.gz"
    assert main(["workload", "agents", str(out)]) == 0
    header = out.read_bytes()
    flags, mtime = header[3], int.from_bytes(header[4:8], "little")
    assert flags & 0x08 and header[10:header.index(b"\0", 10)] == b"agents.jsonl"  # FNAME
    assert mtime == 0
    assert [p.name for p in tmp_path.iterdir()] == ["agents.jsonl.gz"]
    assert main(["workload", "agents", str(out), "--seed", "1"]) == main(["workload", "agents", str(out)]) == 0
    assert out.read_bytes() == header
    capsys.readouterr()


def test_output_to_a_reader_that_went_away_ends_quietly(tmp_path) -> None:
    """``hicache ... | head``: printing the report to a closed pipe was a BrokenPipeError
    traceback (one 'Broken pipe' error line where the command printed it itself)."""
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "workload", "agents", str(tmp_path / "t.jsonl"),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the report: the interpreter takes a second to start
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


@pytest.mark.parametrize("value, words", [('"x"', "'ghost_pages' must be an integer, got 'x'"),
                                          ("true", "'ghost_pages' must be an integer, got True"),
                                          ("1.5", "'ghost_pages' must be an integer, got 1.5")])
def test_a_placement_option_of_the_wrong_type_is_named(tmp_path, capsys, value: str, words: str) -> None:
    """A string was "'<' not supported between instances of 'str' and 'int'"; true and 1.5
    were taken as a ghost list's size."""
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    cfg = tmp_path / "reuse.toml"
    cfg.write_text('[tiers]\ndevice_fraction = 1\nhost_fraction = 1\n'
                   f'[replay]\nplacement = "reuse"\nplacement_options = {{ ghost_pages = {value} }}\n')
    assert words in _error(capsys, ["replay", "-c", str(cfg), "--trace", str(ok), "--no-progress", "--policies", "reuse"])


def test_size_never_writes_its_plot_over_the_trace(tmp_path, capsys) -> None:
    """``--plot`` naming the trace (another spelling of it too) read the trace, then wrote
    the SVG over it."""
    trace = _trace(tmp_path / "t.jsonl", RECORD)
    assert "is the trace" in _error(capsys, ["size", str(trace), "--plot", str(tmp_path / "." / "t.jsonl")])
    assert load_trace(trace)[0].hash_ids == (1, 2)


def test_size_and_workload_errors_exit_2_as_every_command_does(tmp_path, capsys) -> None:
    """``size`` and ``workload`` exited 1 with a prefix of their own (``hicache size: ...``)
    where every other command's operator errors exit 2 with ``hicache: error:``."""
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORD) + "\n" + json.dumps(RECORD) + "\n{oops\n")
    gz = tmp_path / "t.jsonl.gz"
    gz.write_text("plain text under a .gz name\n")
    for trace, words in ((tmp_path / "empty.jsonl", "No such file"), (blank, "blank.jsonl: no requests"),
                         (bad, "bad.jsonl, line 3: not a Mooncake trace record"), (tmp_path, "Is a directory"),
                         (gz, "not a readable gzip file")):
        err = _error(capsys, ["size", str(trace), "--no-plot"])
        assert err.startswith("hicache: error: ") and words in err, err
    assert main(["size", str(ok), "--no-plot"]) == 0  # one request: a table, no error
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        main(["workload", "agents", str(tmp_path / "w.jsonl"), "--seed", "-3"])
    assert usage.value.code == 2 and "must be >= 0" in capsys.readouterr().err
    assert "No such file" in _error(capsys, ["workload", "agents", str(tmp_path / "no" / "w.jsonl")])


def test_a_plot_that_cannot_be_written_is_refused_before_the_trace_is_read(tmp_path, capsys, monkeypatch) -> None:
    """A plot in a missing folder (or a folder, or one not writable) failed only after the whole
    trace was read and sized, minutes on a large one, with exit status 1."""
    import os

    from hicache.replay import size_report

    def never(*args, **kwargs):
        raise AssertionError("the trace was sized")

    monkeypatch.setattr(size_report, "size_report", never)
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path / "ro" and real_access(p, mode))
    (tmp_path / "ro").mkdir()
    for plot, words in ((tmp_path / "no" / "c.svg", "no folder"), (tmp_path, "is a folder"),
                        (tmp_path / "ro" / "c.svg", "not writable")):
        with pytest.raises(SystemExit) as usage:
            main(["size", str(ok), "--plot", str(plot)])
        err = capsys.readouterr().err
        assert usage.value.code == 2 and words in err and "Traceback" not in err, err


def test_a_plot_to_a_pipe_in_a_folder_not_writable_is_allowed(tmp_path, capsys, monkeypatch) -> None:
    """``--plot /dev/stdout`` (or ``/dev/null``) as any user but root was refused, "not
    writable": the check asked for the folder a temporary file is made in, but a pipe or a
    device is written in place, and only root may write in ``/dev`` (played here by a folder
    ``os.access`` says is not writable). A new file there is still refused."""
    import os
    import threading

    ro = tmp_path / "ro"
    ro.mkdir()
    fifo = ro / "plot.svg"
    os.mkfifo(fifo)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro and real_access(p, mode))
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    assert main(["size", str(ok), "--plot", str(fifo), "--no-progress"]) == 0
    reader.join(10)
    assert got and got[0].rstrip().endswith(b"</svg>")
    with pytest.raises(SystemExit):
        main(["size", str(ok), "--plot", str(ro / "new.svg")])
    assert "not writable" in capsys.readouterr().err


@pytest.mark.parametrize("name", [b"caf\xe9.jsonl", b"a\x01b.jsonl"])
def test_size_plots_a_trace_whose_name_is_not_utf8_or_has_a_control_character(tmp_path, name: bytes) -> None:
    """A trace named ``café`` in latin-1 (the plot's title is its name) ended ``size`` with a
    UnicodeEncodeError traceback, after the plot file was opened: an existing plot was left
    empty. A control character in the name made an SVG no XML reader opens."""
    import os
    import xml.etree.ElementTree as ET

    trace = os.fsdecode(name)
    _trace(tmp_path / trace, RECORD, RECORD)
    (tmp_path / "out.svg").write_text("an earlier plot")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}  # a UTF-8 terminal's stdout
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", "size", trace, "--plot", "out.svg", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
    svg = ET.parse(tmp_path / "out.svg").getroot()  # well-formed
    title = next(t.text for t in svg.iter("{http://www.w3.org/2000/svg}text") if t.text and "vs cache size" in t.text)
    assert title.endswith(("caf\ufffd.jsonl", "a\ufffdb.jsonl")), title
    assert ".jsonl: 2 requests" in proc.stdout.decode()  # the report (UTF-8: it printed) names it too
    assert sorted(os.listdir(tmp_path)) == sorted([trace, "out.svg"])  # no temporary file left


def test_replay_prints_its_table_for_a_trace_whose_name_is_not_utf8(tmp_path) -> None:
    """``hicache size`` shows such a name with U+FFFD; the replay's table named the trace as
    it was, and a strict UTF-8 stdout refused it with a UnicodeEncodeError traceback, exit 1,
    after every policy had been replayed."""
    import os

    trace = os.fsdecode(b"caf\xe9.jsonl")
    _trace(tmp_path / trace, RECORD, RECORD)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}  # a UTF-8 terminal's stdout
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", "replay", "--trace", trace, "--policies", "lru",
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode().startswith("trace caf\ufffd.jsonl\n2 requests")


def test_policies_are_a_list_of_names_spaces_allowed_none_refused(tmp_path, capsys) -> None:
    """``lru, reuse`` failed on the policy ' reuse'; ``,`` replayed every policy, silently."""
    ok = _trace(tmp_path / "ok.jsonl", RECORD)
    assert main(["replay", "--trace", str(ok), "--no-progress", "--policies", "lru, reuse", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["lru", "reuse"]
    for empty in (",", ""):
        assert "names no placement policy" in _error(capsys, ["replay", "--trace", str(ok), "--policies", empty])


def _replay_with_stored_reads(tmp_path, monkeypatch, alter) -> list[str]:  # type: ignore[no-untyped-def]
    """The arguments of an ``lru`` replay over the memory store whose reads ``alter(buf)``
    every page read whole: three prompts take turns, each filling the device and the host, so
    turns after the first three come from storage."""
    from hicache_backends.memory.backend import MemoryStorage

    real = MemoryStorage._read_into

    def altered(self, pages, buffers):  # type: ignore[no-untyped-def]
        ok = real(self, pages, buffers)
        for good, buf in zip(ok, buffers):
            if good:
                alter(buf)
        return ok

    monkeypatch.setattr(MemoryStorage, "_read_into", altered)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    trace = _trace(tmp_path / "t.jsonl", *({**RECORD, "timestamp": i, "input_length": 1536, "hash_ids": prompts[i % 3]}
                                            for i in range(9)))
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[tiers]\ndevice_blocks = 3\nhost_blocks = 3\nstorage_fraction = 1\n[storage]\nbackend = "memory"\n')
    return ["replay", "-c", str(cfg), "--trace", str(trace), "--no-progress", "--policies", "lru"]


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_replay_that_restores_corrupted_kv_exits_1(tmp_path, capsys, monkeypatch, as_json) -> None:
    """The replay is the bit-exact check: it printed the verify failures and exited 0, so a job
    gating on it passed on corrupted KV. Its result is still printed, then one line and 1."""

    def flip(buf) -> None:  # type: ignore[no-untyped-def]
        buf[-1] ^= 0x40  # a bit of the payload's last byte

    argv = _replay_with_stored_reads(tmp_path, monkeypatch, flip)
    assert main(argv + (["--json"] if as_json else [])) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "differed from the KV computed" in err and "lru" in err
    if as_json:
        assert json.loads(out)["policies"]["lru"]["verification_failures"] > 0
    else:
        assert "lru" in out


def test_replay_failure_line_counts_the_tokens_it_counted(tmp_path, capsys, monkeypatch) -> None:
    """The verify failures are tokens (``verify_kv`` counts tokens whose KV differs), but the
    exit line called them pages: a whole 512-token page served wrong read as 512 pages."""

    def zero(buf) -> None:  # type: ignore[no-untyped-def]
        buf[:] = bytes(len(buf))  # every byte of the page: every token differs

    assert main(_replay_with_stored_reads(tmp_path, monkeypatch, zero) + ["--json"]) == 1
    out, err = capsys.readouterr()
    tokens = json.loads(out)["policies"]["lru"]["verification_failures"]
    assert tokens and tokens % 512 == 0  # whole pages' worth of tokens
    assert f"lru {tokens} token(s)" in err and "page(s)" not in err


@pytest.mark.parametrize("model, words", [('attention = "mla"', "model.attention"), ("head_dim = 33", "model.head_dim")])
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["demo", "--quick"]])
def test_a_model_the_demo_engine_cannot_run_is_one_line(tmp_path, capsys, model: str, words: str,
                                                        command: list[str]) -> None:
    """A cache config the demo's reference model cannot run (MLA: no separate K and V; an odd
    head dim: no rotary halves) ended ``serve`` and ``demo`` in a ValueError traceback."""
    cfg = tmp_path / "model.toml"
    cfg.write_text(f'[model]\n{model}\n[device]\ndevice = "cpu"\nsize_tokens = 4096\n[storage]\nbackend = "none"\n')
    assert words in _error(capsys, [*command, "-c", str(cfg)])


def test_ctrl_c_during_a_replay_is_one_line_and_leaves_nothing_behind(tmp_path) -> None:
    """SIGINT to a real ``hicache replay`` mid-run: it printed a KeyboardInterrupt traceback
    (asyncio's and the CLI's frames, forty lines) instead of one line; the run's pages must
    still be removed from the store and no half report printed."""
    import os
    import signal
    import time

    trace = tmp_path / "chat.jsonl"
    assert main(["workload", "chat", str(trace)]) == 0
    root = tmp_path / "store"
    root.mkdir()
    cfg = tmp_path / "file.toml"
    cfg.write_text('[tiers]\ndevice_fraction = 0.05\nhost_fraction = 0.2\nstorage_fraction = 0.5\n'
                   f'[storage]\nbackend = "file"\noptions = {{ root = "{root}" }}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "replay", "-c", str(cfg), "--trace", str(trace),
                             "--policies", "lru", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            # a child of a non-interactive shell (CI) may inherit SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(root.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the run's namespace folder: the replay is under way
    time.sleep(0.5)
    assert proc.poll() is None, "the replay ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err.decode()) == (130, b"", "hicache: interrupted\n")
    assert list(root.iterdir()) == []


def test_a_workload_that_cannot_be_written_whole_keeps_the_trace_that_was_there(tmp_path) -> None:
    """The trace was written in place: a write that failed halfway (a full disk; here a file
    size limit, a real one on a real process) left the old trace truncated to a partial new one."""
    import os
    import resource

    out = tmp_path / "trace.jsonl"
    assert main(["workload", "agents", str(out)]) == 0
    before = out.read_bytes()
    limit = len(before) // 2

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", "workload", "chat", str(out)], capture_output=True,
                          env=env, preexec_fn=small_files, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "File too large" in err and "Traceback" not in err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]  # no temporary file left


@pytest.mark.parametrize("argv", [["--clients", "-1"], ["--turns", "0"], ["--max-new-tokens", "0"], ["--seed", "-2"]])
def test_loadgen_counts_out_of_range_are_usage_errors(capsys, argv: list[str]) -> None:
    """``scripts/loadgen.py --clients -1`` was a ValueError traceback from the workload; a
    count out of range is argparse's one-line usage error (exit status 2) now."""
    from hicache.server.loadgen import main as loadgen_main

    with pytest.raises(SystemExit) as exc:
        loadgen_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and argv[0] in err


def test_a_workload_written_to_a_pipe_streams_through_it(tmp_path) -> None:
    """``hicache workload agents /dev/stdout | ...`` failed once traces were written through a
    temporary file renamed over the target: a pipe has no folder to put it in. A target that is
    no regular file is written in place."""
    import os
    import threading

    from hicache.replay.trace import TraceRequest
    from hicache.replay.workloads import write_trace

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_trace(fifo, [TraceRequest(timestamp=0, input_length=512, output_length=1, hash_ids=(1,))])
    reader.join(10)
    assert b'"hash_ids": [1]' in got[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.parametrize("argv", [["workload", "agents", "/dev/stdout"],
                                  ["size", "TRACE", "--no-progress", "--plot", "/dev/stdout"]], ids=["workload", "plot"])
def test_dev_stdout_into_a_pipe_is_written_through_it(tmp_path, argv) -> None:
    """``hicache workload agents /dev/stdout | ...`` (and a plot sent there): /dev/stdout into a
    pipe resolves to ``/proc/PID/fd/pipe:[N]``, no path at all, so it was taken for a file
    not there yet and a temporary file beside it could not be made: exit 2, nothing written."""
    trace = _trace(tmp_path / "t.jsonl", RECORD, {**RECORD, "timestamp": 1})
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b'"hash_ids": [' in proc.stdout or b"</svg>" in proc.stdout


def test_a_plot_written_to_a_named_pipe_streams_through_it(tmp_path) -> None:
    """A target that is no regular file is written in place, but the plot opened it with
    ``O_CREAT | O_EXCL`` (meant for its temporary file), which fails on any existing path:
    ``--plot some.fifo.svg`` ended in 'File exists'."""
    import threading

    from hicache.replay.plot import write_svg_plot

    fifo = tmp_path / "plot.svg"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    try:
        write_svg_plot(fifo, {"lru": [(1, 0.1), (10, 0.5)]}, title="t", x_label="x", y_label="y")
    finally:
        if not got and reader.is_alive():
            with open(fifo, "wb"):  # let the reader go
                pass
        reader.join(10)
    assert got[0].rstrip().endswith(b"</svg>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.svg"]
