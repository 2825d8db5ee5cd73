"""Generated traces in the Mooncake format, with shapes the Mooncake trace lacks.

``agents``: many agent sessions, each a loop of short turns over one of a few long shared
prefixes (system prompt plus tool definitions). Every turn resends the session's whole context
and appends a little (a tool result, a reply), so the previous turn's tail is reused exactly once,
soon; the shared prefixes are reused by every session, all the time; sessions end and new ones
start. Popularity of the prefixes is skewed (Zipf). The Mooncake trace's shape is the opposite:
long documents asked about several times with a private question each time.

``chat``: conversations over a few long shared system prompts, with human think time between
turns (so a conversation's tail is often evicted from host before it is reused), and some
conversations opening with a pasted private document.

Deterministic for a seed (numpy's PCG64), so tests and the README reproduce the same numbers.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

import numpy as np

from hicache.replay.whole_file import written_whole
from hicache.replay.trace import BLOCK_TOKENS, TraceRequest

__all__ = ["WORKLOADS", "agent_workload", "chat_workload", "session_workload", "write_trace"]


def agent_workload(
    *,
    seed: int = 0,
    sessions: int = 300,
    concurrent: int = 60,
    prefixes: int = 6,
    prefix_blocks: tuple[int, int] = (8, 24),
    turns: tuple[int, int] = (3, 12),
    append_blocks: tuple[int, int] = (1, 3),
    turn_gap_ms: tuple[int, int] = (200, 4000),
) -> list[TraceRequest]:
    """Agent sessions as trace requests in time order (see the module docstring)."""
    return session_workload(seed=seed, sessions=sessions, concurrent=concurrent, prefixes=prefixes,
                            prefix_blocks=prefix_blocks, turns=turns, append_blocks=append_blocks,
                            turn_gap_ms=turn_gap_ms)


def chat_workload(
    *,
    seed: int = 0,
    sessions: int = 600,
    concurrent: int = 150,
    prefixes: int = 3,
    prefix_blocks: tuple[int, int] = (16, 48),
    turns: tuple[int, int] = (1, 8),
    append_blocks: tuple[int, int] = (1, 4),
    turn_gap_ms: tuple[int, int] = (5000, 90000),
    document_share: float = 0.3,
    document_blocks: tuple[int, int] = (8, 64),
) -> list[TraceRequest]:
    """Chat: a few long shared system prompts (8k-24k tokens), short conversations with a
    human's think time between turns (5-90 s, so a conversation's tail often outlives the host
    tier), and a share of conversations that open by pasting a private document. Sessions are
    many and concurrent; the shared prompts are reused all the time, documents only within their
    conversation."""
    return session_workload(seed=seed, sessions=sessions, concurrent=concurrent, prefixes=prefixes,
                            prefix_blocks=prefix_blocks, turns=turns, append_blocks=append_blocks,
                            turn_gap_ms=turn_gap_ms, document_share=document_share,
                            document_blocks=document_blocks)


def session_workload(
    *,
    seed: int,
    sessions: int,
    concurrent: int,
    prefixes: int,
    prefix_blocks: tuple[int, int],
    turns: tuple[int, int],
    append_blocks: tuple[int, int],
    turn_gap_ms: tuple[int, int],
    document_share: float = 0.0,
    document_blocks: tuple[int, int] = (0, 0),
) -> list[TraceRequest]:
    """Sessions over shared prefixes (Zipf popularity), each a run of turns that resend the
    whole context and append a few blocks; ``document_share`` of sessions first append a private
    document of ``document_blocks``."""
    if not 0.0 <= document_share <= 1.0:
        raise ValueError(f"document_share must be in [0, 1], got {document_share}")
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    shared = [fresh(int(rng.integers(prefix_blocks[0], prefix_blocks[1] + 1))) for _ in range(prefixes)]
    weights = 1.0 / np.arange(1, prefixes + 1)
    weights /= weights.sum()
    events: list[tuple[int, int, list[int], int]] = []  # (time, order, hash ids, input length)
    clock = [0] * concurrent  # each lane runs one session after another
    for s in range(sessions):
        lane = s % concurrent
        t = clock[lane] + int(rng.integers(0, 2000))
        context = list(shared[int(rng.choice(prefixes, p=weights))])
        if document_share and rng.random() < document_share:  # no draw at all when 0: seeds stay
            context += fresh(int(rng.integers(document_blocks[0], document_blocks[1] + 1)))
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            context += fresh(int(rng.integers(append_blocks[0], append_blocks[1] + 1)))
            partial = int(rng.integers(1, BLOCK_TOKENS + 1))  # the last block is partly filled
            events.append((t, len(events), list(context), (len(context) - 1) * BLOCK_TOKENS + partial))
            t += int(rng.integers(turn_gap_ms[0], turn_gap_ms[1] + 1))
        clock[lane] = t
    events.sort()
    return [TraceRequest(t, length, 1, tuple(ids)) for t, _, ids, length in events]


def write_trace(path: str | os.PathLike[str], requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as Mooncake-format JSON lines, gzip-compressed when ``path`` ends in
    ``.gz``: :func:`~hicache.replay.trace.load_trace` reads such a file through gzip, so plain
    text under that name was a trace no command could read back.

    Written to a temporary file renamed over ``path``: written in place, a write that failed
    halfway (a full disk, Ctrl-C) left the trace that was there truncated to part of the new one."""
    final = os.path.realpath(path)  # a symlink's target is the trace, as open() wrote it
    # errors name the operator's path, not the temporary one
    if os.path.isdir(final):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    if not os.path.isdir(os.path.dirname(final)):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
    with written_whole(path) as tmp, _text_writer(tmp, final if str(path).endswith(".gz") else None) as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


@contextlib.contextmanager
def _text_writer(tmp: str, gzip_name: str | None) -> Iterator[TextIO]:
    """``tmp`` open for UTF-8 text, gzip-compressed when ``gzip_name`` (the trace's own path) is
    given. The gzip header names that file, as gzip does, and holds no time: it named the
    temporary file (``gunzip -N`` restored ``t.jsonl.gz.1234.tmp``), and the time of writing
    made one seed's trace other bytes every run."""
    if gzip_name is None:
        with open(tmp, "w", encoding="utf-8") as plain:
            yield plain
        return
    with open(tmp, "wb") as raw, gzip.GzipFile(os.path.basename(gzip_name), "wb", fileobj=raw, mtime=0) as packed, \
            io.TextIOWrapper(packed, encoding="utf-8") as text:
        yield text


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {"agents": agent_workload, "chat": chat_workload}
