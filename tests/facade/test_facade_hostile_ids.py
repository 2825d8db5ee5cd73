"""Request and session ids are the caller's text (a server passes its client's on): every log
line and error message of the library that names one quotes it (``hicache.errors.quoted``), so
a newline cannot forge a log line, an ANSI escape cannot recolour a terminal, a NUL cannot cut
a line in a collector, and a megabyte id cannot flood the log."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from hicache.errors import OutOfKVSlotsError
from hicache.facade import HiCache
from test_facade import PS, config, prompt, run

#: an id built to forge log lines (a newline, a NUL, an ANSI colour escape, a CR), a megabyte long
EVIL = "x\nERROR hicache forged line\x00\x1b[31m\r" + "A" * 1_000_000
#: what one log line or error message naming such an id may grow to
BOUND = 2_000


def unsafe(text: str) -> bool:
    """Whether ``text`` carries a control character or is past :data:`BOUND`."""
    return len(text) > BOUND or any(ord(c) < 32 or ord(c) == 127 for c in text)


def unsafe_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The log records whose message (or the message of the exception they carry) is unsafe,
    cut short for the assertion's report."""
    bad = []
    for r in caplog.records:
        texts = [r.getMessage()] + ([str(r.exc_info[1])] if r.exc_info and r.exc_info[1] else [])
        bad += [t[:120] for t in texts if unsafe(t)]
    return bad


async def test_hostile_ids_are_quoted_in_the_facades_logs_and_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache")
    errors: list[str] = []
    async with HiCache.from_config(config(device={"max_requests": 3})) as cache:
        await run(cache, EVIL, prompt(1, 3 * PS), session_id=EVIL)  # "turn saved" (debug)
        first = await cache.begin(EVIL, prompt(1, 4 * PS), session_id=EVIL)
        # a second turn of the session while one runs: "arrived while another turn runs"
        second = await cache.begin(EVIL, prompt(1, 4 * PS), session_id=EVIL)
        third = await cache.begin("plain", prompt(2, PS))
        with pytest.raises(OutOfKVSlotsError) as full:  # "no request slot for request ..."
            await cache.begin(EVIL, prompt(3, PS))
        errors.append(str(full.value))
        with pytest.raises(IndexError) as layer:  # "request ...: layer 99 out of range"
            await first.wait_layer(99)
        errors.append(str(layer.value))
        with pytest.raises(ValueError) as copy:  # "request ... was not begun by this cache"
            await cache.commit(dataclasses.replace(first))
        errors.append(str(copy.value))
        with pytest.raises(OutOfKVSlotsError) as room:  # "no room on device for ... of request ..."
            await cache.extend(third, list(range(1500)))
        errors.append(str(room.value))
        for h in (first, second, third):
            await cache.commit(h)
        with pytest.raises(ValueError) as twice:  # "request ... is already committed or aborted"
            await cache.commit(first)
        errors.append(str(twice.value))
        assert await cache.release_session(EVIL)
    logged = [r.getMessage() for r in caplog.records]
    assert any("turn" in m and "saved" in m for m in logged), logged
    assert any("another turn runs" in m for m in logged), logged
    assert [e[:120] for e in errors if unsafe(e)] == []
    assert unsafe_records(caplog) == []
