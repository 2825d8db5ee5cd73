"""Engine test helpers: small models and a device-only prefix-reusing cache double.

``DevicePrefixCache`` exists so the engine's cached-prefix path (``prefix_len > 0``, layer waits,
a fully cached prompt) is tested on its own, independent of the real facade: it reuses the slots
of earlier committed sequences for the longest page-aligned common prefix, and never evicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.config import HiCacheConfig
from hicache.engine import ModelSpec
from hicache.memory import MHATokenToKVPool, PagedTokenAllocator

PAGE = 16


def small_spec(**kw) -> ModelSpec:
    base = dict(vocab_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                intermediate_size=128, max_positions=2048, seed=7)
    base.update(kw)
    return ModelSpec(**base)


def small_config(size_tokens: int = 4096) -> HiCacheConfig:
    return HiCacheConfig.model_validate({
        "model": {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
        "device": {"device": "cpu", "size_tokens": size_tokens, "page_size": PAGE},
        "storage": {"backend": None},
    })


def pool_for(spec: ModelSpec, size: int = 4096) -> MHATokenToKVPool:
    return MHATokenToKVPool(size, PAGE, getattr(torch, spec.kv_dtype), spec.num_kv_heads, spec.head_dim,
                            spec.num_layers, "cpu")


@dataclass(eq=False)
class FakeHandle:
    rid: str
    session_id: str | None
    token_ids: list[int]
    prefix_len: int
    kv_indices: torch.Tensor
    owned: torch.Tensor
    hits: dict[str, int] = field(default_factory=dict)
    waited: list[int] = field(default_factory=list)

    def wait_layer_sync(self, layer: int) -> None:
        self.waited.append(layer)

    async def wait_layer(self, layer: int) -> None:
        self.waited.append(layer)

    async def wait_loaded(self) -> None:
        return None  # the prefix KV is on device already


class DevicePrefixCache:
    """Reuses committed KV by longest page-aligned common prefix (device tier only)."""

    def __init__(self, spec: ModelSpec, size: int = 4096) -> None:
        self.device_pool = pool_for(spec, size)
        self.alloc = PagedTokenAllocator(size, PAGE)
        self.committed: list[tuple[list[int], torch.Tensor]] = []
        self.aborted = 0
        self.live = 0

    def _match(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        best, slots = 0, torch.zeros(0, dtype=torch.int64)
        for toks, kv in self.committed:
            n = 0
            for a, b in zip(toks, tokens):
                if a != b:
                    break
                n += 1
            n = n // PAGE * PAGE
            if n > best:
                best, slots = n, kv[:n]
        return best, slots

    async def begin(self, rid, token_ids, *, session_id=None):
        prefix, slots = self._match(token_ids)
        rest = len(token_ids) - prefix
        owned = self.alloc.alloc(-(-(rest + 64) // PAGE) * PAGE)
        kv = torch.cat([slots, owned[:rest]])
        self.live += 1
        return FakeHandle(rid, session_id, list(token_ids), prefix, kv, owned, {"device": prefix, "host": 0, "storage": 0})

    async def extend(self, handle, new):
        n = len(handle.token_ids)
        handle.token_ids += new
        handle.kv_indices = torch.cat([handle.kv_indices, handle.owned[n - handle.prefix_len: n - handle.prefix_len + len(new)]])
        return handle.kv_indices[n:]

    async def commit(self, handle, *, finished=True):
        self.committed.append((list(handle.token_ids), handle.kv_indices.clone()))
        self.live -= 1

    async def abort(self, handle):
        self.alloc.free(handle.owned)
        self.aborted += 1
        self.live -= 1

    async def release_session(self, session_id):
        pass


def prompt_of(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
