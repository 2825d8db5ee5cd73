"""``HiRadixCache``: the radix cache with host and storage tiers behind it.

Why tiers inside the tree rather than beside it: a prefix is useful only from the root, so
whether a page is worth keeping depends on its place in the tree. Each node records where its
KV lives (device slots, host slots, how many of its pages storage holds) and the tree decides
what moves; :class:`~hicache.controller.HiCacheController` only moves bytes and calls back.

Tier rules kept here:

* Device eviction takes unlocked device leaves by policy. A node with a complete host copy is
  *demoted* (device slots freed, node kept as host-only); without one it is deleted
  (``write_back`` copies it to host first, see :meth:`evict_async`). A prefetch anchor without
  one is kept while other room is found, and when none is, its prefetches are dropped so it can
  go (see :meth:`evict`): whatever ``evictable_size`` counts an eviction can free.
* Host eviction takes host-only leaves in LRU order, never a locked node, a prefetch anchor, or
  a node with a copy to host or storage in flight.
* Both evictions pop their candidates from an :class:`~hicache.prefix_cache.eviction_index.EvictionIndex`
  (O(log n) per victim) instead of walking the tree. Every change that can make a node a
  candidate notes it: ``_note`` is called on device slots added or dropped, locks and host
  protections released, copies finished, host pages attached and children deleted.
* Backups never drop committed KV for want of host room: a backup that finds no host page (even
  after host eviction) or a full queue is *deferred* and started as host pages free up, and
  host copies that device and storage both hold are shed to make room (``_shed_host_copies``).
* Storage writes follow the tree from the root: a node is written only once its parent is in
  storage, because a page whose parent is missing can never be found by a prefix lookup.
* A match walks through host-only nodes: the device hit, the host hit, and the anchor where a
  storage lookup continues (``last_host_node`` and the chain hash after it).

Server flow (all on the event loop)::

    cache.match_req(req)               # device/host hit, fills req fields
    cache.start_prefetch(req)          # storage lookup + background fetch past the host hit
    res = await cache.admit(req)       # wait per stop policy, load host->device, lock prefix
    ... compute req.fill_ids[len(req.prefix_indices):] into its row of req_to_token ...
    cache.cache_finished_req(req)      # insert; write-through to host and storage follows
    cache.abort_req(req)               # instead, on abort: prefetch cancelled, pages freed
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import torch

from hicache.controller.controller import ControllerState, HiCacheController
from hicache.controller.jobs import CloseReport, PrefetchResult, StorageWriteJob
from hicache.errors import ChainGoneError
from hicache.events.convert import HashFormat
from hicache.events.log import EventLog
from hicache.memory.slots import cat_slots
from hicache.observability.tier_events import ChangeKind, Tier, TierChange, TierChangeHub
from hicache.placement import GhostList, PlacementPolicy, StoredPages, default_victim_write_limit, make_placement
from hicache.prefix_cache.facade import AdmitResult, LoadBack, MakeRoom, RequestFlow
from hicache.prefix_cache.eviction_index import EvictionIndex
from hicache.prefix_cache.hashing import fast_page_hashes, namespace_seed
from hicache.prefix_cache.load_back import LoadBacks
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.prefetching import Prefetch, Prefetches
from hicache.prefix_cache.radix import RadixCache
from hicache.prefix_cache.storage_writes import StorageWrites
from hicache.prefix_cache.req import Req
from hicache.prefix_cache.tokens import TokenRun, pack_tokens
from hicache.prefix_cache.types import EvictParams, EvictResult, InitLoadBackParams, MatchPrefixParams, MatchResult

__all__ = ["HiRadixCache"]

logger = logging.getLogger("hicache.controller")

#: tries of a kept node's device->host copy (see ``_backup_done``) before it is let go
_KEPT_COPY_TRIES = 3


class HiRadixCache(RadixCache):
    """Radix cache over device, host and storage tiers.

    Args (beyond :class:`RadixCache`'s):
        host_pool: the host KV pool (``alloc``/``free``/``available_size``, page protocol).
        controller: the :class:`HiCacheController` that moves pages for this cache.
        placement: a :class:`~hicache.placement.PlacementPolicy` or its name (``lru``,
            ``reuse``, ``tiered``): host eviction order and storage admission.
        victim_write_limit: pages host eviction may have queued for storage at once
            (write-back at eviction, see :meth:`_write_victim`; 0: off); default
            :func:`default_victim_write_limit`.
        tier_changes: the hub this tree reports device and host stores and removals to
            (the stack's; a private one by default).
        event_hash_format, event_tiers: the block hashes and the tiers of
            :meth:`take_events` (the config's ``[events]`` ``hash_format`` and ``tiers``).
    """

    def __init__(
        self,
        *,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        page_size: int,
        host_pool: Any,
        controller: HiCacheController,
        eviction_policy: str = "lru",
        placement: str | PlacementPolicy = "lru",
        victim_write_limit: int | None = None,
        disable: bool = False,
        tier_changes: TierChangeHub | None = None,
        event_hash_format: HashFormat = "bytes",
        event_tiers: Iterable[Tier | str] | None = None,
    ) -> None:
        self.tier_changes = tier_changes if tier_changes is not None else TierChangeHub()
        self._event_log = EventLog(self.tier_changes, hash_format=event_hash_format, tiers=event_tiers,
                                   count=lambda n: controller.metrics.incr("take_events_dropped", n))
        #: what host keeps and what storage admits (see :mod:`hicache.placement`)
        self.placement: PlacementPolicy = make_placement(placement)
        if host_pool.page_size != page_size:
            raise ValueError(f"host page_size {host_pool.page_size} != cache page_size {page_size}")
        self.host_pool = host_pool
        #: pages host eviction may have queued for storage at once (default: a quarter of the
        #: host pages device copies cannot take, see :func:`default_victim_write_limit`)
        self.victim_write_limit: int = (
            victim_write_limit if victim_write_limit is not None
            else default_victim_write_limit(int(host_pool.size) // page_size,
                                            int(getattr(token_to_kv_pool_allocator, "size", 0)) // page_size)
        )
        self.controller = controller
        self.config = controller.config
        self.metrics = controller.metrics
        self.write_policy: str = self.config.write_policy
        self.write_through_threshold: int = int(self.config.write_through_threshold or 1)
        self._generation = 0
        #: the host->device loads in flight and their handles
        self.load_backs = LoadBacks(self)
        #: the per-request calls (match, prefetch, admit, release, abort) and their bookkeeping
        self.flow = RequestFlow(self)
        #: explains each admitted request's misses (``None``: no attribution); set by the stack
        self.explain_admit: Any = None
        #: the stored-page directory when the policy chooses storage's evictions and the
        #: backend can delete (see :meth:`StorageWrites.submit`); ``None``: the backend's bound
        storage = controller.storage
        self._stored: StoredPages | None = (
            self.placement.stored if storage is not None and storage.supports_delete else None
        )
        #: the storage prefetches and the holds on what they fetched
        self.prefetches = Prefetches(self, self._stored)
        #: submits storage writes, making room in the directory first (deletions it owes)
        self.storage_writes = StorageWrites(controller=controller, metrics=self.metrics, page_size=page_size,
                                            stored=self._stored, tier_changes=self.tier_changes,
                                            on_cleared=self._storage_cleared)
        super().__init__(
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            page_size=page_size,
            eviction_policy=eviction_policy,
            disable=disable,
        )
        controller.set_host_free(self._free_host)
        if storage is not None:
            controller.on_storage_up(self._offer_short_writes)
            controller.set_unstored_count(self._unstored_pages)
        share = getattr(host_pool, "share_slots", None)
        if share is not None:
            share()  # host slot tensors are views of it (see _alloc_host): made now, not on a request
        self.metrics.gauge("device_tokens", self.total_size)
        self.metrics.gauge("device_evictable_tokens", self.evictable_size)
        self.metrics.gauge("eviction_index_repairs", lambda: self.eviction_index_repairs)
        self.metrics.gauge("host_tokens", self.host_size)
        self.metrics.gauge("host_available_tokens", lambda: self.host_pool.available_size())

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drop the tree and give back its host pages. A node a copy in flight reads or writes
        (a backup to host, a storage write, a load to device) keeps its host pages until that
        copy ends: freed now, they could be handed out again while it still uses them; the
        copy's completion, which finds the tree gone, frees them then (:meth:`_release_old`,
        and :class:`~hicache.prefix_cache.load_back.LoadBacks` for loads)."""
        old = getattr(self, "root_node", None)
        # first: the loads still in flight become the dropped tree's, whose host pages they
        # read stay theirs (LoadBacks.reads_dropped_host)
        self.load_backs.reset()
        if old is not None:
            self._drop_tree_pages()
        self.prefetches.reset()  # aborts the running prefetches (none before the first tree)
        self._generation = getattr(self, "_generation", 0) + 1
        #: write-through backups of inserted nodes, started together once the insert's loop
        #: callback returns (see :meth:`_backup_soon`): (node, op), oldest first
        self._backup_batch: list[tuple[TreeNode, object]] = []
        #: device nodes whose backup found no host room or a full queue, oldest first
        self._deferred: dict[TreeNode, bool] = {}  # node -> keep it on device meanwhile
        self._close_begun = False  # aclose() ran its steps before the controller's close
        self._close_cancelled_prefetches = 0  # the prefetches those steps cancelled (the report's)
        #: device nodes whose host copy became redundant (storage holds it too), oldest first
        self._sheddable: dict[TreeNode, None] = {}
        #: nodes whose storage write landed short (failed, refused, skipped while the store was
        #: down), oldest first: offered again when the store comes back, so neither they nor the
        #: children waiting for them stay out of storage until a hit happens to pass by
        self._short_writes: dict[TreeNode, None] = {}
        #: nodes whose storage write the full queue refused (backpressure), oldest first:
        #: offered again as soon as the queue has room (see :meth:`_offer_refused_writes`)
        self._refused_writes: dict[TreeNode, None] = {}
        #: failed copies of kept nodes (KV that must be written), by node: retried up to
        #: ``_KEPT_COPY_TRIES`` times
        self._failed_kept_copies: dict[TreeNode, int] = {}
        self._prune_at = 1024
        #: prefetch anchors the running device eviction kept (see :meth:`evict`), policy order
        self._kept_anchors: list[TreeNode] = []
        #: pages of host-eviction write-backs queued or being written (bounded)
        self._victim_pages_in_flight = 0
        #: first keys of write-backs that failed (not retried; bounded, oldest forgotten)
        self._victim_failed = GhostList(4096)
        super().reset()
        #: host-only leaves in the placement policy's order (LRU for ``lru``)
        self._host_index = EvictionIndex(self._host_evictable, self.placement.host_key)
        self._eviction_indexes.append(self._host_index)

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        if req.req_pool_idx is None and req.last_node is not None and self.is_admitted(req):
            # admitted but never given a row (its whole prompt was a hit, nothing computed): no
            # KV of its own to insert, but its admit's lock must go, or the prefix stays
            # protected for good (the request is forgotten below: not even an abort frees it)
            self._release_lock(req)
        self.forget_req(req)
        super().cache_finished_req(req, is_insert=is_insert, **kwargs)

    def forget_req(self, req: Any) -> None:
        """``req`` is over for this cache (finished, or its lock taken over by a decorator such
        as the session cache): drop what the cache remembers about it by rid."""
        self.flow.forget(req)

    def is_admitted(self, req: Any) -> bool:
        """Whether :meth:`admit` locked a prefix for this very request (not another one that
        used the same rid)."""
        return self.flow.is_admitted(req)

    # ------------------------------------------------------------------ request flow

    def match_req(self, req: Req, max_prefix_len: int | None = None) -> Any:
        """See :meth:`RequestFlow.match_req`."""
        return self.flow.match_req(req, max_prefix_len)

    def start_prefetch(self, req: Req, max_prefix_len: int | None = None) -> bool:
        """See :meth:`RequestFlow.start_prefetch`."""
        return self.flow.start_prefetch(req, max_prefix_len)

    def count_admitted(self, req: Req) -> None:
        """Count a request whose admit deferred its counts (see ``Req.defer_counts``)."""
        self.flow.count_admitted(req)

    async def admit(self, req: Req, *, mem_quota: int | None = None, wait_load: bool = True,
                    max_prefix_len: int | None = None, make_room: MakeRoom | None = None) -> AdmitResult:
        """See :meth:`RequestFlow.admit`."""
        return await self.flow.admit(req, mem_quota=mem_quota, wait_load=wait_load,
                                     max_prefix_len=max_prefix_len, make_room=make_room)

    def release_req(self, req: Req, is_insert: bool = True) -> None:
        """See :meth:`RequestFlow.release_req`."""
        self.flow.release_req(req, is_insert)

    def abort_req(self, req: Req) -> None:
        """See :meth:`RequestFlow.abort_req`."""
        self.flow.abort_req(req)

    def _free_host(self, indices: torch.Tensor) -> None:
        if indices is not None and indices.numel():
            self.host_pool.free(indices)

    def host_size(self) -> int:
        """Tokens of host memory held by tree nodes."""
        return sum(int(n.host_value.numel()) for n in self._nodes() if n.host_value is not None)

    def storage_prior_hash(self, node: Any, extra_key: str | None) -> str | None:
        """The chain hash storage keys continue from after ``node``: its last page key (which
        hashes the node and its unhashed ancestors on first use), or at the root the
        namespace's seed. ``None`` for what is not a tree node (a session's virtual node).
        :class:`~hicache.errors.ChainGoneError` for a node without page keys (it left the
        tree): no chain continues from it."""
        if not isinstance(node, TreeNode):
            return None
        if node is self.root_node:
            return namespace_seed(extra_key)
        keys = node.hash_value
        if not keys:
            raise ChainGoneError("the node left the tree: no storage chain continues from it")
        return keys[-1]

    # ------------------------------------------------------------------ tier changes

    def _report(self, kind: ChangeKind, tier: Tier, node: TreeNode) -> None:
        """Tell the hub that ``tier`` started (``STORED``) or stopped holding ``node``'s pages."""
        hub = self.tier_changes
        if not hub.wants(kind, tier) or not node.hash_value:  # asking for keys hashes the node
            return
        parent = node.parent if kind is ChangeKind.STORED else None
        hub.emit(TierChange(
            kind, tier, tuple(node.hash_value),
            token_ids=tuple(node.key) if kind is ChangeKind.STORED else (),
            parent_key=parent.hash_value[-1] if parent is not None and parent is not self.root_node and parent.hash_value else None,
            page_size=self.page_size,
        ))

    def _drop_tree_pages(self) -> None:
        """One walk over the tree being dropped: free the host pages no copy in flight uses
        (see :meth:`reset`), and tell the hub that device and host dropped everything, listing
        the pages each held.

        Why list them: a clear that names no pages leaves the attribution ledger unable to
        tell a page the tiers held from one never seen, so after one ``flush_cache`` every
        later miss read ``unknown`` for good (a server that flushes on each weight update lost
        its miss reasons). Keys not computed yet are hashed here, once per page, as an
        eviction would hash them; nothing is hashed when no subscriber wants clears. A host
        copy still being made (``backup_op``) is left out: host is announced when the copy
        lands, which a reset discards, and routers must not see a removal of a block never
        stored there."""
        hub = self.tier_changes
        wanted = [tier for tier in (Tier.DEVICE, Tier.HOST) if hub.wants(ChangeKind.CLEARED, tier)]
        held: dict[Tier, list[str]] = {Tier.DEVICE: [], Tier.HOST: []}
        for node in self._nodes():  # parents first: each node hashes only its own pages
            if wanted:
                if node.value is not None:
                    held[Tier.DEVICE] += node.hash_value
                if node.host_value is not None and node.backup_op is None:
                    held[Tier.HOST] += node.hash_value  # a copy still running was never announced
            if (node.host_value is not None and node.backup_op is None and node.storage_op is None
                    and not self.load_backs.reads_dropped_host(node)):
                self._free_host(node.host_value)
                node.host_value = None
        for tier in wanted:
            hub.emit(TierChange(ChangeKind.CLEARED, tier, tuple(held[tier]), keys_complete=True))

    def _add_device(self, node: TreeNode, value: torch.Tensor) -> None:
        super()._add_device(node, value)
        self._report(ChangeKind.STORED, Tier.DEVICE, node)  # a new node reports once hashed

    def _drop_device(self, node: TreeNode) -> torch.Tensor:
        self._report(ChangeKind.REMOVED, Tier.DEVICE, node)
        return super()._drop_device(node)

    def _drop_host(self, node: TreeNode) -> torch.Tensor:
        """Detach ``node``'s (complete) host copy, reporting it; the caller frees it."""
        host = node.host_value
        assert host is not None
        self._report(ChangeKind.REMOVED, Tier.HOST, node)
        node.host_value = None
        return host

    def take_events(self) -> list[Any]:
        """vLLM-schema KV events since the last call (SGLang's scheduler polls this); the
        first call starts the bounded log (:class:`~hicache.events.log.EventLog`)."""
        return self._event_log.take()

    # ------------------------------------------------------------------ page keys

    def _hash_pages(self, node: TreeNode) -> list[str]:
        """``node``'s page keys, and those of the ancestors they chain from that have none yet
        (top-down, in a loop: a chain of unhashed nodes may be deep)."""
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n._hash_value is None:
            chain.append(n)
            n = n.parent
        if n is None or (n is not self.root_node and not n._hash_value):
            # left the tree before anyone asked (or hangs below a node that did): its chain
            # is gone, so no keys
            for c in chain:
                c._hash_value = []
            return []
        ps = self.page_size
        for c in reversed(chain):
            c._hash_value = fast_page_hashes(c.key, ps, self.storage_prior_hash(c.parent, c.extra_key))
        return node._hash_value  # type: ignore[return-value]

    # ------------------------------------------------------------------ hooks

    def _on_split(self, child: TreeNode, new: TreeNode) -> None:
        # a backup waiting for host room covers both halves (and keeps both on device if asked)
        keep = self._deferred.get(child)
        if keep is not None:
            self._deferred[new] = keep

    def _check_run(self, tokens: TokenRun) -> None:
        if tokens.typecode != "I":  # storage keys hash uint32 token ids; refused before any change
            raise ValueError("token ids must be integers that fit in uint32")

    def _on_new_node(self, node: TreeNode) -> None:
        assert node.parent is not None
        node.hasher = self._hash_pages
        node._hash_value = None  # computed when first asked for (see TreeNode.hash_value)
        self._report(ChangeKind.STORED, Tier.DEVICE, node)  # hashes it only if someone wants it
        self.placement.on_new_node(node)
        if self.write_policy != "write_back" and node.hit_count >= self.write_through_threshold:
            self._backup_soon(node)

    def _on_hit(self, node: TreeNode) -> None:
        if self._stored is not None and node.storage_pages:
            self._stored.touch(node.hash_value[: node.storage_pages])  # a hit in any tier counts
        if node.host_value is None:
            if (
                self.write_policy != "write_back"
                and node.value is not None
                and node.hit_count >= self.write_through_threshold
            ):
                self._backup(node)
        elif node.backuped and node.storage_op is None and not node.on_storage:
            self._maybe_write_storage(node)

    # ------------------------------------------------------------------ host memory

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        if self._backup_batch:  # host slots go out in the order the backups were asked for
            self._start_backups()
        # the tree only reads host slot tensors (slices, joins, frees): a pool that can hand
        # out views of one shared index tensor saves a fresh tensor per backup
        pool = self.host_pool
        alloc = getattr(pool, "alloc_shared", None) or pool.alloc
        host = alloc(num_tokens)
        if host is None:
            self.evict_host(num_tokens - pool.available_size())
            host = alloc(num_tokens)
        if host is None:
            self._shed_host_copies(num_tokens - pool.available_size())
            host = alloc(num_tokens)
        return host

    def _note(self, node: TreeNode | None) -> None:
        """Also list ``node`` for shedding when its host copy is redundant and free now. Every
        change that can make a copy sheddable notes the node (a storage write landing, a
        split, a load, a lock, protection or copy released), so shedding simply forgets a node
        it cannot take yet: the change that frees it lists it again. (Listing only where a
        storage write landed missed split halves and storage hits loaded to device, and
        forgetting a node skipped for a passing lock left its host page pinned for good.)"""
        super()._note(node)
        if node is not None and node.storage_pages and self._sheds(node):
            self._sheddable[node] = None

    def _sheds(self, node: TreeNode) -> bool:
        """May ``node``'s host copy go? Only when the device and storage hold every page too,
        and nothing reads it (a load-back locks its node) or writes it."""
        return (
            self._of_this_tree(node)
            and node.value is not None
            and node.host_value is not None
            and node.on_storage
            and node.lock_ref == 0
            and node.host_ref == 0
            and node.backup_op is None
            and node.storage_op is None
        )

    def _check_stored(self, node: TreeNode) -> bool:
        """Where the policy keeps a directory of what storage holds (``self._stored``), lower
        ``node.storage_pages`` to its leading pages the directory does not know to be gone
        (:meth:`StoredPages.reachable`: pages a prefetch found there count as held); whether
        it dropped (counted, ``storage_pages_lost``).

        Why: pages leave storage without the tree hearing of it per node (the directory's own
        evictions, the backend's removals, a clear). A node that still counted them was taken
        as written: host dropped it first as storage-backed without writing it, its redundant
        host copy was shed, and write-backs of its children chained from the missing pages and
        landed as orphans no lookup reaches, while the node itself was never written again.
        Checked where the count decides something (host eviction's order and write-back chain,
        shedding), so it costs a lookup per page only there. Not while a write of the node is
        in flight: its completion credits pages from the count it started at."""
        stored = self._stored
        k = node.storage_pages
        if stored is None or k <= 0 or node.storage_op is not None:
            return False
        have = stored.reachable(node.hash_value, k)
        if have >= k:
            return False
        node.storage_pages = have
        self.metrics.incr("storage_pages_lost", k - have)
        return True

    def _storage_cleared(self) -> None:
        """The store lost every page (a clear, just applied to the directory): every node's
        count drops to 0, so none is taken as storage-backed. A node with a write in flight
        keeps its count until the write lands (its completion credits pages from it)."""
        for node in self._nodes():
            k = node.storage_pages
            if k > 0 and node.storage_op is None:
                node.storage_pages = 0
                self.metrics.incr("storage_pages_lost", k)

    def _shed_host_copies(self, num_tokens: int) -> int:
        """Free host copies that are redundant (device and storage hold the pages), oldest
        first; returns tokens freed. The nodes stay, on device."""
        freed = 0
        while freed < num_tokens and self._sheddable:
            node = next(iter(self._sheddable))
            del self._sheddable[node]
            self._check_stored(node)  # a copy whose pages left storage is the only one below the device
            if not self._sheds(node):
                continue  # listed again by the change that lets it shed (see _note)
            host = self._drop_host(node)
            self._free_host(host)
            self._note(node)
            freed += int(host.numel())
        if freed:
            self.metrics.incr("host_copies_shed_tokens", freed)
        return freed

    def _alloc_host_upto(self, max_tokens: int) -> torch.Tensor | None:
        """Up to ``max_tokens`` host slots (whole pages), evicting host leaves for room."""
        host = self._alloc_host(max_tokens)
        if host is not None:
            return host
        avail = self.host_pool.available_size() // self.page_size * self.page_size
        return self.host_pool.alloc(avail) if avail > 0 else None

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node.value is None
            and node.host_value is not None
            and not node.children
            and node.lock_ref == 0
            and node.host_ref == 0
            and node.backup_op is None
            and node.storage_op is None
            and node is not self.root_node
        )

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies of host-only leaves, least recently used first; returns tokens
        freed (possibly fewer than asked)."""
        if num_tokens <= 0:
            return 0
        freed = 0
        while freed < num_tokens:
            node = self._host_index.pop()
            if node is None:
                break
            if self._check_stored(node):
                # queued as storage-backed, but its pages left storage: not the first to go any
                # more; queued again under the key its real count gives (it may be written back)
                self._host_index.note(node)
                continue
            if self._write_victim(node):
                continue  # host drops it once storage holds it (it is then evicted first)
            parent = node.parent
            if self.controller.has_storage and parent is not self.root_node and parent is not None \
                    and not parent.on_storage:
                # pages the policy wants in storage now (write-through: all) whose write never
                # started: it waits for its prefix's write, still in flight (a page is written
                # only after its prefix), and host needs the room first. Dropped, as a full host
                # must; counted, since storage will miss them (the close report sums them).
                # Only then: a node whose prefix is stored had its own write sent, and what of
                # it did not land the controller counted already (storage_write_failures,
                # storage_write_skipped_unhealthy), summed in the same report
                unwritten = min(self.placement.storage_pages(node), len(node.hash_value)) - node.storage_pages
                if unwritten > 0:
                    self.metrics.incr("storage_write_dropped_pages", unwritten)
            self.placement.on_host_evicted(node)
            host = self._drop_host(node)
            self._free_host(host)
            freed += int(host.numel())
            self._delete_leaf(node)  # notes the parent, which may be a host-only leaf now
        self.metrics.incr("host_evicted_tokens", freed)
        return freed

    def _write_victim(self, node: TreeNode) -> bool:
        """Write-back at host eviction: queue the pages of ``node`` the policy wants in storage
        (:meth:`PlacementPolicy.victim_pages`), with every unwritten ancestor before them in the
        same job, so a stored page's prefix is always stored. Whether a write was queued; the
        node then stays on host (``storage_op`` keeps it) until the write lands, when it is a
        storage-backed leaf and host drops it first. Never more than ``victim_write_limit``
        pages in flight (one job always may start, however long its chain; 0 turns write-back
        off): past it, or when an ancestor cannot be written now (no host copy, or
        a write of its own in flight), the page is dropped as before and counted
        (``victim_writes_skipped_pages``)."""
        if not self.controller.has_storage or not self.controller.health.up:
            return False
        want = min(self.placement.victim_pages(node), len(node.hash_value))
        if want <= node.storage_pages:
            return False
        if node.hash_value[node.storage_pages] in self._victim_failed:
            return False  # its write-back failed once: drop it rather than retry at every eviction
        chain = [node]
        n = node.parent
        while n is not None and n is not self.root_node:
            self._check_stored(n)  # an ancestor whose pages left storage is written again, first
            if n.on_storage:
                break
            if not n.backuped or n.storage_op is not None:
                self.metrics.incr("victim_writes_skipped_pages", want - node.storage_pages)
                return False
            if n.hash_value[n.storage_pages] in self._victim_failed:
                return False  # the chain's write failed at this ancestor once: not at every eviction
            chain.append(n)
            n = n.parent
        chain.reverse()
        upto = [len(c.hash_value) for c in chain[:-1]] + [want]
        pages = sum(u - c.storage_pages for c, u in zip(chain, upto))
        in_flight = self._victim_pages_in_flight
        if self.victim_write_limit <= 0 or (in_flight and in_flight + pages > self.victim_write_limit):
            self.metrics.incr("victim_writes_skipped_pages", want - node.storage_pages)
            return False
        ps = self.page_size
        prior = self._page_prior(chain[0], chain[0].storage_pages)
        keys: list[str] = []
        hosts: list[torch.Tensor] = []
        for c, u in zip(chain, upto):
            assert c.host_value is not None
            keys.extend(c.hash_value[c.storage_pages : u])
            hosts.append(c.host_value[c.storage_pages * ps : u * ps])
        op = object()
        for c in chain:
            c.storage_op = op
        gen = self._generation

        def done(written: int) -> None:
            if gen != self._generation:
                self._release_old(node, "storage_op", op)  # the bound was reset with the tree
                return
            self._victim_pages_in_flight -= pages
            ctl = self.controller
            if written < len(job.keys) and ctl.health.up and ctl.state is ControllerState.RUNNING:
                # pages sent and not written, the store up: it answered and refused them
                self.metrics.incr("victim_write_failed_pages", len(job.keys) - written)
                self._victim_failed.add(keys[written : written + 1])
            # no refusal, so not remembered as failed (a transient outage must not keep a page
            # out of storage for good): pages the store was down for, skipped (counted,
            # storage_write_skipped_unhealthy; the completion runs in the same loop step as
            # the skip, so health still says down), or left at a close; the nodes are host
            # leaves again, written back at a later eviction once the store is up, or dropped
            # as before with their keys in the ghost list. Pages storage had no room for were
            # never sent (the job was cut, counted as storage_writes_no_room_pages): not a
            # failure either, written back at a later eviction
            self._storage_done(gen, node, op, written)

        job = StorageWriteJob(keys=keys, host_indices=torch.cat(hosts), prior_key=prior, on_done=done)
        if not self.storage_writes.submit(job):
            for c in chain:
                c.storage_op = None
                self._note(c)
            self.metrics.incr("victim_writes_skipped_pages", want - node.storage_pages)
            return False
        self._victim_pages_in_flight += pages
        self.metrics.incr("victim_write_pages", pages)
        return True

    def _inc_host_ref(self, node: TreeNode) -> None:
        while node is not None and node is not self.root_node:
            node.host_ref += 1
            node = node.parent  # type: ignore[assignment]

    def _dec_host_ref(self, node: TreeNode) -> None:
        while node is not None and node is not self.root_node:
            node.host_ref -= 1
            assert node.host_ref >= 0, node
            if node.host_ref == 0:
                self._note(node)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ device -> host

    def _op_chain(self, node: TreeNode, attr: str, op: object) -> list[TreeNode]:
        """``node`` and the ancestors split off it while ``op`` was in flight, root first."""
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root_node and getattr(n, attr) is op:
            chain.append(n)
            n = n.parent
        chain.reverse()
        return chain

    def _backup(self, node: TreeNode, keep: bool = False) -> bool:
        """Start copying ``node``'s device pages to host; the node stays locked until the
        copy completes, so its device slots cannot be freed or reused mid-copy. Without room
        the backup is deferred; with ``keep`` device eviction keeps the node until it starts
        (KV that must not be lost, such as a session's handed-over history)."""
        if self._backup_batch:  # a node still waiting in the batch starts (or is deferred) first
            self._start_backups()
        if node.value is None or node.host_value is not None or node.backup_op is not None:
            return False
        return self._start_marked(node, self._mark_backup(node), keep)

    def _mark_backup(self, node: TreeNode) -> object:
        """Mark ``node``'s backup in flight (its ``backup_op``, returned) and lock it on device."""
        op = object()
        node.backup_op = op
        self.inc_lock_ref(node)
        return op

    def _backup_soon(self, node: TreeNode) -> None:
        """Write-through of a node an insert just made: locked and marked in flight now, as
        :meth:`_backup` leaves it, but its host slots are taken and its copy queued by
        :meth:`_start_backups`, once for all the inserts of this loop step (SGLang's scheduler
        likewise queues write-through at insert and flushes after the batch). Until then
        nothing can tell it from a backup in flight (locked: device eviction leaves it; its
        ``backup_op`` keeps host eviction and a second backup away; a split hands both to the
        new parent) except its ``host_value``, still ``None``. Every host allocation, device
        eviction, drain and close starts the waiting ones first, so host slots go out in
        insert order and eviction sees what it would have seen; so does the next match (requests
        served back to back, with no turn of the loop between them, see the backups of the
        earlier ones started). Outside a running loop (no controller can run there) the backup
        starts at once."""
        if not self._backup_batch:
            try:
                asyncio.get_running_loop().call_soon(self._start_backups)
            except RuntimeError:
                self._backup(node)
                return
        self._backup_batch.append((node, self._mark_backup(node)))

    def _start_backups(self) -> None:
        """Start the backups :meth:`_backup_soon` marked, oldest first (a start never raises:
        :meth:`_start_marked` defers what fails)."""
        batch, self._backup_batch = self._backup_batch, []
        for node, op in batch:
            self._start_marked(node, op)

    def _start_marked(self, node: TreeNode, op: object, keep: bool = False) -> bool:
        """Start the copy of a node :meth:`_mark_backup` marked with ``op``; whether it started.
        Without room, a refused queue or any failure it is unmarked, unlocked and deferred
        (``keep``: device eviction keeps it meanwhile). A node split since it was marked is
        copied with the parents split off it (one host allocation, one job, as if the copy had
        started before the split)."""
        if node.backup_op is not op:  # the tree was reset meanwhile
            return False
        chain = self._op_chain(node, "backup_op", op)
        host = None
        tokens = sum(len(c.key) for c in chain)
        try:
            # host room is taken with the mark's lock lifted: it covers every ancestor, and a
            # locked node's redundant host copy is never shed (a backup was deferred, a
            # write-back's KV dropped at eviction, for want of room its own ancestors held).
            # Safe: host allocation never evicts from the device, and the chain's own marks
            # keep its nodes from being shed or backed up again
            self.dec_lock_ref(node)
            try:
                host = self._alloc_host(tokens)
            finally:
                self.inc_lock_ref(node)
            if host is not None:
                off = 0
                for c in chain:
                    n = len(c.key)
                    c.host_value = host[off : off + n]
                    off += n
                dev = node.value if len(chain) == 1 else cat_slots([c.value for c in chain])  # type: ignore[misc]
                gen = self._generation
                if self.controller.submit_backup(dev, host, lambda ok: self._backup_done(gen, node, op, ok, keep)):  # type: ignore[arg-type]
                    for c in chain:
                        self._deferred.pop(c, None)
                    return True
        except Exception:  # noqa: BLE001 - run from a loop callback too: nobody would see it raise
            # whatever failed, the node must not stay marked and locked forever: deferred
            logger.exception("a write-through backup could not start")
        if host is not None:
            self._free_host(host)
        for c in chain:  # no room (or the queue refused it): deferred
            c.host_value = None
            c.backup_op = None
        self.dec_lock_ref(node)
        for c in chain:
            self._defer_backup(c, keep)
        return False

    def evict(self, params: EvictParams | int) -> EvictResult:
        """Free device slots (see :meth:`RadixCache.evict`). The device-only prefetch anchors
        it meets are kept; only when the other leaves fall short are the prefetches on them
        dropped and they evicted, in policy order, as many as the room still missing.

        Why: a prefetch keeps its anchor until its request is admitted, and a request may wait
        long after its prefetch finished; such anchors were skipped but counted as evictable,
        so a scheduler trusting ``evictable_size`` admitted requests that then failed for
        memory while queued ones held it (see :meth:`Prefetches.drop_for_room`). Anchors go
        last: a waiting request's prefix is about to be used, and its fetch is lost with it."""
        self._start_backups()
        need = params if isinstance(params, int) else params.num_tokens
        self._kept_anchors = []
        freed = super().evict(params).num_tokens_evicted
        anchors, self._kept_anchors = self._kept_anchors, []
        if freed < need and anchors:
            room = 0
            for node in anchors:
                if room >= need - freed:
                    break
                if self._in_tree(node) and node.value is not None and self.prefetches.drop_for_room(node):
                    room += len(node.key)
            if room:
                freed += super().evict(need - freed).num_tokens_evicted
                self._kept_anchors = []
        return EvictResult(num_tokens_evicted=freed)

    def match_prefix(self, params: MatchPrefixParams, *, count_hit: bool = True) -> MatchResult:
        if self._backup_batch:  # requests served back to back, the loop never between them
            self._start_backups()
        return super().match_prefix(params, count_hit=count_hit)

    def release_backup(self, node: TreeNode) -> None:
        """Stop keeping ``node`` on device for its backup (the caller gave up waiting for host
        room); the backup stays deferred, as a best effort."""
        if node in self._deferred:
            self._deferred[node] = False

    def _defer_backup(self, node: TreeNode, keep: bool) -> None:
        """Backpressure: remember a backup that found no room, to start it when room frees up
        (:meth:`_retry_deferred`) instead of dropping committed KV."""
        if node not in self._deferred:
            self.metrics.incr("backup_deferred")
        self._deferred[node] = keep or self._deferred.get(node, False)

    def _retry_deferred(self) -> int:
        """Start deferred backups, oldest first, until one finds no room; returns how many
        started. Nodes that left the device (or the tree) meanwhile are dropped from the list."""
        started = 0
        while self._deferred:
            node = next(iter(self._deferred))
            if not self._in_tree(node) or node.value is None or node.host_value is not None:
                del self._deferred[node]
                continue
            if node.backup_op is not None or not self._backup(node, self._deferred[node]):
                break
            started += 1
        return started

    def _backup_done(self, gen: int, node: TreeNode, op: object, ok: bool, keep: bool = False) -> None:
        if gen != self._generation:
            self._release_old(node, "backup_op", op)
            return
        chain = self._op_chain(node, "backup_op", op)
        for n in chain:
            n.backup_op = None
            if not ok and n.host_value is not None:
                self._free_host(n.host_value)
                n.host_value = None
        if not ok and keep:
            # KV that must be written (a session's handed-over history) is kept on device and
            # tried again, a few times: without the mark the next device eviction dropped it
            # with no copy anywhere. A copy that keeps failing (a broken copy engine) lets go
            for n in chain:
                tries = self._failed_kept_copies.get(n, 0) + 1
                if tries < _KEPT_COPY_TRIES:
                    self._failed_kept_copies[n] = tries
                    self._defer_backup(n, True)
                else:
                    self._failed_kept_copies.pop(n, None)
                    self.metrics.incr("kept_backups_given_up")
                    logger.error("a device->host copy that must not be lost failed %d times; its KV is no "
                                 "longer kept on device", tries)
        elif ok:
            for n in chain:
                self._failed_kept_copies.pop(n, None)
        self.dec_lock_ref(node)  # notes every node it unlocks
        if ok:
            for n in chain:
                self._report(ChangeKind.STORED, Tier.HOST, n)
                self._maybe_write_storage(n)
        self._retry_deferred()

    def write_backup(self, node: TreeNode) -> bool:
        """Back ``node`` up to host now, whatever the policy (SGLang's name). Until the copy
        has started, device eviction keeps the node: the caller needs the KV written."""
        return self._backup(node, keep=True)

    # ------------------------------------------------------------------ host -> storage

    def _maybe_write_storage(self, node: TreeNode) -> None:
        """Queue ``node``'s pages for storage if its parent is there already; a node already
        in storage passes the turn to its children (iteratively: chains can be long)."""
        if not self.controller.has_storage:
            return
        stack = [node]
        while stack:
            n = stack.pop()
            if not n.backuped or n.storage_op is not None:
                continue
            if n.on_storage:
                stack.extend(n.children.values())
                continue
            self._write_storage(n)

    def _write_storage(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and node.host_value is not None
        if parent is not self.root_node and not parent.on_storage:
            return  # continuity: written once the parent is
        ps = self.page_size
        k = node.storage_pages
        upto = min(self.placement.storage_pages(node), len(node.hash_value))
        if upto <= k:
            return  # not admitted (yet): a later hit or ghost hit may admit it
        prior = self._page_prior(node, k)
        op = object()
        node.storage_op = op
        gen = self._generation
        job = StorageWriteJob(
            keys=node.hash_value[k:upto],
            host_indices=node.host_value[k * ps : upto * ps],
            prior_key=prior,
            on_done=lambda pages: self._storage_done(gen, node, op, pages),
        )
        if not self.storage_writes.submit(job):
            node.storage_op = None
            # a full queue (backpressure) makes room as its writes end; any other refusal (the
            # store down) is offered again when the store is back
            (self._refused_writes if self.controller.storage_queue_full else self._short_writes)[node] = None
            self._note(node)

    def _page_prior(self, node: TreeNode, k: int) -> str | None:
        """The key before ``node``'s page ``k`` in storage's chain (``None`` at the root)."""
        if k:
            return node.hash_value[k - 1]
        parent = node.parent
        return parent.hash_value[-1] if parent is not None and parent is not self.root_node and parent.hash_value else None

    def _storage_done(self, gen: int, node: TreeNode, op: object, pages: int) -> None:
        if gen != self._generation:
            self._release_old(node, "storage_op", op)
            return
        remaining = pages
        chain = self._op_chain(node, "storage_op", op)
        for n in chain:
            n.storage_op = None
            want = len(n.hash_value) - n.storage_pages
            take = min(remaining, want)
            n.storage_pages += take
            remaining -= take
            if take < want:
                self._short_writes[n] = None
            self._note(n)  # lists a redundant host copy for shedding
            self._host_index.requeue(n)  # its host eviction key may have dropped (now in storage)
        # a written node passes the turn to its children; so does a parent split off it while
        # the write was in flight (children inserted after the split waited for it), each but
        # the next node of the chain, which the loop reaches itself
        tops = chain or [node]
        for upper, lower in zip(tops, [*tops[1:], None]):
            if upper.on_storage and upper.parent is not None:
                for child in [c for c in upper.children.values() if c is not lower]:
                    self._maybe_write_storage(child)
        if self._listed() > self._prune_at:
            self._prune_lists()
        self._offer_refused_writes()
        self._retry_deferred()

    def _offer_refused_writes(self) -> None:
        """Offer again, oldest first, the storage writes the full queue refused, while it has
        room (a write that ends makes some). Why: a refused write stayed on host unwritten
        until a hit happened to pass by, and so did every child waiting for it: ``drain()``
        returned with storage missing the burst that filled the queue, and the close neither
        wrote nor reported it (``drained``, nothing unwritten)."""
        while self._refused_writes and not self.controller.storage_queue_full:
            node = next(iter(self._refused_writes))
            del self._refused_writes[node]
            if self._in_tree(node) and node.host_value is not None:
                self._maybe_write_storage(node)

    def _release_old(self, node: TreeNode, attr: str, op: object) -> None:
        """A copy (``attr`` names its mark, ``op``) of a tree reset since has ended: free the
        host pages its nodes still hold. :meth:`reset` left them to it, and nobody else frees
        them (they leaked, for ``lru`` and ``tiered`` alike). The mark is cleared as each node
        is freed, so a node is freed once; the pages are the old node's own, never the new
        tree's (reset did not free them, so they were never handed out again)."""
        for n in self._op_chain(node, attr, op):
            setattr(n, attr, None)
            # a load of the dropped tree still reading the pages frees them when it ends
            if n.host_value is not None and not self.load_backs.reads_dropped_host(n):
                self._free_host(n.host_value)
                n.host_value = None

    def _offer_short_writes(self) -> None:
        """The store is back: offer again the writes that landed short, oldest first (each
        passes the turn to its children once written, as any write does)."""
        nodes, self._short_writes = list(self._short_writes), {}
        for n in nodes:
            if self._in_tree(n) and n.host_value is not None:
                self._maybe_write_storage(n)
        if nodes:
            self.metrics.incr("storage_writes_reoffered", len(nodes))

    def _unstored_pages(self, reported: set[str]) -> int:
        """(At close.) Pages of the nodes on host that the placement wants in storage and
        storage does not hold, but for ``reported`` (the close listed them unwritten): what the
        close report names as never written there. Why from the nodes: a write skipped or
        failed and re-offered since may have landed, and a child waiting for its prefix's write
        never had one. Nodes without a host copy are left out: their backups are reported
        apart (``deferred_backup_pages``, ``failed_device_backups``), and pages host dropped
        are no longer the cache's to write (``storage_write_dropped_pages``, a lifetime total)."""
        missing = 0
        for node in self._nodes():
            if node.host_value is None:
                continue
            want = self.placement.storage_pages(node)
            if want <= node.storage_pages:
                continue  # (asked first: a node's keys are hashed on first use, and most need none)
            missing += sum(1 for key in node.hash_value[node.storage_pages : want] if key not in reported)
        return missing

    def _prune_lists(self) -> None:
        """Forget listed nodes that left the tree or the device (amortized: the limit doubles
        with what stays), so the lists never hold more than about twice the live nodes."""
        # device lists forget nodes off the device; the short writes, nodes off host
        lists: list[tuple[dict[TreeNode, Any], str]] = [
            (self._sheddable, "value"), (self._deferred, "value"), (self._failed_kept_copies, "value"),
            (self._short_writes, "host_value"), (self._refused_writes, "host_value"),
        ]
        for d, copy in lists:
            for n in [n for n in d if not self._in_tree(n) or getattr(n, copy) is None]:
                del d[n]
        self._prune_at = max(1024, 2 * self._listed())

    def _listed(self) -> int:
        """Nodes held by the lists :meth:`_prune_lists` prunes."""
        return (len(self._sheddable) + len(self._deferred) + len(self._short_writes) + len(self._refused_writes)
                + len(self._failed_kept_copies))

    def _in_tree(self, node: TreeNode) -> bool:
        """Whether ``node`` is still a node of this tree (not removed, not of a tree reset since)."""
        return node.parent is not None and self._of_this_tree(node)

    # ------------------------------------------------------------------ device eviction

    def _evict_device_node(self, node: TreeNode) -> int:
        n = len(node.key)
        if node.backuped:
            self._free(self._drop_device(node))
            self.metrics.incr("device_evicted_tokens", n)
            return n
        if node.backup_op is not None:
            return 0  # a copy in flight: freed by a later eviction once it is done
        if (self.write_policy == "write_back" or node in self._deferred) and self._backup(node):
            return 0  # freed by a later eviction once the copy is done (a prefetch anchor stays)
        if self._deferred.get(node):
            return 0  # KV that must be written waits on device for host room
        if node.host_ref:
            # a prefetch anchor (of a waiting request) that can only go by leaving the tree:
            # kept unless the rest of the tree cannot make the room (see evict)
            self._kept_anchors.append(node)
            return 0
        # no host copy and none possible (write-through refused, or no host room): drop it
        if node.children:
            if not all(self._host_evictable(c) or self._droppable(c) for c in node.children.values()):
                return 0
            for child in list(node.children.values()):
                self._drop_subtree(child)
            if node.children:
                return 0
        self._free(self._drop_device(node))
        if node.host_value is not None:  # a host copy still being written cannot be here
            self._free_host(self._drop_host(node))
        self._delete_leaf(node)
        self.metrics.incr("device_evicted_tokens", n)
        return n

    def _droppable(self, node: TreeNode) -> bool:
        if node.value is not None or node.lock_ref or node.host_ref or node.backup_op or node.storage_op:
            return False
        return all(self._droppable(c) for c in node.children.values())

    def _drop_subtree(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child)
        if node.host_value is not None:
            # an eviction (its device parent goes), not a reset: the policy hears of it like
            # evict_host's drops, or a ghost list forgets pages host dropped unwritten
            self._check_stored(node)
            self.placement.on_host_evicted(node)
            self._free_host(self._drop_host(node))
        self._delete_leaf(node)

    async def make_device_room(self, num_tokens: int) -> bool:
        """Free device slots until ``num_tokens`` are available, waiting for backups that pin
        pages; whether they are."""
        alloc = self.token_to_kv_pool_allocator
        short = num_tokens - alloc.available_size()
        if short > 0:
            await self.evict_async(short)
        return alloc.available_size() >= num_tokens

    async def evict_async(self, params: EvictParams | int) -> EvictResult:
        """:meth:`evict`, waiting for write-back copies so their device pages can go too."""
        need = params if isinstance(params, int) else params.num_tokens
        freed = self.evict(need).num_tokens_evicted
        for _ in range(3):
            if freed >= need:
                break
            self._retry_deferred()  # kept nodes go once their host copy exists
            await self.controller.drain_backups()  # not the storage writes behind them
            got = self.evict(need - freed).num_tokens_evicted
            if got == 0 and (any(self._deferred.values()) or self._victim_pages_in_flight) and self.controller.has_storage:
                # KV kept on device waits for host room, which storage writes free (redundant
                # host copies are shed once written), and a write-back at host eviction keeps its
                # chain (and so a device parent that has no host copy) until it lands; their time
                # is bounded by storage health. One write at a time, not the whole queue: the
                # first to land may free the room, and a slow store's backlog is seconds
                for _ in range(max(1, self.controller.storage_writes_pending)):
                    await self.controller.wait_storage_progress()
                    self._retry_deferred()
                    await self.controller.drain_backups()
                    got += self.evict(need - freed - got).num_tokens_evicted
                    if freed + got >= need or not self.controller.storage_writes_pending:
                        break
            if got == 0:
                break
            freed += got
        return EvictResult(num_tokens_evicted=freed)

    # ------------------------------------------------------------------ host -> device

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """See :meth:`LoadBacks.init_load_back`."""
        return self.load_backs.init_load_back(params)

    def start_load_back(self, params: InitLoadBackParams) -> LoadBack | None:
        """See :meth:`LoadBacks.start_load_back`."""
        return self.load_backs.start_load_back(params)

    def loads_in_flight(self, indices: torch.Tensor) -> list[asyncio.Future[bool]]:
        """See :meth:`LoadBacks.loads_in_flight`."""
        return self.load_backs.loads_in_flight(indices)

    async def wait_loads(self, indices: torch.Tensor) -> bool:
        """See :meth:`LoadBacks.wait_loads`."""
        return await self.load_backs.wait_loads(indices)

    def ready_to_load_host_cache(self) -> list[Any]:
        """See :meth:`LoadBacks.ready_to_load_host_cache`."""
        return self.load_backs.ready_to_load_host_cache()

    # ------------------------------------------------------------------ storage -> host

    def prefetch_from_storage(self, req_id: str, last_host_node: TreeNode, new_input_tokens: list[int],
                              last_hash: str | None = None, *, prefix_tokens: list[int] | None = None,
                              extra_key: str | None = None, owner: object = None) -> bool:
        """See :meth:`Prefetches.prefetch_from_storage` (the same signature: SGLang's)."""
        return self.prefetches.prefetch_from_storage(req_id, last_host_node, new_input_tokens, last_hash,
                                                     prefix_tokens=prefix_tokens, extra_key=extra_key, owner=owner)

    def prefetch_view(self, req_id: str) -> tuple[int, list[str], Any] | None:
        """See :meth:`Prefetches.prefetch_view`."""
        return self.prefetches.prefetch_view(req_id)

    def is_prefetching(self, req_id: str) -> bool:
        """Whether ``req_id`` has a storage prefetch whose pages are not yet in the tree (read
        straight from ``prefetches.running``: asked on every request)."""
        return req_id in self.prefetches.running

    def cancel_prefetch(self, req_id: str, holder: object = None) -> None:
        """See :meth:`Prefetches.cancel_prefetch`."""
        self.prefetches.cancel_prefetch(req_id, holder)

    def release_prefetched(self, req_id: str, holder: object = None) -> None:
        """See :meth:`Prefetches.release_prefetched`."""
        self.prefetches.release_prefetched(req_id, holder)

    def check_prefetch_progress(self, req_id: str) -> bool:
        """See :meth:`Prefetches.check_prefetch_progress`."""
        return self.prefetches.check_prefetch_progress(req_id)

    async def wait_prefetch(self, req_id: str, *, hold: object = None) -> int:
        """See :meth:`Prefetches.wait_prefetch`."""
        return await self.prefetches.wait_prefetch(req_id, hold=hold)

    def _insert_host(self, state: Prefetch, result: PrefetchResult) -> tuple[int, TreeNode | None]:
        """Hang fetched pages under their prefix as host-only nodes; pages already present are
        freed (or adopted as the host copy of a device-only node). Returns the new tokens and
        the node ending at the last fetched page (``None`` when the prefix left the tree)."""
        ps = self.page_size
        start = state.start
        end = start + result.pages * ps
        host = result.host_indices
        tokens = state.tokens
        node = self.root_node
        pos = 0
        now = self._tick()
        adopted: list[TreeNode] = []
        while pos < end:
            child = node.children.get(self._child_key(state.extra_key, tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos, end)
            if pos < start < pos + m:
                m = start - pos
            if m < len(child.key):
                child = self._split(child, m)
            if pos + m > start:
                part = host[pos - start : pos + m - start]
                if child.host_value is None and child.backup_op is None:
                    child.host_value = part
                    child.storage_pages = len(child.hash_value)
                    self._note(child)
                    self._report(ChangeKind.STORED, Tier.HOST, child)
                    adopted.append(child)
                else:
                    self._free_host(part)
            child.last_access_time = now
            pos += m
            node = child
        # a node the fetch shows to be in storage passes the turn to its children, as a landed
        # write does: those on host waited for it (continuity) and were never written otherwise
        for n in adopted:
            self._maybe_write_storage(n)
        if pos < start:  # the prefix left the tree meanwhile: the pages cannot be attached
            self._free_host(host)
            return 0, None
        if pos >= end:
            return 0, (node if node is not self.root_node else None)
        new = TreeNode(parent=node, extra_key=state.extra_key, key=pack_tokens(tokens[pos:end]))
        new.host_value = host[pos - start :]
        new.hash_value = state.keys[(pos - start) // ps : (end - start) // ps]
        new.storage_pages = len(new.hash_value)
        new.last_access_time = now
        node.children[self._child_key(state.extra_key, tokens, pos)] = new
        self._note(new)
        self._report(ChangeKind.STORED, Tier.HOST, new)
        return end - pos, new

    # ------------------------------------------------------------------ lifecycle

    async def drain(self) -> None:
        """Wait for every queued copy (device->host, host->storage, loads) to complete, and
        for the deferred backups that room freed by those copies lets start.

        A retry that finds no room may still have queued a write: host eviction writes a
        victim back (``tiered``) and drops it only once it landed. That write is waited for
        too, and the backup retried after it: returning then left the write queued and the
        backup unstarted, and storage behind the directory, after a drain."""
        while True:
            self._start_backups()
            await self.controller.drain()
            self._offer_refused_writes()  # the queue has room now: queued, so waited for below
            if not self._retry_deferred() and not self._backup_batch \
                    and not self.controller.storage_writes_pending:
                return

    async def drain_backups(self) -> None:
        """Wait for the device->host copies and loads only (storage writes may go on)."""
        self._start_backups()
        await self.controller.drain_backups()

    async def aclose(self, timeout: float | None = None, *, deadline: float | None = None) -> Any:
        """Close the controller (drains backups for up to ``timeout``, default its
        ``close_timeout_s``; reports what it could not write), the whole close ending by
        ``deadline`` (``time.monotonic()``) if given (see ``HiCacheController.aclose``).

        Safe to call again after a cancelled call (a hurried close: ``timeout=0``): the steps
        before the controller's close run once, and the controller hands the whole report to
        the next caller when the first was cancelled. Why: the cache's part of the report (the
        deferred backups, the undeleted storage pages) exists only here."""
        if not self._close_begun:
            self._close_begun = True
            self._close_cancelled_prefetches = self.prefetches.close()
            self.storage_writes.unsubscribe()
            self._start_backups()  # drained by the close, or reported
            self._offer_refused_writes()  # as is each write the queue refused (re-offered as it drains)
            self._retry_deferred()
            self.storage_writes.send_doomed()
        report = await self.controller.aclose(timeout, deadline=deadline)
        if isinstance(report, CloseReport):  # cancelled above: the controller found none left
            report.cancelled_prefetches += self._close_cancelled_prefetches
        # backups still waiting for host room: only the tree knows them, so the tree reports
        # them (committed KV that reached no tier below the device is never lost silently;
        # a node storage holds lost nothing)
        pages = sum(
            len(n.key) // self.page_size for n in self._deferred
            if self._of_this_tree(n) and n.value is not None and n.host_value is None and not n.on_storage
        )
        if pages and isinstance(report, CloseReport):
            report.deferred_backup_pages = pages
            logger.warning("cache close: %d page(s) committed on device never reached host (their backups "
                           "waited for host room)", pages)
        undeleted = self.storage_writes.undeleted()
        if undeleted and isinstance(report, CloseReport):
            report.undeleted_storage_pages = undeleted
            logger.warning("cache close: %d page(s) evicted from storage by the placement policy were never "
                           "deleted there (the store was down); it holds them past its capacity until its own "
                           "bound evicts them", undeleted)
        return report

    def sanity_check(self) -> None:
        super().sanity_check()
        for node in self._nodes():
            assert node.value is not None or node.host_value is not None, f"node without data: {node!r}"
            if node.host_value is not None:
                assert node.host_value.numel() == len(node.key), node
            assert len(node.hash_value) == len(node.key) // self.page_size, node
