"""Memory tiers: device KV pools (L1), pinned host pools (L2), and the copies between them.

* :mod:`~hicache.memory.allocator` - paged token-slot allocation with misuse detection
* :mod:`~hicache.memory.req_pool` - the request-to-token table
* :mod:`~hicache.memory.device_pool` - MHA/GQA and MLA device KV pools
* :mod:`~hicache.memory.layouts` - host layouts and the canonical flat page format
* :mod:`~hicache.memory.host_pool` - host KV pools implementing the storage page protocol
* :mod:`~hicache.memory.mamba` - per-request recurrent state pools for hybrid models
* :mod:`~hicache.memory.copy_engine` - backup/load off the event loop, layer by layer
* :mod:`~hicache.memory.transfer` - copy plans (runs of units); the CUDA and numpy/torch copies
* :mod:`~hicache.memory.spans` - CPU copies as byte-span tables for the native span copier
* :mod:`~hicache.memory.slots` - copying and joining slot index tensors on the event loop
* :mod:`~hicache.memory.layer_counter` - per-layer completion for asyncio and threads

Typical wiring::

    dev = MHATokenToKVPool(size, page_size, torch.bfloat16, head_num, head_dim, layer_num,
                           device_for(None))
    host = MHATokenToKVPoolHost(dev, host_to_device_ratio=4.0, page_size=page_size)
    engine = CopyEngine(dev, host)
    await engine.backup(device_indices, host_indices)        # all layers, off the loop
    handle = engine.load(host_indices, device_indices)       # returns at once
    await handle.counter.wait(0)                             # layer 0 is on the device
    storage.register_mem_pool_host(host)                     # page protocol for L3

Token indices everywhere are int64 tensors covering whole pages; the allocators hand them out.
"""

from hicache.memory.allocator import AllocatorError, PagedTokenAllocator
from hicache.memory.copy_engine import CopyEngine, LayerLoadHandle
from hicache.memory.device import device_for
from hicache.memory.device_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool
from hicache.memory.host_pool import HostKVPool, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hicache.memory.layer_counter import LayerDoneCounter
from hicache.memory.layouts import LAYER_FIRST, LAYOUTS, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_FORMAT
from hicache.memory.mamba import MambaHostPool, MambaStatePool
from hicache.memory.req_pool import ReqToTokenPool

__all__ = [
    "AllocatorError",
    "CopyEngine",
    "HostKVPool",
    "KVPool",
    "LAYER_FIRST",
    "LAYOUTS",
    "LayerDoneCounter",
    "LayerLoadHandle",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolHost",
    "MambaHostPool",
    "MambaStatePool",
    "PAGE_FIRST",
    "PAGE_FIRST_DIRECT",
    "PAGE_FORMAT",
    "PagedTokenAllocator",
    "ReqToTokenPool",
    "device_for",
]
