"""What the cache tells the outside world: tier changes, metrics, per-request attribution.

Everything here is optional to a caller: the tiers report what changed to a
:class:`~hicache.observability.tier_events.TierChangeHub`, and each consumer (the KV-event
publisher for routers, the attribution that explains misses, metrics) subscribes to it, so no
tier knows who listens.
"""

from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub

__all__ = ["ChangeKind", "Tier", "TierChange", "TierChangeHub"]
