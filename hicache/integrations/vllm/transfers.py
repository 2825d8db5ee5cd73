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
    to storage (in the background) as job ``job``, chained after ``prior_key``."""

    req_id: str
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    write_from: int = 0
    prior_key: str | None = None
    job: int = 0

    def __post_init__(self) -> None:
        _check(self.keys, self.slots, self.block_ids)
        if not 0 <= self.write_from <= len(self.keys):
            raise ValueError(f"write_from={self.write_from} for {len(self.keys)} pages")


@dataclass
class WorkerReport:
    """From the workers since their last report: storage writes that ended (job -> how many
    workers finished it), and slots whose content is not what the scheduler believes."""

    jobs_done: Counter[int] = field(default_factory=Counter)
    bad_slots: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.jobs_done or self.bad_slots)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports in one (vLLM aggregates the workers' reports of a step)."""
        return WorkerReport(self.jobs_done + other.jobs_done, self.bad_slots | other.bad_slots)
