"""The scheduler half of the connector: how much of a prompt hicache holds, and which pages
each step loads and saves.

Lookup never stalls vLLM's scheduler: the first ask for a request starts an existence check of
its pages on the storage loop and waits for it at most ``lookup_wait_s``; if it is still
running, the answer is "not yet" (``None``) and vLLM asks again next step. A lookup that takes
longer than ``lookup_timeout_s`` is a miss. The hit is the longest run of pages, from the first
block vLLM does not hold itself, that exists for *every* parallel rank (each rank stores its own
shard). It stops one token short of the prompt: vLLM must compute at least one token.

Saves: after each step, every block that became full (prompt or generated tokens) and that
hicache did not just load is sent to the workers to be saved.

Nothing here imports vLLM; the connector passes request ids, token ids and block ids.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.integrations.vllm.naming import PageKeyChain
from hicache.integrations.vllm.store_io import StoreIO
from hicache.integrations.vllm.worker_side import PageTransfer

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
    lookup: _Lookup | None = None
    saved_pages: int = 0  # pages [0, saved_pages) are stored, loaded or held by vLLM already


@dataclass
class StepPlan:
    """What the workers do in one step."""

    loads: list[PageTransfer] = field(default_factory=list)
    saves: list[PageTransfer] = field(default_factory=list)


class SchedulerSide:
    """Per-request lookup and save bookkeeping for vLLM's scheduler."""

    def __init__(self, store: StoreIO, *, block_size: int, lookup_wait_s: float, lookup_timeout_s: float) -> None:
        self.store = store
        self.block_size = block_size
        self.lookup_wait_s = lookup_wait_s
        self.lookup_timeout_s = lookup_timeout_s
        self._reqs: dict[str, _Request] = {}
        self._loads: dict[str, PageTransfer] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            ("lookups", "lookup_timeouts", "hit_tokens", "pages_to_load", "pages_to_save"), 0
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
            state = self._reqs[req_id] = _Request(PageKeyChain(bs, cache_salt))
        start = num_computed // bs
        usable = max(0, len(token_ids) - 1) // bs  # at least one token left to compute
        state.saved_pages = max(state.saved_pages, start)
        if usable <= start:
            state.lookup = None
            return 0
        lk = state.lookup
        if lk is None or lk.start_page != start or lk.num_pages != usable - start:
            keys = state.chain.extend(token_ids, usable)[start:]
            self.stats["lookups"] += 1
            lk = state.lookup = _Lookup(start, len(keys), self.store.submit(self._leading_hits(keys)), time.monotonic())
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
        return max(0, (start + lk.hit_pages) * bs - num_computed)

    async def _leading_hits(self, keys: list[str]) -> int:
        """Length of the run of ``keys`` from the start that every rank's store holds."""
        best = len(keys)
        for backend in self.store.backends:
            flags = await backend.exists_pages(keys[:best])
            run = 0
            for f in flags:
                if not f:
                    break
                run += 1
            best = min(best, run)
            if best == 0:
                break
        return best

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; ``num_external_tokens`` of them are ours to fill."""
        state = self._reqs.get(req_id)
        if state is None or num_external_tokens <= 0 or state.lookup is None:
            return
        lk = state.lookup
        n = num_external_tokens // self.block_size
        end = lk.start_page + n
        if n <= 0 or end > len(block_ids) or end > len(state.chain.keys):
            logger.warning("hicache: %s: %d external tokens do not fit its blocks; not loading", req_id, num_external_tokens)
            return
        self._loads[req_id] = PageTransfer(
            req_id, tuple(state.chain.keys[lk.start_page : end]), tuple(int(b) for b in block_ids[lk.start_page : end])
        )
        state.saved_pages = max(state.saved_pages, end)
        self.stats["hit_tokens"] += n * self.block_size
        self.stats["pages_to_load"] += n

    # ------------------------------------------------------------------ steps
    def plan_step(self, scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int]]]) -> StepPlan:
        """``scheduled``: (req_id, tokens with KV before this step, tokens with KV once it ran,
        all token ids, block ids) of every request in the step. Returns the loads queued for
        them and the new saves.

        A request that computes again tokens of pages counted as saved (vLLM recomputes blocks
        whose load failed, or a preempted request) has those pages saved again."""
        plan = StepPlan()
        bs = self.block_size
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
            full = len(keys)
            first = state.saved_pages
            if full > first:
                plan.saves.append(
                    PageTransfer(req_id, tuple(keys[first:full]), tuple(int(b) for b in block_ids[first:full]))
                )
                self.stats["pages_to_save"] += full - first
                state.saved_pages = full
        return plan

    def finished(self, req_id: str) -> None:
        state = self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        if state is not None and state.lookup is not None and not state.lookup.future.done():
            state.lookup.future.cancel()

    def close(self, timeout: float) -> None:
        self.store.close(timeout)
        logger.info("hicache scheduler: %s", self.stats)
