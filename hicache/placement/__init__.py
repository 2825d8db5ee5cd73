"""Placement: per tier, which pages to keep and which to admit.

Device eviction order stays :mod:`hicache.prefix_cache.policy` (the ``eviction_policy`` knob). A
:class:`PlacementPolicy` decides the rest, through a few hooks the tree calls:

* which host-only leaf the host tier evicts first (:meth:`PlacementPolicy.host_key`);
* how many of a node's pages may be written to storage now (:meth:`PlacementPolicy.storage_pages`);
* what the tree tells it: a node created by an insert, a node evicted from host.

Policies (``cache.placement``):

* ``lru`` - today's behaviour, bit for bit: host evicts least recently used leaves, every page
  backed up to host is written to storage (write-through).
* ``reuse`` - storage admission only: a page is written once it proved reuse (hit while on host,
  or came back after leaving host unwritten: a ghost hit). Host stays LRU.
* ``tiered`` - ``reuse``, plus host keeps the pages storage does not hold (it evicts pages that
  are already in storage first, so the two tiers hold different pages), plus early admission of
  the body of long prompts (documents, agent contexts: costly to recompute, and reused), plus
  storage eviction by the tree: leaves of the stored subtree, least recently used in any tier
  first (:class:`StoredPages`, deleted through the backend's ``batch_delete``).

See ``docs/placement.md`` for why each choice should hold beyond one trace.
"""

from hicache.placement.base import PlacementPolicy, default_victim_write_limit, node_end_tokens
from hicache.placement.ghost import GhostList
from hicache.placement.lru import LruPlacement
from hicache.placement.registry import PLACEMENT_POLICIES, make_placement
from hicache.placement.stored import StoredPages
from hicache.placement.tiered import ReusePlacement, TieredPlacement

__all__ = [
    "GhostList",
    "LruPlacement",
    "PLACEMENT_POLICIES",
    "PlacementPolicy",
    "default_victim_write_limit",
    "ReusePlacement",
    "StoredPages",
    "TieredPlacement",
    "make_placement",
    "node_end_tokens",
]
