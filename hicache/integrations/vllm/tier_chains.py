"""Which page each stored chunk extends, so a bounded store can evict prompts tail first.

hicache's ``file`` backend evicts least-recently-used *leaves*: a page is a candidate only
once no stored page names it as parent, so a prompt's later pages go before its first ones and
what survives is always a usable prefix. vLLM's store jobs carry no parents, only the token
position of each key in its request (``ReqContext.get_offload_key_position``).
:class:`PrefixChains` remembers, per request and KV group, every key the tier has been shown
(lookups, touches, stores) by position; a key's parent is the one just before it.

No vLLM import: a request context is anything with ``req_id`` and
``get_offload_key_position(key)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from hicache.integrations.vllm.tier_keys import offload_key_group

__all__ = ["PrefixChains"]


class PrefixChains:
    """The offload keys each request has shown the tier, by group and token position.

    A page's parent is the request's key just before it in the same group (the prefix it
    extends); hicache's bounded file store uses parent links to evict a prefix's tail before its
    head. A key whose predecessor the tier never saw gets an earlier ancestor, or none.
    """

    def __init__(self) -> None:
        self._by_req: dict[str, dict[int, tuple[list[int], list[bytes]]]] = {}

    def record(self, keys: Iterable[bytes], ctx: Any) -> None:
        """Remember ``keys`` of request ``ctx`` (keys without a known position are skipped)."""
        groups = self._by_req.setdefault(ctx.req_id, {})
        for key in keys:
            pos = ctx.get_offload_key_position(key)
            if pos is None:
                continue
            positions, known = groups.setdefault(offload_key_group(key), ([], []))
            at = bisect.bisect_left(positions, pos)
            if at < len(positions) and positions[at] == pos:
                continue
            positions.insert(at, pos)
            known.insert(at, key)

    def parent(self, key: bytes, ctx: Any) -> bytes | None:
        """The closest earlier key of the same request and group, or ``None``."""
        pos = ctx.get_offload_key_position(key)
        entry = self._by_req.get(ctx.req_id, {}).get(offload_key_group(key))
        if pos is None or entry is None:
            return None
        positions, known = entry
        at = bisect.bisect_left(positions, pos)
        return known[at - 1] if at else None

    def forget(self, req_id: str) -> None:
        """Drop a finished request's keys."""
        self._by_req.pop(req_id, None)
