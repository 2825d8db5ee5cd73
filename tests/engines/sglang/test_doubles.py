"""The device <-> host copy doubles of the engine tests (``sgl_doubles``) against SGLang's own
pools: each token's K and V land in the row its host layout defines, both ways, so the engine
tests' text checks rest on copies that move the right KV."""

from __future__ import annotations

import pytest
import sgl_doubles
import sgl_helpers as helpers
import torch
from sglang.srt.mem_cache.pool_host import mha

PAGE = 16
LAYERS = 3
COPIES = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")


@pytest.fixture
def doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in COPIES:  # bound by SGLang on CUDA only: absent here
        monkeypatch.setattr(mha, name, getattr(sgl_doubles, name), raising=False)


def test_direct_copies_put_every_token_in_its_layouts_row(doubles: None) -> None:
    dev = helpers.device_pool(size=256, page_size=PAGE, layers=LAYERS)
    g = torch.Generator().manual_seed(0)
    for buf in dev.k_buffer + dev.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    src = torch.cat([torch.arange(48, 64), torch.arange(16, 32)])  # two device pages, out of order
    rows = torch.cat([torch.arange(32, 48), torch.arange(96, 112)])  # two host pages
    lf = helpers.host_pool(dev, "layer_first")
    pf = helpers.host_pool(dev, "page_first_direct")
    for host in (lf, pf):
        host.backup_from_device_all_layer(dev, rows, src, "direct")
    page, off = rows // PAGE, rows % PAGE
    for layer in range(LAYERS):
        for half, device in ((0, dev.k_buffer[layer]), (1, dev.v_buffer[layer])):
            assert torch.equal(lf.kv_buffer[half, layer, rows], device[src])
            assert torch.equal(pf.kv_buffer[half, page, layer, off], device[src])
    dst = torch.arange(128, 160)
    for layer in range(LAYERS):
        pf.load_to_device_per_layer(dev, rows, dst, layer, "direct")
        assert torch.equal(dev.k_buffer[layer][dst], dev.k_buffer[layer][src])
        assert torch.equal(dev.v_buffer[layer][dst], dev.v_buffer[layer][src])
