"""The scheduler's map of the workers' host pools: hicache's radix tree over host page slots.

Why the scheduler owns the host pool's layout: vLLM runs the scheduler and the workers in
different processes, and the scheduler must answer "how much of this prompt is cached" at once,
without asking a worker. So the scheduler decides which host page slot holds which page (the
slots of every worker's :class:`~hicache.memory.host_pool.HostKVPool` are laid out alike), and
the workers only do what each step's metadata says. The tree is hicache's
:class:`~hicache.prefix_cache.radix.RadixCache`, keyed by token ids under the request's salt
(the same root the page-key chain has), with its eviction policies and its incremental
eviction index; a node's slots are host page slots instead of device ones.

Nothing the scheduler believes can turn into garbage KV: a worker checks, for every page it
loads from its host pool, that the slot holds the key the scheduler names, and reports a slot
that does not (:meth:`HostPageTree.drop_slots` then forgets what the tree held there).

Locks: a node whose pages a worker is still writing to storage is locked (so its slots are not
given to other pages while the write reads them) until every worker reported the write done.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from hicache.integrations.vllm.host_pool import slot_indices
from hicache.memory.allocator import PagedTokenAllocator
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.radix import RadixCache
from hicache.prefix_cache.types import EvictParams, InsertParams, MatchPrefixParams, RadixKey

__all__ = ["HostMatch", "HostPageTree"]

logger = logging.getLogger("hicache.integrations.vllm")


class _SlotTree(RadixCache):
    """hicache's radix tree whose "device" slots are host page slots; the two walks the host
    tier needs beyond the tree's own interface."""

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """Slots from the root through ``node``."""
        return self._path_slots(node)

    def drop_subtree(self, node: TreeNode) -> int | None:
        """Free ``node`` and everything below it; ``None`` (nothing dropped) when a lock is
        held anywhere in it. Returns the tokens freed."""
        subtree = [node]
        i = 0
        while i < len(subtree):
            subtree.extend(subtree[i].children.values())
            i += 1
        if any(n.lock_ref for n in subtree):
            return None
        return sum(self._evict_device_node(n) for n in reversed(subtree))  # leaves first

    def nodes_holding(self, slots: set[int]) -> list[TreeNode]:
        ps = self.page_size
        return [n for n in self._nodes() if n.value is not None
                and slots.intersection(int(i) // ps for i in n.value[::ps].tolist())]


class HostMatch:
    """The leading pages of a prompt the host pools hold: ``slots[i]`` holds page ``i``;
    ``node`` is the deepest node of the match (lock it to keep the pages)."""

    __slots__ = ("node", "slots")

    def __init__(self, node: TreeNode, slots: list[int]) -> None:
        self.node = node
        self.slots = slots

    @property
    def pages(self) -> int:
        return len(self.slots)


class HostPageTree:
    """``num_pages`` host page slots, and which page prefixes they hold."""

    def __init__(self, num_pages: int, block_size: int, *, eviction_policy: str = "lru") -> None:
        if num_pages < 1 or block_size < 1:
            raise ValueError(f"bad host tier: {num_pages} pages of {block_size} tokens")
        self.block_size = block_size
        self.num_pages = num_pages
        self.allocator = PagedTokenAllocator(num_pages * block_size, block_size, "cpu")
        self.tree = _SlotTree(
            req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator, page_size=block_size,
            eviction_policy=eviction_policy,
        )
        self.stats: dict[str, int] = dict.fromkeys(("evicted_pages", "dropped_pages", "alloc_failures"), 0)

    # ------------------------------------------------------------------ slots <-> token indices
    def _slots(self, indices: torch.Tensor) -> list[int]:
        return [int(i) // self.block_size for i in indices[:: self.block_size].tolist()]

    def _indices(self, slots: Sequence[int]) -> torch.Tensor:
        return slot_indices(slots, self.block_size)

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: Sequence[int], salt: str | None, max_pages: int, *, count_hit: bool = True) -> HostMatch:
        """The longest run of the first ``max_pages`` pages of ``tokens`` the host pools hold."""
        n = max(0, min(max_pages, len(tokens) // self.block_size)) * self.block_size
        key = RadixKey(list(tokens[:n]), salt)
        result = self.tree.match_prefix(MatchPrefixParams(key=key), count_hit=count_hit)
        return HostMatch(result.last_device_node, self._slots(result.device_indices))

    # ------------------------------------------------------------------ slots
    def reserve(self, num_pages: int, keep: TreeNode | None = None, *, partial: bool = False) -> list[int] | None:
        """``num_pages`` free slots, evicting unlocked leaves by policy for room (never ``keep``
        or its ancestors); ``None`` when not that many can be freed, or with ``partial`` as
        many as can be (``None`` when none)."""
        if num_pages <= 0:
            return []
        bs = self.block_size
        if keep is not None:
            self.tree.inc_lock_ref(keep)
        try:
            if partial:  # every unlocked page can be evicted: locks reach up to the root
                room = (self.allocator.available_size() + self.tree.evictable_size()) // bs
                num_pages = min(num_pages, room)
                if num_pages <= 0:
                    self.stats["alloc_failures"] += 1
                    return None
            need = num_pages * bs
            got = self.allocator.alloc(need)
            if got is None:
                before = self.allocator.available_size()
                self.stats["evicted_pages"] += self.tree.evict(EvictParams(need - before)).num_tokens_evicted // bs
                got = self.allocator.alloc(need)
        finally:
            if keep is not None:
                self.tree.dec_lock_ref(keep)
        if got is None:
            self.stats["alloc_failures"] += 1
            return None
        return self._slots(got)

    def release(self, slots: Iterable[int]) -> None:
        """Give back slots that never joined the tree (staging for one step)."""
        slots = list(slots)
        if slots:
            self.allocator.free(self._indices(slots))

    # ------------------------------------------------------------------ insert, locks
    def insert(self, tokens: Sequence[int], salt: str | None, prefix: HostMatch, slots: Sequence[int]) -> TreeNode:
        """Pages ``[prefix.pages, prefix.pages + len(slots))`` of ``tokens`` now live in
        ``slots`` (the pages before them are ``prefix``, a match made in this same call
        sequence). Returns the node of the last page. Slots the tree did not take (it held the
        page already) are given back."""
        bs = self.block_size
        end = prefix.pages + len(slots)
        key = RadixKey(list(tokens[: end * bs]), salt)
        value = self._indices([*prefix.slots, *slots])
        result = self.tree.insert(InsertParams(key=key, value=value))
        node = result.last_device_node
        held = self._slots(self.tree.path_slots(node))
        extra = [s for s, h in zip(slots, held[prefix.pages :]) if s != h]
        if len(held) != end:  # cannot happen: the path was just inserted
            extra = list(slots)
        self.release(extra)
        return node

    def lock(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        if node.tree is not self.tree.root_node.tree:
            return
        try:
            self.tree.dec_lock_ref(node)
        except RuntimeError:  # a lock released twice: a bug here, never a reason to stop vLLM
            logger.exception("hicache: host tier lock bookkeeping is off")

    # ------------------------------------------------------------------ repair
    def drop_slots(self, bad: Iterable[int]) -> int:
        """A worker found that these slots do not hold what the tree says: forget the nodes
        holding them (with the pages after them, unreachable now). Locked subtrees stay until
        their write is done; the worker keeps refusing their pages meanwhile. Returns the pages
        dropped."""
        bad = set(bad)
        if not bad:
            return 0
        dropped = 0
        for node in self.tree.nodes_holding(bad):
            if node.parent is not None:  # not gone with an earlier victim's subtree
                dropped += (self.tree.drop_subtree(node) or 0) // self.block_size
        self.stats["dropped_pages"] += dropped
        return dropped

    def held_pages(self) -> int:
        return self.tree.total_size() // self.block_size
