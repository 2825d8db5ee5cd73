"""``RadixCache``: a page-granular radix tree over device KV slots.

Why a radix tree: requests that share a prompt prefix (a system prompt, a conversation so far)
share KV, and the longest cached prefix of a new request is one walk from the root. Keys are
cut to whole pages because KV slots are allocated, copied and stored a page at a time; a
trailing partial page is never cached. A node is split where a new key diverges from it, so
every node is shared by all keys that pass through it.

This class manages one tier (device). :class:`~hicache.prefix_cache.hiradix.HiRadixCache`
extends it with host and storage tiers through the hooks ``_on_new_node``, ``_on_hit``,
``_evict_device_node`` and ``_match_extra``.

Everything here runs on one thread (the server's event loop); nothing blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch

from hicache.prefix_cache.base import BasePrefixCache
from hicache.prefix_cache.eviction_index import EvictionIndex
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.policy import eviction_key
from hicache.prefix_cache.req import Req
from hicache.memory.slots import cat_slots, copy_slots, empty_slots
from hicache.prefix_cache.tokens import TokenRun, is_packed, key_run, pack_tokens, page_key
from hicache.prefix_cache.types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)

__all__ = ["RadixCache", "free_token_pages"]

logger = logging.getLogger("hicache.prefix_cache")


def free_token_pages(allocator: Any, indices: torch.Tensor, page_size: int) -> None:
    """Free every page touched by token slots ``indices`` (each page once).

    A request's slot row may end in a partly used page, or list only the used slots of it; the
    allocator works in whole pages, so the pages are recovered from the slots.
    """
    if indices is None or indices.numel() == 0:
        return
    idx = indices.reshape(-1).to("cpu", torch.int64)
    n = idx.numel()
    if n % page_size == 0 and int(idx[0]) % page_size == 0 and int(idx[-1]) % page_size == page_size - 1:
        try:
            allocator.free(idx)  # the common case: whole pages, validated by the allocator
            return
        except ValueError:
            pass  # not whole pages after all: free the pages the slots touch
    pages = torch.unique(idx // page_size)
    allocator.free((pages[:, None] * page_size + torch.arange(page_size)).reshape(-1))


class RadixCache(BasePrefixCache):
    """Radix prefix cache over a paged device KV pool.

    Args:
        req_to_token_pool: ``ReqToTokenPool`` whose rows list each request's KV slots.
        token_to_kv_pool_allocator: device allocator (``alloc``/``free``/``available_size``).
        page_size: tokens per page; keys are cut to whole pages.
        eviction_policy: ``lru``, ``lfu``, ``slru`` or ``priority``.
        disable: behave as a cache that never hits (inserts free their slots).
    """

    def __init__(
        self,
        *,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        page_size: int,
        eviction_policy: str = "lru",
        disable: bool = False,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy: str = eviction_policy
        self._evict_key = eviction_key(eviction_policy)
        self.device = getattr(token_to_kv_pool_allocator, "device", torch.device("cpu"))
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drop the whole tree. Memory the tree held is *not* freed here: callers reset their
        allocators together with the cache (as SGLang's scheduler does on flush)."""
        self.root_node = TreeNode()
        self.root_node.tree = object()  # every node of this tree inherits it (see _note)
        self.root_node.lock_ref = 1
        self.root_node.value = torch.empty((0,), dtype=torch.int64)
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._clock = 0
        #: unlocked device leaves in policy order (see :mod:`~hicache.prefix_cache.eviction_index`)
        self._device_index = EvictionIndex(self._is_device_leaf, self._evict_key)
        self._eviction_indexes: list[EvictionIndex] = [self._device_index]
        #: candidates a rescan found that no change had noted (a bug if ever non-zero)
        self.eviction_index_repairs = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        """No slots on this tree's device (see :func:`~hicache.memory.slots.empty_slots`)."""
        return empty_slots(self.device)

    def _child_key(self, extra_key: str | None, tokens: list[int] | TokenRun, pos: int) -> tuple[Any, ...]:
        return (extra_key, page_key(tokens[pos : pos + self.page_size]))

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def root_node_handle(self, extra_key: str | None = None) -> TreeNode:
        return self.root_node

    def is_root(self, node: Any) -> bool:
        return node is self.root_node

    # ------------------------------------------------------------------ size accounting

    def _add_device(self, node: TreeNode, value: torch.Tensor) -> None:
        node.value = value
        if node.lock_ref > 0:
            self.protected_size_ += len(node.key)
        else:
            self.evictable_size_ += len(node.key)
        self._note(node)

    def _drop_device(self, node: TreeNode) -> torch.Tensor:
        value = node.value
        assert value is not None
        node.value = None
        if node.lock_ref > 0:
            self.protected_size_ -= len(node.key)
        else:
            self.evictable_size_ -= len(node.key)
        self._note(node)
        self._note(node.parent)  # may be a device leaf now
        return value

    def _note(self, node: TreeNode | None) -> None:
        """``node`` changed in a way that may make it an eviction candidate (see
        :mod:`~hicache.prefix_cache.eviction_index`). Every such change must call this.

        Nodes of a tree dropped by :meth:`reset` are ignored: a lock released on one after the
        reset must not put it, and slots the new tree may own, up for eviction."""
        if node is not None and node is not self.root_node and self._of_this_tree(node):
            for index in self._eviction_indexes:
                index.note(node)

    def _of_this_tree(self, node: TreeNode) -> bool:
        """Whether ``node`` belongs to this tree, not to one :meth:`reset` dropped (whose
        nodes live on in the requests, copies and loads that still hold them)."""
        return node.tree is self.root_node.tree

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens on device held by the tree."""
        return self.evictable_size_ + self.protected_size_

    # ------------------------------------------------------------------ walking

    def _match_len(self, node_key: TokenRun, tokens: list[int] | TokenRun, pos: int, end: int) -> int:
        """Whole-page length of the common prefix of ``node_key`` and ``tokens[pos:end]``
        (the first page is known to match: it is the child key).

        Runs for every node of every walk, on keys of up to the whole prompt: the request's
        part is packed (unless ``tokens`` is packed already) and compared with the packed node
        key in one C-level comparison; only on a divergence does numpy locate it (one
        vectorised pass, no Python loop over pages).
        """
        n = len(node_key)
        limit = n if n <= end - pos else end - pos
        seg = tokens[pos : pos + limit]
        if type(seg) is not TokenRun:
            seg = pack_tokens(seg)
        if limit == n:
            if node_key == seg:
                return n
        elif node_key[:limit] == seg:
            return limit
        same = np.frombuffer(node_key, node_key.typecode)[:limit] == np.frombuffer(seg, seg.typecode)
        first = int(same.argmin())  # the first differing token (one exists)
        return first - first % self.page_size

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; returns the new parent holding the first part.

        Locks, protections and operations in flight are copied to the new parent: every one of
        them passes through it too. Sizes do not change.
        """
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key) and m % ps == 0
        head, tail = self._cut_key(child.key, m)
        new = TreeNode(parent=parent, extra_key=child.extra_key, key=head)
        new.value = child.value[:m] if child.value is not None else None
        new.host_value = child.host_value[:m] if child.host_value is not None else None
        pages = m // ps
        new.hasher = child.hasher
        if child._hash_value is not None:
            new.hash_value = child.hash_value[:pages]
        else:  # not computed yet: both halves compute theirs from their own keys when asked
            new._hash_value = None
        new.storage_pages = min(child.storage_pages, pages)
        new.lock_ref = child.lock_ref
        new.host_ref = child.host_ref
        new.last_access_time = child.last_access_time
        new.hit_count = child.hit_count
        new.priority = child.priority
        new.backup_op = child.backup_op
        new.storage_op = child.storage_op
        parent.children[self._child_key(child.extra_key, head, 0)] = new
        child.key = tail
        child.value = child.value[m:] if child.value is not None else None
        child.host_value = child.host_value[m:] if child.host_value is not None else None
        if child._hash_value is not None:
            child.hash_value = child.hash_value[pages:]
        child.storage_pages = max(0, child.storage_pages - pages)
        child.parent = new
        new.children[self._child_key(child.extra_key, child.key, 0)] = child
        self._note(new)
        self._on_split(child, new)
        return new

    @staticmethod
    def _cut_key(key: TokenRun, m: int) -> tuple[TokenRun, TokenRun]:
        """``key[:m]`` and ``key[m:]``, with ``key`` itself reused as the larger part.

        Why: a node's key can be a whole document, and a split used to copy it twice into
        new memory; where first touching memory is slow (a VM) one split of the radix
        benchmark measured up to 1.7 ms, the whole replay's splits 0.34 s. Only the smaller
        part is copied now; the larger one is the old array, cut in place (a truncation, or a
        move inside memory already touched). Node keys are never shared (every one is a
        slice or a packing of its own), so nothing else sees the cut; an array something
        still reads through a buffer cannot be resized, and is then copied as before."""
        try:
            if m <= len(key) - m:
                head = key[:m]
                del key[:m]
                return head, key
            tail = key[m:]
            del key[m:]
            return key, tail
        except BufferError:  # exported (a live memoryview or numpy view of it): copy both
            return key[:m], key[m:]

    def _on_split(self, child: TreeNode, new: TreeNode) -> None:
        """``new`` now holds the first part of ``child``'s pages."""

    def _walk(self, key: RadixKey, end: int) -> list[TreeNode]:
        """Nodes matching ``key.token_ids[:end]`` from the root (splitting the last one where
        the key diverges inside it)."""
        tokens = key.token_ids
        node = self.root_node
        pos = 0
        path: list[TreeNode] = []
        if end and not is_packed(tokens) and self._child_key(key.extra_key, tokens, 0) in node.children:
            tokens = key_run(key, end)  # packed once (and kept for the insert) only on a hit
        while pos < end:
            child = node.children.get(self._child_key(key.extra_key, tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos, end)
            if m < len(child.key):
                child = self._split(child, m)
            path.append(child)
            pos += m
            node = child
        return path

    # ------------------------------------------------------------------ match

    def _key_of(self, params: MatchPrefixParams) -> RadixKey:
        key = params.key
        if not isinstance(key, RadixKey):
            key = RadixKey(list(key))
        if key.extra_key is None and params.req is not None and params.req.extra_key is not None:
            key = RadixKey(key.token_ids, params.req.extra_key)
        return key

    def match_prefix(self, params: MatchPrefixParams, *, count_hit: bool = True) -> MatchResult:
        """Longest cached whole-page prefix of ``params.key``.

        Walks through nodes whose device copy was evicted (their KV is on host), so the result
        reports the device hit (``device_indices``), the host hit after it
        (``host_hit_length``) and the deepest node with KV anywhere (``last_host_node``), where
        a storage lookup continues. ``count_hit=False`` (ours) looks without counting a hit
        (a re-match of the same request).
        """
        if self.disable:
            return MatchResult(self._empty(), self.root_node, self.root_node, self.root_node, 0)
        key = self._key_of(params)
        path = self._walk(key, self._aligned(len(key)))
        now = self._tick()
        # None as SGLang's Req has it without priority scheduling (SGLang reads it as 0)
        priority = (params.req.priority or 0) if params.req is not None else 0
        for node in path:
            node.last_access_time = now
            node.priority = max(node.priority, priority)
        return self._result(path, hit=count_hit)

    def _result(self, path: list[TreeNode], *, hit: bool) -> MatchResult:
        values: list[torch.Tensor] = []
        last_device = self.root_node
        last_any = self.root_node
        host_len = 0
        on_device = True
        for node in path:
            if on_device and node.value is not None:
                values.append(node.value)
                last_device = node
            elif node.host_value is not None:
                on_device = False
                host_len += len(node.key)
            else:
                break
            last_any = node
            if hit:
                node.hit_count += 1
                self._on_hit(node)
        if len(values) == 1:
            # the whole device hit is one node's slots (most hits: 8.16M of the radix
            # benchmark's 8.3M matched tokens): shared, not copied; detach() is a new tensor
            # object (so a caller reshaping its result in place leaves the node's alone) at
            # 0.8 us, where the copy cost 9 us per 24k slots in warm memory and several times
            # that in fresh memory (the benchmark's slowest runs)
            device_indices = values[0].detach()
        else:
            device_indices = cat_slots(values, self._empty)
        return MatchResult(
            device_indices=device_indices,
            last_device_node=last_device,
            last_host_node=last_any,
            best_match_node=last_any,
            host_hit_length=host_len,
            cache_protected_len=int(device_indices.numel()),
            full_kv_hit_length=int(device_indices.numel()) + host_len,
        )

    def storage_prior_hash(self, node: Any, extra_key: str | None) -> str | None:
        """The chain hash storage keys continue from after ``node`` (a match's
        ``last_host_node``); ``None`` without a storage tier. Not part of a match result:
        only a storage lookup needs it (see :class:`~hicache.prefix_cache.types.MatchResult`)."""
        return None

    # ------------------------------------------------------------------ insert

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert page-aligned ``params.key`` with device slots ``params.value``.

        Returns the length already on device (the caller frees its duplicate slots there).
        Slots of nodes whose device copy was evicted are adopted (the node is revived), as are
        the slots of the new suffix.
        """
        key = params.key
        assert key is not None and params.value is not None
        end = self._aligned(len(key))
        value = params.value
        # packed once, before the tree changes: a bad token id fails here, and every
        # comparison and the new node's key are slices of it
        tokens = key_run(key, end)
        self._check_run(tokens)
        node = self.root_node
        pos = 0
        prefix_len = 0
        now = self._tick()
        priority = params.priority or 0  # None: no priority scheduling (SGLang's Req), as 0
        while pos < end:
            child = node.children.get(self._child_key(key.extra_key, tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos, end)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            if child.value is None:
                self._add_device(child, copy_slots(value, pos, pos + m))
                self._on_revive(child)
            else:
                if prefix_len == pos:
                    prefix_len += m
                if pos + m > params.inserted_len:  # not a node this request already counted
                    child.hit_count += 1
                    self._on_hit(child)
            pos += m
            node = child
        if pos < end:
            new = TreeNode(parent=node, extra_key=key.extra_key, key=tokens[pos:end])
            new.last_access_time = now
            new.priority = priority
            new.hit_count = 1
            node.children[self._child_key(key.extra_key, tokens, pos)] = new
            self._add_device(new, copy_slots(value, pos, end))
            self._on_new_node(new)
            node = new
        return InsertResult(prefix_len=prefix_len, total_len=end, last_device_node=node)

    # hooks for the hierarchical subclass
    def _check_run(self, tokens: TokenRun) -> None:
        """Refuse a key before the tree changes (every token id is valid here)."""

    def _on_new_node(self, node: TreeNode) -> None:
        """A node was created with device KV."""

    def _on_revive(self, node: TreeNode) -> None:
        """An evicted node got device KV again."""

    def _on_hit(self, node: TreeNode) -> None:
        """``node.hit_count`` went up."""

    # ------------------------------------------------------------------ request lifecycle

    def _row(self, req: Req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx]

    def _free(self, indices: torch.Tensor) -> None:
        free_token_pages(self.token_to_kv_pool_allocator, indices, self.page_size)

    def cache_finished_req(self, req: Req, is_insert: bool = True, **kwargs: Any) -> None:
        """Insert a finished request's committed KV; free duplicates and the partial last page;
        release the request's lock. The ``req_pool_idx`` slot is left to the caller."""
        if req.req_pool_idx is None:
            return
        committed = req.pop_committed_kv_cache()
        row = self._row(req)
        alloc_end = max(req.kv_allocated_len, committed)
        aligned = self._aligned(committed)
        protected = req.cache_protected_len
        if self.disable or not is_insert:
            self._free(row[protected:alloc_end])
        else:
            tokens = req.full_ids[:aligned]
            key = RadixKey(tokens, req.extra_key)
            result = self.insert(InsertParams(key=key, value=row[:aligned], priority=req.priority,
                                              inserted_len=protected))
            self._free_duplicates(row, protected, aligned, result)
            if alloc_end > aligned:
                self._free(row[aligned:alloc_end])
        self._release_lock(req)

    def _release_lock(self, req: Req) -> None:
        """Drop ``req``'s lock on its prefix and forget the prefix (the request is over)."""
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = None
        req.prefix_indices = self._empty()
        req.cache_protected_len = 0

    def cache_unfinished_req(self, req: Req, chunked: bool = False, **kwargs: Any) -> None:
        """Insert the KV of ``req.fill_ids`` computed so far and move the lock to the new
        deepest node; ``req.prefix_indices`` becomes the tree's slots followed by the
        request's own unaligned tail."""
        if req.req_pool_idx is None:
            return
        tokens = list(req.fill_ids)
        n = len(tokens)
        row = self._row(req)
        kv = row[:n]
        if self.disable:
            req.prefix_indices = copy_slots(kv)
            return
        aligned = self._aligned(n)
        protected = req.cache_protected_len
        key = RadixKey(tokens[:aligned], req.extra_key)
        result = self.insert(InsertParams(key=key, value=kv[:aligned], priority=req.priority,
                                          inserted_len=protected))
        path = self._walk(key, aligned)
        # the insert just gave every node of the path device slots (evicted ones are revived)
        new_indices = cat_slots(cast("list[torch.Tensor]", [p.value for p in path]), self._empty)
        self._free_duplicates(kv, protected, aligned, result, new_indices)
        new_last = path[-1] if path else self.root_node
        if new_indices.numel() > protected:
            row[protected : new_indices.numel()] = new_indices[protected:].to(row.device)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last)
        req.prefix_indices = cat_slots([new_indices, row[new_indices.numel() : n]], self._empty)
        req.cache_protected_len = int(new_indices.numel())
        req.last_node = new_last

    def _free_duplicates(self, row: torch.Tensor, protected: int, aligned: int, result: InsertResult,
                         tree: torch.Tensor | None = None) -> None:
        """Free the request's slots in ``[protected, aligned)`` that the tree did not adopt
        (it had KV there already). Usually that is the leading run ``result.prefix_len``; but a
        node revived by the insert (host-only, given our slots) may be followed by nodes that
        were on device, whose duplicates lie past it, so compare with the tree's slots."""
        if aligned <= protected:
            return
        if tree is None:
            tree = self._path_slots(result.last_device_node)
        if int(tree.numel()) != aligned:  # cannot happen (the inserted path is on device)
            if result.prefix_len > protected:
                self._free(row[protected : result.prefix_len].clone())
            return
        mine = row[protected:aligned].to(torch.int64)
        dup = mine[mine != tree[protected:aligned].to(mine.device)]
        if dup.numel():
            self._free(dup.clone())

    def _path_slots(self, node: Any) -> torch.Tensor:
        """Device slots from the root through ``node`` (empty if one of them has none)."""
        values: list[torch.Tensor] = []
        while node is not None and node is not self.root_node:
            if node.value is None:
                return self._empty()
            values.append(node.value)
            node = node.parent
        values.reverse()
        return cat_slots(values, self._empty)

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable or node is None:
            return IncLockRefResult(delta=0)
        delta = 0
        start = node
        # a node of a tree reset() dropped (a lock taken before a flush) counts in no size of
        # this one: its lock changes, the sizes stay (see dec_lock_ref)
        mine = self._of_this_tree(node)
        while node is not self.root_node and node is not None:
            if mine and node.lock_ref == 0 and node.value is not None:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return IncLockRefResult(delta=delta, node_id=start.id)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable or node is None:
            return DecLockRefResult(delta=0)
        delta = 0
        # Why: a request admitted before a flush (reset()) releases its lock after it, on nodes
        # of the dropped tree; counted here they made the new tree's evictable_size() report
        # tokens no node holds (and protected_size() go negative), so a scheduler admitted
        # requests that then failed for memory, and each eviction walked the tree for them
        mine = self._of_this_tree(node)
        while node is not self.root_node and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}: a lock was released twice")
            if mine and node.lock_ref == 1 and node.value is not None:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._note(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    # ------------------------------------------------------------------ eviction

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_device_leaf(self, node: TreeNode) -> bool:
        if node.value is None or node.lock_ref or node is self.root_node:
            return False
        for child in node.children.values():  # a loop, not any(): this runs per noted node
            if child.value is not None:
                return False
        return True

    def evict(self, params: EvictParams | int) -> EvictResult:
        """Free device slots of unlocked leaves, in policy order, until ``num_tokens`` are
        freed or nothing evictable is left. Victims come from the eviction index, so a call
        costs O(victims x log n) rather than a walk of the tree (43 ms at 10k nodes before)."""
        need = params if isinstance(params, int) else params.num_tokens
        if self.disable or need <= 0:
            return EvictResult(0)
        index = self._device_index
        freed = 0
        tried: set[TreeNode] = set()  # each node gets one try per call
        kept: set[TreeNode] = set()  # leaves that could not go now: candidates again next call
        node: TreeNode | None = None
        rescanned = False
        try:
            while freed < need:
                node = index.pop()
                if node is None:
                    # Unlocked device tokens always include an unlocked device leaf, so an empty
                    # index with evictable tokens left (and none kept back) means a missed note.
                    if rescanned or kept or self.evictable_size_ == 0:
                        break
                    rescanned = True
                    self._repair(index)
                    continue
                if node in tried:
                    # noted again by its own failed attempt (a write-back refused by a full
                    # queue unlocks it): trying again in this call could loop forever
                    kept.add(node)
                    continue
                tried.add(node)
                got = self._evict_device_node(node)  # a freed leaf notes its parent
                if got == 0 and self._is_device_leaf(node):
                    kept.add(node)
                freed += got
                node = None
        finally:
            for n in kept:
                index.note(n)
            index.note(node)  # the node an exception interrupted, if any
        return EvictResult(num_tokens_evicted=freed)

    def _repair(self, index: EvictionIndex) -> None:
        """Rebuild ``index`` from a walk of the whole tree, and say so if it had missed any."""
        missed = len(index.missing(self._nodes()))
        index.rebuild(self._nodes())
        if missed:
            self.eviction_index_repairs += missed
            logger.warning("eviction index had missed %d candidates; rebuilt from the tree", missed)

    def _evict_device_node(self, node: TreeNode) -> int:
        """Free ``node``'s device slots; returns tokens freed. Without lower tiers the node
        goes away."""
        n = len(node.key)
        self._free(self._drop_device(node))
        self._delete_leaf(node)
        return n

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        key = self._child_key(node.extra_key, node.key, 0)
        if parent.children.get(key) is node:
            del parent.children[key]
        node.parent = None
        for index in self._eviction_indexes:
            index.discard(node)
        self._note(parent)  # may be a leaf now

    # ------------------------------------------------------------------ introspection

    def pretty_print(self) -> str:
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append("  " * depth + repr(child))
                visit(child, depth + 1)

        visit(self.root_node, 0)
        lines.append(f"#tokens on device: {self.total_size()}")
        text = "\n".join(lines)
        logger.debug("%s", text)
        return text

    def sanity_check(self) -> None:
        """Recount sizes from the tree and compare; raises ``AssertionError`` on drift."""
        evictable = protected = 0
        for node in self._nodes():
            assert node.lock_ref >= 0 and node.host_ref >= 0, node
            assert len(node.key) % self.page_size == 0 and node.key, node
            if node.value is not None:
                assert node.value.numel() == len(node.key), node
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
        assert evictable == self.evictable_size_, (evictable, self.evictable_size_)
        assert protected == self.protected_size_, (protected, self.protected_size_)
        for index in self._eviction_indexes:
            missing = index.missing(self._nodes())
            assert not missing, f"eviction candidates never noted: {missing[:5]}"

    def all_device_indices(self) -> torch.Tensor:
        """Every device slot the tree holds (for leak checks)."""
        vals = [n.value for n in self._nodes() if n.value is not None]
        return torch.cat(vals) if vals else self._empty()
