"""Host->device load-back of matched prefixes: the loads in flight and their handles.

A node gets its device slots when its load *starts* (so a match during the load sees a device
hit), and the tree keeps the load's node locked until the copy ends: on success the slots are
simply valid, on failure every node holding slots of the load is dropped from the device again.
Whoever reuses slots a load still writes waits for it (:meth:`LoadBacks.loads_in_flight`), and
the engine's forward pass waits on the per-layer handles (:meth:`LoadBacks.ready_to_load_host_cache`).

Why a collaborator the cache owns (``cache.load_backs``) and not a part of the cache class: the
loads in flight, their completion futures and the handles not yet taken are state of their own,
reset together; the load needs only a narrow slice of the tree, spelled out as
:class:`LoadHost`, so this module does not import the cache class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Protocol

import torch

from hicache.controller.controller import HiCacheController
from hicache.errors import CacheClosedError
from hicache.prefix_cache.facade import LoadBack
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.types import EvictParams, EvictResult, InitLoadBackParams

__all__ = ["LoadBacks", "LoadHost"]

logger = logging.getLogger("hicache.controller")


@dataclasses.dataclass(eq=False)
class _Load:
    node: TreeNode
    chain: list[TreeNode]
    done: asyncio.Future[bool] | None
    dev: torch.Tensor | None = None  # the device slots being written (whatever splits happen)


def _load_running(handle: Any) -> bool:
    """Whether a load handle's copy is still running (one that failed has ended too)."""
    return not handle.counter.ended()


class LoadHost(Protocol):
    """What :class:`LoadBacks` uses of its cache (a :class:`~hicache.prefix_cache.HiRadixCache`)."""

    root_node: TreeNode
    disable: bool
    controller: HiCacheController
    config: Any
    metrics: Any
    token_to_kv_pool_allocator: Any

    def inc_lock_ref(self, node: Any) -> Any: ...
    def dec_lock_ref(self, node: Any) -> Any: ...
    def evict(self, params: EvictParams | int) -> EvictResult: ...
    def _add_device(self, node: TreeNode, value: torch.Tensor) -> None: ...
    def _drop_device(self, node: TreeNode) -> torch.Tensor: ...
    def _free(self, indices: torch.Tensor) -> None: ...
    def _free_host(self, indices: torch.Tensor) -> None: ...
    def _empty(self) -> torch.Tensor: ...


class LoadBacks:
    """The host->device loads of one cache: started, in flight, and their handles."""

    def __init__(self, cache: LoadHost) -> None:
        self.cache = cache
        #: bumped by :meth:`reset`: a load of a dropped tree ends without touching the new one
        self.generation = 0
        self.loads: list[_Load] = []
        #: handles started since :meth:`ready_to_load_host_cache` last took them
        self.new_handles: list[Any] = []
        #: nodes of dropped trees whose host pages a load still in flight reads, with how many
        #: such loads (see :meth:`reset`)
        self._dropped_reads: dict[TreeNode, int] = {}

    def reset(self) -> None:
        """The tree was dropped: loads still in flight complete into nothing, and whoever waits
        for one must not wait forever.

        The host pages such a load reads stay allocated until it ends, and its completion
        frees them (:meth:`_free_dropped_reads`): the tree's ``reset`` frees every other host
        page of the dropped tree, and pages freed under a running load were handed to the new
        tree's backups, whose writes the load then copied to the device as KV."""
        self.generation += 1
        if self.loads:
            # the device slots such a load writes go back with the caller's cleared allocator,
            # and nothing here can stop the copy: said, so a flush mid-load is never silent
            logger.warning("reset() while %d host->device load(s) run: they still write their device "
                           "slots, which the cleared allocator may hand out; drain() before a flush",
                           len(self.loads))
        for load in self.loads:
            for c in load.chain:
                self._dropped_reads[c] = self._dropped_reads.get(c, 0) + 1
            if load.done is not None and not load.done.done():
                load.done.set_result(False)  # whoever waits for it must not wait forever
        self.loads = []
        self.new_handles = []

    def reads_dropped_host(self, node: TreeNode) -> bool:
        """Whether a load of a dropped tree still reads ``node``'s host pages (then that load's
        end frees them, not the tree's ``reset`` nor the end of another copy of the node)."""
        return node in self._dropped_reads

    def _free_dropped_reads(self, load: _Load) -> None:
        """A load of a dropped tree ended: free the host pages of its chain that no other copy
        in flight still holds (a storage write's end frees those, see the tree's
        ``_release_old``)."""
        for c in load.chain:
            left = self._dropped_reads.get(c, 0) - 1
            if left > 0:
                self._dropped_reads[c] = left
                continue
            self._dropped_reads.pop(c, None)
            if c.host_value is not None and c.backup_op is None and c.storage_op is None:
                self.cache._free_host(c.host_value)
                c.host_value = None

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Allocate device slots for the host part of a match and start loading it layer by
        layer. All or nothing: when the chain exceeds ``mem_quota`` or device memory cannot be
        found, nothing is loaded. Returns ``(new device indices, new deepest device node)``;
        :meth:`ready_to_load_host_cache` hands out the load handles (per-layer counters)."""
        cache = self.cache
        load = self.start_load_back(params)
        if load is not None and load.started:
            return load.indices, load.node
        if load is not None:
            cache.metrics.incr("load_back_skipped")
        node = params.node
        if node is None and params.req is not None:
            node = params.req.last_host_node
        if node is None:
            return cache._empty(), cache.root_node
        return cache._empty(), self._device_prefix_end(node)

    def _device_prefix_end(self, node: TreeNode) -> TreeNode:
        """The deepest node on ``node``'s path whose whole path from the root is on device.

        Usually the first device ancestor; but a device node can sit below a host-only one
        (a failed load-back dropped the parent's device copy after an insert hung the child
        under it), and its slots do not continue any device prefix."""
        root = self.cache.root_node
        path: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n is not root:
            path.append(n)
            n = n.parent
        end = root
        for n in reversed(path):
            if n.value is None:
                break
            end = n
        return end

    def start_load_back(self, params: InitLoadBackParams) -> LoadBack | None:
        """:meth:`init_load_back` returning the started load; ``None`` when there is nothing
        to load (or it is below the threshold, or over the quota). When device memory cannot be
        found even by eviction, the result has not started and says how much it lacked
        (``lacking``): the caller may make room asynchronously and try again."""
        cache = self.cache
        root = cache.root_node
        node = params.node
        if node is None and params.req is not None:
            node = params.req.last_host_node
        if node is None or node is root or cache.disable:
            return None
        chain: list[TreeNode] = []
        n = node
        while n is not root and n.value is None:
            chain.append(n)
            n = n.parent
        anchor = n
        if anchor is not root and self._device_prefix_end(anchor) is not anchor:
            # the chain would continue device slots that do not start at the root: loading it
            # would hand the request KV at the wrong positions; it recomputes instead
            cache.metrics.incr("load_back_skipped")
            return None
        chain.reverse()
        cut = next((i for i, c in enumerate(chain) if not c.backuped), len(chain))
        if cut < len(chain):
            chain = chain[:cut]
            node = chain[-1] if chain else anchor
        if not chain:
            return None
        total = sum(len(c.key) for c in chain)
        if total < cache.config.load_back_threshold or (params.mem_quota is not None and total > params.mem_quota):
            cache.metrics.incr("load_back_skipped")
            return None
        cache.inc_lock_ref(node)  # keeps the chain on host and the prefix on device meanwhile
        alloc = cache.token_to_kv_pool_allocator
        dev = alloc.alloc(total)
        if dev is None:
            cache.evict(total - alloc.available_size())
            dev = alloc.alloc(total)
        if dev is None:
            cache.dec_lock_ref(node)
            return LoadBack(cache._empty(), anchor, lacking=total)
        host = torch.cat([c.host_value for c in chain])  # type: ignore[misc]
        off = 0
        for c in chain:
            cache._add_device(c, dev[off : off + len(c.key)])
            off += len(c.key)
        gen = self.generation
        try:
            fut = asyncio.get_running_loop().create_future()
        except RuntimeError:
            fut = None
        load = _Load(node, chain, fut, dev)
        try:
            handle = cache.controller.start_load(host, dev, lambda ok: self._load_done(gen, load, ok))
        except CacheClosedError:
            # closing or closed: a request admitted while the cache closes (its caller gets
            # CacheClosedError next); nothing failed, so nothing is logged as an error
            logger.debug("load-back not started: the controller is closed")
            self._load_done(gen, load, False)
            return None
        except Exception:  # noqa: BLE001 - fall back to compute
            logger.exception("load-back could not start")
            self._load_done(gen, load, False)
            return None
        self.loads.append(load)
        # a caller that waits on the returned handle (the facade, the replay) never takes it
        # through ready_to_load_host_cache: handles whose load ended go, or the list grows with
        # every load-back of a long-running server
        self.new_handles = [h for h in self.new_handles if _load_running(h)]
        self.new_handles.append(handle)
        return LoadBack(dev, node, fut, handle)

    def _load_done(self, gen: int, load: _Load, ok: bool) -> None:
        if gen != self.generation:  # the tree was reset meanwhile: nothing to update
            self._free_dropped_reads(load)
            if load.done is not None and not load.done.done():
                load.done.set_result(False)
            return
        if load in self.loads:
            self.loads.remove(load)
        cache = self.cache
        if not ok:
            # Drop every node holding slots of this load, deepest first. Walk up from the
            # load's node rather than over ``load.chain``: a match or insert may have split a
            # chain node meanwhile, and the new upper half (not in the chain) holds loaded slots
            # too; leaving it would serve unloaded KV as a device hit.
            root = cache.root_node
            n: TreeNode | None = load.node
            while (
                n is not None and n is not root and n.value is not None
                and load.dev is not None and bool(torch.isin(n.value, load.dev).all())
            ):
                cache._free(cache._drop_device(n))
                n = n.parent
        cache.dec_lock_ref(load.node)
        if load.done is not None and not load.done.done():
            load.done.set_result(ok)

    def loads_in_flight(self, indices: torch.Tensor) -> list[asyncio.Future[bool]]:
        """Completion futures of the host->device loads still writing into any of the device
        slots ``indices``. A node gets its device slots when its load *starts*, so a match
        during the load sees them as a device hit: whoever reuses them must wait for these."""
        if not self.loads or indices is None or indices.numel() == 0:
            return []
        out: list[asyncio.Future[bool]] = []
        for load in self.loads:
            if load.done is None or load.done.done() or load.dev is None:
                continue
            if bool(torch.isin(indices, load.dev.to(indices.device)).any()):
                out.append(load.done)
        return out

    async def wait_loads(self, indices: torch.Tensor) -> bool:
        """Wait until no load writes into ``indices``; ``False`` when one of them failed (its
        slots were then freed by the tree: KV at ``indices`` is not valid)."""
        ok = True
        while True:
            pending = self.loads_in_flight(indices)
            if not pending:
                return ok
            await asyncio.wait(pending)
            ok = ok and all(f.result() for f in pending if not f.cancelled())

    def ready_to_load_host_cache(self) -> list[Any]:
        """Load handles started since the last call (``handle.counter`` is the per-layer
        ``LayerDoneCounter`` the forward pass waits on), less those that had already ended
        when a later load-back started: nothing is left to wait on there, and a caller that
        never calls this (it waits on ``LoadBack.load_handle``) must not pile them up."""
        handles, self.new_handles = self.new_handles, []
        return handles
