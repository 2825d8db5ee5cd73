"""The scheduler half of the connector: how much of a prompt hicache holds, and which pages
each step loads and saves.

Lookup is tiered and never stalls vLLM's scheduler. First hicache's radix tree over the
workers' host pools (:mod:`.host_tree`): pages there are a hit at once. For the pages after
them, an existence check in storage starts on the storage loop and is waited for, but all the
lookups of one scheduler step share one wait budget of ``lookup_wait_s``: vLLM asks about every
waiting request each step, and a slow store must not multiply the stall by the queue length.
A lookup still running is "not yet" (``None``) and vLLM asks again next step. A lookup that
takes longer than ``lookup_timeout_s`` is a miss. A storage hit is the longest run of pages
that exists for *every* parallel rank (each rank stores its own shard). The hit stops one token
short of the prompt: vLLM must compute at least one token.

Slots: the scheduler decides which host slot each page goes to, for pages read from storage
(they join the tree when their prefix is there) and for saves: every block that became full
(prompt or generated tokens) is copied into a host slot at the end of its step, and the ones
storage may lack are written to it in the background; their node stays locked until every
worker reported the write done (:meth:`SchedulerSide.on_report`). Room comes from the tree's
eviction policy. Worker reports of slots that did not hold what the tree says drop those nodes
at once, locked or not (a locked node's slots are freed when its write ends).

Durability: a page counts as in storage only when every worker reported it written (or a
lookup found it); a save writes from the first page of its prefix not known to be in storage
or under way, so a write that failed or was refused is made again by the next save through
that prefix instead of leaving a hole before every later page.

KV computed over a failed load: vLLM runs a step even when a load in it failed (and rolls the
request back afterwards), so the pages that step computed for a request whose earlier KV was
being loaded attended to garbage; with async scheduling so did the next step, planned before
the failure was known. Each save names the blocks its request's KV sits in that were loaded in
a step whose outcome the scheduler has not seen yet (``PageSave.depends_on``, from every such
load: vLLM shares blocks between requests); a worker that saw one fail drops the save. A step's
outcome is seen when the workers' report of it arrives (``WorkerReport.step``): vLLM rolls the
requests back in that same update. With several workers, a save with such blocks has its
storage write wait for the scheduler's word (``hold``): commit once every worker reported it
clean, abort otherwise.

A storage hit is never slower than recomputing it: while a page read costs more than
recomputing the page, storage hits are not claimed (``hit_pages_cut_recompute``); the paces
come from the workers' reports (:mod:`.load_bound`).

Reset (``reset_cache``, e.g. after new weights): the tree forgets every page, requests start
new key chains under a new cache epoch (so nothing stored before matches), and the workers drop
their host pages when the next step's metadata shows the new epoch.

Nothing here imports vLLM; the connector passes request ids, token ids and block ids.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.errors import quoted
from hicache.integrations.vllm.host_tree import HostMatch, HostPageTree
from hicache.integrations.vllm.load_bound import LoadBound
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
    future: concurrent.futures.Future[list[bool]]
    started: float
    exists: list[bool] | None = None  # per page from start_page: every rank's store holds it
    answered: float = 0.0  # when ``exists`` came (time.monotonic())


@dataclass
class _Request:
    chain: PageKeyChain
    salt: str | None
    tokens: Sequence[int] = ()
    start_page: int = 0  # pages vLLM held itself at the last lookup
    lookup: _Lookup | None = None
    saved_pages: int = 0  # pages [0, saved_pages) are stored, loaded or held by vLLM already
    known: int = 0  # pages [0, known) are in storage or being written to it, as far as this request saw
    cut: int = 0  # storage pages its last lookup did not claim (slower than recomputing)
    capped: int = 0  # storage pages its last lookup did not claim for want of host room


#: how long a storage lookup's answer is taken as current for a request asked about again
LOOKUP_TTL_S = 1.0


def _drop_lookup(state: _Request) -> None:
    """Cancel the request's storage lookup if it still runs (its answer is not wanted)."""
    if state.lookup is not None and not state.lookup.future.done():
        state.lookup.future.cancel()


@dataclass
class _Write:
    """One save's storage write, until every worker reported it ended."""

    node: TreeNode | None  # locked while workers read its slots (None: nothing of it left in the tree)
    reports_left: int
    req_id: str
    first: int  # the request's page index of its first page
    slots: list[int]  # the slots it writes, in page order
    written: int | None = None  # leading pages written, the fewest any worker reported
    park: list[int] = field(default_factory=list)  # slots dropped from the tree: freed when the write ends
    verdicts_left: int = 0  # a held write: workers still to report it held, tainted or skipped
    ended_verdicts: int = 0  # a held write: verdicts that end the worker's part (tainted, skipped)
    aborted: bool = False


@dataclass
class StepPlan:
    """What the workers do in one step: this step's loads and saves, the held storage writes
    to start (``commit``) or forget (``abort``), the cache epoch (see :meth:`SchedulerSide.reset`)
    and the step numbers the workers keep failed loads by."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    commit: list[int] = field(default_factory=list)
    abort: list[int] = field(default_factory=list)
    epoch: int = 0
    step: int = 0  # this step's number
    resolved: int = 0  # the last step whose outcome the scheduler has seen


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
        recompute_bound: bool = True,
        recompute_tokens_per_s: float | None = None,
        repace_s: float = 10.0,
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
        self._wait_left = lookup_wait_s  # what this step's lookups may still wait, all together
        #: host pages promised to storage hits reported since the last plan, not yet reserved
        #: (a hit the host tier has no room to read into fails its request under vLLM's
        #: default ``kv_load_failure_policy="fail"``, so a hit is never larger than the room)
        self._promised: dict[str, int] = {}
        self._commits: list[int] = []  # held writes every worker reported clean: start them
        self._aborts: list[int] = []  # held writes some worker found tainted: forget them
        self._pending_bad: set[int] = set()  # bad slots whose node could not go yet (a lock)
        self._step = 0  # steps planned
        self._resolved = 0  # the last step whose workers' report arrived (its failed loads are handled)
        self._unresolved: list[tuple[int, frozenset[int]]] = []  # (step, blocks it loads) not resolved yet
        #: the cache epoch: 0 until the first reset; its random key roots every key chain after
        self.epoch = 0
        self._epoch_key: str | None = None
        self.stats: dict[str, int] = dict.fromkeys(
            ("lookups", "lookup_waits", "lookup_timeouts", "hit_tokens", "host_hit_tokens", "pages_to_load",
             "pages_to_save", "pages_rewritten", "pages_unwritten", "saves_dropped", "saves_tainted",
             "saves_aborted", "loads_without_room", "hits_capped_for_room", "bad_slot_pages_dropped", "resets",
             "requests_rerooted", "hit_pages_cut_recompute", "repace_loads"), 0
        )
        #: storage reads against recomputing them
        self.bound = LoadBound(self.block_size, enabled=recompute_bound, recompute_tokens_per_s=recompute_tokens_per_s,
                               repace_s=repace_s, stats=self.stats)

    # ------------------------------------------------------------------ lookup
    def matched_tokens(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None, num_computed: int
    ) -> int | None:
        """Tokens beyond ``num_computed`` (block aligned) hicache can load, or ``None`` for
        "ask again"."""
        bs = self.block_size
        state = self._rooted(req_id, cache_salt)
        state.tokens = token_ids
        start = num_computed // bs
        state.start_page = start
        usable = max(0, len(token_ids) - 1) // bs  # at least one token left to compute
        state.saved_pages = max(state.saved_pages, start)
        if usable <= start:
            state.lookup = None
            return 0
        host = self.tree.match(token_ids, cache_salt, usable, count_hit=False)
        base = max(start, host.pages)
        if base >= usable:
            state.lookup = None
            return usable * bs - num_computed
        # ask storage from the first page not known to be there (pages vLLM or the tree hold
        # may still be missing from it: their answer tells the saves what to write again)
        ask = min(base, self._first_unknown(state, host.slots, usable))
        lk = state.lookup
        if lk is None or lk.start_page > ask or lk.start_page + lk.num_pages != usable or (
                lk.exists is not None and time.monotonic() - lk.answered > LOOKUP_TTL_S):
            # an answer is asked again once it is old: a request vLLM could not admit asks every
            # step, a preempted one comes back minutes later, and the store may have dropped the
            # pages meanwhile (its bound, another engine): promised, their load fails the request
            keys = state.chain.extend(token_ids, usable)[ask:]
            self.stats["lookups"] += 1
            lk = state.lookup = _Lookup(ask, len(keys), self.store.submit(self._exists(keys)), time.monotonic())
        if lk.exists is None and not self._wait_for(req_id, lk):
            return None
        exists = lk.exists or []
        ask = max(ask, lk.start_page)
        asked = exists[ask - lk.start_page :]
        found = ask + leading_run(asked)
        if found < ask + len(asked) and state.known > found:
            # the store lacks page ``found`` although this request saw it stored or being
            # written (before a preemption: the store's bound, another engine dropped it since):
            # its saves must write it again, and what follows it, or they land behind a hole
            state.known = found
        else:
            state.known = max(state.known, found)
        hit = leading_run(exists[base - lk.start_page :])
        self._promised.pop(req_id, None)
        capped = 0
        if hit:  # read into host slots: only as many pages as the host tier can take now
            room = self.tree.room(keep=host.node) - sum(self._promised.values())
            if hit > room:
                capped = hit - max(0, room)
                hit = max(0, room)
        if capped > state.capped:  # a request asked about again is counted once
            self.stats["hits_capped_for_room"] += capped - state.capped
        state.capped = capped
        cut = hit if hit and not self.bound.reading_pays(req_id) else 0
        if cut > state.cut:  # a request asked about again is counted once
            self.stats["hit_pages_cut_recompute"] += cut - state.cut
        state.cut = cut
        hit -= cut
        if hit:
            self._promised[req_id] = hit
        return max(0, (base + hit) * bs - num_computed)

    def _rooted(self, req_id: str, cache_salt: str | None) -> _Request:
        """The request's state, rooted at ``cache_salt``. A request whose salt changed (a vLLM
        streaming-input session given a new image, whose identifier is part of the root) starts
        a new state: its pages after the change are other KV than the same tokens under the old
        root, so its lookups, host pages and saves all move to the new root, and every page it
        holds is saved again under it (``saved_pages`` 0)."""
        state = self._reqs.get(req_id)
        if state is None or state.salt != cache_salt:
            if state is not None:
                self.stats["requests_rerooted"] += 1
                _drop_lookup(state)
            state = self._reqs[req_id] = _Request(PageKeyChain(self.block_size, cache_salt, self._epoch_key), cache_salt)
        return state

    def reroot(self, req_id: str, cache_salt: str | None) -> None:
        """A running request's salt is now ``cache_salt`` (see :meth:`_rooted`); a request
        without state (finished, or reset) stays without."""
        if req_id in self._reqs:
            self._rooted(req_id, cache_salt)

    def _wait_for(self, req_id: str, lk: _Lookup) -> bool:
        """Wait for ``lk`` out of this step's budget; ``False``: still running, ask again."""
        wait = min(self.lookup_wait_s, self._wait_left)
        try:
            if wait > 0 and not lk.future.done():
                self.stats["lookup_waits"] += 1
                t0 = time.monotonic()
                try:
                    lk.exists = lk.future.result(timeout=wait)
                finally:
                    self._wait_left -= time.monotonic() - t0
            else:
                lk.exists = lk.future.result(timeout=0)
        except concurrent.futures.TimeoutError:
            if wait > 0:
                self._wait_left = 0.0  # the budget is spent: the step's other lookups only peek
            if time.monotonic() - lk.started < self.lookup_timeout_s:
                return False
            lk.future.cancel()
            self.stats["lookup_timeouts"] += 1
            lk.exists = []
        except BaseException as exc:  # noqa: BLE001 - a broken lookup is a miss
            logger.warning("hicache: lookup of %s failed: %r", quoted(req_id), exc)
            lk.exists = []
        lk.answered = time.monotonic()
        return True

    async def _exists(self, keys: list[str]) -> list[bool]:
        """Per key: does every rank's store hold it."""
        result = [True] * len(keys)
        for backend in self.store.backends:
            last = max((i for i, e in enumerate(result) if e), default=-1)
            if last < 0:
                break
            got = list(await backend.exists_pages(keys[: last + 1]))
            for i in range(len(result)):
                result[i] = result[i] and i < len(got) and bool(got[i])
        return result

    def _first_unknown(self, state: _Request, tree_slots: Sequence[int], limit: int) -> int:
        """The first page in ``[0, limit)`` of a request not known to be in storage or being
        written: not in the request's own knowledge (``known``), and not a tree slot whose page
        is stored or under way (``tree_slots``: the tree's match for the request)."""
        k = 0
        while k < limit:
            if k < state.known:
                k = state.known
            elif k < len(tree_slots) and self.tree.known(tree_slots[k]):
                k += 1
            else:
                break
        return min(k, limit)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; ``num_external_tokens`` of them are ours to fill:
        from host slots where the tree holds the pages, else read from storage into new slots."""
        state = self._reqs.get(req_id)
        bs = self.block_size
        self._promised.pop(req_id, None)  # reserved below for real (or not needed)
        if state is None or num_external_tokens <= 0:
            return
        start = state.start_page
        n = num_external_tokens // bs
        end = start + n
        keys = state.chain.extend(state.tokens, end)
        if n <= 0 or end > len(block_ids) or end > len(keys):
            logger.warning("hicache: %s: %d external tokens do not fit its blocks; not loading", quoted(req_id), num_external_tokens)
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
                # the pages follow the tree's: they join it (the worker reports them if the read
                # fails). They count as stored: the lookup found them in every rank's store (a
                # bad-slot report or a free forgets that with the slot)
                self.tree.stored.update(s for s in new if s >= 0)
                self._lock_for_step(self.tree.insert(state.tokens, state.salt, host, new))
            else:
                self._staging.extend(new)  # vLLM holds the pages before them, the tree does not
            slots = [*slots, *new]
        self._loads[req_id] = PageLoad(
            req_id, tuple(keys[start:end]), tuple(slots), tuple(int(b) for b in block_ids[start:end]),
            from_host=max(0, held - start),
        )
        # pages past ``end`` are computed again from here (a preempted request resumed with a
        # shorter hit than it had saved): they are saved again, from what storage lacks (known)
        state.saved_pages = end
        self.stats["hit_tokens"] += n * bs
        self.stats["host_hit_tokens"] += max(0, held - start) * bs
        self.stats["pages_to_load"] += n

    def _lock_for_step(self, node: TreeNode) -> None:
        """Keep ``node``'s slots out of this step's evictions: a load or a save's copy planned
        into a slot that a later request of the same step got again would fail (the worker
        refuses two reads, or two copies, into one slot)."""
        self.tree.lock(node)
        self._step_locks.append(node)

    # ------------------------------------------------------------------ steps
    def plan_step(self, scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int]]]) -> StepPlan:
        """``scheduled``: (req_id, tokens with KV before this step, tokens with KV once it ran,
        all token ids, block ids) of every request in the step. Returns the loads queued for
        them, the new saves, and the word on held writes the workers reported since.

        A request that computes again tokens of pages counted as saved (vLLM recomputes blocks
        whose load failed, or a preempted request) has those pages saved again."""
        self._step += 1
        self.bound.clock_step(self._step, scheduled)
        plan = StepPlan(commit=self._commits, abort=self._aborts, epoch=self.epoch, step=self._step,
                        resolved=self._resolved)
        self._commits, self._aborts = [], []
        self._wait_left = self.lookup_wait_s  # the lookups up to the next plan share a new budget
        self._promised.clear()  # hits not allocated by now are asked for again
        bs = self.block_size
        try:
            loaded: set[str] = set()
            for req_id, *_ in scheduled:
                load = self._loads.pop(req_id, None)
                if load is not None:
                    plan.loads.append(load)
                    loaded.add(req_id)
            # every block loaded in a step whose outcome is not known yet, this one's included: a
            # request whose KV sits in one of them (its own load, or a block vLLM shares with a
            # request that loads it) computes over it
            self._unresolved = [(step, blocks) for step, blocks in self._unresolved if step > self._resolved]
            step_loads = frozenset(b for load in plan.loads for b in load.block_ids)
            if step_loads:
                self._unresolved.append((self._step, step_loads))
            loading: set[int] = set().union(*(blocks for _, blocks in self._unresolved))
            for req_id, computed_before, computed_after, token_ids, block_ids in scheduled:
                state = self._reqs.get(req_id)
                if state is None:
                    continue
                if req_id not in loaded and computed_before < state.saved_pages * bs:
                    state.saved_pages = computed_before // bs
                    state.known = min(state.known, state.saved_pages)  # a failed load may have been a lost page
                full = min(computed_after, len(token_ids), len(block_ids) * bs) // bs
                if full <= state.saved_pages:
                    continue
                depends: tuple[int, ...] = ()
                if loading:
                    before = -(-computed_before // bs)  # vLLM counts a partly computed block as read
                    depends = tuple(sorted(loading.intersection(int(b) for b in block_ids[:before])))
                keys = state.chain.extend(token_ids, full)
                save = self._save(req_id, state, token_ids, keys, block_ids, depends)
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
        self, req_id: str, state: _Request, token_ids: Sequence[int], keys: list[str], block_ids: Sequence[int],
        depends: tuple[int, ...],
    ) -> PageSave | None:
        """Pages ``[saved_pages, len(keys))`` are new: put every page from the end of the
        tree's match on into host slots (as many as there is room for, the first ones first),
        and write to storage every page from the first one storage may lack (the tree's pages
        included: they are then written from their slots). Sets ``saved_pages`` to the end of
        what is saved: pages that found no room are tried again next step."""
        full = len(keys)
        host: HostMatch = self.tree.match(token_ids, state.salt, full, count_hit=False)
        held = min(host.pages, full)
        new: list[int] = []
        if held < full:
            got = self.tree.reserve(full - held, keep=host.node, partial=True)
            if got is None:
                self.stats["saves_dropped"] += full - max(held, state.saved_pages)
            else:
                new = got
                if len(new) < full - held:
                    self.stats["saves_dropped"] += full - held - len(new)
        end = held + len(new)
        node = self.tree.insert(token_ids, state.salt, host, new) if new else host.node
        if new:
            # the new pages land in their slots only at this step's save: a later request of
            # the plan must not evict them (the copy-only ones hold no write's lock)
            self._lock_for_step(node)
        state.saved_pages = max(state.saved_pages, end)
        first = self._first_unknown(state, host.slots, end)
        begin = min(first, held)  # tree pages before `held` are only written, never copied
        if begin >= end:
            return None  # nothing to copy, storage has (or is getting) every page
        slots = [*host.slots[begin:held], *new]
        job = 0
        hold = False
        if first < end:
            job = next(self._jobs)
            writes = slots[first - begin :]
            hold = bool(depends) and self.num_workers > 1
            self.tree.lock(node)  # its slots stay put while a worker writes them to storage
            self.tree.begin_writing(writes)
            self._writes[job] = _Write(node, self.num_workers, req_id, first, writes,
                                       verdicts_left=self.num_workers if hold else 0)
            self.stats["pages_to_save"] += end - first
            self.stats["pages_rewritten"] += max(0, held - first)
            state.known = max(state.known, end)
        return PageSave(
            req_id, tuple(keys[begin:end]), tuple(slots), tuple(int(b) for b in block_ids[begin:end]),
            write_from=first - begin, prior_key=keys[first - 1] if first > 0 else None, job=job,
            copy_from=held - begin, depends_on=depends, hold=hold,
        )

    # ------------------------------------------------------------------ reports
    def on_report(self, report: WorkerReport) -> None:
        """What the workers did: the word on held writes, writes that every worker ended (their
        pages now count as stored as far as all of them wrote them; their nodes unlock), slots
        a worker found not holding what the tree says (forgotten at once), and the step the
        report ends (loads up to it are resolved); the step's time and reads (see
        :class:`.load_bound.LoadBound`)."""
        self.bound.time_step(report)
        if report.step is not None:
            self._resolved = max(self._resolved, report.step)
        for job, n in report.tainted.items():
            self.stats["saves_tainted"] += n
        for job in set(report.held) | set(report.tainted) | set(report.skipped):
            write = self._writes.get(job)
            if write is None or write.verdicts_left <= 0:
                continue
            against = report.tainted.get(job, 0) + report.skipped.get(job, 0)
            write.ended_verdicts += against
            self._verdicts(job, write, report.held.get(job, 0) + against, against > 0)
        for job, n in report.written.items():
            write = self._writes.get(job)
            if write is not None:
                write.written = n if write.written is None else min(write.written, n)
        for job, count in report.jobs_done.items():
            write = self._writes.get(job)
            if write is None:
                continue
            write.reports_left -= count
            if write.verdicts_left > 0:
                # until the word is given, only a worker that tainted or skipped the write ends
                # its part (with that verdict); one that ended otherwise (no verdict, or a held
                # write it gave up at close) does not write its shard: that counts against it
                missing = (self.num_workers - write.reports_left) - write.ended_verdicts
                if missing > 0:
                    write.ended_verdicts += missing
                    logger.warning("hicache: %d worker(s) ended held write %d without a verdict; aborting it",
                                   missing, job)
                    self._verdicts(job, write, missing, True)
            if write.reports_left <= 0:
                del self._writes[job]
                self._end_write(write)
        bad = report.bad_slots | self._pending_bad
        if bad:
            self._pending_bad = set()
            dropped = self._drop_bad(bad)
            self.stats["bad_slot_pages_dropped"] += dropped
            logger.info("hicache: %d host slot(s) did not hold their page; %d page(s) forgotten", len(bad), dropped)

    def _verdicts(self, job: int, write: _Write, n: int, against: bool) -> None:
        """``n`` workers' verdicts on held write ``job`` (``against``: one of them taints or
        skipped it); once every worker gave one, the write is committed or aborted."""
        write.aborted = write.aborted or against
        write.verdicts_left -= n
        if write.verdicts_left <= 0:
            (self._aborts if write.aborted else self._commits).append(job)
            self.stats["saves_aborted"] += write.aborted

    def _end_write(self, write: _Write) -> None:
        written = 0 if write.aborted else min(write.written or 0, len(write.slots))
        parked = set(write.park)
        self.tree.end_writing(write.slots, [s for s in write.slots[:written] if s not in parked])
        if written < len(write.slots):
            # storage lacks these pages: the next save through them writes them again
            self.stats["pages_unwritten"] += len(write.slots) - written
            state = self._reqs.get(write.req_id)
            if state is not None:
                state.known = min(state.known, write.first + written)
        if write.node is not None:
            self.tree.unlock(write.node)
        self.tree.release(write.park)

    def _drop_bad(self, bad: set[int]) -> int:
        """Forget the nodes holding ``bad`` slots, with the pages after them, now: a write
        that still reads a slot in there keeps it (parked, freed when the write ends) and
        moves its lock to the surviving parent, so the pages before stay put for it too."""
        dropped = 0
        root = self.tree.tree.root_node
        for node in self.tree.nodes_holding(bad):
            if not self.tree.attached(node):
                continue
            node = self.tree.cut_at(node, bad)
            subtree = self.tree.subtree(node)
            members = {id(n) for n in subtree}
            sub_slots = self.tree.node_slots(subtree)
            anchor = node.parent if node.parent is not root else None
            keep: set[int] = set()
            for write in self._writes.values():
                if write.node is not None and id(write.node) in members:
                    if anchor is not None:
                        self.tree.lock(anchor)
                    self.tree.unlock(write.node)
                    write.node = anchor
                    write.park.extend(s for s in write.slots if s in sub_slots)
                keep.update(s for s in write.park if s in sub_slots)
            n = self.tree.drop_subtree(node, keep)
            if n is None:  # a lock no write holds (cannot happen between steps): next report
                self._pending_bad |= bad & sub_slots
                continue
            dropped += n
        return dropped

    # ------------------------------------------------------------------ reset
    def reset(self) -> bool:
        """Forget every page hicache holds for this engine (vLLM's ``reset_cache``: new
        weights make every stored page wrong). The tree is emptied (slots that storage writes
        still read are freed when those end), held writes are aborted, requests lose their
        state (their next lookup starts over; one still running saves nothing more), and a new
        random cache epoch roots every key chain from now on, so no page stored before is ever
        matched again, by this engine or after it. Workers drop their host pages when the next
        step's metadata shows the new epoch. Returns ``True`` once done; ``False`` if pages
        stayed in the tree (vLLM then reports the reset as failed)."""
        self.epoch += 1
        self._epoch_key = secrets.token_hex(16)
        for state in self._reqs.values():
            _drop_lookup(state)
        self._reqs.clear()
        self._loads.clear()
        for node in self._step_locks:
            self.tree.unlock(node)
        self._step_locks = []
        self.tree.release(self._staging)
        self._staging = []
        for write in self._writes.values():
            if write.node is not None:
                self.tree.unlock(write.node)
                write.node = None
            write.park = sorted(set(write.park) | set(write.slots))
            if write.verdicts_left > 0:
                write.aborted = True
        for job in self._commits:  # every worker reported them clean, but their pages are of the old epoch
            if job in self._writes:
                self._writes[job].aborted = True
        self._aborts.extend(self._commits)
        self._commits = []
        self._pending_bad.clear()
        dropped = self.tree.clear(keep={s for w in self._writes.values() for s in w.park})
        self.tree.stored.clear()
        self.stats["resets"] += 1
        if self.tree.held_pages():  # a lock nothing here holds (cannot happen): not done
            logger.error("hicache: cache reset left %d host page(s) in the tree", self.tree.held_pages())
            return False
        logger.info("hicache: cache reset (epoch %d): %d host page(s) forgotten, %d write(s) still running",
                    self.epoch, dropped, len(self._writes))
        return True

    # ------------------------------------------------------------------ requests
    def load_sources(self, req_id: str) -> tuple[int, int] | None:
        """Tokens the planned load of ``req_id`` takes from host slots and from storage
        (``None``: no load planned)."""
        load = self._loads.get(req_id)
        if load is None:
            return None
        bs = self.block_size
        return load.from_host * bs, (len(load.keys) - load.from_host) * bs

    def finished(self, req_id: str) -> None:
        state = self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._promised.pop(req_id, None)
        self.bound.finished(req_id)
        if state is not None:
            _drop_lookup(state)

    def close(self, timeout: float) -> None:
        self.store.close(timeout)
        logger.info("hicache scheduler: %s, host tier %s (%d pages held)", self.stats, self.tree.stats,
                    self.tree.held_pages())
