"""KV events for cache-aware routers, in vLLM's schema, from every tier.

* :mod:`~hicache.events.schema` - the wire classes (vLLM's ``KVEventBatch``, ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``) and msgpack encoding;
* :mod:`~hicache.events.convert` - tier changes as events, page keys as block hashes;
* :mod:`~hicache.events.publisher` - the publisher thread: ZMQ PUB with sequence numbers, a
  replay ROUTER, in-process streams; bounded, never blocking;
* :mod:`~hicache.events.stream` - the in-process async iterator;
* :mod:`~hicache.events.service` - a stack's hub feeding a publisher;
* :mod:`~hicache.events.log` - ``take_events()`` for engines that poll;
* :mod:`~hicache.events.subscriber` - a consumer with gap detection and replay (``hicache events``).

See ``docs/kv-events.md``.
"""

from hicache.events.convert import block_hash, to_event
from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "block_hash",
    "decode_batch",
    "encode_batch",
    "to_event",
]
