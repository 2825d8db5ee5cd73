"""Helpers shared by the tiered-cache tests."""

from __future__ import annotations

from hicache.prefix_cache import EvictParams
from hicache.replay import serve_request


async def host_only(stack, tokens: list[int], rid: str = "seed") -> None:  # type: ignore[no-untyped-def]
    """Serve ``tokens`` once, let the backups land, then demote everything to host."""
    await serve_request(stack, tokens, rid=rid)
    await stack.cache.drain()
    stack.cache.evict(EvictParams(num_tokens=10**6))
    assert stack.cache.total_size() == 0
