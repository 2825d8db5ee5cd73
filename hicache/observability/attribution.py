"""Per-request attribution: how many prompt tokens hit on each tier, and why the rest missed.

Why: a hit ratio says how much was reused, not what to fix. A prefix that was never stored
needs nothing; one evicted from host wants a bigger host pool or another placement; one cut by
the prefetch timeout wants a longer timeout; one the store lost to a checksum wants a look at
the disk. Every request the cache admits gets a :class:`RequestAttribution` whose hit and miss
tokens add up to its prompt, counted in ``hicache_request_hit_tokens_total{cache,tier}`` and
``hicache_request_miss_tokens_total{cache,reason}`` and logged at debug level (logger
``hicache.attribution``).

Cost: nothing is computed for the tokens that hit. For a miss, O(missed pages): the page keys
(taken from the prefetch when it ran, else hashed from the last hit) and one look-up each in
the :class:`~hicache.observability.page_ledger.PageLedger`. No storage call is made, except in
explain mode (see :meth:`Attributor.explain`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.errors import quoted
from hicache.observability.metrics import InstanceMetrics

from hicache.observability.page_ledger import (
    CORRUPT,
    IN_STORAGE,
    LOST_DEVICE,
    LOST_HOST,
    LOST_STORAGE,
    PageLedger,
)
from hicache.observability.tier_events import TierChangeHub

__all__ = [
    "AttributionTotals",
    "Attributor",
    "HIT_TIERS",
    "MissReason",
    "PrefetchView",
    "RequestAttribution",
]

logger = logging.getLogger("hicache.attribution")

HIT_TIERS = ("device", "host", "storage")


class MissReason(str, enum.Enum):
    """Why prompt tokens were not reused (a closed set; the value is the metric label)."""

    #: no tier ever held the page, as far as this process saw
    NEVER_STORED = "never_stored"
    #: the tokens after the prompt's last full page: never cacheable
    PARTIAL_PAGE = "partial_page"
    EVICTED_DEVICE = "evicted_device"
    EVICTED_HOST = "evicted_host"
    #: removed from storage (evicted for space, deleted, cleared, or gone unseen: another process)
    EVICTED_STORAGE = "evicted_storage"
    #: on host (or just fetched there) but its load to device found no room or failed
    LOAD_SKIPPED = "load_skipped"
    #: storage holds it but it was not fetched: below the prefetch threshold, rate limited,
    #: no host memory for it, or the prefetch was dropped for device room before admit
    PREFETCH_SKIPPED = "prefetch_skipped"
    #: the stop policy ended the wait before the fetch reached it
    PREFETCH_TIMEOUT = "prefetch_timeout"
    BACKEND_ERROR = "backend_error"
    #: the controller had marked the store down (or the call was interrupted by the trip)
    STORAGE_DOWN = "storage_down"
    #: the page exists in the store under another namespace (model, dtype, geometry, salt...)
    NAMESPACE_MISMATCH = "namespace_mismatch"
    #: the stored page failed its checksum or format check and was dropped
    VERIFICATION_FAILED = "verification_failed"
    #: cannot be known (a record the ledger's capacity pushed out, a page lost in a race, a page
    #: with no record after a device or host clear that named no pages)
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class RequestAttribution:
    """Where one request's prompt tokens came from. ``sum(hits) + sum(misses) == prompt_tokens``.

    ``hits``: tokens per tier (``device``, ``host``, ``storage``); ``misses``: tokens per
    :class:`MissReason` value, only the non-zero ones.
    """

    rid: str
    prompt_tokens: int
    hits: Mapping[str, int]
    misses: Mapping[str, int]
    #: set while a namespace probe may still refine ``never_stored`` (explain mode)
    probe_key: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def hit_tokens(self) -> int:
        return sum(self.hits.values())

    @property
    def miss_tokens(self) -> int:
        return sum(self.misses.values())

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "hits": dict(self.hits), "misses": dict(self.misses)}

    def summary(self) -> str:
        """One line: ``hit device=128 host=64 storage=0; missed evicted_host=256``."""
        hit = " ".join(f"{t}={self.hits.get(t, 0)}" for t in HIT_TIERS)
        miss = " ".join(f"{r}={n}" for r, n in sorted(self.misses.items())) or "none"
        return f"{self.prompt_tokens} tokens: hit {hit}; missed {miss}"


class AttributionTotals:
    """Attributions summed over many requests (the replay's per-policy breakdown)."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.hits: dict[str, int] = dict.fromkeys(HIT_TIERS, 0)
        self.misses: dict[str, int] = {}

    def add(self, a: RequestAttribution | None) -> None:
        if a is None:
            return
        self.requests += 1
        self.prompt_tokens += a.prompt_tokens
        for tier, n in a.hits.items():
            self.hits[tier] = self.hits.get(tier, 0) + n
        for reason, n in a.misses.items():
            self.misses[reason] = self.misses.get(reason, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": dict(self.hits),
            "miss_tokens": dict(sorted(self.misses.items(), key=lambda kv: -kv[1])),
        }

    def fractions(self) -> dict[str, float]:
        """Share of prompt tokens per tier hit and per miss reason (``hit:device``, ``miss:...``)."""
        total = self.prompt_tokens or 1
        out = {f"hit:{t}": n / total for t, n in self.hits.items()}
        out.update({f"miss:{r}": n / total for r, n in self.misses.items()})
        return out


_HIT_DOC = "Prompt tokens whose KV a request reused, per tier"
_MISS_DOC = "Prompt tokens a request recomputed, per reason"


@dataclasses.dataclass(frozen=True)
class PrefetchView:
    """A request's prefetch as the attribution reads it: its keys start at page
    ``start_page`` of the prompt; ``op`` is the controller's op (``None``: not started)."""

    start_page: int
    keys: Sequence[str]
    op: Any


class Attributor:
    """Explains one stack's requests. Owns the stack's :class:`PageLedger`.

    Args:
        hub: the stack's tier-change hub (the ledger subscribes to it).
        page_size: tokens per page.
        ledger_pages: keys the ledger remembers at most.
        explain: probe other namespaces of the store for ``never_stored`` pages (one page,
            at most ``namespace_probe_limit`` namespaces, on a worker thread); also on while
            the ``hicache.attribution`` logger is at debug level.
    """

    def __init__(
        self,
        hub: TierChangeHub,
        *,
        page_size: int,
        ledger_pages: int = 1 << 17,
        explain: bool = False,
        namespace_probe_limit: int = 8,
        metrics: InstanceMetrics | None = None,
    ) -> None:
        self.page_size = page_size
        self.ledger = PageLedger(ledger_pages)
        self.ledger.attach(hub)
        self._explain = explain
        self.namespace_probe_limit = namespace_probe_limit
        # the cache's own instance (its ``cache`` label; its series leave with it), or one
        # of its own for an attributor used alone
        self._owns_metrics = metrics is None
        self.metrics: InstanceMetrics = metrics if metrics is not None else InstanceMetrics()
        # zeros from the start: rate() and increase() take a series' first sample as its start,
        # so one born at its first count hid that count (a lone backend_error never showed)
        for tier in HIT_TIERS:
            self.metrics.child("counter", "request_hit_tokens", _HIT_DOC, {"tier": tier})
        for reason in MissReason:
            self.metrics.child("counter", "request_miss_tokens", _MISS_DOC, {"reason": reason.value})

    @property
    def explain_enabled(self) -> bool:
        return self._explain or logger.isEnabledFor(logging.DEBUG)

    def close(self) -> None:
        self.ledger.detach()
        if self._owns_metrics:
            self.metrics.close()

    # ------------------------------------------------------------------ building

    def attribute(
        self,
        *,
        rid: str,
        tokens: Sequence[int],
        hits: Mapping[str, int],
        held: int,
        prior_hash: str | None,
        prefetch: PrefetchView | None,
        storage: str,
        record: bool = True,
    ) -> RequestAttribution:
        """The attribution of an admitted request.

        ``hits``: tokens reused per tier; ``held``: tokens of the prompt the tree held at the
        last match (device + host, at least the hits); ``prior_hash``: the chain hash after
        those; ``storage``: ``"none"`` (no L3), ``"up"`` or ``"down"``. ``record`` counts
        and logs it now (else the caller does, through :meth:`record`, after a probe).
        """
        ps = self.page_size
        total = len(tokens)
        full = total // ps * ps
        hit = min(sum(hits.values()), total)
        held = min(max(held, hit), full) if hit <= full else hit
        misses: dict[str, int] = {}
        if total > max(full, hit):
            misses[MissReason.PARTIAL_PAGE.value] = total - max(full, hit)
        if held > hit:
            misses[MissReason.LOAD_SKIPPED.value] = held - hit
        probe_key = None
        if held < full:
            reasons, probe_key = self._page_reasons(tokens, held, full, prior_hash, prefetch, storage)
            for r in reasons:
                misses[r.value] = misses.get(r.value, 0) + ps
        out = RequestAttribution(rid, total, {t: int(hits.get(t, 0)) for t in HIT_TIERS}, misses,
                                 probe_key if self.explain_enabled else None)
        if record:
            self.record(out)
        return out

    def restored(self, rid: str, total: int, prefix_len: int, *, record: bool = True) -> RequestAttribution:
        """A session turn restored from its slot: the history is a device hit, the new turn's
        tokens were never stored."""
        prefix_len = min(prefix_len, total)
        misses = {MissReason.NEVER_STORED.value: total - prefix_len} if total > prefix_len else {}
        out = RequestAttribution(rid, total, {"device": prefix_len, "host": 0, "storage": 0}, misses)
        if record:
            self.record(out)
        return out

    def record(self, a: RequestAttribution) -> None:
        """Count ``a`` in the Prometheus counters and log it (debug)."""
        for tier, n in a.hits.items():
            if n:
                self.metrics.child("counter", "request_hit_tokens", _HIT_DOC, {"tier": tier}).inc(n)
        for reason, n in a.misses.items():
            if n:
                self.metrics.child("counter", "request_miss_tokens", _MISS_DOC, {"reason": reason}).inc(n)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s: %s", quoted(a.rid), a.summary())

    async def explain(self, a: RequestAttribution, storage: Any) -> RequestAttribution:
        """Explain mode: ask the store whether the first ``never_stored`` page exists under
        another namespace (one key, at most ``namespace_probe_limit`` namespaces, on a worker
        thread); if so every ``never_stored`` page of the request is a namespace mismatch.
        Then count and log it. A probe that fails leaves the attribution as it was."""
        if a.probe_key is not None and storage is not None:
            probe = getattr(storage, "other_namespaces_holding", None)
            found: list[str] | None = None
            if probe is not None:
                try:
                    found = await asyncio.to_thread(probe, a.probe_key, limit=self.namespace_probe_limit)
                except Exception:  # noqa: BLE001 - an explanation must never fail the request
                    logger.debug("namespace probe of %s failed", quoted(a.rid), exc_info=True)
            if found:
                misses = dict(a.misses)
                n = misses.pop(MissReason.NEVER_STORED.value, 0)
                misses[MissReason.NAMESPACE_MISMATCH.value] = misses.get(MissReason.NAMESPACE_MISMATCH.value, 0) + n
                logger.debug("request %s: its first missed page is stored under namespace(s) %s",
                             quoted(a.rid), quoted(found))
                a = dataclasses.replace(a, misses=misses)
        a = dataclasses.replace(a, probe_key=None)
        self.record(a)
        return a

    # ------------------------------------------------------------------ per page

    def _page_reasons(
        self,
        tokens: Sequence[int],
        start: int,
        full: int,
        prior_hash: str | None,
        prefetch: PrefetchView | None,
        storage: str,
    ) -> tuple[list[MissReason], str | None]:
        ps = self.page_size
        first = start // ps
        n = (full - start) // ps
        keys: Sequence[str] | None = None
        if prefetch is not None:
            off = first - prefetch.start_page
            if off >= 0 and off + n <= len(prefetch.keys):
                keys = prefetch.keys[off : off + n]
        if keys is None:
            from hicache.prefix_cache.hashing import fast_page_hashes  # the core's hashing, lazily

            keys = fast_page_hashes(list(tokens[start:full]), ps, prior_hash)
        flags = self.ledger.flags(keys)
        op = prefetch.op if prefetch is not None else None
        reasons: list[MissReason] = []
        probe_key: str | None = None
        broke: MissReason | None = None  # reason of the first page past storage's leading run
        for j, key in enumerate(keys):
            f = flags[j]
            rel = first + j - prefetch.start_page if prefetch is not None and op is not None else -1
            if op is not None and 0 <= rel < len(prefetch.keys):  # type: ignore[union-attr]
                r, broke = self._fetched_reason(op, rel, f, key, storage, broke)
            else:
                r = self._unasked_reason(f, key, storage)
            if r is MissReason.NEVER_STORED and probe_key is None:
                probe_key = key
            reasons.append(r)
        return reasons, probe_key

    def _own(self, f: int | None) -> MissReason | None:
        """The reason the ledger alone gives (the tier the page was last lost from)."""
        if f is None:
            return None
        if f & LOST_STORAGE:
            return MissReason.VERIFICATION_FAILED if f & CORRUPT else MissReason.EVICTED_STORAGE
        if f & LOST_HOST:
            return MissReason.EVICTED_HOST
        if f & LOST_DEVICE:
            return MissReason.EVICTED_DEVICE
        return None

    def _never(self, key: str) -> MissReason:
        return MissReason.UNKNOWN if self.ledger.maybe_forgotten(key) else MissReason.NEVER_STORED

    def _unasked_reason(self, f: int | None, key: str, storage: str) -> MissReason:
        """A page storage was not asked about (no prefetch, or outside it)."""
        own = self._own(f)
        if storage == "down" and own not in (MissReason.EVICTED_STORAGE, MissReason.VERIFICATION_FAILED):
            return MissReason.STORAGE_DOWN
        if storage == "up" and f is not None and f & IN_STORAGE:
            return MissReason.PREFETCH_SKIPPED
        return own or self._never(key)

    def _fetched_reason(
        self, op: Any, rel: int, f: int | None, key: str, storage: str, broke: MissReason | None
    ) -> tuple[MissReason, MissReason | None]:
        """A page inside the request's prefetch: what happened to it there."""
        own = self._own(f)
        failure = MissReason.STORAGE_DOWN if storage == "down" else MissReason.BACKEND_ERROR
        if not op.exists_answered:  # storage was asked and gave no answer (yet)
            if own in (MissReason.EVICTED_STORAGE, MissReason.VERIFICATION_FAILED):
                return own, broke
            if op.stop == "exists_failed":
                return failure, broke
            return MissReason.PREFETCH_TIMEOUT, broke
        if rel < op.found_pages:  # storage held it
            if rel < (op.taken_pages or 0):
                return MissReason.UNKNOWN, broke  # fetched, but its prefix left the tree meanwhile
            if rel >= op.room_pages:
                return MissReason.PREFETCH_SKIPPED, broke  # no host memory for it
            if broke is not None:
                return broke, broke  # the fetch stopped at an earlier page
            stop = op.stop
            if stop == "cut":
                r = MissReason.PREFETCH_TIMEOUT
            elif stop in ("read_failed", "exists_failed"):
                r = failure
            elif stop in ("backend_error", "error"):
                r = MissReason.BACKEND_ERROR
            elif stop == "page_failed":
                r = own if own in (MissReason.VERIFICATION_FAILED, MissReason.EVICTED_STORAGE) else MissReason.UNKNOWN
            else:
                r = MissReason.UNKNOWN
            return r, r
        # storage's leading run ended before this page
        if f is not None and f & IN_STORAGE:
            # written by this process and not found: removed where we could not see it (its own
            # eviction, another process's), or unreachable behind the page that broke the run
            r = broke if broke is not None and rel > op.found_pages else MissReason.EVICTED_STORAGE
        else:
            r = own or self._never(key)
        if rel == op.found_pages:
            broke = r
        return r, broke
