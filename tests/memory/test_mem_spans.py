"""The native span copier and its span tables: bounds checks, streaming vs plain stores, the
tables built from real pool views, and the engine's choice of copy path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.memory import CopyEngine, spans, transfer
from hicache.memory.spans import NATIVE_AVAILABLE, span_pair, split_table

native_only = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="span copier not built")


def test_span_copier_is_built_where_required():
    """CI (``HICACHE_REQUIRE_NATIVE=1``, a machine with a C compiler) fails here instead of
    silently skipping every native test below if the optional extension did not build."""
    assert NATIVE_AVAILABLE or os.environ.get("HICACHE_REQUIRE_NATIVE") != "1"


def token_idx(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)


def rows(*spans_: tuple[int, int, int]) -> np.ndarray:
    return np.array(spans_, dtype=np.int64).reshape(-1, 3)


def reference(dst: np.ndarray, src: np.ndarray, table: np.ndarray, dst_shift: int = 0, src_shift: int = 0) -> None:
    for d, s, n in table.tolist():
        dst[d + dst_shift : d + dst_shift + n] = src[s + src_shift : s + src_shift + n]


def copy_spans(*args, **kwargs) -> int:
    return spans._spancopy.copy_spans(*args, **kwargs)


STREAM_KINDS = ["avx2", "sse2", "none"]


@pytest.fixture(params=STREAM_KINDS)
def stream_kind(request):
    """Each streaming copy variant this CPU can run (the import picks one; switch for the test)."""
    if not NATIVE_AVAILABLE:
        pytest.skip("span copier not built")
    try:
        previous = spans._spancopy._set_stream_kind(request.param)
    except ValueError:
        pytest.skip(f"{request.param} not available on this CPU")
    yield request.param
    spans._spancopy._set_stream_kind(previous)


@native_only
@pytest.mark.parametrize("streaming", [False, True])
def test_copies_spans_and_returns_bytes(streaming, stream_kind):
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    table = rows((0, 100, 5000), (9000, 3, 40000), (60000, 0, 7))
    assert copy_spans(dst, src, table, streaming=streaming) == 45007
    want = np.zeros_like(dst)
    reference(want, src, table)
    assert np.array_equal(dst, want)


@native_only
@given(
    data=st.lists(
        st.tuples(st.integers(0, 20000), st.integers(0, 20000), st.integers(0, 12000)), max_size=12
    ),
    dst_shift=st.integers(0, 64),
    src_shift=st.integers(0, 64),
    streaming=st.booleans(),
)
@settings(max_examples=150, deadline=None)
@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_matches_a_python_reference_for_any_spans(kind, data, dst_shift, src_shift, streaming):
    """Unaligned starts, odd lengths, overlapping destinations (later spans win), shifts, with
    and without streaming stores: byte for byte what a Python loop gives."""
    try:
        previous = spans._spancopy._set_stream_kind(kind)
    except ValueError:
        pytest.skip(f"{kind} not available on this CPU")
    size = 32 * 1024 + 64
    src = np.random.default_rng(len(data)).integers(0, 256, size, dtype=np.uint8)
    dst = np.full(size, 0xEE, dtype=np.uint8)
    want = dst.copy()
    table = rows(*data)
    reference(want, src, table, dst_shift, src_shift)
    try:
        copy_spans(dst, src, table, dst_shift=dst_shift, src_shift=src_shift, streaming=streaming)
    finally:
        spans._spancopy._set_stream_kind(previous)
    assert np.array_equal(dst, want)


@native_only
@pytest.mark.parametrize(
    ("table", "dst_shift", "src_shift"),
    [
        (rows((0, 0, 10), (95, 0, 6)), 0, 0),  # dst end past the buffer
        (rows((0, 0, 10), (0, 60, 5)), 0, 0),  # src end past the buffer
        (rows((-1, 0, 1)), 0, 0),  # negative dst
        (rows((0, -8, 1)), 0, 0),  # negative src
        (rows((0, 0, -1)), 0, 0),  # negative length
        (rows((0, 0, 10)), 91, 0),  # the shift pushes dst out
        (rows((0, 0, 10)), 0, 55),  # the shift pushes src out
        (rows((0, 0, 2**62)), 0, 0),  # overflowing length
        (rows((-(2**63) + 10, 0, 5)), -(2**63), 0),  # the shift overflows int64 (would wrap to 10)
        (rows((2**63 - 1, 0, 5)), 1, 0),  # ... and the other way
        (rows((0, 2**63 - 1, 5)), 0, 2**62),
    ],
)
def test_bad_spans_raise_and_copy_nothing(table, dst_shift, src_shift):
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"falls outside the buffers .*nothing was copied"):
        copy_spans(dst, src, table, dst_shift=dst_shift, src_shift=src_shift)
    assert not dst.any()


@native_only
def test_malformed_tables_and_read_only_destinations_are_rejected():
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="whole number"):
        copy_spans(dst, src, np.zeros(4, dtype=np.int64))
    ro = np.zeros(64, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        copy_spans(ro, src, rows((0, 0, 8)))
    with pytest.raises(TypeError):
        copy_spans(dst, src, [[0, 0, 8]])  # not a buffer
    objects = np.empty(8, dtype=object)  # raw bytes over object pointers crashed the process
    with pytest.raises(TypeError, match="Python objects"):
        copy_spans(objects, src, rows((0, 0, 8)))
    with pytest.raises(TypeError, match="Python objects"):
        copy_spans(dst, np.empty(8, dtype=object), rows((0, 0, 8)))
    assert objects.tolist() == [None] * 8
    with pytest.raises(TypeError, match="native int64"):
        copy_spans(dst, src, np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(TypeError, match="native int64"):
        copy_spans(dst, src, np.zeros((1, 3), dtype=np.float64))
    with pytest.raises(TypeError, match="native int64"):
        copy_spans(dst, src, bytes(24))
    with pytest.raises(TypeError, match="native int64"):
        copy_spans(dst, src, np.zeros((1, 3), dtype=">i8" if np.little_endian else "<i8"))
    with pytest.raises(ValueError, match="contiguous"):
        copy_spans(dst, src, np.zeros((3, 3), dtype=np.int64)[:, ::2])
    assert copy_spans(dst, src, rows()) == 0 and not dst.any()


@native_only
@pytest.mark.parametrize("shape", [(3, 4), (6, 2), (4, 6), (3, 2, 2)])
def test_a_table_of_rows_other_than_three_is_refused(shape):
    """A (3, 4) table is 96 bytes, a whole number of 24-byte rows: it was read as four rows it
    does not hold and copied bytes from and to where no row said. Only rows of 3 (or a flat table of 3n
    values) are tables."""
    src, dst = np.arange(1, 65, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    table = np.zeros(shape, dtype=np.int64)
    table.reshape(-1)[:3] = (0, 0, 8)  # one span the copier would find if it read the bytes as rows
    assert table.nbytes % 24 == 0
    with pytest.raises(ValueError, match="rows of 3 .*nothing was copied"):
        copy_spans(dst, src, table)
    assert not dst.any()
    assert copy_spans(dst, src, table.reshape(-1)) == 8  # the same values, flat: rows of 3 in order
    assert dst[:8].tolist() == list(range(1, 9))


@native_only
def test_a_table_that_changes_during_the_copy_cannot_redirect_it():
    """The table is checked, then copied from a snapshot: here the first span rewrites the second
    row (the table lives in ``dst``) into one far outside the buffer, after the check."""
    dst = np.zeros(4096, dtype=np.uint8)
    table = dst[:48].view(np.int64).reshape(2, 3)
    table[0] = (24, 0, 24)
    table[1] = (0, 0, 0)
    src = np.array([1 << 40, 0, 4096], dtype=np.int64).view(np.uint8).copy()
    assert copy_spans(dst, src, table) == 24
    assert table[1].tolist() == [1 << 40, 0, 4096]  # rewritten, but never used


@native_only
def test_overlapping_buffers_copy_like_memmove():
    buf = np.arange(256, dtype=np.uint8)
    want = buf.copy()
    want[10:110] = buf[0:100].copy()
    copy_spans(buf, buf, rows((10, 0, 100)), streaming=True)
    assert np.array_equal(buf, want)


@pytest.mark.parametrize("total", [1, 7, 64 * 1024 + 3])
def test_split_table_halves_bytes_in_order(total):
    rng = np.random.default_rng(total)
    cuts = np.sort(rng.choice(np.arange(1, total), size=min(5, total - 1), replace=False)) if total > 1 else []
    lengths = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    table = np.stack([starts + 1000, starts, lengths], axis=1)
    first, second = split_table(table)
    assert int(first[:, 2].sum()) == (total + 1) // 2 and int(second[:, 2].sum()) == total // 2
    assert (first[:, 2] > 0).all() and (second[:, 2] > 0).all()
    covered = [b for d, s, n in np.concatenate([first, second]).tolist() for b in range(s, s + n)]
    assert covered == list(range(total))  # every byte once, in order
    assert all(d == s + 1000 for d, s, _ in np.concatenate([first, second]).tolist())


@native_only
def test_span_pair_merges_contiguous_dims_and_runs(device_pool_factory, host_pool_factory):
    dev = device_pool_factory("mha", size=16 * 4, page_size=4, layers=3)
    host = host_pool_factory(dev, layout="layer_first", pages=16)
    (d,), (h,) = dev.transfer_views(), host.transfer_views()
    per_layer = span_pair(d, h, layer_dim=2)
    assert per_layer is not None and per_layer.runs_merge
    assert per_layer.piece_bytes == 4 * dev.geometry.token_nbytes  # one page of K (or V), one layer
    assert per_layer.device.pieces.size == 2  # K and V
    plan = transfer.make_plan(token_idx([0, 1, 2, 9], 4), host.size, token_idx([5, 6, 7, 3], 4), dev.size, 4,
                              src_what="h", dst_what="d")
    table = per_layer.table(plan, to_host=False)
    assert table.shape == (2 * 2, 3)  # two runs, K and V each
    assert per_layer.table(plan, to_host=False) is table  # cached on the plan
    assert not table.flags.writeable and not any(h.flags.writeable for h in per_layer.halves(plan, to_host=False))
    assert sorted(table[:, 2].tolist()) == sorted([3 * per_layer.piece_bytes, per_layer.piece_bytes] * 2)

    direct = host_pool_factory(dev, layout="page_first_direct", pages=16)
    whole = span_pair(d, direct.transfer_views()[0])
    assert whole is not None and not whole.runs_merge  # device pages are strided by layer


@native_only
def test_span_pair_declines_what_it_cannot_serve(device_pool_factory, host_pool_factory):
    dev = device_pool_factory("mha", size=8 * 4, page_size=4)
    host = host_pool_factory(dev, layout="page_first", pages=8)
    (d,), (h,) = dev.transfer_views(), host.transfer_views()
    assert span_pair(d.view(torch.int64), h.view(torch.int64)) is None  # not byte views
    assert span_pair(d[..., ::2], h[..., ::2]) is None  # 1-byte pieces
    assert span_pair(d, h, layer_dim=d.dim()) is None  # no such dim
    assert span_pair(d, d) is None  # one storage for both sides


@native_only
def test_engine_uses_the_span_copier_by_default(device_pool_factory, host_pool_factory, monkeypatch):
    dev = device_pool_factory("mha", size=8 * 4, page_size=4)
    host = host_pool_factory(dev, layout="page_first", pages=8)
    with CopyEngine(dev, host) as eng:
        assert eng.native
    with CopyEngine(dev, host, native=False) as eng:
        assert not eng.native
    monkeypatch.setattr("hicache.memory.copy_engine.span_pair", lambda *a, **k: None)
    with CopyEngine(dev, host) as eng:
        assert not eng.native  # silently falls back
    with pytest.raises(RuntimeError, match="cannot describe"):
        CopyEngine(dev, host, native=True)


def test_native_true_without_the_copier_says_so(device_pool_factory, host_pool_factory, monkeypatch):
    monkeypatch.setattr("hicache.memory.copy_engine.NATIVE_AVAILABLE", False)
    monkeypatch.setattr("hicache.memory.copy_engine.span_pair", lambda *a, **k: None)
    dev = device_pool_factory("mha", size=8 * 4, page_size=4)
    host = host_pool_factory(dev, layout="page_first", pages=8)
    with pytest.raises(RuntimeError, match="is not built"):
        CopyEngine(dev, host, native=True)
    with CopyEngine(dev, host) as eng:
        assert not eng.native


@native_only
def test_streaming_is_chosen_by_step_size(device_pool_factory, host_pool_factory, monkeypatch, fill_bytes):
    """Big steps stream, small ones use memcpy; both land the same bytes."""
    seen: list[bool] = []
    real = spans._spancopy

    class Spy:
        STREAM_KIND = real.STREAM_KIND

        @staticmethod
        def copy_spans(*args, **kwargs):
            seen.append(kwargs["streaming"])
            return real.copy_spans(*args, **kwargs)

    monkeypatch.setattr(spans, "_spancopy", Spy)
    dev = device_pool_factory("mha", size=8 * 4, page_size=4)
    fill_bytes(dev.kv_data, 4)
    host = host_pool_factory(dev, layout="page_first", pages=8)
    with CopyEngine(dev, host) as eng:
        monkeypatch.setattr(spans, "STREAM_MIN_BYTES", 1 << 40)
        eng.backup_sync(token_idx([1, 2], 4), token_idx([0, 5], 4))
        monkeypatch.setattr(spans, "STREAM_MIN_BYTES", 1)
        eng.backup_sync(token_idx([3, 4], 4), token_idx([2, 7], 4))
    assert seen == [False, True]
    for d, h in [(1, 0), (2, 5), (3, 2), (4, 7)]:
        want = dev.kv_data[:, :, d * 4 : (d + 1) * 4].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(host.get_data_page(h * 4).view(torch.uint8), want)


@native_only
def test_split_native_backup_is_byte_exact(device_pool_factory, host_pool_factory, monkeypatch, fill_bytes):
    """A big backup is copied half by the engine thread and half by the second copy thread;
    loads stay on the engine thread. Both land every byte, nothing else touched."""
    monkeypatch.setattr("hicache.memory.copy_engine.os.cpu_count", lambda: 2)
    monkeypatch.setattr(transfer, "SPLIT_MIN_BYTES", 1)
    halves: list[int | None] = []
    real_copy = spans.SpanPair.copy

    def spy(self, plan, *, to_host, layer=0, half=None):
        halves.append(half)
        return real_copy(self, plan, to_host=to_host, layer=layer, half=half)

    monkeypatch.setattr(spans.SpanPair, "copy", spy)
    ps, pages = 4, 16
    src = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=3)
    dst = device_pool_factory("mha", size=pages * ps, page_size=ps, layers=3)
    fill_bytes(src.kv_data, 8)
    dst.kv_data.view(torch.uint8).fill_(0xCD)
    host = host_pool_factory(src, layout="layer_first", pages=pages)
    d, h, t = [5, 1, 9, 2, 14], [3, 4, 0, 11, 7], [2, 8, 6, 0, 13]
    with CopyEngine(src, host) as eng:
        eng.backup_sync(token_idx(d, ps), token_idx(h, ps))
    assert sorted(halves) == [0, 1]
    halves.clear()
    with CopyEngine(dst, host) as eng:
        eng.load_sync(token_idx(h, ps), token_idx(t, ps))
    assert halves == [None] * 3
    for layer in range(3):
        for a, b in zip(t, d):
            assert torch.equal(dst.kv_data[:, layer, a * ps : (a + 1) * ps].view(torch.uint8),
                               src.kv_data[:, layer, b * ps : (b + 1) * ps].view(torch.uint8))
        others = [p for p in range(pages) if p not in t]
        assert all(bool((dst.kv_data[:, layer, p * ps : (p + 1) * ps].view(torch.uint8) == 0xCD).all()) for p in others)


@native_only
def test_native_split_half_failure_waits_for_the_other_half(device_pool_factory, host_pool_factory, monkeypatch):
    """If the engine thread's half of a split backup fails, the step still waits for the second
    thread's half before the error surfaces (no copy outlives the failed operation)."""
    import threading
    import time

    monkeypatch.setattr("hicache.memory.copy_engine.os.cpu_count", lambda: 2)
    monkeypatch.setattr(transfer, "SPLIT_MIN_BYTES", 1)
    other_done = threading.Event()

    def fake(self, plan, *, to_host, layer=0, half=None):
        if half == 1:
            time.sleep(0.05)
            other_done.set()
            return 0
        raise RuntimeError("boom")

    monkeypatch.setattr(spans.SpanPair, "copy", fake)
    dev = device_pool_factory("mha", size=8 * 4, page_size=4)
    host = host_pool_factory(dev, layout="page_first", pages=8)
    with CopyEngine(dev, host) as eng:
        with pytest.raises(RuntimeError, match="boom"):
            eng.backup_sync(token_idx([1, 5, 3, 6], 4), token_idx([2, 0, 4, 7], 4))
        assert other_done.is_set()


def strided_view(shape: list[int], order: list[int], pad: list[int], seed: int) -> torch.Tensor:
    """A byte view of logical ``shape`` whose dims lie in memory in ``order`` (outermost first),
    each padded by ``pad`` elements and started at an offset inside a bigger random tensor."""
    g = torch.Generator().manual_seed(seed)
    phys = [shape[j] for j in order]
    big = torch.randint(0, 256, [s + p for s, p in zip(phys, pad)], dtype=torch.uint8, generator=g)
    v = big[tuple(slice(p // 2, p // 2 + s) for s, p in zip(phys, pad))]
    return v.permute(*[order.index(j) for j in range(len(shape))])


@st.composite
def view_pairs(draw):
    inner = [draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([16, 17, 32, 48]))]
    units = [draw(st.integers(2, 6)), draw(st.integers(2, 6))]
    views = []
    for i, u in enumerate(units):
        # mostly with the last dim innermost (as every real pool), sometimes anywhere
        order = [*draw(st.permutations(range(3))), 3] if draw(st.integers(0, 5)) else draw(st.permutations(range(4)))
        pad = [draw(st.sampled_from([0, 0, 1, 3])) for _ in range(4)]
        views.append(strided_view([u, *inner], list(order), pad, seed=draw(st.integers(0, 1000)) + i))
    n = draw(st.integers(1, min(units)))
    src = draw(st.permutations(range(units[0])))[:n]
    dst = draw(st.permutations(range(units[1])))[:n]
    if draw(st.booleans()):
        src, dst = sorted(src), sorted(dst)  # runs
    return views[0], views[1], list(src), list(dst)


def storage_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


@native_only
@given(pair=view_pairs(), per_layer=st.booleans(), to_host=st.booleans(), split=st.booleans())
@settings(max_examples=200, deadline=None)
def test_span_tables_match_torch_for_any_strided_views(pair, per_layer, to_host, split):
    """Random layouts (any dim order, padding, offsets): the span copy writes exactly what a
    per-unit torch assignment writes, into the whole storage (nothing outside the units)."""
    dev, host, dev_units, host_units = pair
    sp = span_pair(dev, host, layer_dim=2 if per_layer else None)
    if sp is None:
        return  # pieces too small to serve; the engine uses its numpy/torch path then
    src, dst = (dev, host) if to_host else (host, dev)
    s_units, d_units = (dev_units, host_units) if to_host else (host_units, dev_units)
    plan = transfer.make_plan(torch.tensor(s_units), src.shape[0], torch.tensor(d_units), dst.shape[0], 1,
                              src_what="s", dst_what="d")
    for layer in range(dev.shape[2]) if per_layer else [None]:
        want_storage = storage_copy(dst)
        want = torch.empty(0, dtype=torch.uint8).set_(want_storage.untyped_storage()).as_strided(
            dst.shape, dst.stride(), dst.storage_offset()
        )
        for s, d in zip(s_units, d_units):
            if layer is None:
                want[d] = src[s]
            else:
                want[d, :, layer] = src[s, :, layer]
        kw = {"to_host": to_host, "layer": layer or 0}
        if split:
            sp.copy(plan, half=0, **kw)
            sp.copy(plan, half=1, **kw)
        else:
            sp.copy(plan, **kw)
        assert torch.equal(storage_copy(dst), want_storage)


def reference_table(sp: spans.SpanPair, plan: transfer.TransferPlan, to_host: bool) -> np.ndarray:
    """The ``(dst, src, nbytes)`` rows as :meth:`SpanPair._table` built them before it cut its
    numpy calls: unit by unit (or run by run), piece by piece, in order."""
    dst, src = (sp.host, sp.device) if to_host else (sp.device, sp.host)
    if sp.runs_merge:
        units = [(s, d, k * sp.piece_bytes) for s, d, k in plan.runs.tolist()]
    else:
        units = [(s, d, sp.piece_bytes) for s, d in zip(plan.src_units.tolist(), plan.dst_units.tolist())]
    out = [
        (dst.base + d * dst.unit_stride + dp, src.base + s * src.unit_stride + sp_, n)
        for s, d, n in units
        for dp, sp_ in zip(dst.pieces.tolist(), src.pieces.tolist())
    ]
    return np.array(out, dtype=np.int64).reshape(-1, 3)


@native_only
@given(pair=view_pairs(), per_layer=st.booleans(), to_host=st.booleans())
@settings(max_examples=200, deadline=None)
def test_span_table_rows_match_unit_by_unit_rows(pair, per_layer, to_host):
    dev, host, dev_units, host_units = pair
    sp = span_pair(dev, host, layer_dim=2 if per_layer else None)
    if sp is None:
        return
    src, dst = (dev, host) if to_host else (host, dev)
    s_units, d_units = (dev_units, host_units) if to_host else (host_units, dev_units)
    plan = transfer.make_plan(torch.tensor(s_units), src.shape[0], torch.tensor(d_units), dst.shape[0], 1,
                              src_what="s", dst_what="d")
    table = sp.table(plan, to_host=to_host)
    assert table.dtype == np.int64 and table.flags.c_contiguous and not table.flags.writeable
    np.testing.assert_array_equal(table, reference_table(sp, plan, to_host))
