"""SGLang host pools seen through hicache's page protocol, in the canonical byte order.

SGLang's host pools keep KV in one of several layouts, and their own flat pages
(``get_data_page(flat=True)``) are the layout's bytes: a page written by a ``page_head`` server
and read by a ``layer_first`` server is a hit with scrambled KV (SGLang #33268). hicache stores
every page in one canonical order whatever the layout (:mod:`hicache.memory.layouts`)::

    [component][layer][token in page][*token shape]     C = 2 (K, V) for MHA, 1 for MLA

:class:`CanonicalPagePool` wraps one SGLang KV host pool and gives hicache's storage that
order: a *live* view of a page where the layout keeps it contiguous (MLA ``page_first_direct``
and ``page_unified``), otherwise a permuted view that one ``copy_`` turns into canonical bytes or
scatters back. No SGLang import is needed here: the pool is read through its documented attributes
(``layout``, ``kv_buffer``, ``page_size``).

Pools whose layout is not known here (``page_first_kv_split``, quantized or sparse pools, Mamba state)
are passed through unchanged by :func:`adapt_host_pool`; their pages keep SGLang's own bytes,
and the pool's class and layout go into the namespace so that no other layout ever reads them.
Under decode context parallelism such a pool is seen through :class:`LogicalIndexPool`, which
counts its pages in SGLang's logical index space, as :class:`CanonicalPagePool` does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from hicache.memory.layouts import PAGE_FORMAT
from hicache.storage.pool_format import pool_format_tag
from hicache.storage.segments import BOUNCE_BYTES, PageSegments, PieceSpans, StridedPiece

__all__ = [
    "CanonicalPagePool",
    "KNOWN_LAYOUTS",
    "LogicalIndexPool",
    "adapt_host_pool",
    "is_mla_pool",
    "passthrough_tag",
]

#: SGLang host layouts with a known canonical reorder (MHA and MLA pools).
KNOWN_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")

# (kind, layout) -> (page slicer, permutation of the slice to canonical order). The slicer takes
# (kv_buffer, first token, page index, page_size) and returns the page as SGLang's
# ``get_data_page(flat=False)`` sees it (``page_unified``, whose pages SGLang does not hand out,
# as its buffer holds it); the permutation maps that to (C, L, ps, *token). MHA ``page_unified``
# keeps the heads split in groups, (C, L, ps, G, H/G, D): head ``g * H/G + j`` is group ``g``'s
# ``j``-th (SGLang's page_unified kernels give group ``g`` the run of heads ``[g*H/G, (g+1)*H/G)``
# of a token's row), which no single view can merge back into ``H``; the canonical page is the
# same bytes, ``(C, L, ps, H, D)``, seen as ``(C, L, ps, G, H/G, D)``.
_Buf = TypeVar("_Buf", torch.Tensor, np.ndarray)


class _Slicer(Protocol):
    """One page's slice of the pool's buffer, as a torch tensor or as its numpy view."""

    def __call__(self, b: _Buf, s: int, p: int, ps: int, /) -> _Buf: ...


_MHA: dict[str, tuple[_Slicer, tuple[int, ...]]] = {
    # (2, L, T, H, D)
    "layer_first": (lambda b, s, p, ps: b[:, :, s : s + ps], (0, 1, 2, 3, 4)),
    # (2, T, L, H, D)
    "page_first": (lambda b, s, p, ps: b[:, s : s + ps], (0, 2, 1, 3, 4)),
    # (2, P, L, ps, H, D)
    "page_first_direct": (lambda b, s, p, ps: b[:, p], (0, 1, 2, 3, 4)),
    # (2, P, H, ps, L, D)
    "page_head": (lambda b, s, p, ps: b[:, p], (0, 3, 2, 1, 4)),
    # (P, G, L, 2, ps, H/G, D): sglang.srt.mem_cache.pool_host.page_unified.PageUnifiedLayout
    "page_unified": (lambda b, s, p, ps: b[p], (2, 1, 3, 0, 4, 5)),
}
_MLA: dict[str, tuple[_Slicer, tuple[int, ...]]] = {
    # (L, T, 1, D); one component, added as dim 0 below
    "layer_first": (lambda b, s, p, ps: b[:, s : s + ps], (0, 1, 2, 3)),
    # (T, L, 1, D)
    "page_first": (lambda b, s, p, ps: b[s : s + ps], (1, 0, 2, 3)),
    # (P, L, ps, 1, D)
    "page_first_direct": (lambda b, s, p, ps: b[p], (0, 1, 2, 3)),
    # (P, L, ps, D): page_first_direct's bytes without the unit axis (PageUnifiedLayout, MLA)
    "page_unified": (lambda b, s, p, ps: b[p][:, :, None], (0, 1, 2, 3)),
}


# a numpy integer type of each element size: the pool's memory seen by numpy (which has no
# bfloat16 or float8), to copy strided pieces with numpy
_SAME_SIZE_INT: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_mla_pool(pool: Any) -> bool:
    """Whether an SGLang host pool holds MLA latents (one per token, not per KV head)."""
    return getattr(pool, "kv_cache_dim", None) is not None or "MLA" in type(pool).__name__


#: what identifies a pass-through pool's own byte format (the core's: hicache.storage.pool_format)
passthrough_tag = pool_format_tag


@dataclass
class _Binding:
    buffer: torch.Tensor  # uint8, one page


class CanonicalPagePool:
    """hicache's page protocol over an SGLang KV host pool, in canonical byte order.

    ``page_view(index)`` is what makes storage I/O zero-copy: a live contiguous 1-D byte view
    of the page when the layout has one. For the other layouts, a caller that moves many pages
    (:mod:`hicache.integrations.sglang.transfer`) *binds* a reusable staging page to an index:
    storage then reads into / writes from the staging page, and the caller moves it to or from
    the pool with one strided copy (:meth:`scatter` / :meth:`gather`), off the storage threads.
    Unbound pages take the ordinary staging path of the page protocol, which is correct too.
    """

    def __init__(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        kv = getattr(pool, "kv_buffer", None)
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"{type(pool).__name__} has no kv_buffer tensor")
        if kv.device.type != "cpu":
            raise ValueError(f"{type(pool).__name__}: host kv_buffer must be in CPU memory, got {kv.device}")
        self.mla = is_mla_pool(pool)
        table = _MLA if self.mla else _MHA
        if layout not in table:
            raise ValueError(
                f"{type(pool).__name__}: no canonical reorder for layout {layout!r} "
                f"(known: {sorted(table)})"
            )
        self.pool = pool
        self.layout: str = layout
        # Under decode context parallelism (SGLang's MLA pool with ``dcp_size`` > 1) SGLang's
        # controller hands storage *logical* host indices, ``dcp_size`` of them to one host row,
        # and the pool maps them itself (``_storage_page_index``: row = index // dcp_size): a
        # page is ``page_size * dcp_size`` indices, ``page_size`` rows. Taken as rows, every
        # page was refused and a DCP server stored nothing. ``page_size`` and ``size`` here are
        # in SGLang's index space (what storage counts host indices in), ``rows`` in the pool's.
        self._dcp = _dcp_size(pool)
        self.rows: int = int(pool.page_size)
        self.page_size: int = self.rows * self._dcp
        self.dtype: torch.dtype = kv.dtype
        self._kv = kv
        self._slice, self._perm = table[layout]
        probe = self._canonical(0)
        #: the shape of :meth:`_canonical`'s views (MHA ``page_unified``: heads in groups)
        self._view_shape: tuple[int, ...] = tuple(probe.shape)
        #: the canonical page, (C, L, ps, *token), the same for every layout of a model
        self.page_shape: tuple[int, ...] = (
            (*self._view_shape[:3], int(np.prod(self._view_shape[3:-1])), self._view_shape[-1])
            if len(self._view_shape) > 5 else self._view_shape
        )
        self.page_numel: int = probe.numel()
        self.page_nbytes: int = self.page_numel * kv.element_size()
        rows = int(getattr(pool, "size", 0)) or (kv.numel() // (self.page_numel // self.rows))
        self.size: int = rows * self._dcp
        self._live = probe.is_contiguous()
        self._pieces = _piece_plan(probe, kv.element_size())
        # the pool's bytes, sliced for each direct piece (cheaper than a tensor view per piece)
        self._kv_bytes: memoryview | None = None
        self._kv_np: np.ndarray | None = None
        # span tables of each strided piece of the first page, keyed (component, first layer):
        # every page reuses them shifted (native span copies, see segments.PieceSpans)
        self._spans: dict[tuple[int, int], PieceSpans | None] = {}
        self._base0 = 0
        # the first page's pieces and the byte distance from one page to the next, where
        # every page's pieces are the first's shifted (see _shiftable_first_page)
        self._first_page: tuple[list[tuple[int, int, StridedPiece | None]], int] | None = None
        if kv.is_contiguous() and kv.element_size() in _SAME_SIZE_INT:
            self._kv_bytes = kv.reshape(-1).view(torch.uint8).numpy().data.cast("B")
            # the same memory as numpy (strided pieces are copied with numpy, see segments)
            self._kv_np = kv.view(_SAME_SIZE_INT[kv.element_size()]).numpy()
            if not self._live:
                view0, self._base0 = self._np_page(0)
                kv_u8 = self._kv_np.reshape(-1).view(np.uint8)
                for c, spans in enumerate(self._pieces):
                    for l0, l1, _, direct in spans:
                        if not direct:
                            self._spans[(c, l0)] = PieceSpans.of_view(kv_u8, view0[c, l0:l1])
                self._first_page = self._shiftable_first_page(view0)
        self._bound: dict[int, _Binding] = {}
        self._lock = threading.Lock()

    # -- geometry
    def _page(self, index: int) -> tuple[int, int]:
        index = int(index)
        if index < 0 or index % self.page_size or index + self.page_size > self.size:
            raise IndexError(
                f"page index {index} is not the first token of a page in a host pool of "
                f"{self.size} tokens (page_size={self.page_size})"
            )
        return index, index // self.page_size

    def _canonical(self, index: int) -> torch.Tensor:
        """A (strided) view of the page in canonical order: (C, L, ps, *token)."""
        native = self._slice(self._kv, index // self._dcp, index // self.page_size, self.rows)
        view = native.permute(*self._perm)
        return view.unsqueeze(0) if self.mla else view

    def canonical_view(self, index: int) -> torch.Tensor:
        """The page at ``index`` in canonical order, as a view of the pool (no copy)."""
        self._page(index)
        return self._canonical(index)

    # -- binding of staging pages (see class docstring)
    @property
    def has_live_pages(self) -> bool:
        return self._live

    def new_staging(self, pages: int) -> torch.Tensor:
        """Staging memory for ``pages`` canonical pages (uint8, ``(pages, page_nbytes)``)."""
        return torch.empty((pages, self.page_nbytes), dtype=torch.uint8)

    def bind(self, pairs: Iterable[tuple[int, torch.Tensor]]) -> list[int]:
        """Route storage I/O of each ``(index, staging page)`` pair to the staging page; returns
        the indices bound (an index another call holds is left to the ordinary staging path)."""
        done: list[int] = []
        with self._lock:
            for index, buffer in pairs:
                index = int(index)
                if index in self._bound:
                    continue
                self._bound[index] = _Binding(buffer)
                done.append(index)
        return done

    def unbind(self, indices: Iterable[int]) -> None:
        with self._lock:
            for index in indices:
                self._bound.pop(int(index), None)

    def gather(self, index: int, out: torch.Tensor) -> None:
        """Copy the page into ``out`` (uint8, one page) in canonical order."""
        self._page(index)
        out.view(self.dtype).view(self._view_shape).copy_(self._canonical(index))

    def scatter(self, index: int, src: torch.Tensor) -> None:
        """Store a canonical page (any dtype, exactly ``page_nbytes`` bytes) into the pool."""
        self._page(index)
        src = src.detach().reshape(-1).cpu().contiguous()  # no-ops for a CPU staging page
        nbytes = src.numel() * src.element_size()
        if nbytes != self.page_nbytes:
            raise ValueError(f"flat page has {nbytes} bytes, expected {self.page_nbytes}")
        dst = self._canonical(index)
        typed = src.view(torch.uint8).view(self.dtype).view(self._view_shape)
        if typed.data_ptr() == dst.data_ptr() and dst.is_contiguous():
            return  # read straight into the live page
        dst.copy_(typed)

    # -- hicache's page protocol
    def page_view(self, index: int) -> torch.Tensor | None:
        """Live 1-D byte view of the page (or of the staging page bound to it); ``None`` when
        neither exists, so that storage takes the staging path."""
        self._page(index)
        bound = self._bound.get(int(index))
        if bound is not None:
            return bound.buffer
        if self._live:
            return self._canonical(index).reshape(-1).view(torch.uint8)
        return None

    def page_segments(self, index: int) -> PageSegments | None:
        """The page as pieces of the pool's memory in canonical order, for backends that do
        scatter/gather I/O (:mod:`hicache.storage.segments`): one direct byte run where the layout
        keeps a component's layers together (``page_first_direct``), strided views of a few
        layers each otherwise (``layer_first``, ``page_first``, ``page_head``; see
        :func:`_piece_plan`). ``None`` for a
        live page (its ``page_view`` is simpler) or a page bound to a staging page."""
        start, page = self._page(index)
        if self._live or self._kv_bytes is None or self._kv_np is None or start in self._bound:
            return None
        if self._first_page is not None:
            first, step = self._first_page
            shift = page * step
            kv_bytes = self._kv_bytes
            return PageSegments([
                kv_bytes[at + shift : at + shift + nbytes] if piece is None else StridedPiece.of_page(piece, shift)
                for at, nbytes, piece in first
            ])
        view, base = self._np_page(int(index))
        kv_bytes = self._kv_bytes
        return PageSegments([
            kv_bytes[at : at + nbytes] if piece is None else piece
            for at, nbytes, piece in self._piece_plan_at(view, base, base - self._base0)
        ])

    def _piece_plan_at(self, view: np.ndarray, base: int, shift: int) -> list[tuple[int, int, StridedPiece | None]]:
        """A page's pieces as ``(offset, bytes, None)`` for a direct byte run of the pool and
        ``(0, bytes, strided piece)`` otherwise, from the page's numpy ``view`` at byte
        ``base`` of the pool (``shift`` bytes after the first page's)."""
        plan: list[tuple[int, int, StridedPiece | None]] = []
        for c, spans in enumerate(self._pieces):
            for l0, l1, nbytes, direct in spans:
                if direct:
                    plan.append((base + c * view.strides[0] + l0 * view.strides[1], nbytes, None))
                else:
                    plan.append((0, nbytes, StridedPiece(view[c, l0:l1], self._spans.get((c, l0)), shift)))
        return plan

    def _shiftable_first_page(self, view0: np.ndarray) -> tuple[list[tuple[int, int, StridedPiece | None]], int] | None:
        """The first page's pieces as ``(offset, bytes, strided piece or None)`` and the
        pages' stride in bytes, when any page's pieces are the first's moved by a multiple of
        it (page offsets linear in the page number: every SGLang layout) and every strided
        piece has span tables (the native copier); ``None`` otherwise (each page then builds
        its numpy views)."""
        pages = self.size // self.page_size
        if pages < 3 or any(s is None for s in self._spans.values()):
            return None
        step = self._np_page(self.page_size)[1] - self._base0
        for page in (2, pages - 1):
            if self._np_page(page * self.page_size)[1] - self._base0 != page * step:
                return None
        return self._piece_plan_at(view0, self._base0, 0), step

    def _np_page(self, index: int) -> tuple[np.ndarray, int]:
        """The page at ``index`` as a canonical-order numpy view of the pool's memory, and
        the byte offset of its first element in the pool."""
        assert self._kv_np is not None
        view = self._slice(self._kv_np, index // self._dcp, index // self.page_size, self.rows).transpose(self._perm)
        if self.mla:
            view = view[np.newaxis]
        return view, view.__array_interface__["data"][0] - self._kv_np.__array_interface__["data"][0]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """A canonical copy of the page (pool dtype; 1-D when ``flat``)."""
        self._page(index)
        page = self._canonical(index).clone(memory_format=torch.contiguous_format)  # a snapshot
        return page.reshape(-1) if flat else page.view(self.page_shape)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_numel, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.scatter(index, data_page)

    # -- v0 (SGLang's own flat pages) <-> canonical
    def native_to_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """SGLang's flat page of this layout (``get_data_page(flat=True)``) -> canonical bytes."""
        native = self._slice(self._kv, 0, 0, self.rows)
        typed = flat.detach().reshape(-1).view(self.dtype).view(native.shape)
        view = typed.permute(*self._perm)
        view = view.unsqueeze(0) if self.mla else view
        return view.contiguous().reshape(-1).view(torch.uint8)

    def canonical_into_native(self, canonical: torch.Tensor, out: torch.Tensor) -> None:
        """Write canonical page bytes into ``out``, a flat page in SGLang's order of this layout."""
        native = self._slice(self._kv, 0, 0, self.rows)
        target = out.view(-1).view(self.dtype).view(native.shape).permute(*self._perm)
        target = target.unsqueeze(0) if self.mla else target
        target.copy_(canonical.reshape(-1).view(torch.uint8).view(self.dtype).view(self._view_shape))

    def storage_signature(self) -> dict[str, Any]:
        """What makes pages incompatible. The layout is absent on purpose: every layout stores
        the same canonical bytes."""
        pool = self.pool
        sig: dict[str, Any] = {
            "page_format": PAGE_FORMAT,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_num": int(self.page_shape[1]),
            "page_size": self.rows,  # the rows a stored page holds (DCP: the logical page is in the namespace)
            "is_mla": self.mla,
            "page_nbytes": self.page_nbytes,
        }
        if self.mla:
            sig["head_dim"] = int(self.page_shape[-1])
            for name in ("kv_lora_rank", "qk_rope_head_dim"):
                if getattr(pool, name, None) is not None:
                    sig[name] = int(getattr(pool, name))
        else:
            sig["head_num"] = int(self.page_shape[3])
            sig["head_dim"] = int(self.page_shape[4])
        return sig

    def __repr__(self) -> str:
        return (
            f"CanonicalPagePool({type(self.pool).__name__}, layout={self.layout!r}, "
            f"page_size={self.page_size}, page_nbytes={self.page_nbytes}, live={self._live})"
        )


def _piece_plan(probe: torch.Tensor, elsize: int) -> list[list[tuple[int, int, int, bool]]]:
    """For each component of a canonical page view ``(C, L, ps, *token)``, its pieces as
    ``(first layer, end layer, bytes, direct)``: one direct piece when the component is one
    contiguous run, else strided pieces of as many layers as fit the bounce buffer. The same
    for every page of a pool (strides do not vary).

    Why a component whose layer blocks are each contiguous but apart in the pool (SGLang's
    ``layer_first``: one 64 KiB run per layer, a pool's length apart) is strided too, not a
    direct piece per layer: a read then lands in the cache-resident bounce buffer and reaches
    the pool by one native span copy with streaming stores, instead of the kernel's copy into
    cold pool memory. Through SGLang's controller, idle 2-core machine, 24 x 4 MiB pages, three
    interleaved A/B pairs: get 17-19 ms wall (28-31 ms CPU) against 22-25 ms (34-36 ms) as direct
    pieces, set 31-34 ms against 35-39 ms."""
    plan: list[list[tuple[int, int, int, bool]]] = []
    layers = probe.shape[1]
    block = probe[0, 0].numel() * elsize
    for c in range(probe.shape[0]):
        if probe[c].is_contiguous():
            plan.append([(0, layers, block * layers, True)])
        else:
            step = max(1, BOUNCE_BYTES // max(block, 1))
            plan.append([(l, min(layers, l + step), block * (min(layers, l + step) - l), False) for l in range(0, layers, step)])
    return plan


#: SGLang's host pool classes whose pages are their ``kv_buffer`` rows and nothing else
_PLAIN_POOLS = ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost")
#: SGLang's page protocol: a subclass that redefines it keeps state beyond ``kv_buffer``
_PAGE_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def _plain_pages(pool: Any) -> bool:
    """Whether ``pool``'s pages are its ``kv_buffer`` rows alone: one of SGLang's plain MHA/MLA
    host pools, or a subclass that keeps their page methods. A subclass with pages of its own
    (SGLang's MXFP8 pool keeps each page's scales outside ``kv_buffer`` and refuses flat
    pages) is left to its own methods: the canonical adapter would store the payload without
    the scales and restore it beside another page's."""
    cls = type(pool)
    base = next((c for c in cls.__mro__ if c.__name__ in _PLAIN_POOLS), None)
    return base is not None and all(getattr(cls, m, None) is getattr(base, m, None) for m in _PAGE_METHODS)


def _dcp_size(pool: Any) -> int:
    """The decode-context-parallel ranks a host pool's logical index spans (SGLang's ``dcp_size``:
    ``dcp_size`` logical host indices share one host row); 1 without DCP."""
    size = getattr(pool, "dcp_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


class LogicalIndexPool:
    """A pass-through SGLang host pool under decode context parallelism, with its pages counted
    in SGLang's logical index space.

    SGLang's controller hands storage logical host indices, ``dcp_size`` of them to one host row,
    and the pool's own page methods take them so (``_storage_page_index``: row = index //
    ``dcp_size``); but the pool's ``page_size`` counts rows. hicache's storage takes a page as
    ``page_size`` host indices, so with the pool as it is every page of a batch was refused
    ("expects 48 host indices, got 96") and the pool stored nothing. Here ``page_size`` and
    ``size`` are the pool's ``logical_page_size`` and ``logical_size`` and the page methods are
    the pool's own, given the logical index unchanged. No ``layout``: the pool's format tag goes
    into the namespace by the adapter (:func:`adapt_host_pool`), from the pool itself."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._dcp = _dcp_size(pool)
        self.page_size: int = int(pool.page_size) * self._dcp
        self.size: int = int(getattr(pool, "size", 0)) * self._dcp

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.pool.get_data_page(index, flat)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self.pool.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.pool.set_from_flat_data_page(index, data_page)

    def __repr__(self) -> str:
        return f"LogicalIndexPool({type(self.pool).__name__}, dcp_size={self._dcp}, page_size={self.page_size})"


def adapt_host_pool(pool: Any) -> tuple[Any, str | None]:
    """The pool hicache's storage should see, and (for a pass-through pool) the tag of its own
    byte format that the namespace must carry. A pool that already is a canonical adapter
    (or hicache's own host pool) is returned as is; a pass-through pool under DCP is seen in
    SGLang's logical index space (:class:`LogicalIndexPool`)."""
    if isinstance(pool, (CanonicalPagePool, LogicalIndexPool)) or callable(getattr(pool, "storage_signature", None)):
        return pool, None
    table = _MLA if is_mla_pool(pool) else _MHA
    if (getattr(pool, "layout", None) in table and isinstance(getattr(pool, "kv_buffer", None), torch.Tensor)
            and _plain_pages(pool)):
        try:
            return CanonicalPagePool(pool), None
        except (TypeError, ValueError, RuntimeError):
            pass  # a shape this table does not describe: keep SGLang's bytes, tagged
    return (LogicalIndexPool(pool) if _dcp_size(pool) > 1 else pool), passthrough_tag(pool)
