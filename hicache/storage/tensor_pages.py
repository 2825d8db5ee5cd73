"""The v0 calls' tensor handling: single keys' KV pages read into or written from tensors.

:meth:`~hicache.storage.base.AsyncHiCacheStorage.batch_get` and ``batch_set`` (and ``get`` /
``set`` on top of them) validate the keys, open the storage and hand the tensors here: targets
are checked (tensors, one per key, no two sharing memory), host contiguous ones are read into
in place, the others through a staging tensor copied in off the loop, and a key without a
target is read whole; values are written as their bytes, each page chained to the one before.

Why functions over :class:`TensorPagesHost` and not methods of the storage class: like
:mod:`hicache.storage.pool_pages`, this needs only the guarded primitives and the counters,
so it does not import the storage class and adds nothing to a backend's namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hicache.storage import pages as page_io
from hicache.storage.offload import run_to_completion
from hicache.storage.pool_pages import overlapping
from hicache.storage.stats import StorageStats
from hicache.storage.types import PageKey, PoolName

__all__ = ["TensorPagesHost", "read_tensors", "write_tensors"]

logger = logging.getLogger("hicache.storage")

KV = PoolName.KV.value


class TensorPagesHost(Protocol):
    """What the v0 tensor calls use of their storage (an
    :class:`~hicache.storage.base.AsyncHiCacheStorage`)."""

    stats: StorageStats

    async def _guard(self, what: str, coro: Any, fallback: Any) -> Any: ...
    async def _read_bytes(self, page: PageKey) -> bytes | None: ...
    async def _read_guarded(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]: ...
    async def _write_guarded(
        self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]
    ) -> list[bool]: ...


async def read_tensors(
    host: TensorPagesHost, keys: list[str], target_locations: Sequence[torch.Tensor | None] | None
) -> list[torch.Tensor | None]:
    """The KV page of each (validated) key: read into its target tensor when there is one,
    else a new uint8 tensor; ``None`` on a miss."""
    targets = list(target_locations) if target_locations is not None else [None] * len(keys)
    if len(targets) != len(keys):
        host.stats.incr("invalid_requests")
        logger.error("batch_get: %d keys but %d target locations", len(keys), len(targets))
        return [None] * len(keys)
    out: list[torch.Tensor | None] = [None] * len(keys)
    wrong = [i for i, t in enumerate(targets) if t is not None and not isinstance(t, torch.Tensor)]
    if wrong:
        host.stats.incr("invalid_requests")
        logger.error(
            "batch_get: target_locations must be tensors (or None); got %s for key %d: a miss",
            type(targets[wrong[0]]).__name__, wrong[0],
        )
    direct = [i for i, t in enumerate(targets) if isinstance(t, torch.Tensor)]
    unusable = [i for i in direct if not _can_take_bytes(targets[i])]  # type: ignore[arg-type]
    if unusable:
        host.stats.incr("invalid_requests")
        logger.error(
            "batch_get: %d target(s) cannot take a page's bytes (no storage: meta or sparse, or "
            "elements sharing memory: expanded); those keys are misses", len(unusable),
        )
        direct = [i for i in direct if i not in unusable]
    clash = _aliased_targets([(i, targets[i]) for i in direct])  # type: ignore[misc]
    if clash:
        host.stats.incr("invalid_requests")
        logger.error("batch_get: %d target(s) share memory with an earlier key's target; those keys "
                     "are misses (two pages read into one place would both report a hit)", len(clash))
        direct = [i for i in direct if i not in clash]
    bufs: list[memoryview] = []
    stage: dict[int, torch.Tensor] = {}
    for i in direct:
        t = targets[i]
        assert t is not None
        if t.device.type == "cpu" and t.is_contiguous():
            bufs.append(page_io.as_bytes(t))
        else:
            stage[i] = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            bufs.append(page_io.as_bytes(stage[i]))
    got = await host._read_guarded([PageKey(keys[i], KV) for i in direct], bufs)
    commit = []
    for i, flag in zip(direct, got):
        if flag:
            t = targets[i]
            assert t is not None
            if i in stage:
                commit.append((t, stage[i]))
            out[i] = t
    if commit:
        # A device or strided target takes a real copy: off the loop, and finished before a
        # cancellation unwinds (the caller owns the target).
        await run_to_completion(_copy_into_targets, commit)
    for i, t in enumerate(targets):
        if t is None:
            payload = await host._guard("read", host._read_bytes(PageKey(keys[i], KV)), None)
            if payload is not None and not isinstance(payload, (bytes, bytearray, memoryview)):
                host.stats.incr("backend_errors")  # a backend bug: a miss, never the caller's TypeError
                logger.error("%s: _read_bytes answered %s, not bytes; a miss", type(host).__name__,
                             type(payload).__name__)
                payload = None
            host.stats.incr("read_pages")
            host.stats.incr("read_hits" if payload is not None else "read_misses")
            if payload is not None:
                host.stats.incr("read_bytes", len(payload))
                out[i] = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                          else torch.empty(0, dtype=torch.uint8))  # frombuffer refuses b""
    return out


async def write_tensors(host: TensorPagesHost, keys: list[str], vals: list[Any]) -> bool:
    """Store each tensor of ``vals`` as the KV page of its (validated) key, chained to the key
    before it; True only if every one was stored."""
    if len(vals) != len(keys) or any(not isinstance(v, torch.Tensor) for v in vals):
        host.stats.incr("invalid_requests")
        logger.error("batch_set: need one tensor per key (%d keys, %d values)", len(keys), len(vals))
        return False
    if any(not _has_bytes(v) for v in vals):
        host.stats.incr("invalid_requests")
        logger.error("batch_set: a value has no bytes to store (a meta or sparse tensor)")
        return False
    if any(v.device.type != "cpu" or not v.is_contiguous() for v in vals):  # type: ignore[union-attr]
        flat = await run_to_completion(_host_contiguous, vals)  # device copies: off the loop
    else:
        flat = [v.detach() for v in vals]  # type: ignore[union-attr]
    bufs = [page_io.as_bytes(v) for v in flat]
    chain: list[PageKey | None] = [None, *(PageKey(k, KV) for k in keys[:-1])]
    ok = await host._write_guarded([PageKey(k, KV) for k in keys], bufs, chain)
    return all(ok)


def _has_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor with memory: what a page's bytes can come from or go to
    (a meta tensor has no memory; a sparse one's bytes are not its values)."""
    return t.layout == torch.strided and t.device.type != "meta"


def _can_take_bytes(t: torch.Tensor) -> bool:
    """Whether a page's bytes can be read into ``t``: it has bytes, and no two of its elements
    share memory. An expanded (or overlapping ``as_strided``) target's do: a copy into it
    fails, or keeps only some of the page and would be answered as a hit.

    Why this test: with the dimensions in stride order, each stride clearing the span of the
    ones before it is enough for no overlap (every view of dense memory passes); a layout it
    refuses is a miss, never wrong bytes."""
    if not _has_bytes(t):
        return False
    span = 0
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= span:
            return False
        span += stride * (n - 1)
    return True


def _copy_into_targets(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for target, staged in pairs:
        target.copy_(staged.view(target.dtype).view(target.shape))


def _host_contiguous(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v.detach().cpu().contiguous() for v in values]


def _aliased_targets(targets: Sequence[tuple[int, torch.Tensor]]) -> set[int]:
    """Indices of v0 read targets whose memory overlaps an earlier one's
    (:func:`~hicache.storage.pool_pages.overlapping`); a strided view spans from its first
    element to its last, a conservative extent."""
    return overlapping(
        ((t.device.type, t.device.index), t.data_ptr(),
         t.data_ptr() + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size(), i)
        for i, t in targets if t.numel()
    )
