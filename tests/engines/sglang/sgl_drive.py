"""Driving SGLang's controller storage paths the way its scheduler does: ``_page_backup`` for a
write, ``_storage_hit_query`` then ``_page_transfer`` for a prefetch, and an independent
reader of K/V per (layer, token) in each host layout to check bytes."""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.utils import get_storage_hash_str


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def backup(ctl: Any, token_ids: list[int], host_indices: torch.Tensor) -> int:
    """SGLang's backup of ``token_ids`` held at ``host_indices``; tokens written."""
    keys = get_storage_hash_str(token_ids, None, page_size=ctl.page_size)
    op = StorageOperation(host_indices, token_ids, hash_value=keys, prefix_keys=[])
    ctl._page_backup(op)
    return op.completed_tokens


def prefetch(ctl: Any, token_ids: list[int], rid: str = "r") -> tuple[int, torch.Tensor | None]:
    """SGLang's hit query, then the transfer into freshly allocated host pages; returns the
    completed tokens and the host indices they landed at."""
    op = PrefetchOperation(CacheRequestHandle(rid, 0), token_ids, None, prefix_keys=[])
    hashes, hit_tokens = ctl._storage_hit_query(op)
    if not hit_tokens:
        return 0, None
    op.hash_value = hashes[: hit_tokens // ctl.page_size]
    op.host_indices = ctl.mem_pool_host.alloc(hit_tokens)
    assert op.host_indices is not None, "host pool full"
    ctl._page_transfer(op)
    batches = -(-len(op.hash_value) // STORAGE_BATCH_SIZE)
    return _completed_tokens(ctl, batches), op.host_indices


def _completed_tokens(ctl: Any, batches: int, timeout: float = 30.0) -> int:
    """What SGLang's transfer reported: the last per-batch ack's completed tokens. The acks go
    through the controller's own sync thread (prefetch_sync_queue -> ack_prefetch_queue)."""
    done, seen = 0, 0
    deadline = time.monotonic() + timeout
    # With the sync thread running, every ack ends up in ack_prefetch_queue: block on that one
    # alone, as SGLang's scheduler reads it (polling both queues in turn added up to 10 ms of
    # waiting to each prefetch, the same for every backend, which a benchmark must not time).
    sync = getattr(ctl, "prefetch_sync_thread", None)
    queues = (ctl.ack_prefetch_queue,) if sync is not None and sync.is_alive() else (ctl.prefetch_sync_queue, ctl.ack_prefetch_queue)
    wait = 0.5 if len(queues) == 1 else 0.01
    while seen < batches and time.monotonic() < deadline:
        for q in queues:
            try:
                ack = q.get(timeout=min(wait, max(deadline - time.monotonic(), 0.001)))
            except Empty:
                continue
            if getattr(ack, "completed_tokens", None) is not None:
                done, seen = ack.completed_tokens, seen + 1
    assert seen == batches, f"{seen} of {batches} transfer acks arrived"
    return done


def token_kv(host: Any, layer: int, token: int) -> torch.Tensor:
    """K and V (MHA: (2, H, D)) or the latent (MLA: (1, 1, D)) of one token in one layer,
    read straight from ``kv_buffer`` by the layout's definition in SGLang's source."""
    kv, ps, lay = host.kv_buffer, host.page_size, host.layout
    p, o = divmod(token, ps)
    if "MLA" not in type(host).__name__:
        if lay == "layer_first":
            return kv[:, layer, token]
        if lay == "page_first":
            return kv[:, token, layer]
        if lay == "page_first_direct":
            return kv[:, p, layer, o]
        if lay == "page_head":
            return kv[:, p, :, o, layer]
        if lay == "page_unified":  # (P, head group, L, 2, ps, heads in group, D)
            return kv[p, :, layer, :, o].transpose(0, 1).reshape(2, -1, kv.shape[-1])
    if lay == "layer_first":
        return kv[layer, token].unsqueeze(0)
    if lay == "page_first":
        return kv[token, layer].unsqueeze(0)
    if lay == "page_first_direct":
        return kv[p, layer, o].unsqueeze(0)
    if lay == "page_unified":  # (P, L, ps, D)
        return kv[p, layer, o].view(1, 1, -1)
    raise AssertionError(f"no reader for {lay}")


def pages_equal(a: Any, a_idx: torch.Tensor, b: Any, b_idx: torch.Tensor, layers: int) -> bool:
    for ta, tb in zip(a_idx.tolist(), b_idx.tolist()):
        for layer in range(layers):
            if not torch.equal(token_kv(a, layer, ta), token_kv(b, layer, tb)):
                return False
    return True


def write_then_read(writer: Any, w_host: Any, reader: Any, r_host: Any, pages: int, layers: int, seed: int = 3) -> None:
    """One server backs ``pages`` pages up, another prefetches them: all of them, same K/V."""
    toks = tokens(writer.page_size * pages, seed=seed)
    src = writer.mem_pool_host.alloc(len(toks))
    assert backup(writer, toks, src) == len(toks)
    done, dst = prefetch(reader, toks)
    assert done == len(toks)
    assert pages_equal(w_host, src, r_host, dst, layers)
