"""``reuse`` and ``tiered``: write to storage what proved (or promises) reuse; keep the tiers apart.

Why each choice (``docs/placement.md`` has the measurements):

* **Admission on reuse.** Most pages of real traffic are private tails seen once (on the
  Mooncake trace 58% of unique blocks are never referenced again). Writing them to storage costs
  bandwidth and wear and pushes reused pages out of an LRU store. The host tier is the probation
  queue: a page is written to storage once it is hit while on host (``hit_count`` reaches
  ``reuse_hits``), or when it comes back after host dropped it unwritten (a ghost hit).
* **Ghost list.** A page that left host before its reuse leaves its key behind; seeing it again
  admits the recomputed page, so reuse distances longer than the host tier still reach storage.
* **Exclusive host (tiered).** A page already in storage costs only a storage read when host
  drops it; a page storage lacks is lost. So host evicts storage-backed leaves first, and the two
  tiers hold more distinct pages than an inclusive nest.
* **Early admission of long prompts (tiered).** A long prompt is a document, a codebase or an
  agent's accumulated context: expensive to recompute (attention cost grows with depth) and the
  kind of prefix users come back to. Its body (all but the last ``tail_tokens``, the question that
  is private to this turn) is admitted on first sight, so the first follow-up already hits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.placement.base import PlacementPolicy, node_end_tokens
from hicache.placement.ghost import GhostList
from hicache.placement.stored import StoredPages

if TYPE_CHECKING:
    from hicache.prefix_cache.node import TreeNode

__all__ = ["ReusePlacement", "TieredPlacement"]

_STORAGE_EVICTIONS = ("tree", "backend")

#: keys of long-prompt bodies remembered at least (about 14 MiB of 64-hex keys at most)
_EARLY_KEYS_MIN = 1 << 16


class ReusePlacement(PlacementPolicy):
    """Storage admission on proven reuse; host evicts LRU.

    Args:
        ghost_pages: keys of pages dropped from host unwritten that are remembered (0: none).
        reuse_hits: ``hit_count`` at which a node's pages are admitted (an insert counts 1).
    """

    name = "reuse"

    def __init__(self, *, ghost_pages: int = 1 << 16, reuse_hits: int = 2) -> None:
        if reuse_hits < 1:
            raise ValueError(f"reuse_hits must be at least 1, got {reuse_hits}")
        self.ghost = GhostList(ghost_pages)
        self.reuse_hits = reuse_hits
        # page keys admitted before their node was hit (ghost hits; ``tiered`` keeps its early
        # admissions apart); bounded like the ghost list they come from, since a page may leave
        # the tree before it is ever written
        self._wanted = GhostList(max(1, ghost_pages))
        self.early_pages = 0

    def host_key(self, node: TreeNode) -> tuple[Any, ...]:
        return (node.last_access_time,)

    def storage_pages(self, node: TreeNode) -> int:
        return self.admitted_pages(node)

    def admitted_pages(self, node: TreeNode) -> int:
        """How many of ``node``'s pages, from its first, proved (or promise) reuse."""
        keys = node.hash_value
        if node.hit_count >= self.reuse_hits:
            return len(keys)
        n = 0
        while n < len(keys) and self._admitted(keys[n]):
            n += 1
        return n

    def _admitted(self, key: str) -> bool:
        """Whether page ``key`` was admitted ahead of its node's hits (a ghost hit)."""
        return key in self._wanted

    def on_new_node(self, node: TreeNode) -> None:
        returned = [k for k in node.hash_value if self.ghost.take(k)]
        if returned:
            self._wanted.add(returned)

    def on_host_evicted(self, node: TreeNode) -> None:
        if not node.on_storage:
            self.ghost.add(node.hash_value[node.storage_pages :])

    def stats(self) -> dict[str, int]:
        return {"ghost_hits": self.ghost.hits, "ghost_pages": len(self.ghost), "early_admitted_pages": self.early_pages}


class TieredPlacement(ReusePlacement):
    """:class:`ReusePlacement` plus an exclusive host and early admission of long prompts.

    Args (beyond :class:`ReusePlacement`'s):
        long_prompt_tokens: prompts at least this long have their body admitted on first sight
            (``None``: never).
        tail_tokens: the last tokens of such a prompt are left out (the turn's own question).
        storage_eviction: ``"tree"``: storage evicts leaves of the stored subtree, least
            recently used in any tier first (:class:`~hicache.placement.stored.StoredPages`),
            through the backend's ``batch_delete``; ``"backend"``: the backend's own bound.
            ``"tree"`` needs ``storage_capacity_pages`` and a backend that deletes; without
            them the backend's bound applies.
        storage_capacity_pages: pages storage holds (the stack passes its storage size).
    """

    name = "tiered"

    def __init__(
        self,
        *,
        ghost_pages: int = 1 << 16,
        reuse_hits: int = 2,
        long_prompt_tokens: int | None = 32768,
        tail_tokens: int = 2048,
        storage_eviction: str = "tree",
        storage_capacity_pages: int | None = None,
    ) -> None:
        super().__init__(ghost_pages=ghost_pages, reuse_hits=reuse_hits)
        if storage_eviction not in _STORAGE_EVICTIONS:
            raise ValueError(f"storage_eviction must be one of {list(_STORAGE_EVICTIONS)}, got {storage_eviction!r}")
        if storage_capacity_pages is not None and storage_capacity_pages < 1:
            raise ValueError(f"storage_capacity_pages must be positive or None, got {storage_capacity_pages}")
        self.storage_eviction = storage_eviction
        if storage_eviction == "tree" and storage_capacity_pages is not None:
            self.stored = StoredPages(storage_capacity_pages)
        if long_prompt_tokens is not None and long_prompt_tokens <= 0:
            raise ValueError(f"long_prompt_tokens must be positive or None, got {long_prompt_tokens}")
        if tail_tokens < 0:
            raise ValueError(f"tail_tokens must not be negative, got {tail_tokens}")
        self.long_prompt_tokens = long_prompt_tokens
        self.tail_tokens = tail_tokens
        # keys of long-prompt bodies admitted on first sight, kept until host drops the pages
        # (write-back at eviction reads them then). A bound of their own: they shared the ghost
        # list's (``ghost_pages``), so a ghost list of 0 ("none") or one shorter than a body
        # admitted no body at all (admission is a leading run: a body's first keys went first).
        # The policy is not told the tree's size; storage's capacity, where known, is the tier
        # these pages are meant for, and a floor covers stacks that give none
        self._early = GhostList(max(_EARLY_KEYS_MIN, 2 * (storage_capacity_pages or 0)))

    def host_key(self, node: TreeNode) -> tuple[Any, ...]:
        # Nodes storage (mostly) holds go first: dropping them costs a read, not a recompute.
        # "Mostly": a long prompt's node is admitted but for its tail, whose few pages are the
        # least likely to be reused; counting it as private would pin the whole body on host.
        stored, pages = node.storage_pages, len(node.hash_value)
        return (0 if stored and 4 * stored >= 3 * pages else 1, node.last_access_time)

    def storage_pages(self, node: TreeNode) -> int:
        return 0  # nothing is written while host keeps it: see victim_pages

    def victim_pages(self, node: TreeNode) -> int:
        return self.admitted_pages(node)

    def _admitted(self, key: str) -> bool:
        """A ghost hit's page, or a page of a long prompt's body admitted on first sight."""
        return key in self._wanted or key in self._early

    def on_new_node(self, node: TreeNode) -> None:
        super().on_new_node(node)
        if self.long_prompt_tokens is None or not node.hash_value:
            return
        if node_end_tokens(node) < self.long_prompt_tokens:
            return
        page = len(node.key) // len(node.hash_value)
        body = len(node.hash_value) - -(-self.tail_tokens // page)
        if body > 0:
            # only what the bound keeps, from the first page (a body's later pages are admitted
            # only behind its first), and only that is counted as admitted
            kept = node.hash_value[: min(body, self._early.capacity)]
            self._early.add(kept)
            self.early_pages += len(kept)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        if self.stored is not None:
            out.update(stored_pages=len(self.stored), storage_evicted_pages=self.stored.evicted_pages,
                       storage_removed_by_backend_pages=self.stored.removed_pages)
        return out
