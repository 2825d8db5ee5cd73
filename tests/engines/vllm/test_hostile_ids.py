"""vLLM's request ids carry the client's text (the ``request_id`` of an OpenAI request, with a
suffix of vLLM's): every log line of the connector that names one quotes it
(``hicache.errors.quoted``), so a newline cannot forge a log line, an ANSI escape cannot
recolour a terminal, a NUL cannot cut a line in a collector, and a megabyte id cannot flood
the log. On the connector's halves over a real file store and real tensors, and under vLLM's
own scheduler."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_connector_failures import damage
from test_connector_units import BS, OTHER, TOKENS, begin, kv_layers, load, request, scheduler, stored, worker
from test_real_scheduler import Engine, _store_damaged, prompts
from test_connector_failures import model_dir  # noqa: F401 - a fixture

from hicache.integrations.vllm.naming import PageKeyChain
from hicache.integrations.vllm.transfers import PageSave

#: an id built to forge log lines (a newline, a NUL, an ANSI colour escape, a CR), a megabyte long
EVIL = "x\nERROR hicache forged line\x00\x1b[31m\r" + "A" * 1_000_000


def unsafe_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    """hicache's log records whose message carries a control character or runs past 2,000
    characters, cut short for the assertion's report."""
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hicache")]
    return [m[:120] for m in messages if len(m) > 2_000 or any(ord(c) < 32 or ord(c) == 127 for c in m)]


def test_the_connectors_halves_quote_request_ids_in_their_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hicache")
    a, b = EVIL + "a", EVIL + "b"
    src, _ = stored(tmp_path, seed=2, num_pages=3)
    damage(tmp_path, src, 1)
    other = TOKENS[: 3 * BS] + OTHER[3 * BS :]
    s = scheduler("file", {"root": str(tmp_path)})
    w = worker(tmp_path, kv_layers(seed=3))
    try:
        # a request sharing a block whose load failed: "save of ... dropped" for both
        assert request(s, a, TOKENS, [8, 9, 10, 11, 12, 13]) == 3 * BS
        assert s.matched_tokens(b, other, None, 3 * BS) == 0
        plan = s.plan_step([(a, 3 * BS, len(TOKENS), TOKENS, [8, 9, 10, 11, 12, 13]),
                            (b, 3 * BS, len(other), other, [8, 9, 10, 3, 4, 5])])
        begin(w, plan)
        assert load(w, plan.loads) == {9, 10}
        w.save(plan.saves)
        # more external tokens than blocks: "... external tokens do not fit its blocks"
        c = EVIL + "c"
        assert s.matched_tokens(c, TOKENS, None, 0) is not None
        s.allocated(c, [1], 4 * BS)
        # a save naming a block past the KV cache: "save of ... names block ..."
        keys = PageKeyChain(BS).extend(OTHER, 1)
        w.save([PageSave(EVIL + "d", tuple(keys), (40,), (999,), job=7)])
        # a lookup whose store raises: "lookup of ... failed"
        backend = s.store.backends[0]

        async def broken(keys):  # type: ignore[no-untyped-def]
            raise OSError("the mount went away")

        backend.exists_pages = broken  # type: ignore[method-assign]
        assert s.matched_tokens(EVIL + "e", OTHER, None, 0) is not None
    finally:
        w.close(timeout=10)
        s.close(timeout=10)
    logged = [r.getMessage() for r in caplog.records]
    for what in ("dropped", "do not fit", "names block", "lookup of"):
        assert any(what in m for m in logged), (what, [m[:100] for m in logged])
    assert unsafe_records(caplog) == []


def test_under_vllms_scheduler_request_ids_are_quoted_in_the_connectors_log(
        model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """Two requests of one prefix whose pages are all damaged in the store, under
    ``kv_load_failure_policy: recompute``: the second, sharing the first's failed blocks, is
    rolled back too, with "request ... shares a block whose load failed"."""
    prompt = prompts(7, 1, shared=40)[0]
    _store_damaged(model_dir, tmp_path, prompt, num_blocks=30, policy="recompute")
    caplog.set_level(logging.INFO, logger="hicache")
    # both lookups answered in the step that admits them (the default 5 ms budget split them
    # over two steps on a loaded machine: each loaded alone, and none shared a failed block)
    engine = Engine(model_dir, tmp_path, num_blocks=30, policy="recompute", batch_tokens=256,
                    extra={"lookup_wait_s": 5.0})
    x, y = EVIL + "x", EVIL + "y"
    try:
        engine.add(x, prompt, max_tokens=5)
        engine.add(y, [*prompt, 3, 4, 5], max_tokens=5)
        engine.run()
        assert engine.bad == []
    finally:
        engine.close()
    assert any("shares a block whose load failed" in r.getMessage() for r in caplog.records)
    assert unsafe_records(caplog) == []
