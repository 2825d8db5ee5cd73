"""Scatter/gather page I/O: pages given as pieces of host-pool memory (``PageSegments``).

The pools here are the SGLang adapter's :class:`CanonicalPagePool` over real torch buffers in
each of SGLang's host layouts (the adapter needs no SGLang for that); the store is the real
file backend on a real directory. What is checked: the bytes on disk are the canonical page
whatever the layout, every write/read layout pair reads back exactly, the checksum over the
pieces is the page's, and a damaged, foreign, short or unwritable page is a clean miss or a
failed write with no temporary file left behind.
"""

from __future__ import annotations

import errno
import itertools
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.integrations.sglang.pages import CanonicalPagePool
from hicache.storage import create_async_storage
from hicache.storage.page_format import PageCodec, checksum, checksum_stream
from hicache.storage import segments
from hicache.storage.segments import PageSegments, PieceSpans, StridedPiece, bounce, io_runs
from hicache_backends.file import io as file_io
from hicache_backends.file.layout import FOOTER_LEN, NamespaceLayout, page_id

PS, LAYERS, HEADS, DIM, PAGES = 4, 3, 2, 8, 6
#: a head size whose strided runs (page_first: 256 B, page_head and MLA page_first: 128 B) are
#: long enough for the native span copier (DIM's 16-32 B runs are copied with numpy)
NATIVE_DIM = 64
NATIVE = segments._copy_spans is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="the native span copier (hicache.memory._spancopy) is not built")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _mha_buffer(layout: str, dim: int = DIM) -> torch.Tensor:
    tokens = PAGES * PS
    shape = {
        "layer_first": (2, LAYERS, tokens, HEADS, dim),
        "page_first": (2, tokens, LAYERS, HEADS, dim),
        "page_first_direct": (2, PAGES, LAYERS, PS, HEADS, dim),
        "page_head": (2, PAGES, HEADS, PS, LAYERS, dim),
    }[layout]
    return torch.zeros(shape, dtype=torch.bfloat16)


def _mla_buffer(layout: str, dim: int = DIM) -> torch.Tensor:
    tokens = PAGES * PS
    shape = {
        "layer_first": (LAYERS, tokens, 1, dim),
        "page_first": (tokens, LAYERS, 1, dim),
        "page_first_direct": (PAGES, LAYERS, PS, 1, dim),
    }[layout]
    return torch.zeros(shape, dtype=torch.bfloat16)


def _pool(layout: str, *, mla: bool = False, seed: int = 0, dim: int = DIM) -> CanonicalPagePool:
    kv = _mla_buffer(layout, dim) if mla else _mha_buffer(layout, dim)
    g = torch.Generator().manual_seed(seed)
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
    fake = SimpleNamespace(layout=layout, kv_buffer=kv, page_size=PS, size=PAGES * PS)
    if mla:
        fake.kv_cache_dim = dim
    return CanonicalPagePool(fake)


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages]).to(torch.int64)


async def _store(root, pool: CanonicalPagePool, **options):
    """A file store with ``pool`` registered before it opens (its geometry is in the namespace)."""
    store = create_async_storage("file", root=str(root), namespace={"model": "segments-test"}, **options)
    store.register_mem_pool_host(pool)
    return store


async def _write(store, pool, keys, pages):
    store.register_mem_pool_host(pool)  # the writer's pool (same geometry as the store's)
    return await store.batch_set_v1(keys, _indices(pages))


def _payload_on_disk(store, key: str) -> bytes:
    path = store.layout.path(page_id(key, "kv"))
    data = open(path, "rb").read()
    header = PageCodec.parse(data)
    assert header is not None and header.key == key
    assert len(data) == header.header_len + header.payload_len + FOOTER_LEN
    payload = data[header.header_len : header.header_len + header.payload_len]
    assert checksum(payload) == header.checksum
    return payload


def _canonical_bytes(pool: CanonicalPagePool, page: int) -> bytes:
    return bytes(pool.get_data_page(page * PS).view(torch.uint8).numpy())


# ---------------------------------------------------------------------- pieces


def test_pieces_of_each_layout_are_the_canonical_page() -> None:
    for layout in LAYOUTS:
        pool = _pool(layout, seed=3)
        seg = pool.page_segments(2 * PS)
        assert isinstance(seg, PageSegments) and len(seg) == pool.page_nbytes
        assert bytes(seg.gather_bytes()) == _canonical_bytes(pool, 2)
    # layer_first's per-layer runs lie a pool's length apart: strided pieces of several
    # layers each (one bounce read and one span copy), not a direct piece per layer
    layered = _pool("layer_first").page_segments(0)
    assert all(isinstance(p, StridedPiece) for p in layered.pieces) and len(layered.pieces) < 2 * LAYERS
    assert len(_pool("page_first_direct").page_segments(0).pieces) == 2  # K and V runs
    assert all(isinstance(p, StridedPiece) for p in _pool("page_head").page_segments(0).pieces)
    assert _pool("page_first_direct", mla=True).page_segments(0) is None  # a live page: page_view


def test_scatter_bytes_writes_only_its_page() -> None:
    for layout in LAYOUTS:
        pool = _pool(layout, seed=1)
        before = [_canonical_bytes(pool, p) for p in range(PAGES)]
        new = bytes(np.random.default_rng(5).integers(0, 255, pool.page_nbytes, dtype=np.uint8))
        pool.page_segments(3 * PS).scatter_bytes(new)
        after = [_canonical_bytes(pool, p) for p in range(PAGES)]
        assert after[3] == new
        assert after[:3] + after[4:] == before[:3] + before[4:]
        with pytest.raises(ValueError):
            pool.page_segments(0).scatter_bytes(new[:-2])


def test_io_runs_group_direct_pieces_and_keep_strided_ones_alone() -> None:
    buf = bytearray(64)
    mv = memoryview(buf)
    strided = StridedPiece(np.zeros((4, 4), dtype=np.uint8)[:, :2])
    seg = PageSegments([mv[0:8], mv[8:16], mv[16:24], strided, mv[24:32]])
    runs = list(io_runs(seg, run_bytes=16))
    assert [len(r) if isinstance(r, list) else "s" for r in runs] == [2, 1, "s", 1]
    assert len(seg) == 32 + 8
    with pytest.raises(TypeError):
        PageSegments([b"not a view"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        PageSegments([memoryview(np.zeros(4, dtype=np.int32))])  # not bytes
    with pytest.raises(TypeError):
        StridedPiece(torch.zeros(4))  # type: ignore[arg-type]


def test_streaming_checksum_over_pieces_is_the_page_checksum() -> None:
    data = np.random.default_rng(0).integers(0, 255, 300_000, dtype=np.uint8).tobytes()
    h = checksum_stream()
    for lo in range(0, len(data), 70_001):
        h.update(memoryview(data)[lo : lo + 70_001])
    assert h.intdigest() == checksum(data)


def test_bounce_buffer_is_reused_and_grows() -> None:
    a, va = bounce(10)
    b, vb = bounce(20)
    assert a is b and len(va) == 10 and len(vb) == 20
    big, vbig = bounce(a.size + 1)
    assert big.size >= a.size + 1 and len(vbig) == a.size + 1


STRIDED = [("page_first", False), ("page_head", False), ("page_first", True)]


def _strided_pieces(pool: CanonicalPagePool, page: int) -> list[StridedPiece]:
    return [p for p in pool.page_segments(page * PS).pieces if isinstance(p, StridedPiece)]


@needs_native
@pytest.mark.parametrize("layout,mla", STRIDED)
def test_native_strided_pieces_move_the_same_bytes_as_numpy(monkeypatch, layout, mla) -> None:
    pool = _pool(layout, mla=mla, seed=7, dim=NATIVE_DIM)
    assert _strided_pieces(pool, 1) and all(p.spans is not None for p in _strided_pieces(pool, 1))
    assert all(p.spans is None for p in _strided_pieces(_pool(layout, mla=mla), 1))  # runs too short
    want = [_canonical_bytes(pool, p) for p in range(PAGES)]
    native = [bytes(pool.page_segments(p * PS).gather_bytes()) for p in range(PAGES)]
    monkeypatch.setattr(segments, "_copy_spans", None)  # the numpy path, same pieces
    plain = [bytes(pool.page_segments(p * PS).gather_bytes()) for p in range(PAGES)]
    monkeypatch.undo()
    assert native == want and plain == want
    new = bytes(np.random.default_rng(9).integers(0, 255, pool.page_nbytes, dtype=np.uint8))
    pool.page_segments(4 * PS).scatter_bytes(new)  # streaming stores into one page only
    assert [_canonical_bytes(pool, p) for p in range(PAGES)] == want[:4] + [new] + want[5:]


@needs_native
@pytest.mark.parametrize("layout,mla", [*STRIDED, ("page_first_direct", False)])
def test_every_page_is_the_first_pages_pieces_shifted(layout, mla) -> None:
    """A page's pieces are made from the first page's, moved by the pages' stride (no numpy
    views per page): each is the piece the page's own numpy views give, at the same address
    with the same strides, and moves the same bytes."""
    pool = _pool(layout, mla=mla, seed=3, dim=NATIVE_DIM)
    assert pool._first_page is not None
    shifted = [pool.page_segments(p * PS) for p in range(PAGES)]
    pool._first_page = None  # each page's own views, as before
    built = [pool.page_segments(p * PS) for p in range(PAGES)]
    for fast, slow in zip(shifted, built):
        assert fast is not None and slow is not None and len(fast.pieces) == len(slow.pieces)
        for a, b in zip(fast.pieces, slow.pieces):
            if isinstance(b, StridedPiece):
                assert isinstance(a, StridedPiece) and a.shift == b.shift and a.nbytes == b.nbytes
                assert a.view.__array_interface__ == b.view.__array_interface__
            else:
                assert isinstance(a, memoryview) and bytes(a) == bytes(b)
        assert bytes(fast.gather_bytes()) == bytes(slow.gather_bytes())


def test_only_a_piece_with_span_tables_moves_to_another_page() -> None:
    with pytest.raises(ValueError, match="span tables"):
        StridedPiece.of_page(StridedPiece(np.zeros((4, 4), dtype=np.uint8)[:, :2]), 16)


@needs_native
def test_a_span_table_shifted_outside_the_pool_copies_nothing() -> None:
    pool = _pool("page_head", seed=2, dim=NATIVE_DIM)
    before = [_canonical_bytes(pool, p) for p in range(PAGES)]
    piece = _strided_pieces(pool, PAGES - 1)[-1]
    beyond = StridedPiece(piece.view, piece.spans, piece.shift + pool.page_nbytes)  # past the last page
    buffer = np.full(piece.nbytes, 0xAB, dtype=np.uint8)
    with pytest.raises(ValueError):
        beyond.scatter(buffer)
    with pytest.raises(ValueError):
        beyond.gather(buffer)
    with pytest.raises(ValueError):  # a bounce buffer shorter than the piece
        piece.scatter(buffer[: piece.nbytes // 2])
    assert [_canonical_bytes(pool, p) for p in range(PAGES)] == before
    assert (buffer == 0xAB).all()


def test_span_tables_are_only_built_where_they_pay(monkeypatch) -> None:
    view = np.zeros((4, 4, 64), dtype=np.uint8)[:, :2]  # runs of 128 B
    flat = view.base.reshape(-1) if view.base is not None else view.reshape(-1)
    spans = PieceSpans.of_view(flat, view)
    if NATIVE:
        assert spans is not None and spans.to_pool.shape == (4, 3) and not spans.to_pool.flags.writeable
        assert spans.to_pool[:, 2].sum() == view.nbytes
    assert PieceSpans.of_view(flat, np.zeros((4, 4, 64), dtype=np.uint8)[:, :, :8]) is None  # 8 B runs
    monkeypatch.setattr(segments, "_copy_spans", None)
    assert PieceSpans.of_view(flat, view) is None


# ---------------------------------------------------------------------- through the file backend


@pytest.fixture(params=["one-call", "run-by-run"])
def io_path(request, monkeypatch) -> str:
    """Both ways a page moves: a page of one I/O run in one call (these tests' pages), and
    run by run, as pages larger than ``RUN_BYTES`` do."""
    if request.param == "run-by-run":
        monkeypatch.setattr(file_io, "RUN_BYTES", 0)
    return request.param


@pytest.mark.parametrize("dim", [DIM, NATIVE_DIM])
@pytest.mark.parametrize("w_layout,r_layout", list(itertools.product(LAYOUTS, repeat=2)))
async def test_every_layout_pair_reads_back_exactly(tmp_path, w_layout, r_layout, dim, io_path) -> None:
    writer, reader = _pool(w_layout, seed=1, dim=dim), _pool(r_layout, seed=2, dim=dim)
    keys = [f"k{i}" for i in range(4)]
    async with await _store(tmp_path, writer) as a:
        assert await _write(a, writer, keys, [0, 2, 3, 5]) == [True] * 4
        want = [_canonical_bytes(writer, p) for p in (0, 2, 3, 5)]
        assert [_payload_on_disk(a, k) for k in keys] == want  # canonical on disk
    async with await _store(tmp_path, reader) as b:
        assert await b.batch_get_v1(keys, _indices([5, 1, 0, 4])) == [True] * 4
        assert [_canonical_bytes(reader, p) for p in (5, 1, 0, 4)] == want
        assert b.get_stats()["corrupt_pages"] == 0


@pytest.mark.parametrize("w_layout,r_layout", list(itertools.product(LAYOUTS, repeat=2)))
async def test_pages_larger_than_the_bounce_buffer_move_in_several_pieces(tmp_path, monkeypatch, w_layout, r_layout) -> None:
    """A strided K or V half larger than the bounce buffer is cut into pieces of whole layers
    (here 2 + 1 of 3): the file still holds the canonical page and every layout pair reads it
    back exactly."""
    from hicache.integrations.sglang import pages

    block = PS * HEADS * NATIVE_DIM * 2  # one layer of K (or V) of one page, bf16
    monkeypatch.setattr(pages, "BOUNCE_BYTES", 2 * block)
    writer, reader = _pool(w_layout, seed=1, dim=NATIVE_DIM), _pool(r_layout, seed=2, dim=NATIVE_DIM)
    for pool in (writer, reader):
        if pool.layout in ("page_first", "page_head"):
            pieces = pool.page_segments(0).pieces
            assert all(isinstance(p, StridedPiece) for p in pieces)
            assert [p.nbytes for p in pieces] == [2 * block, block] * 2
    keys = [f"k{i}" for i in range(3)]
    async with await _store(tmp_path, writer) as a:
        assert await _write(a, writer, keys, [1, 3, 4]) == [True] * 3
        want = [_canonical_bytes(writer, p) for p in (1, 3, 4)]
        assert [_payload_on_disk(a, k) for k in keys] == want
    async with await _store(tmp_path, reader) as b:
        assert await b.batch_get_v1(keys, _indices([4, 0, 2])) == [True] * 3
        assert [_canonical_bytes(reader, p) for p in (4, 0, 2)] == want
        assert b.get_stats()["corrupt_pages"] == 0


@pytest.mark.parametrize("w_layout,r_layout", [("layer_first", "page_first"), ("page_first_direct", "layer_first")])
async def test_mla_pools_share_pages_across_layouts(tmp_path, w_layout, r_layout) -> None:
    writer, reader = _pool(w_layout, mla=True, seed=1), _pool(r_layout, mla=True, seed=2)
    async with await _store(tmp_path, writer) as s:
        assert await _write(s, writer, ["a", "b"], [1, 4]) == [True, True]
    async with await _store(tmp_path, reader) as s:
        assert await s.batch_get_v1(["a", "b"], _indices([0, 2])) == [True, True]
        assert _canonical_bytes(reader, 0) == _canonical_bytes(writer, 1)
        assert _canonical_bytes(reader, 2) == _canonical_bytes(writer, 4)


async def test_segmented_and_contiguous_writes_make_the_same_file(tmp_path, io_path) -> None:
    pool = _pool("page_head", seed=4)
    async with await _store(tmp_path / "seg", pool) as s:
        assert await _write(s, pool, ["x"], [2]) == [True]
        seg_file = open(s.layout.path(page_id("x", "kv")), "rb").read()
        codec = PageCodec(s.namespace.digest_bytes)
    layout = NamespaceLayout(str(tmp_path / "flat"), "ab" * 16)
    os.makedirs(layout.subdir(page_id("x", "kv")))
    flat = memoryview(bytearray(_canonical_bytes(pool, 2)))
    r = file_io.write_page(layout, codec, page_id("x", "kv"), "x", "kv", flat, None, False, None)
    assert r.ok
    assert open(layout.path(page_id("x", "kv")), "rb").read() == seg_file


@pytest.mark.parametrize("dim", [DIM, NATIVE_DIM])
async def test_a_damaged_page_is_a_miss_and_removed(tmp_path, dim, io_path) -> None:
    pool, reader = _pool("page_first", seed=1, dim=dim), _pool("page_head", seed=2, dim=dim)
    async with await _store(tmp_path, pool) as s:
        assert await _write(s, pool, ["a", "b"], [0, 1]) == [True, True]
        path = s.layout.path(page_id("b", "kv"))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - FOOTER_LEN - 100)
            f.write(b"\xff\x00\xff")
        s.register_mem_pool_host(reader)  # same geometry: same namespace
        assert await s.batch_get_v1(["a", "b"], _indices([2, 3])) == [True, False]
        assert s.get_stats()["corrupt_pages"] == 1
        assert not os.path.exists(path)


async def test_a_foreign_page_puts_no_byte_into_the_pool(tmp_path, io_path) -> None:
    """The header is checked before the payload is read: a file holding another key's page
    (same size) is a miss and the host page keeps its bytes."""
    pool, reader = _pool("layer_first", seed=1), _pool("page_head", seed=2)
    async with await _store(tmp_path, pool) as s:
        assert await _write(s, pool, ["a", "b"], [0, 1]) == [True, True]
        os.replace(s.layout.path(page_id("a", "kv")), s.layout.path(page_id("b", "kv")))
        before = _canonical_bytes(reader, 3)
        s.register_mem_pool_host(reader)
        assert await s.batch_get_v1(["b"], _indices([3])) == [False]
        assert _canonical_bytes(reader, 3) == before


@pytest.mark.parametrize("dim", [DIM, NATIVE_DIM])
async def test_a_short_file_is_a_miss(tmp_path, dim, io_path) -> None:
    pool = _pool("page_head", seed=1, dim=dim)
    async with await _store(tmp_path, pool) as s:
        assert await _write(s, pool, ["a"], [0]) == [True]
        path = s.layout.path(page_id("a", "kv"))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 7)
        assert await s.batch_get_v1(["a"], _indices([1])) == [False]


@pytest.mark.parametrize("one_call", [True, False], ids=["small-page-one-call", "run-by-run"])
async def test_a_failed_segmented_write_leaves_no_temp_file(tmp_path, monkeypatch, one_call) -> None:
    """The disk fills while a page is written: a small page's only call, or the third call of
    a page written run by run (the temporary file then holds part of the payload)."""
    pool = _pool("page_first", seed=1)
    if not one_call:
        monkeypatch.setattr(file_io, "RUN_BYTES", 0)  # every page takes the run-by-run path
    calls = []
    real = file_io._pwritev
    fail_at = 1 if one_call else 3

    def full_from(fd, bufs, offset):
        calls.append(offset)
        if len(calls) >= fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    async with await _store(tmp_path, pool) as s:
        monkeypatch.setattr(file_io, "_pwritev", full_from)
        assert await _write(s, pool, ["a"], [0]) == [False]
        monkeypatch.setattr(file_io, "_pwritev", real)
        leftovers = [f for _, _, files in os.walk(s.layout.ns_dir) for f in files if f.endswith(".tmp")]
        assert leftovers == []
        assert s.get_stats()["enospc_errors"] == 1
        assert await s.batch_exists(["a"]) == 0
        assert await _write(s, pool, ["a"], [0]) == [True]  # and the disk works again


async def test_a_backend_without_segments_takes_the_staging_path(tmp_path) -> None:
    """The memory backend takes no pieces: the base class gathers and scatters copies."""
    writer, reader = _pool("page_head", seed=1), _pool("page_first", seed=2)
    store = create_async_storage("memory", namespace={"model": "segments-test"})
    store.register_mem_pool_host(writer)
    assert not store.supports_segments
    async with store:
        assert await _write(store, writer, ["a", "b"], [1, 2]) == [True, True]
        store.register_mem_pool_host(reader)
        assert await store.batch_get_v1(["a", "b"], _indices([4, 0])) == [True, True]
        assert _canonical_bytes(reader, 4) == _canonical_bytes(writer, 1)
        assert _canonical_bytes(reader, 0) == _canonical_bytes(writer, 2)


async def test_exists_prefix_stops_at_the_first_miss(tmp_path) -> None:
    pool = _pool("layer_first", seed=1)
    async with await _store(tmp_path, pool) as s:
        assert await _write(s, pool, ["a", "b", "d"], [0, 1, 2]) == [True] * 3
        assert await s.exists_prefix(["a", "b", "c", "d"]) == 2
        assert await s.exists_prefix(["c", "a"]) == 0
        assert await s.exists_prefix([]) == 0


class _Pool(SimpleNamespace):
    """A page-protocol pool whose ``page_segments`` answers per page as told."""

    def __init__(self, inner: CanonicalPagePool, answer) -> None:
        super().__init__(page_size=inner.page_size, page_nbytes=inner.page_nbytes, inner=inner, answer=answer)

    def get_data_page(self, index, flat=True):
        return self.inner.get_data_page(index, flat)

    def get_dummy_flat_data_page(self):
        return self.inner.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index, data):
        self.inner.set_from_flat_data_page(index, data)

    def page_segments(self, index):
        return self.answer(self.inner, index)


def test_segment_sources_fail_only_pages_the_pool_rejects() -> None:
    from hicache.storage.segments import segment_sources

    inner = _pool("page_head")

    def reject_page_one(pool, index):
        if index == PS:
            raise IndexError("no such page")
        return pool.page_segments(index)

    got = segment_sources(_Pool(inner, reject_page_one), [0, PS, 2 * PS])
    assert got is not None and got[1] is None and isinstance(got[0], PageSegments)
    # a page the pool cannot describe (None, or anything else) sends the batch to staging
    assert segment_sources(_Pool(inner, lambda p, i: None if i == PS else p.page_segments(i)), [0, PS]) is None
    assert segment_sources(_Pool(inner, lambda p, i: b"x"), [0]) is None
    assert segment_sources(SimpleNamespace(), [0]) is None


async def test_a_pool_answering_none_is_read_through_staging(tmp_path) -> None:
    writer, inner = _pool("page_first", seed=1), _pool("page_first", seed=2)
    reader = _Pool(inner, lambda p, i: None)
    async with await _store(tmp_path, writer) as s:
        assert await _write(s, writer, ["a"], [1]) == [True]
        s.register_mem_host_pool_v2(reader, "kv")
        assert await s.batch_get_v1(["a"], _indices([2])) == [True]
        assert _canonical_bytes(inner, 2) == _canonical_bytes(writer, 1)
