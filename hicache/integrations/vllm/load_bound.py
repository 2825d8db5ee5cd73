"""Whether the connector's storage hits pay against recomputing them, under vLLM.

vLLM's forward pass waits for the layers the connector loads, so a store slower than the
engine stalls every request of the step, not only the one that hit. The workers report how
long each step's storage reads took (:class:`~hicache.controller.recompute.ReadPace`) and how
long the forward waited for loads; this bound times each step from its plan to its report,
less that wait, against the prefill tokens it computed
(:class:`~hicache.controller.recompute.PrefillCost`, or a configured rate). While a page read
costs more than recomputing the page, storage hits are not claimed; every ``repace_s`` one
request's load is let through to measure the store again (its read alone sets the pace: the
older ones are stale), so a store that recovers is used again. Nothing is cut before both
rates are known.

A step's time runs from its plan, or from the previous step's report when that came later
(async scheduling plans a step while the one before still runs), to its own report; only
prefill tokens count (a request computing one token is decoding). A read counts only the pages
that landed (a read that failed fast says nothing of a good one).

Why a class of its own: it is the only part of the scheduler side that keeps time; the rest is
bookkeeping of pages and slots, and the bound can be reasoned about (and tested) without it.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence

from hicache.controller.recompute import PrefillCost, ReadPace
from hicache.integrations.vllm.transfers import WorkerReport

__all__ = ["LoadBound"]

#: steps clocked whose report has not come, at most (a worker that never reports)
_MAX_CLOCKED_STEPS = 64


class LoadBound:
    """The engine's compute pace against the store's read pace, per page of ``block_size``.

    Args:
        block_size: tokens a page holds.
        enabled: ``False`` claims every storage hit (the ``recompute_bound`` option).
        recompute_tokens_per_s: the engine's prefill rate; ``None``: learned from its steps.
        repace_s: how often a store found slower than recomputing is read once to measure it.
        stats: the counters it adds ``repace_loads`` to.
    """

    def __init__(
        self,
        block_size: int,
        *,
        enabled: bool = True,
        recompute_tokens_per_s: float | None = None,
        repace_s: float = 10.0,
        stats: MutableMapping[str, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.prefill = PrefillCost(recompute_tokens_per_s)
        self.read_pace = ReadPace()
        self.repace_s = repace_s
        self.stats: MutableMapping[str, int] = stats if stats is not None else {}
        self.stats.setdefault("repace_loads", 0)
        self.step_clock: dict[int, tuple[float, int]] = {}  # step -> (planned at, prefill tokens)
        self._paced_at: float | None = None  # the last read reported, or a load let through to measure
        self._read_at: float | None = None  # the last read reported
        self._pacer: str | None = None  # the request let through to measure a slow store
        self._reported_at: float | None = None  # the last step report (a step computes after it)

    def reading_pays(self, req_id: str) -> bool:
        """Whether reading a page from storage is no slower than recomputing it (``True``
        while either rate is unknown: nothing is cut on a guess). A store found slower is
        measured again by one request's load every ``repace_s`` (the *pacer*: it keeps its
        claim when asked about again, until its read is reported or it ends)."""
        if not self.enabled:
            return True
        spp, spt = self.read_pace.seconds_per_page, self.prefill.seconds_per_token
        if spp is None or spt is None or spp <= self.block_size * spt or req_id == self._pacer:
            return True
        now = time.monotonic()
        if self._paced_at is None or now - self._paced_at >= self.repace_s:
            self._paced_at, self._pacer = now, req_id  # its load measures the store; the others wait for its word
            self.stats["repace_loads"] += 1
            return True
        return False

    def clock_step(self, step: int, scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int]]]) -> None:
        """Note when ``step`` was planned and the prefill tokens it computes (timed at its
        report). A request computing one token is decoding: its cost is memory-bound, not what
        a prefill pays per token, so it is left to the fit's fixed part."""
        clock = self.step_clock
        tokens = sum(after - before for _, before, after, *_ in scheduled if after - before > 1)
        clock[step] = (time.monotonic(), tokens)
        while len(clock) > _MAX_CLOCKED_STEPS:
            del clock[next(iter(clock))]

    def time_step(self, report: WorkerReport) -> None:
        """The engine's compute pace and the store's read pace, from a step's report."""
        now = time.monotonic()
        if report.reads:
            if self._read_at is None or now - self._read_at >= self.repace_s:
                # the first read after a pause (a store found slow is read only to measure
                # it again): what was learned before says nothing of the store now
                self.read_pace.forget()
            for pages, seconds in report.reads:
                self.read_pace.observe(pages, seconds)
            self._read_at = self._paced_at = now
            self._pacer = None
        if report.step is None:
            return
        planned = self.step_clock.pop(report.step, None)
        for step in [s for s in self.step_clock if s < report.step]:
            del self.step_clock[step]
        if planned is not None:
            # with async scheduling a step is planned while the one before still runs: its
            # compute starts at that one's report, not at its own plan
            t0, tokens = planned
            if self._reported_at is not None:
                t0 = max(t0, self._reported_at)
            self.prefill.observe(tokens, now - t0 - report.load_wait_s)
        self._reported_at = now

    def finished(self, req_id: str) -> None:
        """``req_id`` ended: if it was measuring the store, the next request after ``repace_s``
        does."""
        if self._pacer == req_id:
            self._pacer = None
