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
that does not (:meth:`~.scheduler_side.SchedulerSide.on_report` then forgets what the tree
held there).

Locks: a node whose pages a worker is still writing to storage is locked (so its slots are not
given to other pages while the write reads them) until every worker reported the write done.
A node that must go while it is locked (a worker reported one of its slots bad) still goes at
once, so no match finds it again: :meth:`HostPageTree.drop_subtree` then keeps the slots a
write still reads out of the allocator (``keep``) and the caller gives them back when the write
ends.

Durability: the tree also knows which slots hold a page that storage has (``stored``) or is
being written to it (``writing``). The scheduler writes a page again when storage may lack it
(an earlier write failed or was refused): a page storage lacks makes every later page of its
prefix unreachable after a restart.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch

from hicache.integrations.vllm.host_pool import page_slots, slot_indices
from hicache.memory.allocator import PagedTokenAllocator
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.radix import RadixCache
from hicache.prefix_cache.types import EvictParams, InsertParams, MatchPrefixParams, RadixKey

__all__ = ["HostMatch", "HostPageTree"]

logger = logging.getLogger("hicache.integrations.vllm")


class _SlotTree(RadixCache):
    """hicache's radix tree whose "device" slots are host page slots; the walks the host tier
    needs beyond the tree's own interface."""

    #: called with the page slots the tree frees (eviction, drops): they hold nothing now;
    #: only while ``watched`` is not empty (the slots the hook cares about: none, no call)
    on_free: Callable[[list[int]], None] | None = None
    watched: set[int] | None = None

    def _free(self, indices: torch.Tensor) -> None:
        if self.on_free is not None and self.watched and indices.numel():
            self.on_free(page_slots(indices, self.page_size))
        super()._free(indices)

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """Slots from the root through ``node``."""
        return self._path_slots(node)

    def attached(self, node: TreeNode) -> bool:
        """``node`` is still in this tree (not dropped or evicted)."""
        while node is not None and node is not self.root_node:
            if node.parent is None or node.tree is not self.root_node.tree:
                return False
            node = node.parent
        return node is self.root_node

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and everything below it, parents before children."""
        nodes = [node]
        i = 0
        while i < len(nodes):
            nodes.extend(nodes[i].children.values())
            i += 1
        return nodes

    def drop_subtree(self, node: TreeNode, keep: Iterable[int] = ()) -> int | None:
        """Forget ``node`` and everything below it; ``None`` (nothing dropped) when a lock is
        held anywhere in it. Slots in ``keep`` stay allocated (a storage write still reads
        them: the caller frees them when it ends); the others are freed. Returns the tokens
        dropped."""
        subtree = self.subtree(node)
        if any(n.lock_ref for n in subtree):
            return None
        keep = set(keep)
        ps = self.page_size
        dropped = 0
        for n in reversed(subtree):  # leaves first
            if n.value is not None:
                value = self._drop_device(n)
                dropped += int(value.numel())
                if keep:
                    mask = torch.tensor([s not in keep for s in page_slots(value, ps)], dtype=torch.bool)
                    value = value.reshape(-1, ps)[mask].reshape(-1)
                self._free(value)
            self._delete_leaf(n)
        return dropped

    def nodes_holding(self, slots: set[int]) -> list[TreeNode]:
        ps = self.page_size
        return [n for n in self._nodes() if n.value is not None and slots.intersection(page_slots(n.value, ps))]

    def node_slots(self, nodes: Iterable[TreeNode]) -> set[int]:
        return {s for n in nodes if n.value is not None for s in page_slots(n.value, self.page_size)}


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
        #: slots whose page storage holds (a write every worker finished), and slots a write
        #: still reads (count of writes); a freed slot holds nothing and leaves ``stored``
        self.stored: set[int] = set()
        self.writing: Counter[int] = Counter()
        self.tree.on_free = self._forget_stored
        self.tree.watched = self.stored

    # ------------------------------------------------------------------ slots <-> token indices
    def _slots(self, indices: torch.Tensor) -> list[int]:
        return page_slots(indices, self.block_size)

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
                num_pages = min(num_pages, self.room())
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

    def room(self, keep: TreeNode | None = None) -> int:
        """Pages :meth:`reserve` could hand out now with ``keep`` (and its ancestors) kept: the
        free ones and every unlocked one eviction may take."""
        if keep is not None:
            self.tree.inc_lock_ref(keep)
        try:
            return (self.allocator.available_size() + self.tree.evictable_size()) // self.block_size
        finally:
            if keep is not None:
                self.tree.dec_lock_ref(keep)

    def release(self, slots: Iterable[int]) -> None:
        """Give back slots that never joined the tree (staging for one step)."""
        slots = list(slots)
        if slots:
            self._forget_stored(slots)
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
    def attached(self, node: TreeNode) -> bool:
        return self.tree.attached(node)

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        return self.tree.subtree(node)

    def nodes_holding(self, slots: Iterable[int]) -> list[TreeNode]:
        """Nodes holding any of ``slots``, each one only if no ancestor is in the list too
        (dropping the ancestor drops it)."""
        found = self.tree.nodes_holding(set(slots))
        ids = {id(n) for n in found}
        out = []
        for n in found:
            p = n.parent
            while p is not None and id(p) not in ids:
                p = p.parent
            if p is None:
                out.append(n)
        return out

    def node_slots(self, nodes: Iterable[TreeNode]) -> set[int]:
        return self.tree.node_slots(nodes)

    def cut_at(self, node: TreeNode, slots: set[int]) -> TreeNode:
        """Split ``node`` before its first page in ``slots`` (the pages before it are fine and
        stay); returns the node that now starts with that page (``node`` itself: a split
        gives the pages before to a new parent)."""
        pages = self._slots(node.value) if node.value is not None else []
        first = next((i for i, slot in enumerate(pages) if slot in slots), 0)
        if first > 0:
            self.tree._split(node, first * self.block_size)
        return node

    def drop_subtree(self, node: TreeNode, keep: Iterable[int] = ()) -> int | None:
        """Forget ``node`` and the pages after it (unreachable without it), except that slots
        in ``keep`` are not freed (see :meth:`_SlotTree.drop_subtree`). ``None`` when a lock
        is held in it. Returns the pages dropped."""
        if not self.tree.attached(node):
            return 0
        tokens = self.tree.drop_subtree(node, keep)
        if tokens is None:
            return None
        self.stats["dropped_pages"] += tokens // self.block_size
        return tokens // self.block_size

    def clear(self, keep: Iterable[int] = ()) -> int:
        """Forget every page (the caller released every lock first); slots in ``keep`` stay
        allocated. Returns the pages dropped."""
        keep = set(keep)
        dropped = 0
        for child in list(self.tree.root_node.children.values()):
            dropped += self.drop_subtree(child, keep) or 0
        return dropped

    # ------------------------------------------------------------------ durability
    def known(self, slot: int) -> bool:
        """Storage holds the page in ``slot``, or a write of it is under way."""
        return slot in self.stored or self.writing[slot] > 0

    def begin_writing(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.writing[slot] += 1

    def end_writing(self, slots: Iterable[int], stored: Iterable[int]) -> None:
        """A write of ``slots`` ended; storage holds the pages of ``stored`` now."""
        for slot in slots:
            if self.writing[slot] > 1:
                self.writing[slot] -= 1
            else:
                self.writing.pop(slot, None)
        self.stored.update(stored)

    def _forget_stored(self, slots: Iterable[int]) -> None:
        self.stored.difference_update(slots)

    def held_pages(self) -> int:
        return self.tree.total_size() // self.block_size
