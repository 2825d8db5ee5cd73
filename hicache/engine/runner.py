"""``Engine``: greedy generation on a :class:`TinyTransformer` with hicache supplying the KV.

Request path (one coroutine per request, any number running concurrently on one loop)::

    handle = await cache.begin(rid, prompt)        # prefix match, load-back, prefetch
    prefill prompt[prefix_len:] on the worker      # layer i waits handle.wait_layer_sync(i)
    loop: slot = await cache.extend(handle, [t])    # decode one token at a time
          forward [t] on the worker
    await cache.commit(handle)                     # the KV becomes reusable

Why one worker thread: forwards of different requests must not run at once (they would fight
over the CPU's cores and over torch's intra-op pool, and two writers to one pool are a hazard),
and the event loop must never run a forward itself (it would stall the controller's copies and
every other request). One :class:`~hicache.engine.worker.ForwardWorker` gives both: forwards are
serialised, requests interleave between forwards, the loop stays free, and queued prefills run
before queued decode steps so time-to-first-token does not grow with the number of requests
decoding.

Why the layer waits happen on the worker (``wait_layer_sync``) rather than one ``await`` before
the prefill: layer 0 of a prefix loaded back from host is ready long before layer ``L-1``, so
computing layer 0 while later layers are still copying hides part of the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from hicache.engine.model import KVPoolLike, TinyTransformer
from hicache.engine.worker import DECODE, PREFILL, ForwardWorker
from hicache.memory.device_pool import MHATokenToKVPool
from hicache.storage.offload import wait_out
from hicache.tokens import token_ids_of

__all__ = ["CacheLike", "Engine", "GenerateResult", "reference_generate", "reference_logits"]

logger = logging.getLogger("hicache.engine")

T = TypeVar("T")


class HandleLike(Protocol):
    rid: str
    token_ids: list[int]
    prefix_len: int
    kv_indices: torch.Tensor
    hits: dict[str, int]

    def wait_layer_sync(self, layer: int) -> None: ...

    async def wait_loaded(self) -> None: ...


class CacheLike(Protocol):
    """The part of :class:`hicache.facade.HiCache` the engine uses (``RecomputeCache`` has it too)."""

    device_pool: Any

    async def begin(self, rid: str, token_ids: list[int], *, session_id: str | None = None) -> Any: ...

    async def extend(self, handle: Any, new_token_ids: list[int]) -> torch.Tensor: ...

    async def commit(self, handle: Any, *, finished: bool = True) -> None: ...

    async def abort(self, handle: Any) -> None: ...

    async def release_session(self, session_id: str) -> bool | None:
        """Whether the session existed; ``None`` from a cache that keeps no sessions (cannot tell)."""
        ...


@dataclass
class GenerateResult:
    """One finished request.

    ``ttft_s`` runs from ``arrival`` (the server's receipt of the request, so queueing counts)
    to the first token; ``prefill_tokens`` are the prompt tokens the cache did not hold, the rest
    (``cached_tokens``) came from the cache, split by tier in ``hits``. A prompt held whole is
    all cached (``prefill_tokens`` 0), though its last token is run again for its logits.
    """

    rid: str
    tokens: list[int]
    prompt_tokens: int
    prefill_tokens: int
    cached_tokens: int
    hits: dict[str, int]
    ttft_s: float
    latency_s: float
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    #: prompt tokens not reused, per reason (``hicache.observability.attribution.MissReason``)
    misses: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON-able fields (no tensors)."""
        return {
            "rid": self.rid,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "hits": dict(self.hits),
            "misses": dict(self.misses),
            "ttft_s": self.ttft_s,
            "latency_s": self.latency_s,
        }


def _timed(fn: Callable[..., T], device: torch.device) -> Callable[..., tuple[T, float]]:
    """``fn`` returning its result and the seconds it ran (timed on the worker thread, so
    queueing behind other forwards is not counted). On CUDA ``fn`` returns once its kernels
    are queued: the clock stops only after the device has run them, or the time is the
    launch's (near flat in the tokens: a learned rate many times the GPU's, every prefetch
    wait cut), and the server's loop, not this thread, waited for the work (``.item()``)."""

    def call(*args: Any, **kwargs: Any) -> tuple[T, float]:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - t0

    return call


def _argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits[-1]).item())


def _scratch_pool(model: TinyTransformer, tokens: int) -> tuple[MHATokenToKVPool, torch.Tensor]:
    """A private pool just big enough for one sequence, with slots ``0..tokens-1``."""
    s = model.spec
    page = 16
    size = max(page, -(-tokens // page) * page)
    pool = MHATokenToKVPool(size, page, model.kv_dtype, s.num_kv_heads, s.head_dim, s.num_layers, model.device)
    return pool, torch.arange(size, dtype=torch.int64, device=model.device)


def reference_logits(model: TinyTransformer, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[len, vocab]`` of every position, computed from scratch in a private pool."""
    pool, idx = _scratch_pool(model, len(token_ids))
    return model.forward(list(token_ids), 0, pool, idx, last_only=False)


def reference_generate(model: TinyTransformer, token_ids: Sequence[int], n: int) -> list[int]:
    """Greedy continuation of ``token_ids`` by ``n`` tokens with no cache: a private pool, a
    full prefill, then one decode step per token - exactly the steps :class:`Engine` takes on
    a cache miss, so this is the answer every cached run must reproduce."""
    if n <= 0:
        return []
    tokens = list(token_ids)
    pool, idx = _scratch_pool(model, len(tokens) + n)
    tok = _argmax(model.forward(tokens, 0, pool, idx))
    out = [tok]
    for _ in range(n - 1):
        tokens.append(tok)
        tok = _argmax(model.forward([tok], len(tokens) - 1, pool, idx))
        out.append(tok)
    return out


class Engine:
    """Runs greedy generation for concurrent requests over a shared cache and one model.

    ``cache`` is an entered :class:`hicache.facade.HiCache` (or a
    :class:`~hicache.engine.recompute.RecomputeCache` for a no-reuse baseline). The engine owns
    its worker thread; :meth:`aclose` waits for the queued forwards and stops it.
    """

    def __init__(self, cache: CacheLike, model: TinyTransformer) -> None:
        pool: KVPoolLike = cache.device_pool
        model.check_pool(pool)
        self.cache: CacheLike = cache
        self.model: TinyTransformer = model
        self._worker = ForwardWorker()
        self._closed = False
        self.forwards: int = 0

    # -- lifecycle
    async def aclose(self) -> None:
        """Stop the worker after the forward in flight (never abandons a half-written KV)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._worker.shutdown, True)

    async def run(self, fn: Callable[..., T], *args: Any, priority: int = DECODE, **kwargs: Any) -> T:
        """Run ``fn`` on the worker thread (``PREFILL`` priority jumps queued decode steps). If
        the caller is cancelled, wait for ``fn`` to finish before re-raising: the forward writes
        into slots the caller is about to give back. A ``fn`` still queued then is dropped
        instead (it has written nothing): a gone client's prefill must not cost the worker a
        forward and delay every request queued behind it."""
        if self._closed:
            raise RuntimeError("engine is closed")
        work = self._worker.submit(lambda: fn(*args, **kwargs), priority)
        fut = asyncio.wrap_future(work)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            work.cancel()  # only succeeds while it is queued: the worker then skips it
            await wait_out(fut)  # a running one ends first, however often the caller is cancelled
            raise

    # -- generation
    async def generate(
        self,
        rid: str,
        token_ids: Sequence[int],
        max_new_tokens: int,
        session_id: str | None = None,
        *,
        arrival: float | None = None,
        on_token: Callable[[int], None] | None = None,
        return_logits: bool = False,
    ) -> GenerateResult:
        """Greedy-decode ``max_new_tokens`` tokens after ``token_ids``.

        ``arrival`` (a ``time.perf_counter()`` value) is when the request arrived; TTFT is
        measured from it. ``on_token`` is called on the loop with each token as it is produced
        (streaming). On any error or cancellation the request is aborted, so no slot leaks.
        """
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        prompt = self._prompt_ids(token_ids)
        t0 = time.perf_counter() if arrival is None else arrival
        handle = await self.cache.begin(rid, prompt, session_id=session_id)
        try:
            result = await self._generate(handle, max_new_tokens, t0, on_token, return_logits)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.cache.abort(handle))
            raise
        await self.cache.commit(handle, finished=True)
        result.latency_s = time.perf_counter() - t0
        return result

    def _prompt_ids(self, token_ids: Sequence[int]) -> list[int]:
        """``token_ids`` as the model's token ids, checked before the cache is asked for anything.

        Why: ``int()`` on each id truncated a float (``[1.7, 2.2]`` was served as ``[1, 2]``,
        another prompt, without a word), and an id past the model's vocabulary only failed in
        the embedding lookup on the worker, after the cache had matched and allocated for it.
        The facade's own check (:func:`hicache.tokens.token_ids_of`) refuses a non-integer, the
        vocabulary bound is the model's: a ``TypeError``/``ValueError`` naming the bad id."""
        tokens = token_ids_of(token_ids)
        if not tokens:
            raise ValueError("generate needs at least one prompt token")
        vocab = self.model.spec.vocab_size
        if max(tokens) >= vocab:  # (in C; the id is found only to name it)
            bad = next(t for t in tokens if t >= vocab)
            raise ValueError(f"token_ids: token id {bad} is outside the model's vocabulary (vocab_size {vocab})")
        return tokens

    async def _generate(
        self,
        handle: Any,
        max_new_tokens: int,
        t0: float,
        on_token: Callable[[int], None] | None,
        return_logits: bool,
    ) -> GenerateResult:
        pool = self.cache.device_pool
        prompt = list(handle.token_ids)
        n_prompt = len(prompt)
        prefix = max(0, min(int(handle.prefix_len), n_prompt))
        # a fully cached prompt still needs its last position's logits: recompute that one token
        # without writing, because its slot belongs to the prefix cache and may be shared
        start = min(prefix, n_prompt - 1)
        write = prefix < n_prompt
        if prefix and not start:
            # a one-token prompt, fully cached: the prefill reads no prefix (so it waits for no
            # layer) but the first decode step reads it, and that forward does not wait
            await handle.wait_loaded()
        logits, compute_s = await self.run(
            _timed(self.model.forward, self.model.device),
            prompt[start:],
            start,
            pool,
            handle.kv_indices,
            wait_layer=handle.wait_layer_sync if start else None,
            write_kv=write,
            priority=PREFILL,
        )
        self.forwards += 1
        note = getattr(self.cache, "note_prefill", None)
        if note is not None and write and not (handle.hits.get("host") or handle.hits.get("storage")):
            # a prefill that waited for no load-back: its time is compute alone, the cost a
            # storage hit saves (the cache weighs prefetch waits against it)
            note(n_prompt - start, compute_s)
        tok = _argmax(logits)
        ttft = time.perf_counter() - t0
        result = GenerateResult(
            rid=handle.rid,
            tokens=[tok],
            prompt_tokens=n_prompt,
            prefill_tokens=n_prompt - prefix,
            cached_tokens=prefix,
            hits={k: int(v) for k, v in dict(handle.hits).items()},
            ttft_s=ttft,
            latency_s=ttft,
            first_logits=logits[-1].clone() if return_logits else None,
            misses=dict(getattr(getattr(handle, "attribution", None), "misses", None) or {}),
        )
        if on_token is not None:
            on_token(tok)
        for _ in range(max_new_tokens - 1):
            await self.cache.extend(handle, [tok])
            logits = await self.run(self.model.forward, [tok], len(handle.token_ids) - 1, pool, handle.kv_indices)
            self.forwards += 1
            tok = _argmax(logits)
            result.tokens.append(tok)
            if on_token is not None:
                on_token(tok)
        return result

    def reference_generate(self, token_ids: Sequence[int], n: int) -> list[int]:
        """Blocking full recompute (no cache), for verification; see :func:`reference_generate`.
        From a coroutine use ``await engine.run(engine.reference_generate, ...)``."""
        return reference_generate(self.model, token_ids, n)
