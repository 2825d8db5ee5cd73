"""``hicache events URL``: print a publisher's KV events, one per line, without gaps.

Connects as a subscriber (:class:`~hicache.events.subscriber.EventSubscriber`); with
``--replay URL`` it catches up through the publisher's replay socket on start (``--from SEQ``)
and whenever a sequence number is skipped (a reconnect, a slow terminal) or the publisher goes
quiet after batches that never arrived (the subscriber's tail check). Lines::

    seq=12 GPU stored 4 blocks 3f2a19c0..,9b1e..(4) parent=77aa01.. tokens=64
    seq=13 STORAGE removed 2 blocks c0ffee12..,d00d..(2)
    seq=14 CPU cleared

or, with ``--json``, one object per event: ``{"seq", "ts", "replayed", "rank", "event"}``.
What was missed for good (older than the replay buffer) is reported on stderr at the end. The
returned counters include ``run_id`` (the publisher run ``next_seq`` belongs to, 16 hex digits):
``next_seq`` is the first batch not printed whole (a stop inside a batch resumes at it, printing
its first events again: applying a prefix of events twice leaves the same state), and a consumer
that saves its position passes both back (``start_seq``, ``start_run_id``) so that a resume
against a restarted publisher starts from that publisher's first batch.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from hicache.errors import quoted
from hicache.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, event_to_dict
from hicache.events.subscriber import EventSubscriber

__all__ = ["format_event", "run"]


def _short(h: bytes | int) -> str:
    return h.hex()[:8] + ".." if isinstance(h, bytes) else str(h)


def _blocks(hashes: list[Any]) -> str:
    shown = ",".join(_short(h) for h in hashes[:2])
    return f"{len(hashes)} blocks {shown}" + (f"..({len(hashes)})" if len(hashes) > 2 else "")


def _printable(value: Any) -> Any:
    """``value`` as it is when it is short plain text (``GPU``), else quoted."""
    if value is None or (isinstance(value, str) and value.isprintable() and len(value) <= 64):
        return value
    return quoted(value)


def format_event(seq: int, event: KVEvent) -> str:
    """One human-readable line for an event (a medium off the wire that is not plain text is
    quoted: a publisher's ``"GPU\\nseq=9 ..."`` printed as it came forged lines of output)."""
    medium = _printable(event.medium)
    if isinstance(event, BlockStored):
        parent = _short(event.parent_block_hash) if event.parent_block_hash is not None else "-"
        return f"seq={seq} {medium} stored {_blocks(event.block_hashes)} parent={parent} tokens={len(event.token_ids)}"
    if isinstance(event, BlockRemoved):
        return f"seq={seq} {medium} removed {_blocks(event.block_hashes)}"
    if isinstance(event, AllBlocksCleared):
        return f"seq={seq} {medium or 'ALL'} cleared"
    return f"seq={seq} {type(event).__name__}"


def run(
    endpoint: str,
    replay_endpoint: str | None = None,
    *,
    topic: str = "",
    start_seq: int | None = None,
    start_run_id: int | None = None,
    as_json: bool = False,
    count: int | None = None,
    timeout_s: float | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Print events until ``count`` were printed or ``timeout_s`` passed without one (both
    ``None``: until interrupted); returns the subscriber's counters. ``start_run_id``: the
    ``run_id`` of an earlier run (``hicache events --run-id`` parses its 16 hex digits)."""
    printed = 0
    # the batch being printed: a stop inside it (``count``, an interrupt) resumes at it, not
    # after it (the subscriber's next_seq), which would skip the events not printed yet
    unfinished: int | None = None
    with EventSubscriber(endpoint, replay_endpoint, topic=topic, start_seq=start_seq,
                         start_run_id=start_run_id) as sub:
        try:
            for got in sub.receive(timeout_s):
                unfinished, shown = got.seq, 0
                for event in got.batch.events:
                    if as_json:
                        line = json.dumps({"seq": got.seq, "ts": got.batch.ts, "replayed": got.replayed,
                                           "rank": got.batch.data_parallel_rank, "event": event_to_dict(event)})
                    else:
                        line = format_event(got.seq, event)
                    out.write(line + "\n")
                    printed += 1
                    shown += 1
                    if count is not None and printed >= count:
                        break
                out.flush()
                if shown == len(got.batch.events):
                    unfinished = None
                if count is not None and printed >= count:
                    break
        except KeyboardInterrupt:
            pass
        position = unfinished if unfinished is not None else sub.next_seq
        stats = {"events": printed, "next_seq": position if position is not None else -1,
                 "gaps": sub.gaps, "replayed": sub.replayed, "lost": sub.lost, "restarts": sub.restarts,
                 "bad_messages": sub.bad_messages,
                 "run_id": f"{sub.run_id:016x}" if sub.run_id is not None else None}
    if stats["lost"] or stats["bad_messages"]:
        err.write(f"hicache events: lost {stats['lost']} batches, {stats['bad_messages']} undecodable\n")
    return stats
