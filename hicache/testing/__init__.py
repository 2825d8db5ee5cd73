"""Test helpers shipped with hicache, for our backends and third-party ones.

``StoreTests`` is the storage conformance suite: subclass it in a backend's test module and
supply ``store_factory`` and ``raw_payload`` (see its docstring). ``inject_load_faults`` makes
a copy engine's loads slow or failing. ``eventually`` waits for a condition with a deadline.
"""

from hicache.testing.faults import inject_load_faults
from hicache.testing.pools import ArrayHostPool, UncheckedHostPool
from hicache.testing.store_tests import StoreTests, reference_v2_hits
from hicache.testing.waiting import eventually

__all__ = ["ArrayHostPool", "StoreTests", "eventually", "inject_load_faults", "reference_v2_hits", "UncheckedHostPool"]
