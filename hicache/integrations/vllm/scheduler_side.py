"""The scheduler half of the connector: how much of a prompt hicache holds, and which pages
each step loads and saves.

Lookup is tiered and never stalls vLLM's scheduler. First hicache's radix tree over the
workers' host pools (:mod:`.host_tree`): pages there are a hit at once. For the pages after
them, an existence check in storage starts on the storage loop and is waited for at most
``lookup_wait_s``; if it is still running, the answer is "not yet" (``None``) and vLLM asks
again next step. A lookup that takes longer than ``lookup_timeout_s`` is a miss. A storage hit is
the longest run of pages that exists for *every* parallel rank (each rank stores its own
shard). The hit stops one token short of the prompt: vLLM must compute at least one token.

Slots: the scheduler decides which host slot each page goes to, for pages read from storage
(they join the tree when their prefix is there) and for saves: every block that became full
(prompt or generated tokens) is copied into a host slot at the end of its step, and the ones
storage lacks are written to it in the background; their node stays locked until every worker
reported the write done (:meth:`SchedulerSide.on_report`). Room comes from the tree's eviction
policy. Worker reports of slots that did not hold what the tree says drop those nodes.

Nothing here imports vLLM; the connector passes request ids, token ids and block ids.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.integrations.vllm.host_tree import HostMatch, HostPageTree
from hicache.integrations.vllm.naming import PageKeyChain
from hicache.integrations.vllm.store_io import StoreIO
from hicache.integrations.vllm.transfers import PageLoad, PageSave, WorkerReport
from hicache.prefix_cache.node import TreeNode
from hicache.storage.hit_policy import leading_run

__all__ = ["SchedulerSide", "StepPlan"]

logger = logging.getLogger("hicache.integrations.vllm")


@dataclass
class _Lookup:
    start_page: int
    num_pages: int  # pages asked about, from start_page
    future: concurrent.futures.Future[int]
    started: float
    hit_pages: int | None = None


@dataclass
class _Request:
    chain: PageKeyChain
    salt: str | None
    tokens: Sequence[int] = ()
    start_page: int = 0  # pages vLLM held itself at the last lookup
    lookup: _Lookup | None = None
    saved_pages: int = 0  # pages [0, saved_pages) are stored, loaded or held by vLLM already


@dataclass
class _Write:
    node: TreeNode
    reports_left: int


@dataclass
class StepPlan:
    """What the workers do in one step."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)


class SchedulerSide:
    """Per-request lookup, host slot and save bookkeeping for vLLM's scheduler."""

    def __init__(
        self,
        store: StoreIO,
        tree: HostPageTree,
        *,
        lookup_wait_s: float,
        lookup_timeout_s: float,
        num_workers: int = 1,
    ) -> None:
        self.store = store
        self.tree = tree
        self.block_size = tree.block_size
        self.lookup_wait_s = lookup_wait_s
        self.lookup_timeout_s = lookup_timeout_s
        self.num_workers = num_workers
        self._reqs: dict[str, _Request] = {}
        self._loads: dict[str, PageLoad] = {}
        self._staging: list[int] = []  # slots of this step's storage reads that join no node
        self._step_locks: list[TreeNode] = []  # pages this step loads: not evicted while it is planned
        self._writes: dict[int, _Write] = {}
        self._jobs = itertools.count(1)
        self.stats: dict[str, int] = dict.fromkeys(
            ("lookups", "lookup_timeouts", "hit_tokens", "host_hit_tokens", "pages_to_load", "pages_to_save",
             "saves_dropped", "loads_without_room"), 0
        )

    # ------------------------------------------------------------------ lookup
    def matched_tokens(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None, num_computed: int
    ) -> int | None:
        """Tokens beyond ``num_computed`` (block aligned) hicache can load, or ``None`` for
        "ask again"."""
        bs = self.block_size
        state = self._reqs.get(req_id)
        if state is None:
            state = self._reqs[req_id] = _Request(PageKeyChain(bs, cache_salt), cache_salt)
        state.tokens = token_ids
        start = num_computed // bs
        state.start_page = start
        usable = max(0, len(token_ids) - 1) // bs  # at least one token left to compute
        state.saved_pages = max(state.saved_pages, start)
        if usable <= start:
            state.lookup = None
            return 0
        held = self.tree.match(token_ids, cache_salt, usable, count_hit=False).pages
        base = max(start, held)
        if base >= usable:
            state.lookup = None
            return usable * bs - num_computed
        lk = state.lookup
        if lk is None or lk.start_page != base or lk.num_pages != usable - base:
            keys = state.chain.extend(token_ids, usable)[base:]
            self.stats["lookups"] += 1
            lk = state.lookup = _Lookup(base, len(keys), self.store.submit(self._leading_hits(keys)), time.monotonic())
        if lk.hit_pages is None:
            try:
                lk.hit_pages = lk.future.result(timeout=self.lookup_wait_s)
            except concurrent.futures.TimeoutError:
                if time.monotonic() - lk.started < self.lookup_timeout_s:
                    return None
                lk.future.cancel()
                self.stats["lookup_timeouts"] += 1
                lk.hit_pages = 0
            except BaseException as exc:  # noqa: BLE001 - a broken lookup is a miss
                logger.warning("hicache: lookup of %s failed: %r", req_id, exc)
                lk.hit_pages = 0
        return max(0, (base + lk.hit_pages) * bs - num_computed)

    async def _leading_hits(self, keys: list[str]) -> int:
        """Length of the run of ``keys`` from the start that every rank's store holds."""
        best = len(keys)
        for backend in self.store.backends:
            best = min(best, leading_run(await backend.exists_pages(keys[:best])))
            if best == 0:
                break
        return best

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; ``num_external_tokens`` of them are ours to fill:
        from host slots where the tree holds the pages, else read from storage into new slots."""
        state = self._reqs.get(req_id)
        bs = self.block_size
        if state is None or num_external_tokens <= 0:
            return
        start = state.start_page
        n = num_external_tokens // bs
        end = start + n
        keys = state.chain.extend(state.tokens, end)
        if n <= 0 or end > len(block_ids) or end > len(keys):
            logger.warning("hicache: %s: %d external tokens do not fit its blocks; not loading", req_id, num_external_tokens)
            return
        host = self.tree.match(state.tokens, state.salt, end, count_hit=True)
        held = min(host.pages, end)
        slots = host.slots[start:held]
        missing = end - max(start, held)
        self._lock_for_step(host.node)
        if missing:
            new = self.tree.reserve(missing, keep=host.node)
            if new is None:
                self.stats["loads_without_room"] += 1
                new = [-1] * missing  # no room: those pages fail and vLLM recomputes them
            elif held >= start:
                # the pages follow the tree's: they join it (the worker reports them if the read fails)
                self._lock_for_step(self.tree.insert(state.tokens, state.salt, host, new))
            else:
                self._staging.extend(new)  # vLLM holds the pages before them, the tree does not
            slots = [*slots, *new]
        self._loads[req_id] = PageLoad(
            req_id, tuple(keys[start:end]), tuple(slots), tuple(int(b) for b in block_ids[start:end]),
            from_host=max(0, held - start),
        )
        state.saved_pages = max(state.saved_pages, end)
        self.stats["hit_tokens"] += n * bs
        self.stats["host_hit_tokens"] += max(0, held - start) * bs
        self.stats["pages_to_load"] += n

    def _lock_for_step(self, node: TreeNode) -> None:
        """Keep ``node``'s slots out of this step's evictions: a load planned into a slot that a
        later request of the same step got again would fail (the worker refuses two reads into
        one slot)."""
        self.tree.lock(node)
        self._step_locks.append(node)

    # ------------------------------------------------------------------ steps
    def plan_step(self, scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int]]]) -> StepPlan:
        """``scheduled``: (req_id, tokens with KV before this step, tokens with KV once it ran,
        all token ids, block ids) of every request in the step. Returns the loads queued for
        them and the new saves.

        A request that computes again tokens of pages counted as saved (vLLM recomputes blocks
        whose load failed, or a preempted request) has those pages saved again."""
        plan = StepPlan()
        bs = self.block_size
        try:
            for req_id, computed_before, computed_after, token_ids, block_ids in scheduled:
                load = self._loads.pop(req_id, None)
                if load is not None:
                    plan.loads.append(load)
                state = self._reqs.get(req_id)
                if state is None:
                    continue
                if load is None and computed_before < state.saved_pages * bs:
                    state.saved_pages = computed_before // bs
                full = min(computed_after, len(token_ids), len(block_ids) * bs) // bs
                if full <= state.saved_pages:
                    continue
                keys = state.chain.extend(token_ids, full)
                save = self._save(req_id, state, token_ids, keys, block_ids)
                if save is not None:
                    plan.saves.append(save)
        finally:
            # staging slots are free for later steps: the worker reads into them in this one
            self.tree.release(self._staging)
            self._staging = []
            for node in self._step_locks:
                self.tree.unlock(node)
            self._step_locks = []
        return plan

    def _save(
        self, req_id: str, state: _Request, token_ids: Sequence[int], keys: list[str], block_ids: Sequence[int]
    ) -> PageSave | None:
        """Pages ``[saved_pages, len(keys))`` are new: put every page from the end of the
        tree's match on into host slots (as many as there is room for, the first ones first),
        and write the new ones to storage. Sets ``saved_pages`` to the end of what is saved:
        pages that found no room are tried again next step."""
        full = len(keys)
        host: HostMatch = self.tree.match(token_ids, state.salt, full, count_hit=False)
        held = min(host.pages, full)
        if held >= full:
            state.saved_pages = full
            return None  # the host tier holds them all already (so storage does too)
        slots = self.tree.reserve(full - held, keep=host.node, partial=True)
        if slots is None:
            self.stats["saves_dropped"] += full - max(held, state.saved_pages)
            state.saved_pages = max(state.saved_pages, held)
            return None
        end = held + len(slots)
        node = self.tree.insert(token_ids, state.salt, host, slots)
        write_from = min(max(state.saved_pages, held), end)
        job = 0
        if write_from < end:
            job = next(self._jobs)
            self.tree.lock(node)  # its slots stay put while a worker writes them to storage
            self._writes[job] = _Write(node, self.num_workers)
            self.stats["pages_to_save"] += end - write_from
        if end < full:
            self.stats["saves_dropped"] += full - end
        state.saved_pages = max(state.saved_pages, end)
        return PageSave(
            req_id, tuple(keys[held:end]), tuple(slots), tuple(int(b) for b in block_ids[held:end]),
            write_from=write_from - held, prior_key=keys[write_from - 1] if write_from > 0 else None, job=job,
        )

    def on_report(self, report: WorkerReport) -> None:
        """What the workers did: unlock nodes whose storage writes every worker ended, forget
        slots a worker found not holding what the tree says."""
        for job, count in report.jobs_done.items():
            write = self._writes.get(job)
            if write is None:
                continue
            write.reports_left -= count
            if write.reports_left <= 0:
                del self._writes[job]
                self.tree.unlock(write.node)
        if report.bad_slots:
            dropped = self.tree.drop_slots(report.bad_slots)
            logger.info("hicache: %d host slot(s) did not hold their page; %d page(s) forgotten",
                        len(report.bad_slots), dropped)

    def finished(self, req_id: str) -> None:
        state = self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        if state is not None and state.lookup is not None and not state.lookup.future.done():
            state.lookup.future.cancel()

    def close(self, timeout: float) -> None:
        self.store.close(timeout)
        logger.info("hicache scheduler: %s, host tier %s (%d pages held)", self.stats, self.tree.stats,
                    self.tree.held_pages())
