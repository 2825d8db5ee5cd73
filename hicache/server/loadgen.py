"""Multi-turn chat load generator: N concurrent conversations against the server over HTTP.

Why this shape of load: prefix caching pays off when requests share prefixes, and chat has two
kinds - a system prompt every conversation starts with, and the conversation's own history,
which each turn resends with one more question and the previous answer appended. A conversation
here is: ``system + u1`` -> ``a1``, ``system + u1 + a1 + u2`` -> ``a2``, ... with seeded random
tokens, so a workload is identical from run to run and two runs (cache on, cache off) can be
compared answer by answer.

Per request it records the server's TTFT (arrival to first token, queueing included), the
client's TTFT (send to first streamed token), latency, the cached tokens by tier and the tokens
computed. ``verify`` checks answers against the no-cache recompute: ``"server"`` asks the server
for it (``debug_reference``), ``"client"`` rebuilds the server's model from ``GET /v1/model``
and recomputes locally after the run, so verification never disturbs the timings.

Importable (:func:`run_load`, :func:`run_load_sync`) and a CLI (``scripts/loadgen.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import aiohttp

from hicache.bench_args import non_negative_int, positive_int
from hicache.errors import HiCacheError

__all__ = ["LoadError", "RequestRecord", "Workload", "conversation_turn_tokens", "main", "run_load", "run_load_sync",
           "summarize"]

logger = logging.getLogger("hicache.server")

Verify = Literal["none", "server", "client"]


class LoadError(HiCacheError, RuntimeError):
    """The load could not start: the server refused its warm-up request (the message says how;
    a HiCacheError, so ``hicache demo`` says it in one line too)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A fixed, seeded multi-turn chat workload."""

    clients: int = 4
    turns: int = 3
    system_tokens: int = 256
    user_tokens: int = 32
    max_new_tokens: int = 8
    vocab_size: int = 256
    seed: int = 0
    use_sessions: bool = True
    stream: bool = True
    warmup: bool = True
    first_turn_only: bool = False

    def __post_init__(self) -> None:
        for name in ("clients", "turns", "user_tokens", "max_new_tokens", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Workload.{name} must be positive")
        if self.system_tokens < 0:
            raise ValueError("Workload.system_tokens must be >= 0")


@dataclass
class RequestRecord:
    """One request's outcome (``error`` set when it failed)."""

    client: int
    turn: int
    prompt: list[int] = field(repr=False)
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    client_ttft_s: float | None = None
    latency_s: float | None = None
    prefill_tokens: int = 0
    cached_tokens: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    reference_match: bool | None = None
    error: str | None = None
    #: on the turn that cut its conversation short: whether the session it left open was
    #: released (None: no session, or nothing to release)
    session_released: bool | None = None


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def system_prompt(w: Workload) -> list[int]:
    return _tokens(random.Random(f"system:{w.seed}"), w.system_tokens, w.vocab_size)


def conversation_turn_tokens(w: Workload, client: int, turn: int) -> list[int]:
    """The user tokens of ``client``'s ``turn`` (deterministic in the workload's seed)."""
    return _tokens(random.Random(f"user:{w.seed}:{client}:{turn}"), w.user_tokens, w.vocab_size)


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], record: RequestRecord, stream: bool
) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            out = await resp.json()
            record.client_ttft_s = time.perf_counter() - t0
        else:
            out = {}
            async for raw in resp.content:
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if "token" in line and record.client_ttft_s is None:
                    record.client_ttft_s = time.perf_counter() - t0
                if line.get("done"):
                    out = line
            if not out:
                raise RuntimeError("stream ended without a summary line")
            if "error" in out:
                raise RuntimeError(f"server error: {out['error']}")
    record.latency_s = time.perf_counter() - t0
    return out


async def _release_session(http: aiohttp.ClientSession, url: str, session: str, record: RequestRecord) -> None:
    """End ``session`` on the server after a failed turn cut its conversation short.

    Only the last turn sends ``end_session``, so without this a conversation stopped by a 503,
    a 500 or a client timeout left its session (request row and pages) on the server until
    ``session_timeout_s`` - for good with none - and the next load run measured a server
    filled by this one's leftovers. A 404 is fine: the session was never opened (turn 0
    refused) or the server already ended it (a final turn that failed). After a client
    timeout the server may still be running the turn; it queues the release behind the
    session's pending turns, so the release applies after it, in order. A failed release is
    recorded (``session_released=False``, counted in the summary) and logged, never raised:
    the run's result is the turns'. The id is quoted as one path segment: sent as it was, a ``/``,
    ``?``, ``#`` or space of a run tag sent the release elsewhere, and its 404 read as ended."""
    try:
        async with http.post(f"{url}/v1/sessions/{quote(session, safe='')}/release") as resp:
            if resp.status not in (200, 404):
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        record.session_released = True
    except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
        record.session_released = False
        logger.warning("loadgen: releasing session %s after a failed turn failed: %s", session,
                       str(exc) or type(exc).__name__)


async def _conversation(
    http: aiohttp.ClientSession, url: str, w: Workload, client: int, system: list[int], verify: Verify, run_tag: str
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    history = list(system)
    session = f"{run_tag}-conv{client}" if w.use_sessions else None
    turns = 1 if w.first_turn_only else w.turns
    for turn in range(turns):
        history += conversation_turn_tokens(w, client, turn)
        rec = RequestRecord(client=client, turn=turn, prompt=list(history))
        body: dict[str, Any] = {"tokens": history, "max_new_tokens": w.max_new_tokens, "stream": w.stream,
                                "rid": f"{run_tag}-c{client}-t{turn}"}
        if session is not None:
            body["session_id"] = session
            body["end_session"] = turn == turns - 1
        if verify == "server":
            body["debug_reference"] = True
        try:
            out = await _post(http, url, body, rec, w.stream)
        except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
            rec.error = str(exc) or type(exc).__name__
            records.append(rec)
            if session is not None:
                await _release_session(http, url, session, rec)
            break  # the rest of the conversation depends on this answer
        rec.tokens = list(out["tokens"])
        rec.ttft_s = out.get("ttft_s")
        rec.prefill_tokens = int(out.get("prefill_tokens", 0))
        rec.cached_tokens = int(out.get("cached_tokens", 0))
        rec.hits = {k: int(v) for k, v in out.get("hits", {}).items()}
        rec.reference_match = out.get("reference_match")
        records.append(rec)
        history += rec.tokens
    return records


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT statistics, per-tier hit rates and token counts over successful requests."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    cttft = [r.client_ttft_s for r in ok if r.client_ttft_s is not None]
    prompt = sum(len(r.prompt) for r in ok)
    tiers = ("device", "host", "storage")
    hits = {t: sum(r.hits.get(t, 0) for r in ok) for t in tiers}
    cached = sum(r.cached_tokens for r in ok)
    checked = [r.reference_match for r in ok if r.reference_match is not None]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "prefill_tokens": sum(r.prefill_tokens for r in ok),
        "cached_tokens": cached,
        "saved_fraction": cached / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "hit_rate": {t: (hits[t] / prompt if prompt else 0.0) for t in tiers},
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "client_ttft_p50_s": _pct(cttft, 0.5),
        "client_ttft_mean_s": statistics.fmean(cttft) if cttft else None,
        "verified": (all(checked) if checked and len(checked) == len(ok) else None),
        "mismatches": sum(1 for c in checked if c is False),
        # sessions of cut-short conversations the server may still hold (see _release_session)
        "session_release_failures": sum(1 for r in records if r.session_released is False),
    }


async def _verify_client(http: aiohttp.ClientSession, url: str, records: list[RequestRecord]) -> None:
    """Recompute every answer with the server's model (rebuilt from its spec) off the loop."""
    from hicache.engine.model import ModelSpec, TinyTransformer
    from hicache.engine.runner import reference_generate

    async with http.get(f"{url}/v1/model") as resp:
        resp.raise_for_status()
        spec = ModelSpec.from_dict((await resp.json())["spec"])

    def check() -> None:
        model = TinyTransformer(spec)
        for r in records:
            if r.error is None:
                r.reference_match = reference_generate(model, r.prompt, len(r.tokens)) == r.tokens

    await asyncio.to_thread(check)


async def _warm_up(http: aiohttp.ClientSession, url: str, system: list[int], tag: str) -> None:
    """Send the system prompt once before the load. A refusal (a prompt past the server's
    context, a vocabulary its model lacks, a 503) is a :class:`LoadError` naming it: raised as
    the bare ``RuntimeError`` of :func:`_post` it ended the CLI in a traceback, though the same
    refusal of any later request is a record in the report. An unreachable server stays an
    ``aiohttp.ClientError``."""
    warm = RequestRecord(client=-1, turn=-1, prompt=system)
    try:
        await _post(http, url, {"tokens": system, "max_new_tokens": 1, "stream": False, "rid": f"{tag}-warmup"},
                    warm, False)
    except (RuntimeError, asyncio.TimeoutError) as exc:
        raise LoadError(f"the warm-up request ({len(system)}-token system prompt) failed: "
                        f"{str(exc) or type(exc).__name__}") from exc


async def run_load(
    url: str,
    workload: Workload | None = None,
    *,
    verify: Verify = "none",
    run_tag: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run ``workload`` against the server at ``url``; returns ``{"summary", "records",
    "wall_s", "workload"}`` (records as dicts, prompts included only as lengths)."""
    w = workload or Workload()
    tag = run_tag or f"load{random.Random().randrange(1 << 30):08x}"
    system = system_prompt(w)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        if w.warmup and system:
            await _warm_up(http, url, system, tag)
        t0 = time.perf_counter()
        per_client = await asyncio.gather(
            *(_conversation(http, url, w, c, system, verify, tag) for c in range(w.clients))
        )
        wall = time.perf_counter() - t0
        records = [r for conv in per_client for r in conv]
        if verify == "client":
            await _verify_client(http, url, records)
    rows = []
    for r in records:
        row = asdict(r)
        row["prompt_tokens"] = len(row.pop("prompt"))
        rows.append(row)
    return {"workload": asdict(w), "wall_s": wall, "summary": summarize(records), "records": rows}


def run_load_sync(url: str, workload: Workload | None = None, **kwargs: Any) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_load` (not from inside a running event loop)."""
    return asyncio.run(run_load(url, workload, **kwargs))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Multi-turn chat load against a hicache demo server; prints JSON.")
    p.add_argument("--url", default="http://127.0.0.1:8471")
    d = Workload()
    # counts checked by argparse: a negative one was a traceback from deep in the load
    p.add_argument("--clients", type=positive_int, default=d.clients)
    p.add_argument("--turns", type=positive_int, default=d.turns)
    p.add_argument("--system-tokens", type=non_negative_int, default=d.system_tokens)
    p.add_argument("--user-tokens", type=positive_int, default=d.user_tokens)
    p.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens)
    p.add_argument("--vocab-size", type=positive_int, default=d.vocab_size)
    p.add_argument("--seed", type=non_negative_int, default=d.seed)
    p.add_argument("--no-sessions", action="store_true", help="send no session_id")
    p.add_argument("--no-stream", action="store_true", help="plain JSON responses (client TTFT = latency)")
    p.add_argument("--no-warmup", action="store_true", help="do not send the system prompt first")
    p.add_argument("--verify", choices=["none", "server", "client"], default="none")
    p.add_argument("--records", action="store_true", help="include per-request records in the output")
    args = p.parse_args(argv)
    w = Workload(clients=args.clients, turns=args.turns, system_tokens=args.system_tokens,
                 user_tokens=args.user_tokens, max_new_tokens=args.max_new_tokens, vocab_size=args.vocab_size,
                 seed=args.seed, use_sessions=not args.no_sessions, stream=not args.no_stream,
                 warmup=not args.no_warmup)
    try:
        report = run_load_sync(args.url, w, verify=args.verify)
    except aiohttp.ClientError as exc:
        print(json.dumps({"error": f"cannot reach {args.url}: {exc}"}), file=sys.stderr)
        return 2
    except LoadError as exc:
        print(json.dumps({"error": str(exc)}), file=sys.stderr)
        return 2
    if not args.records:
        report.pop("records")
    print(json.dumps(report, indent=2))
    s = report["summary"]
    return 1 if s["errors"] or s["mismatches"] else 0
