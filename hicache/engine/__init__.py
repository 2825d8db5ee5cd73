"""The reference engine: a small seeded transformer over hicache's device pool, greedy decoding,
and a no-cache recompute for verifying that cached KV gives the same answers.

- :mod:`hicache.engine.model` - :class:`ModelSpec`, :class:`TinyTransformer` (the forward pass)
- :mod:`hicache.engine.runner` - :class:`Engine` (requests over a cache), :func:`reference_generate`
- :mod:`hicache.engine.recompute` - :class:`RecomputeCache`, the no-reuse baseline "cache"
- :mod:`hicache.engine.worker` - :class:`ForwardWorker`, the forward thread (prefills first)
"""

from hicache.engine.model import KVPoolLike, ModelSpec, TinyTransformer, kv_dtype_of
from hicache.engine.recompute import OutOfKVSlotsError, RecomputeCache, RecomputeHandle
from hicache.engine.runner import CacheLike, Engine, GenerateResult, reference_generate, reference_logits
from hicache.engine.worker import DECODE, PREFILL, ForwardWorker

__all__ = [
    "DECODE",
    "PREFILL",
    "CacheLike",
    "Engine",
    "ForwardWorker",
    "GenerateResult",
    "KVPoolLike",
    "ModelSpec",
    "OutOfKVSlotsError",
    "RecomputeCache",
    "RecomputeHandle",
    "TinyTransformer",
    "kv_dtype_of",
    "reference_generate",
    "reference_logits",
]
