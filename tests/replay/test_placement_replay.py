"""Placement in the replay: every policy verified bit for bit on a prefix of the Mooncake trace,
the bounds and the one-pass miss-ratio curve checked against the reference LRU, and the CLI's
``replay``, ``size`` and ``workload`` commands."""

from __future__ import annotations

import asyncio
import json
import xml.dom.minidom
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.replay import load_replay_config, load_trace, reference_lru, unique_blocks
from hicache.replay.bounds import belady, infinite_cache
from hicache.replay.compare import compare_policies, format_comparison
from hicache.replay.sizing import lru_miss_ratio_curve
from hicache.replay.workloads import agent_workload, chat_workload, write_trace

from _replay_paths import CONFIG, REPO, shared_trace as _trace


def test_every_policy_verifies_and_lru_is_unchanged() -> None:
    """300 requests, capacities of the whole trace: every restored page verifies; lru gives
    exactly the hits and bytes it gave before placement existed; tiered writes less to storage
    (``reuse`` is ``tiered`` minus two rules: tests/placement checks it on its own)."""
    everything = load_trace(_trace())
    cfg = load_replay_config(CONFIG)
    report = asyncio.run(compare_policies(cfg, everything[:300], ["lru", "tiered"],
                                           basis_unique_blocks=unique_blocks(everything)))
    rows = report["policies"]
    assert list(rows) == ["lru", "tiered"]
    assert all(r["verification_failures"] == 0 for r in rows.values())
    # hicache before placement existed (commit 21f54e4), same 300 requests and tiers
    assert rows["lru"]["hit_tokens"] == {"device": 60416, "host": 61440, "storage": 65536}
    assert rows["lru"]["storage_written_bytes"] == rows["lru"]["host_written_bytes"] == 57794560
    assert rows["tiered"]["storage_written_bytes"] < rows["lru"]["storage_written_bytes"]
    # what each tier let go, in pages and bytes; storage removals by who chose them: the
    # backend's bound under lru, the tree's deletions under tiered (the bound never fires)
    for r in rows.values():
        for tier in ("device", "host", "storage"):
            assert r["evicted"][tier]["bytes"] == r["evicted"][tier]["pages"] * 8192
    assert "deleted" not in rows["lru"]["evicted"]["storage"]["by_reason"]
    assert "evicted" not in rows["tiered"]["evicted"]["storage"]["by_reason"]
    bounds = report["bounds"]
    assert bounds["infinite_cache"] >= bounds["belady_at_8784_blocks"] >= max(r["total_hit"] for r in rows.values())
    for r in rows.values():  # every prompt token is a hit on a tier or a miss with its reason
        assert sum(r["hit_tokens"].values()) + sum(r["miss_tokens"].values()) == r["prompt_tokens"]
        assert "unknown" not in r["miss_tokens"], r["miss_tokens"]
    text = format_comparison(report)
    assert "tiered" in text and "belady_at_8784_blocks" in text
    assert "misses (share of prompt tokens, by reason):" in text


def test_miss_ratio_curve_equals_the_reference_lru() -> None:
    requests = load_trace(_trace(), limit=600)
    mrc = lru_miss_ratio_curve(requests)
    for cap in (1, 50, 400, 3000, 10**6):
        ref = reference_lru(requests, [cap])
        assert mrc.hit_ratio(cap, tokens=False) == pytest.approx(ref["hit_ratio"], abs=1e-12)
        assert round(mrc.hit_ratio(cap) * mrc.total_tokens) == ref["hit_tokens"]
    assert mrc.curve([0, 10**9], tokens=False)[1][1] == pytest.approx(infinite_cache(requests)["hit_ratio_blocks"])


def test_belady_bounds() -> None:
    requests = load_trace(_trace(), limit=600)
    unique = unique_blocks(requests)
    ideal = infinite_cache(requests)
    last = -1.0
    for cap in (0, 10, 100, 1000, unique):
        b = belady(requests, cap)
        assert b["hit_ratio_blocks"] >= reference_lru(requests, [cap])["hit_ratio"] if cap else b["hit_blocks"] == 0
        assert last <= b["hit_ratio_blocks"] <= ideal["hit_ratio_blocks"]
        last = b["hit_ratio_blocks"]
    assert belady(requests, unique)["hit_blocks"] == ideal["hit_blocks"]
    with pytest.raises(ValueError):
        belady(requests, -1)


def test_a_block_first_seen_short_hits_only_what_was_seen_in_every_bound() -> None:
    """Block 2 is first a prompt's 188-token last block, then a full one (a turn's tail, completed
    by the next turn): every count of hits gave the second sight all 512 tokens, where only 188
    were ever given to a cache; the generated agents trace's ceiling was 0.9423, not 0.9264."""
    from hicache.replay import TraceRequest

    requests = [TraceRequest(0, 700, 1, (1, 2)), TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 600, 1, (1, 2))]
    seen = 512 + 188 + 512 + 88  # the second sight holds 188 of block 2; the third wants 88 of 512
    total = 700 + 1024 + 600
    assert infinite_cache(requests)["hit_tokens"] == seen
    assert belady(requests, 2)["hit_tokens"] == seen
    ref = reference_lru(requests, [1, 2])
    assert ref["hit_tokens"] == seen and ref["miss_tokens"] == total - seen
    mrc = lru_miss_ratio_curve(requests)
    assert round(mrc.hit_ratio(2) * mrc.total_tokens) == seen
    # a block seen long and asked short is a hit of the short part only, as before
    shrink = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 700, 1, (1, 2))]
    assert infinite_cache(shrink)["hit_tokens"] == 700


def test_size_and_workload_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "agents.jsonl"
    assert main(["workload", "agents", str(trace), "--seed", "3", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["requests"] == len(load_trace(trace)) > 0
    assert load_trace(trace) == agent_workload(seed=3)  # deterministic, and it round-trips
    plot = tmp_path / "curve.svg"
    assert main(["size", str(trace), "--plot", str(plot), "--kv-bytes-per-token", "4096"]) == 0
    out = capsys.readouterr().out
    assert "LRU hit (tokens)" in out and "Belady" in out
    xml.dom.minidom.parse(str(plot))  # a well-formed SVG
    bad = tmp_path / "bad.jsonl"
    no_blocks = '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n'
    for text in ("", '{"timestamp": 0, "input_length": 5}\n', "not json\n", no_blocks):  # empty, a field missing, garbage
        bad.write_text(text)
        assert main(["size", str(bad), "--plot", str(tmp_path / "no.svg")]) == 2  # as every command's errors
        assert "hicache: error: " in (err := capsys.readouterr().err) and "bad.jsonl" in err
    assert main(["size", str(tmp_path / "missing.jsonl"), "--plot", str(plot)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["workload", "agents", str(trace), "--seed", "-1"])
    assert usage.value.code == 2 and "--seed: must be >= 0" in capsys.readouterr().err


def test_agents_workload_shape() -> None:
    requests = agent_workload(seed=1, sessions=40, concurrent=8)
    assert requests == sorted(requests, key=lambda r: r.timestamp)
    for r in requests:
        assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512
    # a turn resends its session's previous turn and appends 1 to 3 blocks
    earlier: set[tuple[int, ...]] = set()
    extended = 0
    for r in requests:
        extended += any(r.hash_ids[:-k] in earlier for k in (1, 2, 3))
        earlier.add(r.hash_ids)
    assert extended > len(requests) // 2


def test_chat_workload_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Long shared system prompts, some conversations open with a private document, turns
    resend the context; the CLI writes the same trace."""
    requests = chat_workload(seed=1, sessions=60, concurrent=12)
    assert requests == sorted(requests, key=lambda r: r.timestamp)
    firsts = {r.hash_ids[:16] for r in requests}
    assert len(firsts) <= 3  # every prompt starts with one of the 3 shared system prompts (>= 16 blocks)
    assert max(len(r.hash_ids) for r in requests) > 48 + 8  # a document was pasted somewhere
    trace = tmp_path / "chat.jsonl"
    assert main(["workload", "chat", str(trace), "--seed", "4", "--json"]) == 0
    capsys.readouterr()
    assert load_trace(trace) == chat_workload(seed=4)
    with pytest.raises(ValueError, match="document_share"):
        chat_workload(document_share=1.5)


def test_replay_command_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "agents.jsonl"
    write_trace(trace, agent_workload(seed=2, sessions=6, concurrent=3))
    cfg = tmp_path / "tiers.toml"  # the agents config, smaller tiers for this small trace
    cfg.write_text((REPO / "configs" / "replay-agents.toml").read_text()
                   .replace("1114112", str(100 * 8192)).replace("3710976", str(200 * 8192)))
    assert main(["replay", "-c", str(cfg), "--trace", str(trace), "--no-progress", "--policies", "lru,tiered"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "tiered" in out and "infinite_cache" in out and "reuse " not in out
    assert main(["replay", "-c", str(cfg), "--trace", str(trace), "--policies", "nope"]) == 2


def test_size_names_belady_by_the_share_it_was_computed_at(tmp_path: Path) -> None:
    """On a trace of two unique blocks Belady "at 1%, 5%, 20%" was three times one block, 50% of
    them, printed beside the curve's rows as if at 1%."""
    from hicache.replay.size_report import format_size_report, size_report

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1,
                                         "hash_ids": ids}) + "\n" for ids in ([1], [2], [1], [2], [1])))
    report = size_report(trace, plot=tmp_path / "c.svg")
    # the keys are the fractions asked for (reports of different traces line up); each one's
    # real size beside it: one block, 50% of the unique ones (keep block 1, bypass 2)
    assert report["belady_hit_tokens_by_share"] == {"0.01": 0.4, "0.05": 0.4, "0.2": 0.4}
    assert [(b["fraction"], b["blocks"], b["share_of_unique"]) for b in report["belady"]] == [
        (0.01, 1, 0.5), (0.05, 1, 0.5), (0.2, 1, 0.5)]
    assert "Belady (offline bound) at 1% (1 block = 50%): 0.4000" in format_size_report(report)
    assert ">50%</text>" in (tmp_path / "c.svg").read_text() and ">1%</text>" not in (tmp_path / "c.svg").read_text()
    shipped = size_report(_trace(), belady_fractions=(0.01, 0.05, 0.2))  # 439, 2,196, 8,784 of 43,924
    assert list(shipped["belady_hit_tokens_by_share"]) == ["0.01", "0.05", "0.2"]
    assert "Belady (offline bound) at 1%: " in format_size_report(shipped)  # 1% of its blocks really
    odd = tmp_path / "odd.jsonl"  # 101 unique blocks: 1 / 5 / 20 blocks are 0.99% / 4.95% / 19.8%
    odd.write_text("".join(json.dumps({"timestamp": i, "input_length": 512, "output_length": 1,
                                       "hash_ids": [i % 101]}) + "\n" for i in range(303)))
    assert list(size_report(odd)["belady_hit_tokens_by_share"]) == ["0.01", "0.05", "0.2"]


def test_size_shows_its_progress_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hicache size`` on a trace of 100k requests ran half a minute without a sign: bars on a
    terminal's stderr now (reading, then every pass over the block references), none elsewhere;
    every pass reports each reference once."""
    import io

    from hicache.replay.size_report import size_report
    from hicache.replay.trace import block_references

    requests = agent_workload(seed=5, sessions=20, concurrent=4)
    trace = tmp_path / "agents.jsonl"
    write_trace(trace, requests)
    n = len(block_references(requests)[0])
    done: list[int] = []
    lru_miss_ratio_curve(requests, tick=done.append)
    assert sum(done) == n
    done.clear()
    assert belady(requests, 50, tick=done.append) == belady(requests, 50)
    assert sum(done) == 2 * n

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stderr, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stderr)
        report = size_report(trace, progress=True)
        assert ("sizing" in stderr.getvalue() and "reading" in stderr.getvalue()) is shown
        assert report == size_report(trace)


def test_a_file_store_sized_by_storage_pages_holds_that_many_pages(tmp_path) -> None:
    """The stack bounded a ``file`` store sized by ``storage_pages`` to that many pages of
    payload, but the store counts each page file whole (header and footer too): it held 15 or
    4 of 16 pages, its own LRU evicting pages the placement directory had room for. It now
    holds exactly ``storage_pages``; one page more, and its bound evicts one."""
    from hicache.controller import ControllerConfig
    from hicache.replay import serve_request
    from hicache.stack import StackConfig, build_stack

    ps, n = 4, 16

    async def run() -> None:
        for head_dim in (2, 128):  # 64-byte pages (224 on disk) and 32 KiB ones
            stack = build_stack(StackConfig(
                page_size=ps, device_pages=2 * n, host_pages=2 * n, storage_pages=n, head_num=8, head_dim=head_dim,
                storage_backend="file", storage_options={"root": str(tmp_path / f"s{head_dim}"), "min_free_bytes": 0},
                req_slots=4, max_context_len=256,
                controller=ControllerConfig(prefetch_threshold=ps, prefetch_policy="wait_complete")))
            try:
                await serve_request(stack, list(range(n * ps)), rid="fill")
                await stack.controller.wait_prefetches()
                await stack.cache.drain()
                assert len(await stack.storage.list_pages()) == n
                assert stack.storage.get_stats().get("evicted_pages", 0) == 0
                # one page more: the store's own bound evicts one
                await serve_request(stack, [10_000 + t for t in range(ps)], rid="one-more")
                await stack.cache.drain()
                assert len(await stack.storage.list_pages()) == n
                assert stack.storage.get_stats().get("evicted_pages", 0) == 1
            finally:
                await stack.aclose()

    asyncio.run(run())
