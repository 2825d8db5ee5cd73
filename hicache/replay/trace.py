"""Reading the Mooncake trace and turning its block ids into token ids.

Format (``shared/traces/README.md`` beside the repository): one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids``; each hash id stands for one block of 512
prompt tokens and identifies the whole prefix through that block. Block ``h`` becomes tokens
``h * 512 + j``; the last block is cut to ``input_length``. A gzip file (one ending in ``.gz``, or
starting with gzip's magic bytes, whatever its name) is read through gzip.

Two kinds of trace are renamed on loading (:func:`prefix_blocks`), the same way for every
consumer (replay, bounds, ``hicache size``): one whose ids do not each name a single prefix (an
id repeated within a request, or following different ids in different requests), since a prefix
cache can hit a block only after the same prefix, and one whose ids are too large for token ids
(storage keys hash uint32 tokens: ``h * 512 + j`` must fit) or negative (signed hashes).

Requests are served in file order, the order the trace's own figures are measured in; timestamps
are read but not used (the replay drains between requests). A trace whose timestamps go back
(logs of several servers, concatenated) is served as written, with a warning saying how often:
the order it arrived in is then not the order replayed, and whether to sort it is its author's
call (equal timestamps are not out of order).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import gzip
import io
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import Any
from pathlib import Path

import numpy as np

from hicache.errors import TraceFormatError
from hicache.json_keys import unique_keys

__all__ = ["TraceRequest", "block_references", "load_trace", "find_trace", "prefix_blocks", "request_tokens",
           "DEFAULT_TRACE_NAME", "shown_name"]

DEFAULT_TRACE_NAME = "mooncake_fast25_synthetic_trace.jsonl"
BLOCK_TOKENS = 512
#: the largest block id whose token ids (``h * 512 + j``) fit in uint32
MAX_BLOCK_ID = (1 << 32) // BLOCK_TOKENS - 1

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    timestamp: float  # ms, as written (an integer stays one)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_lengths(self, block_tokens: int = BLOCK_TOKENS) -> list[int]:
        """Tokens of each block in this request (the last may be partial)."""
        n = len(self.hash_ids)
        return [min(block_tokens, self.input_length - i * block_tokens) for i in range(n)]


#: what :func:`block_references` returns: block ids, tokens, reusable tokens, one per reference
References = tuple[list[int], list[int], list[int]]


def block_references(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> References:
    """Every block reference of ``requests``, in order: its block id, its tokens (the last block
    of a prompt may be partial) and the tokens of it a cache could hit (``reusable``).

    The rule every bound and reference counts hits by (:mod:`~hicache.replay.bounds`, the nested
    LRU of :mod:`~hicache.replay.reference`, the miss-ratio curve of ``hicache size``): a hit on a
    block is worth at most what earlier requests had of it, ``min(tokens, longest seen before)``,
    0 on first sight. A block first seen as a prompt's short last block and later at full length
    (a turn's tail, completed by the next turn) holds only the short part: counting all of it
    put tokens no cache was ever given into the ceilings (agents' infinite cache 0.9423 where
    0.9264 had been seen). Tokens, not pages: a cache of small pages hits whole pages of that
    part and one of 512-token pages none of it (the cache's ``partial_page`` misses), so the
    bounds stay above every page size. One length for every capacity (so the one-pass curve
    still equals the nested LRU): the longest seen before, not what a smaller cache still holds
    of the block; where a block only grows (every generated workload) the two are the same, as
    a hit finds the block held since its previous reference, at least that long."""
    blocks: list[int] = []
    tokens: list[int] = []
    reusable: list[int] = []
    seen: dict[int, int] = {}  # block -> longest prefix of it seen so far
    for req in requests:
        for h, length in zip(req.hash_ids, req.block_lengths(block_tokens)):
            before = seen.get(h, 0)
            blocks.append(h)
            tokens.append(length)
            reusable.append(min(length, before))
            if length > before:
                seen[h] = length
    return blocks, tokens, reusable


def load_trace(path: str | os.PathLike[str], limit: int | None = None, *, progress: bool = False) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace file (all when ``None``). A line that is not a
    Mooncake record is a :class:`~hicache.errors.TraceFormatError` naming the file and line:
    a replay or a sizing run on a silently shortened trace would report wrong hit rates.
    Ids are renamed where they must be (see the module docstring and :func:`prefix_blocks`).
    ``progress``: lines read, on stderr when it is a terminal (seconds per 100k requests)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    out: list[TraceRequest] = []
    try:
        with _open_trace(path) as f, progress_bar(progress, desc="reading", unit=" lines", unit_scale=True, leave=False) as bar:
            for number, raw in enumerate(f, 1):
                bar.update(1)
                if limit is not None and len(out) >= limit:
                    break
                try:
                    # a byte-order mark before a record (an editor's or a Windows tool's
                    # UTF-8) is no part of it: json refused the line. Before any record, not
                    # the first only: such files concatenated have one at each seam
                    line = raw.decode("utf-8-sig" if raw.startswith(codecs.BOM_UTF8) else "utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceFormatError(f"{path}, line {number}: not UTF-8 text ({exc.reason}); a trace is "
                                           "JSON lines, plain or gzip-compressed (.gz)") from None
                if not line.strip():
                    continue
                try:
                    # a field's name twice in the line: given twice? (refused, not read as the last)
                    hook = unique_keys if max(map(line.count, _QUOTED_FIELDS)) > 1 else None
                    out.append(_record(json.loads(line, object_pairs_hook=hook)))
                except (ValueError, TypeError, KeyError, RecursionError) as exc:
                    # RecursionError: JSON nested deeper than the parser's stack (one line of
                    # ``[[[[...`` is enough), a malformed line like any other, not a traceback
                    reason = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
                    raise TraceFormatError(f"{path}, line {number}: not a Mooncake trace record ({reason})") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # zlib.error: a damaged deflate stream
        raise TraceFormatError(f"{path}: not a readable gzip file ({exc})") from None
    back = sum(b.timestamp < a.timestamp for a, b in zip(out, out[1:]))
    if back:
        logger.warning("%s: %d request(s) with a timestamp earlier than the request before; requests are "
                       "served in file order, not sorted by time (sort the trace to replay it as it arrived)",
                       path, back)
    return prefix_blocks(out, source=str(path))


#: the first bytes of every gzip file
_GZIP_MAGIC = b"\x1f\x8b"


@contextlib.contextmanager
def _open_trace(path: str | os.PathLike[str]) -> Iterator[io.BufferedIOBase]:
    """``path``'s bytes, through gzip where it is gzip: named ``.gz``, or starting with gzip's
    magic bytes (a compressed trace saved as ``.GZ``, ``.gzip`` or under the name it was
    downloaded as was refused as "not UTF-8 text"). Peeked, not read: a pipe reads on."""
    with open(path, "rb") as raw:
        if str(path).endswith(".gz") or raw.peek(len(_GZIP_MAGIC)).startswith(_GZIP_MAGIC):
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped
        else:
            yield raw


#: the trace tools report progress every this many + 1 references (``tick`` callbacks)
TICK_MASK = (1 << 16) - 1


def progress_bar(progress: bool, **kwargs: Any) -> Any:
    """The trace tools' tqdm bar on stderr, shown only when ``progress`` and stderr is a
    terminal (``disable=None``): into a log or a pipe every redraw was a line of carriage
    returns. ``kwargs`` are tqdm's (``desc``, ``total``, ``unit``...)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, disable=None if progress else True, **kwargs)


def prefix_blocks(requests: list[TraceRequest], source: str = "trace") -> list[TraceRequest]:
    """``requests`` with every block id naming one prefix, and small enough for token ids.

    The format says a hash id identifies the whole prefix through its block; the bounds, the
    miss-ratio curve and the replay's tokens all rely on it. Where a trace breaks it (an id
    repeated within a request, or one that follows different ids in different requests), each
    (prefix, id) pair becomes a block of its own, which is what a prefix cache can hit: an
    id seen after another prefix is a different block to it. Such a trace, and one with ids
    above :data:`MAX_BLOCK_ID`, is renamed to dense ids in order of first appearance (the
    same hits: only equality of prefixes matters), and so is one with negative ids (signed
    hashes); any other is returned as it is."""
    names: dict[tuple[int, int], int] = {}  # (block before, id) -> dense id
    raw: set[int] = set()
    dense: list[list[int]] = []
    for req in requests:
        before = -1
        ids = []
        for h in req.hash_ids:
            before = names.setdefault((before, h), len(names))
            ids.append(before)
        raw.update(req.hash_ids)
        dense.append(ids)
    split = len(names) - len(raw)  # ids that name more than one prefix (one block each)
    if not split and (not raw or 0 <= min(raw) and max(raw) <= MAX_BLOCK_ID):
        return requests
    if len(names) > MAX_BLOCK_ID + 1:
        raise TraceFormatError(f"{source}: {len(names)} distinct blocks; at most {MAX_BLOCK_ID + 1} fit in "
                               "uint32 token ids")
    if split:
        logger.warning("%s: %d block id(s) follow more than one prefix (or repeat within a request); each "
                       "(prefix, id) is counted as its own block, as a prefix cache sees it", source, split)
    else:
        logger.info("%s: block ids outside 0..%d renamed to dense ids (token ids must fit in uint32)", source,
                    MAX_BLOCK_ID)
    return [dataclasses.replace(req, hash_ids=tuple(ids)) for req, ids in zip(requests, dense)]


#: a record's fields as they appear in its line: a cheap test for one given twice, which only
#: such a line pays the check of (:func:`~hicache.json_keys.unique_keys`)
_QUOTED_FIELDS = ('"timestamp"', '"input_length"', '"output_length"', '"hash_ids"')


def _record(d: object) -> TraceRequest:
    """One parsed line as a request; ``ValueError``/``TypeError``/``KeyError`` when it is none."""
    if not isinstance(d, dict):
        raise TypeError(f"a JSON object per line, got {type(d).__name__}")
    ids = d["hash_ids"]
    if not isinstance(ids, list):
        raise TypeError(f"hash_ids must be a list, got {type(ids).__name__}")
    req = TraceRequest(
        _timestamp(d["timestamp"]), _count(d["input_length"], "input_length"),
        _count(d["output_length"], "output_length"), tuple(_block_id(h) for h in ids),
    )
    # one id per block of the prompt, the last block partial: any other count makes blocks of
    # negative length (ids past the prompt) or a prompt longer than its ids say, and every
    # hit ratio computed from it wrong
    blocks = -(-req.input_length // BLOCK_TOKENS)
    if len(req.hash_ids) != blocks:
        raise ValueError(f"{len(req.hash_ids)} hash ids for input_length {req.input_length}: a Mooncake "
                         f"record has one per {BLOCK_TOKENS}-token block of the prompt ({blocks})")
    return req


def _count(value: object, what: str) -> int:
    """A non-negative integer (a float with no fraction, as some exporters write, is one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0 \
            or (isinstance(value, float) and (value == float("inf") or not value.is_integer())):
        raise ValueError(f"{what} must be a non-negative integer, got {value!r:.40}")
    return int(value)


def _block_id(value: object) -> int:
    """An integer of any sign (a float with no fraction is one): ids are opaque hashes, and a
    signed 64-bit one (Python's ``hash()``) was refused where an unsigned one above 2**54 was
    renamed; :func:`prefix_blocks` renames either."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not value.is_integer()):  # nan and inf are no integers
        raise ValueError(f"a hash id must be an integer, got {value!r:.40}")
    return int(value)


def _timestamp(value: object) -> float:
    """A non-negative number, kept as written: it is only compared with the one before (the
    warning of :func:`load_trace`), so a fraction (``1733.25`` ms, seconds as floats) is no
    reason to refuse the trace, as an integer count was."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"timestamp must be a non-negative number, got {value!r:.40}")
    return value


def find_trace(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The trace: ``explicit``, else ``$HICACHE_TRACE``, else ``../shared/traces/`` next to the
    repository (and the current directory's equivalents). A trace named (``explicit`` or
    ``$HICACHE_TRACE``) that is not there, or is a folder, is an error, never a fall back to
    another trace: a misspelt path would report the hit rates of a workload nobody asked
    about. A pipe is a trace (``--trace <(head -n 1000 t.jsonl)``): it is read once."""
    for named, how in ((explicit, "the trace"), (os.environ.get("HICACHE_TRACE"), "$HICACHE_TRACE")):
        if named:
            path = Path(named)
            if not path.exists() or path.is_dir():
                raise FileNotFoundError(f"{how} {str(path)!r} is not a file")
            return path
    repo = Path(__file__).resolve().parents[2]
    candidates = [
        repo.parent / "shared" / "traces" / DEFAULT_TRACE_NAME,
        Path.cwd().parent / "shared" / "traces" / DEFAULT_TRACE_NAME,
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        "trace not found; pass --trace or set HICACHE_TRACE (looked in: "
        + ", ".join(str(c) for c in candidates) + ")"
    )


def shown_name(name: str) -> str:
    """A file name as text any terminal takes: one that is not UTF-8 (``café`` saved in latin-1)
    holds surrogates, which a strict UTF-8 stdout refused with a traceback after the sizing
    or the replay (``hicache size``'s report, ``hicache replay``'s table)."""
    return re.sub("[\ud800-\udfff]", "\ufffd", name)


def request_tokens(req: TraceRequest, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Token ids of a request's prompt (ids too large for uint32 tokens, or negative, are a ``ValueError``:
    :func:`load_trace` renames them; see :func:`prefix_blocks`)."""
    if not req.hash_ids:
        return []
    if max(req.hash_ids) * block_tokens + block_tokens - 1 >= 1 << 32 or min(req.hash_ids) < 0:
        worst = max(req.hash_ids) if min(req.hash_ids) >= 0 else min(req.hash_ids)
        raise ValueError(f"block id {worst} makes token ids outside uint32; rename the trace's ids "
                         "with prefix_blocks() (load_trace does)")
    ids = np.asarray(req.hash_ids, dtype=np.int64)[:, None] * block_tokens + np.arange(block_tokens, dtype=np.int64)
    return ids.reshape(-1)[: req.input_length].tolist()
