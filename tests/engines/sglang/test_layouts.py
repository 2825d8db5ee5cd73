"""Every SGLang host layout writes and reads the same canonical pages, through SGLang's
factory and SGLang's controller (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import sgl_drive as drive
import sgl_helpers as helpers

PAGE = 16
LAYERS = 4


def _server(layout: str, root: str, *, mla: bool = False, interface_v1: int | None = None, seed: int = 0):
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS, mla=mla)
    host = helpers.host_pool(dev, layout)
    helpers.fill_random(host, seed)
    extra = helpers.extra_config("file", root=root)
    if interface_v1 is not None:
        extra["interface_v1"] = interface_v1
    return host, helpers.controller(dev, host, extra)


def _round_trip(w_layout: str, r_layout: str, root: str, *, mla: bool = False, interface_v1: int | None = None) -> None:
    writer_host, writer = _server(w_layout, root, mla=mla, interface_v1=interface_v1, seed=1)
    reader_host, reader = _server(r_layout, root, mla=mla, interface_v1=interface_v1, seed=2)
    try:
        drive.write_then_read(writer, writer_host, reader, reader_host, 6, LAYERS)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


@pytest.mark.parametrize("w_layout,r_layout", list(itertools.product(helpers.MHA_LAYOUTS, repeat=2)))
def test_mha_every_layout_pair_reads_back_exactly(w_layout, r_layout, store_root):
    _round_trip(w_layout, r_layout, store_root)


@pytest.mark.parametrize("w_layout,r_layout", list(itertools.product(helpers.MLA_LAYOUTS, repeat=2)))
def test_mla_every_layout_pair_reads_back_exactly(w_layout, r_layout, store_root):
    _round_trip(w_layout, r_layout, store_root, mla=True)


@pytest.mark.parametrize("w_layout,r_layout", [("page_head", "layer_first"), ("page_first", "page_head"), ("layer_first", "page_first")])
def test_v0_path_keeps_canonical_order_too(w_layout, r_layout, store_root):
    """With ``interface_v1`` set to 0 SGLang moves its own flat pages (batch_get/batch_set);
    they are reordered to canonical bytes, so layouts still share pages."""
    _round_trip(w_layout, r_layout, store_root, interface_v1=0)


def test_v0_and_v1_servers_share_pages(store_root):
    w_host, writer = _server("page_head", store_root, interface_v1=0, seed=1)
    r_host, reader = _server("page_first", store_root, seed=2)
    try:
        drive.write_then_read(writer, w_host, reader, r_host, 3, LAYERS, seed=4)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


def test_zero_copy_path_is_on_by_default(store_root):
    host, ctl = _server("layer_first", store_root)
    try:
        assert ctl.storage_config.extra_config["interface_v1"] == 1
        assert ctl.page_get_func == ctl._page_get_zero_copy
        assert ctl.page_set_func == ctl._page_set_zero_copy
    finally:
        ctl.detach_storage_backend()


def test_canonical_page_equals_sglang_layer_first_flat_page(store_root):
    """The canonical order is SGLang's own layer_first flat page: a store written by hicache
    holds exactly the bytes SGLang's layer_first pool calls a page."""
    from hicache.integrations.sglang.pages import CanonicalPagePool

    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS)
    lf = helpers.host_pool(dev, "layer_first")
    helpers.fill_random(lf, 5)
    for layout in helpers.MHA_LAYOUTS:
        other = helpers.host_pool(dev, layout)
        adapter_lf, adapter_other = CanonicalPagePool(lf), CanonicalPagePool(other)
        for page in range(3):
            adapter_other.set_from_flat_data_page(page * PAGE, adapter_lf.get_data_page(page * PAGE))
            assert torch.equal(adapter_other.get_data_page(page * PAGE), lf.get_data_page(page * PAGE, flat=True))


@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_v0_get_without_a_target_returns_the_page_that_was_set(layout, store_root):
    """SGLang's ``get(key)`` returns the value ``set(key, value)`` stored. Without a target the
    adapter returned the stored canonical bytes (uint8, layer_first order) in place of the
    pool's flat page, so the value came back in another dtype and, for a layout other than
    layer_first, scrambled. It is now the flat page in the pool's own order and dtype."""
    host, ctl = _server(layout, store_root, interface_v1=0, seed=6)
    st = ctl.storage_backend
    try:
        keys = ["ab" * 32, "cd" * 32]
        pages = [host.get_data_page(i * PAGE) for i in range(2)]
        assert st.set(keys[0], pages[0]) and st.batch_set(keys[1:], pages[1:])
        got = [st.get(keys[0]), *st.batch_get(keys[1:])]
        for page, back in zip(pages, got):
            assert back is not None and back.dtype == page.dtype and torch.equal(back, page)
    finally:
        ctl.detach_storage_backend()


#: (MLA, kv-head groups of an MHA page) of the ``page_unified`` pools below
_UNIFIED = [(False, 1), (False, 2), (True, 1)]


def _unified_dev(mla: bool):  # type: ignore[no-untyped-def]
    # 4 heads, so that 2 groups of 2 heads each put a head's place in the page to the test
    return helpers.device_pool(page_size=PAGE, layers=LAYERS, heads=4, mla=mla)


def _attached(host, root: str, *, mla: bool, backend: str = "file"):  # type: ignore[no-untyped-def]
    """hicache's storage through SGLang's factory, with ``host`` as the KV host pool."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = helpers.extra_config(backend, **({"root": root} if backend == "file" else {}))
    cfg = helpers.storage_config(root, "m", extra=extra, is_mla_model=mla)
    st = StorageBackendFactory.create_backend("dynamic", cfg, host)
    st.register_mem_pool_host(host)
    st.on_host_pools_registered()
    return st


@pytest.mark.parametrize("mla,groups", _UNIFIED)
def test_page_unified_canonical_pages_are_the_other_layouts(mla, groups):
    """SGLang's ``page_unified`` host pools (MLA: ``(P, L, ps, D)``; MHA: ``(P, head group, L,
    2, ps, heads in group, D)``) were passed through in SGLang's own bytes, and SGLang's
    ``get_data_page`` raises ``ValueError`` for that layout: every write failed. The canonical
    adapter now reorders them: every token's K/V (or latent), read by the layout's definition,
    is where the canonical page of every other layout puts it."""
    from hicache.integrations.sglang.pages import CanonicalPagePool

    dev = _unified_dev(mla)
    unified = helpers.host_pool(dev, helpers.UNIFIED, head_group_num=groups)
    helpers.fill_random(unified, 5)
    adapter = CanonicalPagePool(unified)
    assert adapter.has_live_pages == mla  # MLA: page_first_direct's bytes, no copy
    for layout in helpers.MLA_LAYOUTS if mla else helpers.MHA_LAYOUTS:
        other = helpers.host_pool(dev, layout)
        helpers.fill_random(other, 6)
        theirs = CanonicalPagePool(other)
        assert theirs.storage_signature() == adapter.storage_signature()
        idx = torch.arange(3 * PAGE)
        for page in range(3):
            theirs.set_from_flat_data_page(page * PAGE, adapter.get_data_page(page * PAGE))
        assert drive.pages_equal(unified, idx, other, idx, LAYERS)
        helpers.fill_random(other, 7)
        for page in range(3):  # and back, through the strided gather/scatter
            buf = adapter.new_staging(1)[0]
            theirs.gather(page * PAGE, buf)
            adapter.scatter(page * PAGE, buf)
        assert drive.pages_equal(unified, idx, other, idx, LAYERS)


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("mla,groups", _UNIFIED)
def test_page_unified_pages_round_trip_byte_exact(mla, groups, backend, store_root):
    """A ``page_unified`` KV host pool stores its pages and reads them back byte for byte,
    through the file store (its pool pieces) and the memory store (staged pages)."""
    dev = _unified_dev(mla)
    host = helpers.host_pool(dev, helpers.UNIFIED, head_group_num=groups)
    helpers.fill_random(host, 8)
    st = _attached(host, store_root, mla=mla, backend=backend)
    try:
        keys = [f"{i:02x}" * 32 for i in range(3)]
        host.alloc(PAGE)  # pages off the first
        src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
        assert st.batch_set_v1(keys, src) == [True] * 3
        assert st.batch_get_v1(keys, dst) == [True] * 3
        for a, b in zip(src[::PAGE].tolist(), dst[::PAGE].tolist()):
            assert torch.equal(host.kv_buffer[a // PAGE], host.kv_buffer[b // PAGE])
    finally:
        st.close()


@pytest.mark.parametrize("mla,groups", _UNIFIED)
def test_page_unified_and_every_other_layout_share_pages(mla, groups, store_root):
    """One namespace for every layout: pages a ``page_unified`` server wrote are hits with the
    same K/V for a server of any other layout, and the other way round."""
    dev = _unified_dev(mla)
    unified = helpers.host_pool(dev, helpers.UNIFIED, head_group_num=groups)
    helpers.fill_random(unified, 9)
    u = _attached(unified, store_root, mla=mla)
    keys = [f"{i:02x}" * 32 for i in range(2)]
    src = unified.alloc(2 * PAGE)
    try:
        assert u.batch_set_v1(keys, src) == [True, True]
        for n, layout in enumerate(helpers.MLA_LAYOUTS if mla else helpers.MHA_LAYOUTS):
            other = helpers.host_pool(dev, layout)
            helpers.fill_random(other, 10 + n)
            st = _attached(other, store_root, mla=mla)
            try:
                dst = other.alloc(2 * PAGE)
                assert st.batch_get_v1(keys, dst) == [True, True]
                assert drive.pages_equal(unified, src, other, dst, LAYERS)
                theirs = [f"{0xa0 + n:02x}{i:02x}" * 16 for i in range(2)]
                mine = other.alloc(2 * PAGE)
                assert st.batch_set_v1(theirs, mine) == [True, True]
            finally:
                st.close()
            back = unified.alloc(2 * PAGE)
            assert u.batch_get_v1(theirs, back) == [True, True]
            assert drive.pages_equal(other, mine, unified, back, LAYERS)
    finally:
        u.close()
