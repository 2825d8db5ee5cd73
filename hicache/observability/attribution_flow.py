"""The glue between the request flow of a tiered radix cache and the :class:`Attributor`.

Why a separate object the tree holds (``cache.explain_admit``): :class:`RequestFlow` calls two
hooks, one before it waits for the prefetch (to keep the prefetch's keys and op, which the
wait hands back and forgets) and one after it admitted the request, and knows nothing else
about attribution. Everything here is bookkeeping of what the flow already computed; an error
in it is logged and the request goes on without an attribution, never fails.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.errors import ChainGoneError, quoted
from hicache.observability.attribution import Attributor, PrefetchView, RequestAttribution

__all__ = ["TreeAttribution"]

logger = logging.getLogger("hicache.attribution")


class TreeAttribution:
    """The two hooks :class:`~hicache.prefix_cache.facade.RequestFlow` calls on ``cache.explain_admit``."""

    def __init__(self, cache: Any, attributor: Attributor) -> None:
        self.cache = cache
        self.attributor = attributor

    def before_wait(self, req: Any) -> PrefetchView | None:
        """The request's prefetch (keys and op) before admit waits for it and drops it."""
        try:
            view = self.cache.prefetch_view(req.rid)
            if view is None:
                return None
            start, keys, op = view
            return PrefetchView(start // self.attributor.page_size, keys, op)
        except Exception:  # noqa: BLE001 - attribution must never fail a request
            logger.exception("reading the prefetch of request %s failed", quoted(req.rid))
            return None

    def _prior_hash(self, req: Any, m: Any) -> str | None:
        """The chain hash after the match (a match leaves it to whoever needs it)."""
        if m.storage_prior_hash is not None:
            return m.storage_prior_hash
        return self.cache.storage_prior_hash(m.last_host_node, req.extra_key)

    def storage_state(self) -> str:
        ctl = self.cache.controller
        if not ctl.has_storage:
            return "none"
        return "up" if ctl.health.up else "down"

    def after_admit(self, req: Any, pending: PrefetchView | None, m: Any,
                    device: int, host: int, storage: int) -> RequestAttribution | None:
        """The admitted request's attribution (counted now unless the caller explains it)."""
        try:
            return self.attributor.attribute(
                rid=req.rid,
                tokens=req.fill_ids or req.origin_input_ids,
                hits={"device": device, "host": host, "storage": storage},
                held=m.device_hit_length + m.host_hit_length,
                prior_hash=self._prior_hash(req, m),
                prefetch=pending,
                storage=self.storage_state(),
                record=not req.explain_misses,
            )
        except ChainGoneError:  # its match ended on a node that left the tree: no keys to explain by
            return None
        except Exception:  # noqa: BLE001 - attribution must never fail an admitted request
            logger.exception("attributing request %s failed", quoted(req.rid))
            return None
