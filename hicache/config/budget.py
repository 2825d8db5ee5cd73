"""What a deployment config would allocate, checked against the machine before torch is asked.

Why: an absurd size (``device.max_context_len = 1e9``) otherwise reaches torch as one raw
``RuntimeError`` about a 512 GB allocation, with nothing naming the field. Here every pool's
bytes are computed from the fields that size it, and a pool larger than the memory it lives in
is a :class:`~hicache.errors.ConfigError` that names those fields and the bytes needed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from hicache.errors import ConfigError

__all__ = ["MemoryNeed", "check_memory", "memory_needs", "system_memory_bytes"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """One allocation: what it is, where it lives, the fields that size it, its bytes."""

    what: str
    where: str  # "device" or "host"
    fields: str
    nbytes: int


def system_memory_bytes() -> int | None:
    """Physical memory of this machine (``None`` where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def memory_needs(config: Any, *, page_nbytes: int, host_pages: int, device_is_host: bool) -> list[MemoryNeed]:
    """The big allocations of ``config`` (a ``HiCacheConfig``)."""
    d = config.device
    dev = "host" if device_is_host else "device"
    needs = [
        MemoryNeed("the device KV pool", dev, f"device.size_tokens ({d.size_tokens})",
                   d.size_tokens // d.page_size * page_nbytes),
        MemoryNeed("the request table (one int64 per token position)", dev,
                   f"device.max_requests ({d.max_requests}) x device.max_context_len ({d.max_context_len})",
                   d.max_requests * d.max_context_len * 8),
    ]
    src = f"host.size_bytes ({config.host.size_bytes})" if config.host.size_bytes else f"host.ratio ({config.host.ratio})"
    needs.append(MemoryNeed("the host KV pool", "host", src, host_pages * page_nbytes))
    for i, pool in enumerate(config.extra_pools):
        slot = sum(math.prod(shape) for shape in pool.state_shapes.values()) * _ITEMSIZE.get(pool.dtype, 4)
        needs.append(MemoryNeed(f"extra pool {pool.name!r} (device)", dev,
                                f"extra_pools[{i}].slots ({pool.slots}) x state_shapes", pool.slots * slot))
        needs.append(MemoryNeed(f"extra pool {pool.name!r} (host)", "host",
                                f"extra_pools[{i}].host_slots ({pool.host_slots}) x state_shapes", pool.host_slots * slot))
    return needs


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def check_memory(needs: list[MemoryNeed], *, host_bytes: int | None, device_bytes: int | None) -> None:
    """Raise :class:`ConfigError` when one allocation, or all of one kind together, cannot fit
    the memory it lives in (limits that are ``None`` are not checked)."""
    for where, limit in (("host", host_bytes), ("device", device_bytes)):
        if limit is None:
            continue
        mine = [n for n in needs if n.where == where]
        total = sum(n.nbytes for n in mine)
        over = [n for n in mine if n.nbytes > limit]
        if over:
            raise ConfigError("; ".join(f"{n.fields} needs {_gib(n.nbytes)} for {n.what}" for n in over)
                              + f"; this machine has {_gib(limit)} of {where} memory")
        if total > limit:
            parts = ", ".join(f"{n.what} {_gib(n.nbytes)} ({n.fields})" for n in mine if n.nbytes)
            raise ConfigError(f"the pools need {_gib(total)} of {where} memory together, more than the "
                              f"{_gib(limit)} this machine has: {parts}")
