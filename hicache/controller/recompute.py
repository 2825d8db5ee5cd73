"""When waiting for a prefetch stops paying: a storage hit must not be slower than recomputing.

A request waiting for its prefetch trades time now for prefill work later. The trade pays only
while the pages still to come would take longer to recompute than to fetch. SGLang's
``timeout`` policy waits a fixed ``2 s + 0.1 s`` per 1Ki tokens whatever the store's speed,
and its users report storage hits slower than recomputing (a file-backend hit at 2,450 ms to
the first token against 1,725 ms recomputed): on a slow or busy store the fixed wait is the
bug. This module holds the two rates the comparison needs, and the comparison:

* :class:`PrefillCost`: seconds the engine takes per prefilled token, either configured
  (``prefetch_recompute_tokens_per_s``) or learned from the prefills the engine reports
  (:meth:`PrefillCost.observe`): a decayed least-squares fit of ``seconds = a + b * tokens``,
  of which only the slope ``b`` is what a hit saves (the fixed part of a forward is paid
  either way).
* :class:`ReadPace`: seconds a page of a prefetch takes to land, learned from the prefetches'
  own batch reads (moving average); before any read has finished, the reads still in flight
  and the store's ``exists`` round trips (a read call takes at least one) give a lower bound.
* :func:`give_up_at`: when waiting stops paying: while the pages still missing land sooner
  than they would be recomputed; a call running late counts against the store as it goes on,
  so a store that stalls is given up on. Whatever the estimates say, a wait as long as
  recomputing what was missing when it began has lost: that cap is what a request can count
  on, and the only rule before anything shows the store's pace.

Both rates are ``None`` until known; nothing is cut on a guess.
"""

from __future__ import annotations

import math

__all__ = ["PrefillCost", "ReadPace", "give_up_at"]


class PrefillCost:
    """Seconds a token of prefill costs the engine: configured, or learned from its prefills.

    Args:
        tokens_per_s: a fixed rate (the engine's measured prefill throughput); ``None``: learn
            it from :meth:`observe`.
        decay: weight kept by older observations at each new one: recent load matters more,
            and a fresh engine's first forwards (lazy initialisation, allocator growth, cold
            caches: measured 1.4x the later ones on the demo model) fade out.
        min_observations: prefills seen before a learned rate is used.
        min_tokens: shorter prefills are ignored: their fixed cost (a forward's launch, the
            sampling) would pass for a per-token cost.

    The slope is taken only where the reports tell it from zero (at least twice its standard
    error): a GPU's short prefills cost about the same whatever their length, and a slope
    fitted through their jitter, tiny and positive, read as millions of tokens a second and
    cut every wait at once. Otherwise the average cost of a token stands (fixed part
    included: an upper bound, it errs towards waiting, which the fixed timeout still bounds).
    """

    def __init__(self, tokens_per_s: float | None = None, *, decay: float = 0.9, min_observations: int = 4,
                 min_tokens: int = 32) -> None:
        if tokens_per_s is not None and not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
            raise ValueError(f"tokens_per_s must be a positive number, got {tokens_per_s!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.fixed = tokens_per_s
        self.decay = decay
        self.min_observations = min_observations
        self.min_tokens = min_tokens
        self.observations = 0
        # decayed sums of w, n, n^2, t, n*t, t^2 over (tokens n, seconds t)
        self._w = self._n = self._nn = self._t = self._nt = self._tt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill the engine ran: ``tokens`` computed in ``seconds`` (bad values ignored:
        a report must never break the request that made it)."""
        if self.fixed is not None:
            return
        try:
            n, t = float(tokens), float(seconds)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float
            return
        if not (math.isfinite(n) and math.isfinite(t)) or n < max(1, self.min_tokens) or t <= 0:
            return
        d = self.decay
        sums = (self._w * d + 1.0, self._n * d + n, self._nn * d + n * n, self._t * d + t,
                self._nt * d + n * t, self._tt * d + t * t)
        if not all(math.isfinite(x) for x in sums):
            return  # a report past what a float squares: it would poison the sums for good
        self._w, self._n, self._nn, self._t, self._nt, self._tt = sums
        self.observations += 1

    @property
    def seconds_per_token(self) -> float | None:
        """What recomputing one more token costs; ``None`` while unknown."""
        if self.fixed is not None:
            return 1.0 / self.fixed
        if self.observations < self.min_observations or self._n <= 0:
            return None
        w, var = self._w, self._w * self._nn - self._n * self._n
        if var > 1e-9 * w * self._nn:  # prompts of different lengths: the slope
            cov = self._w * self._nt - self._n * self._t
            slope = cov / var
            # residuals' sum of squares (w * RSS = w*tt - t^2 - slope * cov) and the slope's
            # standard error over the decayed weight less the two fitted parameters
            rss = max(0.0, (w * self._tt - self._t * self._t - slope * cov) / w)
            stderr = math.sqrt(rss / max(w - 2.0, 1e-9) * w / var)
            if slope > 2.0 * stderr and _usable(slope):
                return slope
        spt = self._t / self._n  # one length only (or a slope lost in the noise): the average
        return spt if _usable(spt) else None

    @property
    def tokens_per_s(self) -> float | None:
        spt = self.seconds_per_token
        return None if spt is None else 1.0 / spt

    def seconds(self, tokens: int) -> float | None:
        spt = self.seconds_per_token
        return None if spt is None else max(0, tokens) * spt


def _usable(seconds_per_token: float) -> bool:
    """A cost a wait can be weighed against: positive, finite, and finite as a rate (reports
    of absurd seconds underflow to 0 or a denormal: a free recompute, every wait cut)."""
    return 0.0 < seconds_per_token < math.inf and math.isfinite(1.0 / seconds_per_token)


class ReadPace:
    """Seconds a page of a prefetch takes to land, from the prefetches' own reads.

    A moving average over batches (``alpha``: the newest batch's weight), so a store that
    slows down (a busy disk, a remote store under load) is seen within a few batches."""

    def __init__(self, alpha: float = 0.25) -> None:
        self.alpha = alpha
        self.seconds_per_page: float | None = None

    def forget(self) -> None:
        """Drop what was learned: the next read alone sets the pace (after a long pause
        without reads, the old average says nothing of the store now)."""
        self.seconds_per_page = None

    def observe(self, pages: int, seconds: float) -> None:
        if pages <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        spp = seconds / pages
        old = self.seconds_per_page
        self.seconds_per_page = spp if old is None else old + self.alpha * (spp - old)


def give_up_at(
    *,
    now: float,
    missing_pages: int,
    inflight_pages: int,
    call_since: float | None,
    wait_start: float,
    cap_s: float,
    page_tokens: int,
    seconds_per_token: float,
    seconds_per_page: float | None,
) -> float:
    """When a request waiting for the ``missing_pages`` its prefetch still has to land should
    stop waiting, if nothing lands before (a time on ``now``'s clock; ``now`` or earlier: at
    once; ``math.inf``: not while nothing moves).

    A storage call of the prefetch began at ``call_since`` (``None``: none in flight),
    bringing ``inflight_pages`` of them (0: the ``exists`` call). The expected time to land
    the rest is the pages not asked for yet at the known pace plus what the call in flight
    still needs: its expected time less what it has taken, or, once it is late, as much
    again as it is late (a store that stalls looks worse the longer it stalls). Waiting is
    worth it while that is below the time to recompute the missing pages. Whatever the
    estimates say, a wait from ``wait_start`` as long as ``cap_s`` (recomputing what was
    missing when it began) has lost: that is the bound a request can count on, and the only
    one while no pace is known."""
    if missing_pages <= 0:
        return math.inf  # everything is here or about to be handed over
    hard = wait_start + cap_s
    if seconds_per_page is None:
        return hard
    slack = missing_pages * page_tokens * seconds_per_token - max(0, missing_pages - inflight_pages) * seconds_per_page
    if slack < 0:
        return now  # the pages not even asked for yet land later than all would be recomputed
    if call_since is None:
        return hard
    expected = inflight_pages * seconds_per_page
    if now - call_since < expected - slack:
        return now  # this call alone would take longer than the recompute's slack
    return min(hard, call_since + expected + slack)
