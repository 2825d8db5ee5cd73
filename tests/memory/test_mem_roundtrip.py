"""Byte-exact round trips device -> host -> flat storage page -> host -> device, for every layout.

A storage backend is emulated the way a real one behaves: it copies the page's bytes out
(``get_data_page`` or the live ``page_view``) and later writes bytes into a dummy page that is
committed with ``set_from_flat_data_page`` (or straight into ``page_view``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.memory import LAYOUTS, CopyEngine
from hicache.memory.spans import NATIVE_AVAILABLE

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: (device, CopyEngine's ``native``): both CPU copy paths, and CUDA
ENGINES = [
    pytest.param("cpu", True, id="cpu-native",
                 marks=pytest.mark.skipif(not NATIVE_AVAILABLE, reason="span copier not built")),
    pytest.param("cpu", False, id="cpu-numpy"),
    pytest.param("cuda", None, id="cuda", marks=CUDA),
]
HOST_SENTINEL = 0xAB
DEVICE_SENTINEL = 0xCD

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.float16, torch.bfloat16, torch.float32] + ([FP8] if FP8 is not None else [])


def token_idx(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)


def canonical_page(dev_pool, page: int) -> bytes:
    """The canonical flat bytes of a device page, built independently of the host code:
    [component][layer][token][...] in C order."""
    ps = dev_pool.page_size
    part = dev_pool.kv_data[:, :, page * ps : (page + 1) * ps].contiguous().cpu()
    return part.view(torch.uint8).numpy().tobytes()


def store_pages(host, host_pages: list[int]) -> dict[int, bytes]:
    """What a backend writes: the bytes of each page, copied out."""
    ps = host.page_size
    out = {}
    for p in host_pages:
        view = host.page_view(p * ps)
        data = view if view is not None else host.get_data_page(p * ps, flat=True)
        assert data.dim() == 1
        out[p] = data.contiguous().view(torch.uint8).numpy().tobytes()
    return out


def read_pages(host, stored: dict[int, bytes], mapping: dict[int, int], *, direct: bool) -> None:
    """What a backend does on a read: bytes into a dummy page (or the live view), then commit."""
    ps = host.page_size
    for src, dst in mapping.items():
        payload = np.frombuffer(stored[src], dtype=np.uint8)
        view = host.page_view(dst * ps) if direct else None
        if view is not None:
            view.numpy()[:] = payload
            host.set_from_flat_data_page(dst * ps, view)  # committing the view itself is a no-op
            continue
        dummy = host.get_dummy_flat_data_page()
        assert dummy.numel() * dummy.element_size() == host.page_nbytes == len(payload)
        dummy.view(torch.uint8).numpy()[:] = payload
        host.set_from_flat_data_page(dst * ps, dummy)


def sentinel_ok(t: torch.Tensor, value: int) -> bool:
    return bool((t.reshape(-1).view(torch.uint8) == value).all())


@pytest.mark.parametrize(("device", "native"), ENGINES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout_out", LAYOUTS)
@pytest.mark.parametrize("layout_in", LAYOUTS)
def test_round_trip_all_layouts(device, native, kind, page_size, layout_out, layout_in,
                                device_pool_factory, host_pool_factory, fill_bytes):
    rng = np.random.default_rng(page_size * 7 + len(layout_out) + 3 * len(layout_in))
    dev_pages_total, host_pages_total = 12, 10
    src_dev = device_pool_factory(kind, size=dev_pages_total * page_size, page_size=page_size, device=device)
    dst_dev = device_pool_factory(kind, size=dev_pages_total * page_size, page_size=page_size, device=device)
    fill_bytes(src_dev.kv_data, 1)
    dst_dev.kv_data.view(torch.uint8).fill_(DEVICE_SENTINEL)
    host_out = host_pool_factory(src_dev, layout=layout_out, pages=host_pages_total)
    host_in = host_pool_factory(dst_dev, layout=layout_in, pages=host_pages_total)

    n = 5  # odd, with runs and gaps on both sides
    start = int(rng.integers(0, dev_pages_total - 1))
    rest = [int(p) for p in rng.permutation(dev_pages_total) if p not in (start, start + 1)]
    dev_pages = [start, start + 1, *rest[: n - 2]]
    host_pages = [0, 1, 2, 6, 9]
    with CopyEngine(src_dev, host_out, native=native) as eng:
        eng.backup_sync(token_idx(dev_pages, page_size), token_idx(host_pages, page_size))

    # host holds the canonical bytes; untouched host pages keep the sentinel
    for d, h in zip(dev_pages, host_pages):
        assert host_out.get_data_page(h * page_size).view(torch.uint8).numpy().tobytes() == canonical_page(src_dev, d)
    for h in set(range(host_pages_total)) - set(host_pages):
        assert sentinel_ok(host_out.get_data_page(h * page_size), HOST_SENTINEL)

    stored = store_pages(host_out, host_pages)
    in_pages = [8, 3, 4, 5, 0]
    read_pages(host_in, stored, dict(zip(host_pages, in_pages)), direct=(page_size != 4))
    for h in set(range(host_pages_total)) - set(in_pages):
        assert sentinel_ok(host_in.get_data_page(h * page_size), HOST_SENTINEL)

    out_dev_pages = [11, 2, 3, 7, 0]
    with CopyEngine(dst_dev, host_in, native=native) as eng:
        handle = eng.load(token_idx(in_pages, page_size), token_idx(out_dev_pages, page_size))
        handle.wait_sync(timeout=30)
    for d_src, d_dst in zip(dev_pages, out_dev_pages):
        assert canonical_page(dst_dev, d_dst) == canonical_page(src_dev, d_src)
    for d in set(range(dev_pages_total)) - set(out_dev_pages):
        ps = page_size
        assert sentinel_ok(dst_dev.kv_data[:, :, d * ps : (d + 1) * ps].contiguous(), DEVICE_SENTINEL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_round_trip_dtypes(dtype, kind, device_pool_factory, host_pool_factory, fill_bytes):
    ps = 8
    src = device_pool_factory(kind, size=8 * ps, page_size=ps, dtype=dtype, layers=2)
    dst = device_pool_factory(kind, size=8 * ps, page_size=ps, dtype=dtype, layers=2)
    fill_bytes(src.kv_data, 5)
    for layout in LAYOUTS:
        host = host_pool_factory(src, layout=layout, pages=4)
        dst.kv_data.view(torch.uint8).fill_(DEVICE_SENTINEL)
        with CopyEngine(src, host) as eng:
            eng.backup_sync(token_idx([5, 6, 1], ps), token_idx([3, 0, 1], ps))
        page = host.get_data_page(0)
        assert page.dtype == dtype and page.numel() * page.element_size() == host.page_nbytes
        with CopyEngine(dst, host) as eng:
            eng.load_sync(token_idx([3, 0, 1], ps), token_idx([0, 1, 2], ps))
        for a, b in zip([5, 6, 1], [0, 1, 2]):
            assert canonical_page(dst, b) == canonical_page(src, a)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_flat_page_is_layout_independent(kind, device_pool_factory, host_pool_factory, fill_bytes):
    """The same device page backed up under each layout gives byte-identical flat pages, and a
    page written under one layout reads back as identical KV under every other."""
    ps = 4
    dev = device_pool_factory(kind, size=6 * ps, page_size=ps)
    fill_bytes(dev.kv_data, 9)
    flats = {}
    for layout in LAYOUTS:
        host = host_pool_factory(dev, layout=layout, pages=3)
        with CopyEngine(dev, host) as eng:
            eng.backup_sync(token_idx([2, 3], ps), token_idx([1, 2], ps))
        flats[layout] = (host.get_data_page(ps).view(torch.uint8).numpy().tobytes(),
                         host.get_data_page(2 * ps, flat=False))
        assert host.storage_signature() == host_pool_factory(dev, layout="page_first", pages=3).storage_signature()
    first = next(iter(flats.values()))
    for layout, (flat, shaped) in flats.items():
        assert flat == first[0], layout
        assert torch.equal(shaped.view(torch.uint8), first[1].view(torch.uint8)), layout
    for w in LAYOUTS:
        for r in LAYOUTS:
            writer = host_pool_factory(dev, layout=w, pages=3)
            with CopyEngine(dev, writer) as eng:
                eng.backup_sync(token_idx([2], ps), token_idx([0], ps))
            reader = host_pool_factory(dev, layout=r, pages=3)
            reader.set_from_flat_data_page(2 * ps, writer.get_data_page(0))
            back = device_pool_factory(kind, size=6 * ps, page_size=ps)
            with CopyEngine(back, reader) as eng:
                eng.load_sync(token_idx([2], ps), token_idx([5], ps))
            assert canonical_page(back, 5) == canonical_page(dev, 2), (w, r)


def test_storage_helpers_accept_our_pools(device_pool_factory, host_pool_factory, fill_bytes):
    """The storage layer's own page helpers: zero-copy for page_first, staged otherwise."""
    pages = pytest.importorskip("hicache.storage.pages")
    ps = 4
    dev = device_pool_factory("mha", size=4 * ps, page_size=ps)
    fill_bytes(dev.kv_data, 11)
    src = host_pool_factory(dev, layout="page_first", pages=4)
    with CopyEngine(dev, src) as eng:
        eng.backup_sync(token_idx([0, 1, 2, 3], ps), token_idx([3, 2, 1, 0], ps))
    written = [bytes(mv) for mv in pages.write_sources(src, [0, ps, 2 * ps, 3 * ps])]
    dst = host_pool_factory(dev, layout="layer_first", pages=4)
    targets = pages.read_targets(dst, [0, ps, 2 * ps, 3 * ps])
    assert all(t is not None and t.staging is not None for t in targets)  # layer_first stages
    for t, payload in zip(targets, written):
        t.buffer[:] = payload
    assert pages.commit_reads(dst, targets, [True] * 4) == [True] * 4
    for p in range(4):
        assert dst.get_data_page(p * ps).view(torch.uint8).numpy().tobytes() == written[p]
    direct = pages.read_targets(src, [0])
    assert direct[0].staging is None  # page_first: storage reads straight into the pool
