"""Session-cache test helpers: a small cache stack, deterministic synthetic KV, and a client
that drives turns the way a server would (match, prefetch, admit, allocate, write KV, finish).

Synthetic KV: the K/V of a token depend only on (token id, position, layer), so the KV of any
prefix a turn is handed (restored slot, tree hit, host load, storage fetch) can be checked
against a full recompute exactly, without a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import torch

from hicache.controller import ControllerConfig, HiCacheController
from hicache.memory import CopyEngine, MHATokenToKVPool, MHATokenToKVPoolHost, PagedTokenAllocator, ReqToTokenPool
from hicache.prefix_cache import HiRadixCache, RadixCache, Req, Session
from hicache.session import SessionAwareCache, SessionConfig
from hicache.storage import create_async_storage

PS = 4
LAYERS = 2
HEAD_DIM = 4
VOCAB = 1000


# ---------------------------------------------------------------------- synthetic KV

def kv_of(tokens: list[int], start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``tokens`` at positions ``start...`` in ``layer`` (exact in float32)."""
    n = len(tokens)
    t = torch.tensor(tokens, dtype=torch.float32)
    p = torch.arange(start, start + n, dtype=torch.float32)
    lay = torch.full((n,), float(layer))
    one = torch.ones(n)
    k = torch.stack([t, p, lay, one], dim=1).reshape(n, 1, HEAD_DIM)
    v = torch.stack([2 * t + 1, 3 * p, lay + 0.5, -one], dim=1).reshape(n, 1, HEAD_DIM)
    return k, v


def write_kv(pool: MHATokenToKVPool, slots: torch.Tensor, tokens: list[int], start: int) -> None:
    """What a forward pass does: store the KV of ``tokens`` (positions ``start...``)."""
    if not tokens:
        return
    assert slots.numel() == len(tokens)
    for layer in range(LAYERS):
        k, v = kv_of(tokens, start, layer)
        pool.set_kv_buffer(layer, slots, k, v)


def kv_matches(pool: MHATokenToKVPool, slots: torch.Tensor, tokens: list[int], start: int = 0) -> bool:
    """Does the pool hold, at ``slots``, exactly the KV a full recompute of ``tokens`` gives?"""
    if slots.numel() != len(tokens):
        return False
    if not tokens:
        return True
    idx = slots.to(torch.int64)
    for layer in range(LAYERS):
        k, v = kv_of(tokens, start, layer)
        if not torch.equal(pool.get_key_buffer(layer)[idx], k) or not torch.equal(pool.get_value_buffer(layer)[idx], v):
            return False
    return True


# ---------------------------------------------------------------------- the stack

@dataclasses.dataclass
class Stack:
    device_pool: MHATokenToKVPool
    allocator: PagedTokenAllocator
    req_pool: ReqToTokenPool
    inner: Any
    cache: SessionAwareCache
    host_pool: MHATokenToKVPoolHost | None = None
    engine: CopyEngine | None = None
    controller: HiCacheController | None = None
    storage: Any = None

    @property
    def hier(self) -> bool:
        return self.controller is not None

    def accounted(self) -> int:
        """Device tokens that are free, in the tree, or held by session slots."""
        return self.allocator.available_size() + self.inner.total_size() + self.cache.session_held_tokens()

    async def empty_everything(self) -> None:
        """Release every session, finish every write-back and evict both tiers completely."""
        for sid in list(self.cache.slots):
            self.cache.release_session(sid)
        await self.cache.drain_writeback()
        huge = 1 << 30
        for _ in range(6):
            if self.hier:
                await self.inner.drain()
                await self.inner.evict_async(huge)
                await self.inner.drain()
                self.inner.evict_host(huge)
            else:
                self.inner.evict(huge)
            if self.inner.total_size() == 0 and not self.inner.root_node.children:
                break

    def assert_initial(self) -> None:
        """Every pool back to its initial free size."""
        assert self.allocator.available_size() == self.allocator.capacity, self.inner.pretty_print()
        assert self.req_pool.available_size() == self.req_pool.size
        if self.host_pool is not None:
            assert self.host_pool.available_size() == self.host_pool.size
        assert self.cache.session_held_tokens() == 0
        assert self.cache.session_held_req_count() == 0

    def hold_backups(self) -> asyncio.Event:
        """Hold every device->host copy until the returned event is set (a wedged copy stream)."""
        assert self.engine is not None
        return hold_backups(self.engine)

    async def aclose(self) -> None:
        await self.cache.aclose()
        if self.storage is not None:
            await self.storage.aclose()
        if self.engine is not None:
            await self.engine.aclose()


def make_stack(
    *,
    hier: bool = True,
    device_pages: int = 64,
    host_pages: int = 256,
    req_slots: int = 8,
    max_context: int = 1024,
    storage_id: str | None = None,
    write_policy: str = "write_through",
    config: SessionConfig | None = None,
    clock: Any = None,
    controller: dict[str, Any] | None = None,
) -> Stack:
    """A cache stack over small pools (float32, 2 layers, one head of 4, page of 4 tokens)."""
    size = device_pages * PS
    device_pool = MHATokenToKVPool(size, PS, torch.float32, 1, HEAD_DIM, LAYERS, "cpu")
    allocator = PagedTokenAllocator(size, PS)
    req_pool = ReqToTokenPool(req_slots, max_context)
    kw: dict[str, Any] = {} if clock is None else {"clock": clock}
    if not hier:
        inner = RadixCache(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PS)
        return Stack(device_pool, allocator, req_pool, inner, SessionAwareCache(inner, config, **kw))
    host_pool = MHATokenToKVPoolHost(device_pool, host_size_bytes=host_pages * PS * device_pool.bytes_per_token,
                                     page_size=PS, pin_memory=False)
    engine = CopyEngine(device_pool, host_pool)
    storage = create_async_storage("memory", None, store_id=storage_id) if storage_id else None
    ctrl = HiCacheController(
        copy_engine=engine, host_pool=host_pool, storage=storage,
        config=ControllerConfig(write_policy=write_policy, prefetch_threshold=0, prefetch_policy="wait_complete",
                                **(controller or {})),
    )
    inner = HiRadixCache(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PS,
                         host_pool=host_pool, controller=ctrl)
    cache = SessionAwareCache(inner, config, **kw)
    return Stack(device_pool, allocator, req_pool, inner, cache, host_pool, engine, ctrl, storage)


# ---------------------------------------------------------------------- a client

@dataclasses.dataclass
class TurnResult:
    req: Req
    prefix_len: int
    computed: int
    restored: bool
    admit: Any


class Conversation:
    """One client of a streaming session: keeps the history, sends turns, checks KV."""

    def __init__(self, stack: Stack, sid: str, seed: int = 0, *, streaming: bool = True) -> None:
        self.stack = stack
        self.sid = sid
        self.rng = random.Random(seed)
        self.history: list[int] = []
        self.turns = 0
        self.streaming = streaming

    def new_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def request(self, n_in: int) -> Req:
        tokens = self.history + self.new_tokens(n_in)
        self.turns += 1
        return Req(rid=f"{self.sid}-t{self.turns}", origin_input_ids=tokens,
                   session=Session(self.sid, streaming=self.streaming))

    async def begin(self, req: Req, *, retries: int = 0) -> Any:
        """Match (and re-match, as a scheduler that rejected the turn would), then admit."""
        cache = self.stack.cache
        for _ in range(1 + retries):
            cache.match_req(req)
        cache.start_prefetch(req)
        res = await cache.admit(req)
        n = int(req.prefix_indices.numel())
        assert kv_matches(self.stack.device_pool, req.prefix_indices, req.origin_input_ids[:n]), \
            f"{req.rid}: prefix KV differs from a full recompute"
        return res

    async def prefill(self, req: Req, *, chunk: int | None = None, upto: int | None = None) -> None:
        cache = self.stack.cache
        tokens = req.origin_input_ids
        start = int(req.prefix_indices.numel())
        end = len(tokens) if upto is None else upto
        step = chunk or (end - start) or 1
        pos = start
        while pos < end:
            b = min(end, pos + step)
            req.fill_ids = tokens[:b]
            slots = await cache.alloc_extend(req, b)
            assert slots is not None, f"{req.rid}: no memory for prefill"
            write_kv(self.stack.device_pool, slots[pos:b], tokens[pos:b], pos)
            req.kv_committed_len = b
            pos = b
            if pos < len(tokens):
                cache.cache_unfinished_req(req, chunked=True)
                # the request's prefix is now everything computed so far, in its own row
                row = self.stack.req_pool.req_to_token[req.req_pool_idx][:pos]
                assert torch.equal(req.prefix_indices, row), f"{req.rid}: prefix indices after a chunk"
                assert kv_matches(self.stack.device_pool, req.prefix_indices, tokens[:pos])

    async def decode(self, req: Req, n_out: int) -> None:
        cache = self.stack.cache
        for i in range(n_out):
            tok = self.rng.randrange(VOCAB)
            req.output_ids.append(tok)
            if i == n_out - 1:
                break  # the last sampled token's KV is computed by the next turn
            full = req.full_ids
            pos = len(full) - 1
            slots = await cache.alloc_extend(req, pos + 1)
            assert slots is not None, f"{req.rid}: no memory for decode"
            write_kv(self.stack.device_pool, slots[pos:pos + 1], [tok], pos)
            req.kv_committed_len = pos + 1
        req.fill_ids = req.full_ids

    def finish(self, req: Req) -> None:
        self.stack.cache.release_req(req)
        self.history = req.full_ids

    async def turn(self, n_in: int = 6, n_out: int = 3, *, chunk: int | None = None, retries: int = 0) -> TurnResult:
        req = self.request(n_in)
        res = await self.begin(req, retries=retries)
        prefix = int(req.prefix_indices.numel())
        await self.prefill(req, chunk=chunk)
        await self.decode(req, n_out)
        self.finish(req)
        self.check_slot()
        return TurnResult(req, prefix, len(req.origin_input_ids) - prefix, bool(getattr(res, "restored", False)), res)

    def check_slot(self) -> None:
        """The slot (if any) holds exactly the KV of the committed history."""
        slot = self.stack.cache.slots.get(self.sid)
        if slot is None or not slot.is_holding_kv:
            return
        n = slot.kv_committed_len
        assert slot.token_ids == self.history[:n]
        row = self.stack.req_pool.req_to_token[slot.req_pool_idx][:n]
        assert kv_matches(self.stack.device_pool, row, self.history[:n]), f"{self.sid}: slot KV is wrong"


def hold_backups(engine: CopyEngine) -> asyncio.Event:
    """Hold every device->host copy of ``engine`` until the returned event is set (a wedged
    copy stream)."""
    gate = asyncio.Event()
    real = engine.backup

    async def held(dev, host):  # type: ignore[no-untyped-def]
        await gate.wait()
        await real(dev, host)

    engine.backup = held  # type: ignore[method-assign]
    return gate
