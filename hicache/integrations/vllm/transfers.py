"""What the scheduler tells the workers each step, and what the workers tell it back.

Plain picklable values (vLLM sends the metadata to worker processes and the report back).
Slots are host page slots the scheduler chose (:mod:`.host_tree`); block ids are vLLM's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["PageLoad", "PageSave", "WorkerReport"]


def _check(keys: tuple[str, ...], slots: tuple[int, ...], block_ids: tuple[int, ...]) -> None:
    if not len(keys) == len(slots) == len(block_ids):
        raise ValueError(f"{len(keys)} keys, {len(slots)} slots and {len(block_ids)} blocks differ")


@dataclass(frozen=True)
class PageLoad:
    """Pages of one request into vLLM blocks, in prefix order (a failed page fails the ones
    after it). The first ``from_host`` pages are in the host pool already; the others are read
    from storage into their slots first. A slot of ``-1`` had no room: that page fails."""

    req_id: str
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    from_host: int = 0

    def __post_init__(self) -> None:
        _check(self.keys, self.slots, self.block_ids)
        if not 0 <= self.from_host <= len(self.keys):
            raise ValueError(f"from_host={self.from_host} for {len(self.keys)} pages")


@dataclass(frozen=True)
class PageSave:
    """Blocks of one request copied into host slots; pages ``[write_from:]`` are then written
    to storage (in the background) as job ``job``, chained after ``prior_key``.

    - ``copy_from``: the first ``copy_from`` pages are in their host slots already (the tree
      holds them) but storage may lack them (an earlier write failed or was refused): they are
      only written, never copied again, and ``write_from`` is then ``0``. Why: a page storage
      lacks is a hole that makes every page after it unreachable by a prefix lookup.
    - ``depends_on``: blocks that the request's KV before the step sits in and whose load
      (in this step, or in an earlier one whose outcome the scheduler has not seen yet: with
      async scheduling the next step is planned before) may have failed. vLLM runs a step even
      when such a load fails (and rolls the request back after it), so the pages computed over
      it attended to garbage: a worker that saw one of these blocks fail drops the save (its
      slots reported bad), it is never stored.
    - ``hold``: several workers (tp x pp) and ``depends_on`` is not empty: one worker cannot
      know whether another one's load failed (the garbage then reaches every rank through
      the collectives), so the storage write waits for the scheduler's word, given once every
      worker reported the save (``WorkerReport.held``/``tainted``/``skipped``), in a later step's
      metadata (commit or abort).
    """

    req_id: str
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    write_from: int = 0
    prior_key: str | None = None
    job: int = 0
    copy_from: int = 0
    depends_on: tuple[int, ...] = ()
    hold: bool = False

    def __post_init__(self) -> None:
        _check(self.keys, self.slots, self.block_ids)
        if not 0 <= self.write_from <= len(self.keys):
            raise ValueError(f"write_from={self.write_from} for {len(self.keys)} pages")
        if not 0 <= self.copy_from <= len(self.keys) or (self.copy_from and self.write_from):
            raise ValueError(f"copy_from={self.copy_from} with write_from={self.write_from} for {len(self.keys)} pages")


def _min_merge(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for job, n in b.items():
        out[job] = min(out[job], n) if job in out else n
    return out


def _slowest(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Two ranks' reads of the same steps, in order: each the fewest pages landed in the
    longest time (reads past the shorter list kept as they are)."""
    n = min(len(a), len(b))
    pairs = [(min(pa, pb), max(sa, sb)) for (pa, sa), (pb, sb) in zip(a[:n], b[:n])]
    return pairs + a[n:] + b[n:]


@dataclass
class WorkerReport:
    """From the workers since their last report:

    - ``jobs_done``: storage writes that ended (job -> how many workers finished it);
    - ``written``: job -> leading pages written, the fewest of the workers that reported it (a
      page is a storage hit only when every rank holds its shard);
    - ``bad_slots``: slots whose content is not what the scheduler believes;
    - ``held``: job -> workers that copied a ``hold`` save and wait for the scheduler's word;
    - ``tainted``: job -> workers that dropped a save because a block its KV depends on failed
      to load;
    - ``skipped``: job -> workers that got a ``hold`` save but have nothing of it to write (a
      slot still busy, a page no longer in its slot, a closed worker): the write cannot be
      whole on every rank, so this counts as that worker's verdict against it (an abort);
    - ``step``: the scheduler's step this report ends (the lowest of the workers'): vLLM handles
      that step's failed loads with this very output, so the scheduler need not suspect them
      any more (``None``: no step begun).
    - ``reads``: (pages landed, seconds) of each step's storage reads (all of its requests
      together, start to last page landed): the store's pace, weighed against recomputing;
      merged rank by rank as the slowest (each rank reads its shard of the same pages, and the
      forward waits for the last one);
    - ``load_wait_s``: how long the forward passes waited for loads (the slowest worker's):
      not compute, so left out when the scheduler times the engine's steps.
    """

    jobs_done: Counter[int] = field(default_factory=Counter)
    bad_slots: set[int] = field(default_factory=set)
    written: dict[int, int] = field(default_factory=dict)
    held: Counter[int] = field(default_factory=Counter)
    tainted: Counter[int] = field(default_factory=Counter)
    step: int | None = None
    skipped: Counter[int] = field(default_factory=Counter)
    reads: list[tuple[int, float]] = field(default_factory=list)
    load_wait_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.jobs_done or self.bad_slots or self.written or self.held or self.tainted
                    or self.skipped or self.step is not None or self.reads or self.load_wait_s)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports in one (vLLM aggregates the workers' reports of a step)."""
        steps = [s for s in (self.step, other.step) if s is not None]
        return WorkerReport(
            self.jobs_done + other.jobs_done, self.bad_slots | other.bad_slots, _min_merge(self.written, other.written),
            self.held + other.held, self.tainted + other.tainted, min(steps) if steps else None,
            self.skipped + other.skipped, _slowest(self.reads, other.reads), max(self.load_wait_s, other.load_wait_s),
        )
