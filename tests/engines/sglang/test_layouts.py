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
