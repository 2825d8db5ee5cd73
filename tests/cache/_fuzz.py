"""A seeded, model-based random driver of the whole hierarchical cache on a real stack.

What it drives: a :class:`~hicache.session.SessionAwareCache` over the
:class:`~hicache.prefix_cache.HiRadixCache` of :func:`~hicache.stack.build_stack` (torch pools,
copy engine, controller, a real ``memory`` store with an on/off switch), the way a server does:
requests over shared prefixes (page-aligned or not), prefetches, admits (some left running in the
background while other steps go on), chunked prefill, decode, finish or abort, streaming session
turns and releases, evictions of both tiers, drains, flushes, the store going down and up, load
faults, and a close at the end.

The reference: the KV of position ``i`` of a sequence is a function of the whole prefix
``tokens[:i + 1]`` (:func:`kv_ids`, written with :func:`~hicache.replay.synthetic.write_synthetic_kv`),
so every prefix the cache hands out, from any tier, is checked byte for byte. After every step
the sizes are recounted from the tree and the pools (:meth:`Fuzz.check`); at the end everything
is released and drained and every pool must be back to its initial free count, and the close
must report whatever it could not write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch

from hicache.controller import ControllerConfig
from hicache.errors import RequestAbortedError
from hicache.prefix_cache import MatchPrefixParams, RadixKey, Req, Session
from hicache.replay.synthetic import verify_kv, write_synthetic_kv
from hicache.session import SessionAwareCache, SessionConfig
from hicache.session.slot import ceil_align
from hicache.stack import StackConfig, build_stack, stored_page_nbytes
from hicache.storage.registry import register_backend
from hicache.testing import inject_load_faults
from hicache_backends.memory import MemoryStorage

BACKEND = "fuzz-switch-memory"


class GatedMemoryStorage(MemoryStorage):
    """The memory backend whose primitives (exists, read, write) first call :meth:`_gate`,
    which a subclass makes raise (a store that fails calls)."""

    def _gate(self) -> None:
        pass

    async def _exists(self, pages):  # type: ignore[no-untyped-def]
        self._gate()
        return await super()._exists(pages)

    async def _read(self, pages, buffers):  # type: ignore[no-untyped-def]
        self._gate()
        return await super()._read(pages, buffers)

    async def _write(self, pages, buffers, parents):  # type: ignore[no-untyped-def]
        self._gate()
        return await super()._write(pages, buffers, parents)


class SwitchStorage(GatedMemoryStorage):
    """The memory backend whose calls raise while ``down`` (a store that went away)."""

    backend_name = BACKEND
    down = False

    def _gate(self) -> None:
        if self.down:
            raise OSError("fuzz: the store is down")


register_backend(BACKEND, SwitchStorage)


def kv_ids(tokens: Sequence[int]) -> torch.Tensor:
    """Per position, a 62-bit hash of the prefix ending there: the "KV" written for it."""
    out = []
    h = 0x9E3779B97F4A7C15
    for t in tokens:
        h = ((h ^ (t + 1)) * 0x100000001B3 + 0x632BE59BD9B4E019) & ((1 << 62) - 1)
        out.append(h)
    return torch.tensor(out, dtype=torch.int64)


@dataclasses.dataclass
class FuzzCase:
    seed: int
    steps: int = 500
    page_size: int = 4
    device_pages: int = 24
    host_pages: int = 32
    storage_pages: int = 64
    placement: str = "lru"
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    req_slots: int = 6
    sessions: bool = True
    faults: bool = True
    flush: bool = True
    #: close with sessions open, copies queued and the store maybe down (no drain first)
    busy_close: bool = False


@dataclasses.dataclass(eq=False)
class Live:
    """A request the driver has started and not yet finished or aborted."""

    req: Req
    tokens: list[int]
    phase: str = "matched"  # matched -> admitting (task) -> running
    pos: int = 0  # tokens whose KV is computed
    task: asyncio.Task[Any] | None = None
    sid: str | None = None
    n_out: int = 0
    aborted: bool = False


class Fuzz:
    def __init__(self, case: FuzzCase) -> None:
        self.case = case
        self.rng = random.Random(case.seed)
        ps = case.page_size
        ctl = ControllerConfig(
            write_policy=case.write_policy, prefetch_policy=case.prefetch_policy, prefetch_threshold=ps,
            prefetch_timeout_base_s=0.05, prefetch_timeout_per_ki_token_s=0.0,
            storage_max_retries=1, storage_retry_base_s=0.001, storage_retry_max_s=0.002,
            storage_health_errors=2, storage_probe_base_s=0.02, storage_probe_max_s=0.05,
            storage_stall_s=2.0, cancelled_io_grace_s=0.0, close_timeout_s=5.0,
            backup_queue_size=8, storage_queue_size=16, storage_batch_pages=3,
        )
        self.stack = build_stack(StackConfig(
            page_size=ps, layer_num=2, head_num=1, head_dim=2, device_pages=case.device_pages,
            host_pages=case.host_pages, storage_backend=BACKEND, storage_pages=case.storage_pages,
            placement=case.placement, req_slots=case.req_slots, max_context_len=512, controller=ctl,
        ))
        self.cache = SessionAwareCache(self.stack.cache, SessionConfig())
        self.inner = self.stack.cache
        self.store: SwitchStorage = self.stack.storage  # type: ignore[assignment]
        self.live: dict[str, Live] = {}
        self.sessions: dict[str, list[int]] = {}  # idle open sessions -> history
        self.busy_sessions: set[str] = set()
        self.prefixes = [self.tokens(self.rng.randint(1, 6 * ps)) for _ in range(5)]
        self.finished: list[tuple[list[int], str | None]] = []
        self.n = 0
        self.restore_faults: Any = None
        self.log: list[str] = []
        self.device_capacity = case.device_pages * ps
        self.host_capacity = int(self.stack.host_pool.size)

    # ------------------------------------------------------------------ helpers

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(5000) for _ in range(n)]

    def note(self, what: str) -> None:
        self.log.append(what)

    def verify(self, slots: torch.Tensor, tokens: list[int], what: str) -> None:
        n = int(slots.numel())
        assert n <= len(tokens), (what, n, len(tokens))
        if n:
            bad = verify_kv(self.stack.device_pool, slots, kv_ids(tokens[:n]))
            assert bad == 0, f"{what}: {bad} of {n} tokens of reused KV differ\n" + "\n".join(self.log[-30:])

    def own_tokens(self, lv: Live) -> int:
        """Device slots the running request holds that neither the tree nor a slot counts."""
        req = lv.req
        if req.req_pool_idx is None:
            return 0
        ps = self.case.page_size
        slot = self.cache.slots.get(lv.sid) if lv.sid else None
        if slot is not None and slot.is_holding_kv and slot.req_pool_idx == req.req_pool_idx:
            return ceil_align(int(req.kv_allocated_len), ps) - ceil_align(slot.kv_allocated_len, ps)
        return ceil_align(int(req.kv_allocated_len), ps) - int(req.cache_protected_len)

    # ------------------------------------------------------------------ invariants

    def check(self, *, quiet: bool = False) -> None:
        """Everything that must hold between any two steps."""
        inner, stack = self.inner, self.stack
        self.cache.sanity_check()
        assert inner.evictable_size() >= 0 and inner.protected_size() >= 0
        assert inner.total_size() <= self.device_capacity
        host = inner.host_size()
        assert host <= self.host_capacity
        assert stack.host_pool.available_size() + host <= self.host_capacity, (
            stack.host_pool.available_size(), host, self.host_capacity)
        assert inner.eviction_index_repairs == 0
        assert stack.controller.metrics.counters["worker_errors"] == 0
        stored = self.store.get_stats().get("stored_bytes", 0)
        assert stored <= self.case.storage_pages * stored_page_nbytes(BACKEND, stack.config.page_nbytes)
        if all(lv.task is None for lv in self.live.values()):
            own = sum(self.own_tokens(lv) for lv in self.live.values())
            accounted = (stack.allocator.available_size() + inner.total_size()
                         + self.cache.session_held_tokens() + own)
            assert accounted == self.device_capacity, (
                accounted, self.device_capacity, stack.allocator.available_size(), inner.total_size(),
                self.cache.session_held_tokens(), own, "\n".join(self.log[-30:]))
        if all(lv.task is None for lv in self.live.values()):
            self.check_locks()
        for lv in self.live.values():  # a running request's prefix keeps its KV
            if lv.phase == "running" and lv.req.req_pool_idx is not None and lv.pos:
                row = stack.req_to_token_pool.req_to_token[lv.req.req_pool_idx][: lv.pos]
                self.verify(row, self.full(lv), f"running {lv.req.rid}")
        for sid in self.sessions:
            slot = self.cache.slots.get(sid)
            if slot is not None and slot.is_holding_kv:
                row = stack.req_to_token_pool.req_to_token[slot.req_pool_idx][: slot.kv_committed_len]
                self.verify(row, slot.token_ids, f"slot {sid}")

    def check_locks(self) -> None:
        """Every node's ``lock_ref`` is the number of holders whose path crosses it: admitted
        requests, session slots, backups in flight (one lock per copy, on its deepest node)
        and loads in flight."""
        inner = self.inner
        holders: list[Any] = []
        for lv in self.live.values():
            if lv.phase == "running" and inner.is_admitted(lv.req) or lv.req.last_node is not None and lv.phase == "running":
                holders.append(lv.req.last_node)
        for slot in self.cache.slots.values():
            if slot.is_holding_kv:
                holders.append(slot.last_node)
        nodes = list(inner._nodes())
        for n in nodes:
            if n.backup_op is not None and not any(c.backup_op is n.backup_op for c in n.children.values()):
                holders.append(n)
        holders += [load.node for load in inner.load_backs.loads]
        want: dict[Any, int] = {}
        for h in holders:
            while h is not None and h is not inner.root_node and hasattr(h, "lock_ref"):
                want[h] = want.get(h, 0) + 1
                h = h.parent
        bad = [(n, n.lock_ref, want.get(n, 0)) for n in nodes if n.lock_ref != want.get(n, 0)]
        assert not bad, f"lock counts differ from their holders: {bad[:4]}\n" + "\n".join(self.log[-30:])

    def full(self, lv: Live) -> list[int]:
        return lv.tokens + lv.req.output_ids

    # ------------------------------------------------------------------ steps

    def new_request(self) -> None:
        ps = self.case.page_size
        rng = self.rng
        sid = None
        extra = None
        if self.case.sessions and rng.random() < 0.3:
            idle = [s for s in self.sessions if s not in self.busy_sessions]
            if idle and rng.random() < 0.7:
                sid = rng.choice(idle)
                tokens = self.sessions[sid] + self.tokens(rng.randint(1, 3 * ps))
            else:
                sid = f"s{self.n}"
                self.sessions[sid] = []
                tokens = list(rng.choice(self.prefixes))[: rng.randint(0, 6 * ps)] + self.tokens(rng.randint(1, 3 * ps))
        else:
            base = list(rng.choice(self.prefixes))
            if self.finished and rng.random() < 0.4:
                base = list(rng.choice(self.finished)[0])
            cut = rng.randint(0, len(base))
            if rng.random() < 0.5:
                cut = cut // ps * ps
            tokens = base[:cut] + self.tokens(rng.randint(0 if cut else 1, 4 * ps))
            if rng.random() < 0.1:
                extra = "lora-a"
        self.n += 1
        rid = f"r{self.n}"
        req = Req(rid=rid, origin_input_ids=tokens, extra_key=extra,
                  session=Session(sid, streaming=True) if sid else None)
        if sid:
            self.busy_sessions.add(sid)
        self.cache.match_req(req)
        self.cache.start_prefetch(req)
        self.live[rid] = Live(req, list(tokens), sid=sid, n_out=rng.randint(0, 5) if sid else rng.randint(0, 2))
        self.note(f"new {rid} len={len(tokens)} sid={sid} extra={extra}")

    async def admit(self, lv: Live, background: bool) -> None:
        lv.phase = "admitting"
        lv.task = asyncio.ensure_future(self.cache.admit(lv.req))
        self.note(f"admit {lv.req.rid} bg={background}")
        if not background:
            await self.finish_admit(lv)
        elif self.rng.random() < 0.5:
            await asyncio.sleep(0)  # the admit has begun: an abort or cancel now finds it waiting

    async def finish_admit(self, lv: Live) -> None:
        task, lv.task = lv.task, None
        assert task is not None
        try:
            await task
        except asyncio.CancelledError:
            self.note(f"admit {lv.req.rid}: cancelled")
            self.abort(lv)  # a server drops a request whose admit it cancelled
            return
        except RequestAbortedError:
            self.note(f"admit {lv.req.rid}: aborted")
            self.drop(lv)
            return
        if lv.aborted:  # the admit had ended before the abort: the abort released it
            self.note(f"admit {lv.req.rid}: done before its abort")
            self.drop(lv)
            return
        req = lv.req
        n = int(req.prefix_indices.numel())
        self.verify(req.prefix_indices, lv.tokens, f"admit {req.rid}")
        lv.pos = n
        lv.phase = "running"
        self.note(f"admitted {req.rid} prefix={n}")

    async def compute(self, lv: Live) -> bool:
        """Prefill the next chunk (or all) of ``lv``; whether it made progress."""
        req = lv.req
        end = len(lv.tokens)
        step = self.rng.choice([end - lv.pos, self.case.page_size, self.rng.randint(1, 7)])
        b = min(end, lv.pos + max(1, step))
        req.fill_ids = lv.tokens[:b]
        slots = await self.cache.alloc_extend(req, b)
        if slots is None:
            self.note(f"compute {req.rid}: no room")
            return False
        write_synthetic_kv(self.stack.device_pool, slots[lv.pos:b], kv_ids(lv.tokens[:b])[lv.pos:b])
        req.kv_committed_len = b
        lv.pos = b
        self.note(f"compute {req.rid} -> {b}")
        if b < end:
            self.cache.cache_unfinished_req(req, chunked=True)
            # the insert may hand the request tree slots another request's load still fills
            # (as HiCache.commit does, wait for them; a failed one ends the request)
            if not await self.inner.wait_loads(req.prefix_indices):
                self.note(f"chunk {req.rid}: a shared load failed")
                return False
            self.verify(req.prefix_indices, lv.tokens, f"chunk {req.rid}")
        return True

    async def decode(self, lv: Live) -> bool:
        req = lv.req
        full = self.full(lv)
        tok = self.rng.randrange(5000)
        req.output_ids.append(tok)
        lv.n_out -= 1
        if lv.n_out <= 0:
            req.fill_ids = self.full(lv)
            return True  # the last token's KV is computed by the next turn
        pos = len(full)
        slots = await self.cache.alloc_extend(req, pos + 1)
        if slots is None:
            req.output_ids.pop()
            lv.n_out += 1
            return False
        write_synthetic_kv(self.stack.device_pool, slots[pos:pos + 1], kv_ids(full + [tok])[pos:])
        req.kv_committed_len = pos + 1
        lv.pos = pos + 1
        req.fill_ids = self.full(lv)
        return True

    def finish(self, lv: Live) -> None:
        req = lv.req
        req.fill_ids = self.full(lv)
        self.cache.release_req(req)
        self.live.pop(req.rid)
        if lv.sid:
            self.busy_sessions.discard(lv.sid)
            if lv.sid in self.sessions:
                self.sessions[lv.sid] = req.full_ids
        else:
            self.finished.append((req.full_ids[: req.kv_committed_len], req.extra_key))
            self.finished = self.finished[-8:]
        self.note(f"finish {req.rid} committed={req.kv_committed_len}")

    def drop(self, lv: Live) -> None:
        self.live.pop(lv.req.rid, None)
        if lv.sid:
            self.busy_sessions.discard(lv.sid)
            slot = self.cache.slots.get(lv.sid)
            if (slot is None or not slot.is_holding_kv) and not self.sessions.get(lv.sid):
                self.sessions.pop(lv.sid, None)  # a first turn that never ran: no session

    def abort(self, lv: Live) -> None:
        lv.aborted = True
        self.cache.abort_req(lv.req)
        self.note(f"abort {lv.req.rid} phase={lv.phase}")
        if lv.task is None:
            self.drop(lv)
        # an admit in flight raises RequestAbortedError (or returns): finish_admit sees to it

    async def step(self) -> None:
        rng = self.rng
        r = rng.random()
        live = list(self.live.values())
        if r < 0.2 or not live:
            if len(self.live) < self.case.req_slots:
                self.new_request()
                return
        lv = rng.choice(live) if live else None
        if lv is not None and r < 0.8:
            if lv.task is not None:
                x = rng.random()
                if x < 0.15:
                    self.abort(lv)
                elif x < 0.25:
                    self.note(f"cancel admit {lv.req.rid}")
                    lv.task.cancel()
                await self.finish_admit(lv)
            elif lv.phase == "matched":
                if rng.random() < 0.1:
                    self.abort(lv)
                else:
                    await self.admit(lv, background=rng.random() < 0.3)
            elif lv.phase == "running":
                if rng.random() < 0.03:
                    self.abort(lv)
                elif lv.pos < len(lv.tokens):
                    if not await self.compute(lv):
                        self.abort(lv)
                elif lv.n_out > 0:
                    if not await self.decode(lv):
                        self.abort(lv)
                else:
                    self.finish(lv)
                    if not lv.sid:
                        await self.rematch_check()
            return
        await self.system_step()

    async def rematch_check(self) -> None:
        """A request just finished: the same tokens match at least its aligned committed KV,
        at once (nothing ran in between), and the match's device part verifies."""
        if not self.finished or self.live and any(lv.task for lv in self.live.values()):
            return
        tokens, extra = self.finished[-1]
        m = self.inner.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra)), count_hit=False)
        ps = self.case.page_size
        aligned = len(tokens) // ps * ps
        got = int(m.device_indices.numel()) + int(m.host_hit_length)
        assert got >= aligned, (got, aligned, "\n".join(self.log[-20:]))
        self.verify(m.device_indices, tokens, "rematch")

    async def system_step(self) -> None:
        rng = self.rng
        inner, cache = self.inner, self.cache
        r = rng.random()
        if r < 0.15:
            n = rng.randint(1, self.device_capacity)
            self.note(f"evict {n}")
            cache.evict(n)
        elif r < 0.25:
            n = rng.randint(1, self.device_capacity)
            self.note(f"evict_async {n}")
            await cache.evict_async(n)
        elif r < 0.35:
            n = rng.randint(1, self.host_capacity)
            self.note(f"evict_host {n}")
            inner.evict_host(n)
        elif r < 0.5:
            self.note("drain")
            await cache.drain()
        elif r < 0.6 and self.case.sessions:
            idle = [s for s in self.sessions if s not in self.busy_sessions]
            if idle:
                sid = rng.choice(idle)
                self.note(f"release session {sid}")
                cache.release_session(sid)
                self.sessions.pop(sid)
            elif self.sessions and rng.random() < 0.3:
                sid = rng.choice(list(self.sessions))
                self.note(f"offload session {sid}")
                cache.offload_session(sid)
        elif r < 0.63 and self.case.faults:
            self.store.down = not self.store.down
            self.note(f"store down={self.store.down}")
            if not self.store.down:
                self.stack.controller.health.probe_passed()
        elif r < 0.67 and self.case.faults:
            if self.restore_faults is None:
                p = rng.choice([0.3, 1.0])
                self.restore_faults = inject_load_faults(self.stack.copy_engine, fail=lambda: rng.random() < p)
                self.note(f"load faults on p={p}")
            else:
                self.restore_faults()
                self.restore_faults = None
                self.note("load faults off")
        elif r < 0.78 and self.case.flush and not self.live:
            await self.flush()
        elif r < 0.8:
            self.note("cold: evict both tiers")
            await cache.evict_async(1 << 30)
            inner.evict_host(1 << 30)
        elif r < 0.87:
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        else:
            await asyncio.sleep(0)

    async def flush(self) -> None:
        """A server's flush_cache: only while no request runs; pools reset with the cache."""
        self.note("flush")
        stack = self.stack
        self.cache.reset()
        stack.allocator.clear()
        stack.req_to_token_pool.clear()
        self.sessions.clear()
        self.busy_sessions.clear()
        self.finished.clear()

    # ------------------------------------------------------------------ the run

    async def empty(self) -> None:
        """Finish every request (abort the unfinished), release every session, drain and evict
        both tiers completely."""
        for lv in list(self.live.values()):
            if lv.task is not None:
                await self.finish_admit(lv)
        for lv in list(self.live.values()):
            self.abort(lv)
        self.store.down = False
        self.stack.controller.health.probe_passed()
        if self.restore_faults is not None:
            self.restore_faults()
            self.restore_faults = None
        for sid in list(self.cache.slots):
            self.cache.release_session(sid)
        self.sessions.clear()
        for _ in range(6):
            await self.cache.drain()
            await self.cache.evict_async(1 << 30)
            await self.cache.drain()
            self.inner.evict_host(1 << 30)
            if self.inner.total_size() == 0 and not self.inner.root_node.children:
                break

    async def run(self) -> None:
        stack = self.stack
        try:
            for i in range(self.case.steps):
                await self.step()
                self.check()
            if self.case.busy_close:
                for lv in list(self.live.values()):
                    if lv.task is not None:
                        await self.finish_admit(lv)
                for lv in list(self.live.values()):
                    self.abort(lv)
            else:
                await self.empty()
                self.check()
                await stack.controller.wait_prefetches()
                assert stack.allocator.available_size() == self.device_capacity, self.inner.pretty_print()
                assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size
                assert stack.host_pool.available_size() == stack.host_pool.size, (
                    stack.host_pool.available_size(), stack.host_pool.size, self.inner.pretty_print())
                assert self.inner.total_size() == 0 and self.inner.host_size() == 0
        finally:
            report = await self.cache.aclose()
            await stack.copy_engine.aclose()
            if self.restore_faults is not None:
                self.restore_faults()
        assert report is not None, "the close gave no report"
        counters = stack.controller.metrics.counters
        assert counters["worker_errors"] == 0
        # every queued write drained, or what was not is reported
        assert report.drained or report.unwritten_pages or report.deferred_backup_pages, report
        skipped = counters.get("storage_write_skipped_unhealthy", 0) + counters.get("storage_write_failures", 0)
        assert report.lifetime_failed_storage_pages >= skipped, (report, skipped)
