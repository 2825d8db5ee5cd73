"""``hicache bench copy`` and ``hicache bench evict`` end to end on tiny sizes: JSON out, every row
measured against its baseline (behaviour, not time: no threshold here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.memory.spans import NATIVE_AVAILABLE

TINY = ["--layers", "2", "--heads", "1", "--head-dim", "8", "--page-size", "4", "--pages", "4", "--reps", "1"]


def test_bench_copy_reports_every_row(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the CLI hands the script its own argv
    out = tmp_path / "copy.json"
    main(["bench", "copy", *TINY, "--out", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    paths = ["native", "numpy"] if NATIVE_AVAILABLE else ["numpy"]
    assert report["default_path"] == paths[0]
    rows = {(r["path"], r["layout"], r["pattern"], r["op"]) for r in report["results"]}
    assert rows == {
        (p, lo, pa, op)
        for p in paths
        for lo in ("layer_first", "page_first", "page_first_direct")
        for pa in ("runs", "scattered")
        for op in ("backup", "load")
    }
    assert all(r["ratio"] > 0 and r["gbps"] > 0 for r in report["results"])
    assert report["min_ratio"] == min(r["ratio"] for r in report["results"] if r["path"] == paths[0])
    assert report["config"]["bytes_per_op"] == 4 * 4 * 2 * 2 * 8 * 2  # pages x tokens x K/V x layers x dim x bf16


def test_bench_evict_checks_victims_and_reports(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    main(["bench", "evict", "--sizes", "50,200", "--reps", "3"])
    report = json.loads(capsys.readouterr().out)
    assert [r["requests"] for r in report["results"]] == [50, 200]
    assert all(r["nodes"] >= r["requests"] and r["index_evict_ms"] > 0 for r in report["results"])


@pytest.mark.parametrize(("args", "message"), [
    (["evict", "--sizes", "abc"], "argument --sizes: 'abc' is not an integer"),
    (["evict", "--sizes", ","], "argument --sizes: needs at least one integer"),
    (["evict", "--page-size", "0"], "argument --page-size: must be at least 1, got 0"),
    (["evict", "--reps", "0"], "argument --reps: must be at least 1, got 0"),
    # each repeat evicts a leaf: a tree of 10 requests ran out of them (a victim of None)
    (["evict", "--sizes", "10"], "--sizes [10]: each size must be at least --reps (20)"),
    (["copy", "--layers", "0"], "argument --layers: must be at least 1, got 0"),
    (["copy", "--seed", "-1"], "argument --seed: must not be negative, got -1"),
    # a misspelt name was a KeyError or ValueError traceback mid-run, and a copy path not
    # known ran the numpy path under the misspelt name's label
    (["copy", "--layouts", "page_frist"], "argument --layouts: unknown 'page_frist'; allowed: layer_first, page_first"),
    (["copy", "--patterns", "runs,scatter"], "argument --patterns: unknown 'scatter'; allowed: runs, scattered"),
    (["copy", "--paths", "numpi"], "argument --paths: unknown 'numpi'; allowed: native, numpy"),
    (["copy", "--layouts", ","], "argument --layouts: needs at least one name"),
    (["copy", "--device", "tpu"], "argument --device: 'tpu' is not a torch device"),
    (["storage", "--pages", "0"], "argument --pages: must be at least 1, got 0"),
    (["storage", "--exists-scales", "1,x"], "argument --exists-scales: 'x' is not an integer"),
    (["s3", "--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
    # moto slept a negative or nan delay: every request failed, and the run ended in an
    # AssertionError traceback; a prompt of no pages was timed as nothing
    (["s3", "--latency-ms", "nan"], "argument --latency-ms: must be a finite number of at least 0, got nan"),
    (["s3", "--latency-ms", "-5"], "argument --latency-ms: must be a finite number of at least 0, got -5"),
    (["s3", "--lookup-pages", "0"], "argument --lookup-pages: must be at least 1, got 0"),
])
def test_bench_arguments_out_of_range_are_usage_errors(args: list[str], message: str, capsys, monkeypatch) -> None:
    """They were tracebacks halfway through a run (a page size of 0, an empty size list), or a
    run that measured nothing; each is now refused before anything runs."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("what", ["evict", "copy", "storage"])
def test_an_out_file_that_cannot_be_written_is_refused_before_the_run(what: str, tmp_path: Path, capsys,
                                                                     monkeypatch) -> None:
    """``--out`` in a missing folder, or naming a folder, failed only when the report was written:
    after the whole benchmark had run (minutes at the default sizes), with its JSON on stdout
    and an error (a traceback when the script is run directly). It is a usage error now."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for out, words in ((tmp_path / "no" / "r.json", "no folder"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", what, "--out", str(out)])
        captured = capsys.readouterr()
        assert exc.value.code == 2 and captured.out == "", captured.out[:200]
        assert "argument --out" in captured.err and words in captured.err and "Traceback" not in captured.err
