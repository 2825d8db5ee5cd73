"""Storage->host prefetch of the pages that follow a request's host hit, as the tree sees it.

The controller fetches the pages (see :mod:`hicache.controller.prefetch`); this module keeps
the tree's side of each prefetch: the anchor it continues from (protected from host eviction
by a ``host_ref`` while the fetch runs; a device eviction that finds no other room drops the
prefetch, see :meth:`Prefetches.drop_for_room`), the page keys and tokens it fetches, the
stored pages it pins in the placement's directory, and, once the pages are in the tree, the
protection admit holds on them until it has used them (:meth:`Prefetches.wait_prefetch` with
``hold``).

Why a collaborator the cache owns (``cache.prefetches``) and not a part of the cache class: the
running prefetches and the holds on fetched pages are state of their own, with their own
invariant (every anchor ``host_ref`` and every pin is released exactly once: at the finish,
the cancel, a drop for device room or the reset); the prefetch needs only a narrow slice of
the tree, spelled out as :class:`PrefetchHost`, so this module does not import the cache
class. Hanging fetched pages under their prefix is tree surgery and stays with the tree
(``_insert_host``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from hicache.controller.controller import HiCacheController
from hicache.controller.jobs import PrefetchResult
from hicache.errors import ChainGoneError
from hicache.placement import StoredPages
from hicache.prefix_cache.hashing import fast_page_hashes
from hicache.prefix_cache.node import TreeNode
from hicache.prefix_cache.tokens import TokenRun

__all__ = ["Prefetch", "PrefetchHost", "Prefetches"]


@dataclasses.dataclass(eq=False)
class Prefetch:
    anchor: TreeNode
    tokens: list[int]  # from the root through the prefetched pages
    start: int  # first prefetched token
    keys: list[str]
    extra_key: str | None
    pinned: list[str] = dataclasses.field(default_factory=list)  # stored pages kept while it reads
    owner: object = None  # the request that started it (a reused rid's cancel must not abort it)


class PrefetchHost(Protocol):
    """What :class:`Prefetches` uses of its cache (a :class:`~hicache.prefix_cache.HiRadixCache`)."""

    root_node: TreeNode
    page_size: int
    disable: bool
    controller: HiCacheController
    config: Any
    metrics: Any

    def storage_prior_hash(self, node: Any, extra_key: str | None) -> str | None: ...
    def _inc_host_ref(self, node: TreeNode) -> None: ...
    def _dec_host_ref(self, node: TreeNode) -> None: ...
    def _alloc_host_upto(self, max_tokens: int) -> torch.Tensor | None: ...
    def _free_host(self, indices: torch.Tensor) -> None: ...
    def _insert_host(self, state: Prefetch, result: PrefetchResult) -> tuple[int, TreeNode | None]: ...


class Prefetches:
    """The storage prefetches of one cache, by request id, and the holds on what they fetched.

    Args:
        cache: the tree the pages go into.
        stored: the placement's stored-page directory (prefetched pages are pinned in it while
            they are read, and touched as storage hits); ``None`` without one.
    """

    def __init__(self, cache: PrefetchHost, stored: StoredPages | None) -> None:
        self.cache = cache
        self.stored = stored
        self.running: dict[str, Prefetch] = {}
        #: rid -> [(deepest node its prefetch attached, holder)]: a host_ref kept from the end of
        #: the prefetch until admit has used the pages (see :meth:`wait_prefetch`), one per
        #: holder (requests reusing a rid may overlap); nodes of a dropped tree need no release
        self.held: dict[str, list[tuple[TreeNode, object]]] = {}

    def reset(self) -> None:
        """The tree was dropped: running prefetches are aborted (their host pages freed by the
        controller) and their pins released; the holds go with the tree's refs."""
        for rid, state in list(self.running.items()):
            self.cache.controller.abort_prefetch(rid)
            self._unpin(state)
        self.running = {}
        self.held = {}

    def close(self) -> int:
        """Cancel every prefetch and release every hold (the cache closes); returns how many
        prefetches were cancelled. Why counted here: the close report's
        ``cancelled_prefetches`` was the controller's count, and its close ran after this one,
        when no prefetch was left to count (0 however many were reading)."""
        cancelled = sum(self._abort(rid, state) for rid, state in list(self.running.items()))
        for rid in list(self.held):
            self.release_prefetched(rid)
        return cancelled

    def prefetch_from_storage(
        self,
        req_id: str,
        last_host_node: TreeNode,
        new_input_tokens: list[int],
        last_hash: str | None = None,
        *,
        prefix_tokens: list[int] | None = None,
        extra_key: str | None = None,
        owner: object = None,
    ) -> bool:
        """Start fetching the pages of ``new_input_tokens`` (which continue the prefix ending
        at ``last_host_node``) from storage into host memory. ``prefix_tokens`` are the tokens
        from the root through ``last_host_node``; ``owner`` (the request) is the only holder
        whose :meth:`cancel_prefetch` aborts it. Returns whether a prefetch started."""
        cache = self.cache
        controller = cache.controller
        if not controller.has_storage or cache.disable or req_id in self.running:
            return False
        ps = cache.page_size
        aligned = len(new_input_tokens) // ps * ps
        if aligned == 0:  # nothing left to fetch (a full hit, a partial page): no prefetch skipped
            return False
        if aligned < cache.config.prefetch_threshold:
            cache.metrics.incr("prefetch_skipped_threshold")
            return False
        tokens = list(new_input_tokens[:aligned])
        try:
            prior = last_hash if last_hash is not None else cache.storage_prior_hash(last_host_node, extra_key)
        except ChainGoneError:  # the node left the tree: nothing to continue from
            return False
        keys = fast_page_hashes(tokens, ps, prior)
        prefix = list(prefix_tokens) if prefix_tokens is not None else self._path_tokens(last_host_node)
        cache._inc_host_ref(last_host_node)
        op = None
        try:  # raised too (called off the cache's loop): the anchor must not stay held
            op = controller.start_prefetch(req_id, keys, alloc_host=cache._alloc_host_upto)
        finally:
            if op is None:
                cache._dec_host_ref(last_host_node)
        if op is None:
            return False
        pinned = self.stored.pin(keys) if self.stored is not None else []
        self.running[req_id] = Prefetch(last_host_node, prefix + tokens, len(prefix), keys, extra_key, pinned, owner)
        return True

    def prefetch_view(self, req_id: str) -> tuple[int, list[str], Any] | None:
        """``(first token, page keys, controller op)`` of ``req_id``'s running prefetch
        (the miss attribution reads how it ended); ``None`` without one."""
        state = self.running.get(req_id)
        if state is None:
            return None
        return state.start, state.keys, self.cache.controller.prefetch_op(req_id)

    def cancel_prefetch(self, req_id: str, holder: object = None) -> None:
        """Abort ``req_id``'s prefetch, if any: its host pages are freed, its anchor released
        (and the protection of pages it already attached, see :meth:`wait_prefetch`). With
        ``holder``, only that request's: a prefetch another request reusing the rid started
        (its ``owner``) and the other holders' protection stay."""
        state = self.running.get(req_id)
        if state is not None and (holder is None or state.owner is None or state.owner is holder):
            self._abort(req_id, state)
        self.release_prefetched(req_id, holder)

    def _abort(self, req_id: str, state: Prefetch) -> bool:
        """Abort the running prefetch ``state`` of ``req_id``: host pages, anchor and pins;
        whether the controller still had its op (not yet taken) to cancel."""
        cancelled = self.cache.controller.abort_prefetch(req_id)
        del self.running[req_id]
        self.cache._dec_host_ref(state.anchor)
        self._unpin(state)
        return cancelled

    def drop_for_room(self, node: TreeNode) -> bool:
        """Abort the running prefetches that continue from ``node`` or from a node below it,
        if they are all that protects it (its ``host_ref``); whether they were (none is left).

        Why: device eviction wants ``node``'s slots and ``node`` has no host copy, so it can go
        only by leaving the tree, which an anchor must not (its prefetch's pages hang below
        it, its ``host_ref`` is released along its path). A queued request's prefetch held its
        anchor until the request was admitted, finished or not, while the tree counted the
        anchor as evictable: a request that could run failed for memory nobody could free.
        Memory for a request that runs wins over a fetch for one that waits: the prefetch is
        aborted (its host pages freed, room for the backups host lacked) and its request finds
        no prefetch at admit, matches again and computes what it would have fetched; counted
        as ``prefetch_dropped_for_room``. A node an admit's hold protects (see
        :meth:`wait_prefetch`) keeps everything: that admit is using the pages."""
        through = []
        for rid, state in self.running.items():
            n: TreeNode | None = state.anchor
            while n is not None and n is not node:
                n = n.parent
            if n is not None:
                through.append((rid, state))
        if not through or len(through) != node.host_ref:
            return False
        for rid, state in through:
            self._abort(rid, state)
        self.cache.metrics.incr("prefetch_dropped_for_room", len(through))
        return True

    def release_prefetched(self, req_id: str, holder: object = None) -> None:
        """Drop the protection :meth:`wait_prefetch` (``hold``) kept on ``req_id``'s fetched
        pages; with ``holder``, only that holder's (a reused rid must not release another's)."""
        cache = self.cache
        for node, who in self.held.pop(req_id, []):
            if holder is not None and who is not holder:
                self.held.setdefault(req_id, []).append((node, who))  # another request's
            elif node.tree is cache.root_node.tree:  # a reset dropped the tree, and its refs
                cache._dec_host_ref(node)

    def _path_tokens(self, node: TreeNode) -> list[int]:
        root = self.cache.root_node
        parts: list[TokenRun] = []
        while node is not None and node is not root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for part in reversed(parts) for t in part]

    def check_prefetch_progress(self, req_id: str) -> bool:
        """Non-blocking (SGLang's scheduler polls this): ``True`` once the request may proceed
        under the stop policy; the fetched pages are then in the tree."""
        if req_id not in self.running:
            return True
        controller = self.cache.controller
        if not controller.prefetch_ready(req_id):
            return False
        self._finish_prefetch(req_id, controller.take_prefetch(req_id))
        return True

    async def wait_prefetch(self, req_id: str, *, hold: object = None) -> int:
        """Wait as the stop policy allows; returns the tokens the prefetch added to the tree.

        With ``hold`` (any object naming the holder), the pages stay protected from host
        eviction (a ``host_ref`` on the deepest, so on its whole path) until
        :meth:`release_prefetched` or :meth:`cancel_prefetch`: admit may wait (for loads, for
        device room) before it locks them, and unprotected they were host-evictable leaves
        then: dropped, recomputed, and the host hit before them counted as the storage hit.

        A ``hold`` other than the request that started the prefetch (its ``owner``: a live
        request reusing the rid) neither waits nor takes it: it got 0 and waited out the other
        request's read, and the owner then found no prefetch (its storage hit counted as host)."""
        state = self.running.get(req_id)
        if state is None or (hold is not None and state.owner is not None and state.owner is not hold):
            return 0
        result = await self.cache.controller.wait_prefetch(req_id)
        return self._finish_prefetch(req_id, result, hold, state=state)

    def _finish_prefetch(self, req_id: str, result: PrefetchResult | None, hold: object = None,
                         *, state: Prefetch | None = None) -> int:
        """``state``: the prefetch the caller waited for. Another one of the rid since (the
        request aborted while it waited, the rid reused) is left alone: popped here, it lost its
        anchor and pins, and its controller op was never taken or aborted (host pages held until
        close, and no later prefetch of the rid could start)."""
        cache = self.cache
        current = self.running.get(req_id)
        if current is None or (state is not None and current is not state):
            if result is not None:
                cache._free_host(result.host_indices)
            return 0
        del self.running[req_id]
        state = current
        cache._dec_host_ref(state.anchor)
        self._unpin(state)
        if result is not None and result.pages and self.stored is not None:
            self.stored.touch(state.keys[: result.pages])  # a storage hit
        if result is None or result.pages == 0:
            if result is not None:
                cache._free_host(result.host_indices)
            return 0
        added, last = cache._insert_host(state, result)
        if hold is not None and last is not None:
            self.release_prefetched(req_id, hold)  # at most one hold per holder
            cache._inc_host_ref(last)
            self.held.setdefault(req_id, []).append((last, hold))
        return added

    def _unpin(self, state: Prefetch) -> None:
        if self.stored is not None and state.pinned:
            self.stored.unpin(state.pinned)
            state.pinned = []
