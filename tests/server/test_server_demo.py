"""The main job end to end on a tiny workload: three phases, a complete report, every cached
answer equal to the no-cache one, storage hits after the restart."""

from __future__ import annotations

from pathlib import Path

from server_helpers import requires_facade, small_config
from hicache.demo import format_report, run_demo_async
from hicache.server.loadgen import Workload


@requires_facade
async def test_demo_reports_hits_ttft_and_matching_answers(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "store")
    w = Workload(clients=3, turns=2, system_tokens=128, user_tokens=32, max_new_tokens=4)
    report = await run_demo_async(cfg, workload=w)
    assert report["all_answers_match"] is True
    assert report["answers_compared"] == 3 * 2 + 3
    assert report["failed_requests"] == []
    base, cached, restart = report["baseline"], report["cached"], report["restart"]
    assert base["prefill_tokens_saved"] == 0 and base["errors"] == 0
    assert cached["prefill_tokens_saved"] > 0 and cached["prefill_tokens"] < base["prefill_tokens"]
    assert restart["hit_tokens"]["storage"] > 0
    assert report["ttft_speedup_p50"] is not None
    text = format_report(report)
    assert "hit rate by tier" in text and "every cached answer equals the no-cache recompute: yes" in text
    assert "just loaded from storage" in text
    # a store that does not outlive its server (memory): the restart's hits are not storage's
    restart["hit_tokens"]["storage"] = 0
    text = format_report(report)
    assert "nothing came from storage" in text and "just loaded from storage" not in text


def test_a_failed_request_is_named_in_the_report_not_only_counted_as_a_difference() -> None:
    from hicache.demo import _failures

    phase = {"records": [{"client": 0, "turn": 0, "error": None},
                         {"client": 1, "turn": 3, "error": "OutOfKVSlotsError('no room')"}]}
    failed = _failures("cached", phase)
    assert failed == [{"phase": "cached", "client": 1, "turn": 3, "error": "OutOfKVSlotsError('no room')"}]
    assert _failures("restart", None) == []


def test_a_missing_answer_is_told_apart_from_a_different_one() -> None:
    """The demo once reported a request that failed in its last turn as "1 differed": only an
    answer present in both runs and different can mean wrong KV."""
    from hicache.demo import AnswerCheck, _answers, _compare, _verdict_no

    want = {(c, t): [c, t, 7] for c in range(2) for t in range(4)}
    records = [{"client": c, "turn": t, "tokens": v, "error": None} for (c, t), v in want.items()]
    records[3] = {**records[3], "tokens": [], "error": "OutOfKVSlotsError('no room')"}  # conversation 0, turn 3
    check = _compare(_answers({"records": records}), want)
    assert check == AnswerCheck(compared=8, differing=0, missing=1)
    verdict = _verdict_no({"answers_mismatched": check.differing, "answers_missing": check.missing})
    assert verdict == "NO (0 differ; 1 missing: a request failed (see below), so there is no answer to compare)"

    records[5] = {**records[5], "tokens": [9, 9, 9]}
    check = _compare(_answers({"records": records}), want) + _compare({(0, 0): [0, 0, 7]}, {(0, 0): [0, 0, 7]})
    assert check == AnswerCheck(compared=9, differing=1, missing=1)


@requires_facade
async def test_a_demo_run_leaves_no_pages_in_the_store(tmp_path: Path) -> None:
    """Each run writes under a namespace of its own (a fresh salt), which no later run can read:
    its pages were left in the store, a namespace of dead pages more with every ``hicache demo``
    (``./.hicache/store``; ``demo_stress.py --runs 20`` left twenty)."""
    root = tmp_path / "store"
    w = Workload(clients=2, turns=2, system_tokens=128, user_tokens=32, max_new_tokens=4)
    for _ in range(2):
        report = await run_demo_async(small_config(root), workload=w)
        assert report["all_answers_match"] is True and report["restart"]["hit_tokens"]["storage"] > 0
    assert [p for p in root.rglob("*") if p.is_file()] == []
