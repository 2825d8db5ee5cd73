"""Device pools, host pools (sizing, layouts, page protocol) and the Mamba state pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.keys import Namespace
from hicache.memory import (
    LAYOUTS,
    CopyEngine,
    MambaHostPool,
    MambaStatePool,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    device_for,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
FP8 = getattr(torch, "float8_e4m3fn", None)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes may be NaN patterns)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class _Layer:
    layer_id = 1


def test_device_for():
    assert device_for("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device_for(None).type == expected
    assert device_for("cuda").type == expected


@pytest.mark.parametrize("device", DEVICES)
def test_mha_pool_buffers(device):
    pool = MHATokenToKVPool(16, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=3, device=device)
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert pool.size == 16 and pool.page_size == 4 and pool.layer_num == 3 and pool.dtype == torch.bfloat16
    k, v = pool.get_kv_buffer(1)
    assert k.shape == (16, 2, 8) and k.is_contiguous() and v.shape == (16, 2, 8)
    loc = torch.tensor([3, 9], device=device)
    ck, cv = torch.randn(2, 2, 8), torch.randn(2, 16)  # cache_v given flat: reshaped per token
    pool.set_kv_buffer(_Layer(), loc, ck, cv)
    assert torch.equal(pool.get_key_buffer(1)[loc].cpu(), ck.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(1)[loc].cpu(), cv.view(2, 2, 8).to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched


def test_mla_pool_buffers():
    pool = MLATokenToKVPool(8, 2, torch.float16, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2, device="cpu")
    assert pool.bytes_per_token == 2 * 8 * 2
    latent = torch.randn(2, 1, 8)
    pool.set_kv_buffer(0, torch.tensor([1, 4]), latent, None)
    assert torch.equal(pool.get_key_buffer(0)[[1, 4]], latent.half())
    assert pool.get_value_buffer(0).shape == (8, 1, 6)
    assert torch.equal(pool.get_value_buffer(0)[[1, 4]], latent[..., :6].half())
    pool.set_mla_kv_buffer(1, torch.tensor([0]), latent[:1, :, :6], latent[:1, :, 6:])
    assert torch.equal(pool.get_key_buffer(1)[0], latent[0].half())


@pytest.mark.skipif(FP8 is None, reason="torch without float8")
def test_fp8_pool_stores_dtype_and_writes_via_bytes():
    pool = MHATokenToKVPool(8, 2, FP8, head_num=1, head_dim=4, layer_num=1, device="cpu")
    assert pool.get_key_buffer(0).dtype == FP8
    vals = torch.tensor([[[0.5, 1.0, -2.0, 0.25]]])
    pool.set_kv_buffer(0, torch.tensor([5]), vals, vals)
    assert torch.equal(pool.get_key_buffer(0)[5].float(), vals[0])


def test_host_sizing_bytes_and_ratio():
    dev = MHATokenToKVPool(64, 4, torch.float16, head_num=2, head_dim=4, layer_num=2, device="cpu")
    page = 4 * dev.bytes_per_token
    h = MHATokenToKVPoolHost(dev, host_size_bytes=5 * page + 7, page_size=4)
    assert h.size == 20 and h.num_pages == 5 and h.page_nbytes == page and h.layout == "page_first"
    assert h.available_size() == 20
    h = MHATokenToKVPoolHost(dev, host_to_device_ratio=1.5, page_size=4, layout="layer_first")
    assert h.size == 96
    h = MHATokenToKVPoolHost(dev, page_size=4)
    assert h.size == 128  # default ratio 2.0
    assert h.pin_memory == torch.cuda.is_available()


@pytest.mark.parametrize("ratio", [0.29, 0.57, 1.13])
def test_a_ratio_naming_whole_pages_sizes_the_host_pool_to_all_of_them(ratio):
    """``100 * 0.29`` is 28.999999999999996 in floats: a host pool sized by a ratio that names
    29 of 100 device pages got 28 (KV and Mamba pools alike), one page short of what was asked,
    where a config's ``host.ratio`` gives all of them."""
    want = round(100 * ratio)
    dev = MHATokenToKVPool(100 * 4, 4, torch.float16, head_num=1, head_dim=8, layer_num=1, device="cpu")
    assert MHATokenToKVPoolHost(dev, host_to_device_ratio=ratio, page_size=4).num_pages == want
    state = MambaStatePool(100, {"ssm": (4,)}, torch.float32, "cpu")
    assert MambaHostPool(state, host_to_device_ratio=ratio).size == want


def test_host_validation():
    dev = MHATokenToKVPool(16, 4, torch.float16, head_num=2, head_dim=4, layer_num=2, device="cpu")
    with pytest.raises(ValueError, match="not both"):
        MHATokenToKVPoolHost(dev, host_size_bytes=10**6, host_to_device_ratio=2, page_size=4)
    with pytest.raises(ValueError, match="no page"):
        MHATokenToKVPoolHost(dev, host_size_bytes=10, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        MHATokenToKVPoolHost(dev, page_size=8)
    with pytest.raises(ValueError, match="unknown host layout"):
        MHATokenToKVPoolHost(dev, page_size=4, layout="token_first")
    with pytest.raises(TypeError):
        MLATokenToKVPoolHost(dev, page_size=4)
    with pytest.raises(MemoryError, match="GiB"):
        MHATokenToKVPoolHost(dev, host_size_bytes=1 << 60, page_size=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory"):
            MHATokenToKVPoolHost(dev, page_size=4, pin_memory=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_protocol_semantics(layout):
    dev = MHATokenToKVPool(16, 4, torch.bfloat16, head_num=2, head_dim=4, layer_num=3, device="cpu")
    host = MHATokenToKVPoolHost(dev, host_size_bytes=4 * 4 * dev.bytes_per_token, page_size=4, layout=layout)
    dummy = host.get_dummy_flat_data_page()
    assert dummy.dtype == torch.bfloat16 and dummy.dim() == 1
    assert dummy.numel() * 2 == host.page_nbytes == 4 * dev.bytes_per_token
    data = torch.randn(dummy.numel()).to(torch.bfloat16)
    host.set_from_flat_data_page(8, data)
    got = host.get_data_page(8)
    assert torch.equal(got, data)
    assert host.get_data_page(8, flat=False).shape == (2, 3, 4, 2, 4)
    got.zero_()  # a snapshot, not the pool's memory
    assert torch.equal(host.get_data_page(8), data)
    host.set_from_flat_data_page(4, data.view(torch.uint8))  # any dtype with the right byte count
    assert torch.equal(host.get_data_page(4), data)
    with pytest.raises(IndexError):
        host.get_data_page(5)  # not a page start
    with pytest.raises(IndexError):
        host.get_data_page(16)
    with pytest.raises(ValueError, match="bytes"):
        host.set_from_flat_data_page(0, data[:-1])
    view = host.page_view(8)
    if layout == "page_first":
        assert view is not None and view.dtype == torch.uint8 and view.is_contiguous() and view.dim() == 1
        assert view.numel() == host.page_nbytes
        view.fill_(0)  # live: writes land in the pool
        assert (host.get_data_page(8).view(torch.uint8) == 0).all()
    else:
        assert view is None
    views = host.page_views([8, 0, 8])  # a storage batch asks for all its pages at once
    if layout == "page_first":
        assert views is not None and [len(v) for v in views] == [host.page_nbytes] * 3
        assert bytes(views[0]) == host.page_view(8).numpy().tobytes()
        views[1][:] = b"\x07" * host.page_nbytes  # live, like page_view
        assert (host.get_data_page(0).view(torch.uint8) == 7).all()
        for bad in ([5], [16], [-4], [0, 3]):  # not a page start, out of range
            with pytest.raises(IndexError):
                host.page_views(bad)
    else:
        assert views is None


def test_storage_signature_is_layout_independent_and_feeds_namespace():
    dev = MLATokenToKVPool(8, 4, torch.bfloat16, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=3, device="cpu")
    sigs = [MLATokenToKVPoolHost(dev, page_size=4, layout=lay).storage_signature() for lay in LAYOUTS]
    assert sigs[0] == sigs[1] == sigs[2]
    sig = sigs[0]
    assert sig["dtype"] == "bfloat16" and sig["is_mla"] is True and sig["layer_num"] == 3
    assert sig["head_num"] == 1 and sig["head_dim"] == 8 and sig["page_size"] == 4
    assert "layout" not in sig
    ns = Namespace(model="m").with_signature(sig)
    assert ns.kv_dtype == "bfloat16" and ns.num_layers == 3 and ns.page_size == 4 and ns.layout is None


def test_host_alloc_and_typed_view():
    dev = MHATokenToKVPool(16, 4, torch.float16, head_num=2, head_dim=4, layer_num=3, device="cpu")
    for layout, shape in [("layer_first", (2, 3, 32, 2, 4)), ("page_first", (8, 2, 3, 4, 2, 4)),
                          ("page_first_direct", (2, 8, 3, 4, 2, 4))]:
        host = MHATokenToKVPoolHost(dev, page_size=4, layout=layout)
        assert host.kv_buffer.shape == shape and host.kv_buffer.dtype == torch.float16
        got = host.alloc(8)
        assert got.tolist() == list(range(8)) and host.available_size() == 24
        host.free(got)
        host.alloc(4)
        host.clear()
        assert host.available_size() == 32


def test_mamba_host_pool_round_trip(fill_bytes):
    shapes = {"conv": (2, 3), "ssm": (5,)}
    dev = MambaStatePool(6, shapes, torch.bfloat16, "cpu")
    for t in dev.states.values():
        fill_bytes(t, 3)
    host = MambaHostPool(dev, host_size=4)
    assert host.size == 4 and host.page_size == 1 and host.page_nbytes == (6 + 5) * 2
    sig = host.storage_signature()
    assert sig["page_size"] == 1 and sig["state_shapes"] == {"conv": [2, 3], "ssm": [5]}
    with CopyEngine(dev, host) as eng:
        assert eng.num_layers == 1
        eng.backup_sync(torch.tensor([4, 1, 2]), torch.tensor([0, 1, 3]))
        assert same(host.states["conv"][0], dev.states["conv"][4])
        assert same(host.states["ssm"][3], dev.states["ssm"][2])
        flat = host.get_data_page(1)
        expected = torch.cat([dev.states["conv"][1].reshape(-1), dev.states["ssm"][1].reshape(-1)])
        assert same(flat, expected)
        assert host.page_view(1).numel() == host.page_nbytes
        # storage round trip into another slot, then back to the device
        dummy = host.get_dummy_flat_data_page()
        dummy.copy_(flat)
        host.set_from_flat_data_page(2, dummy)
        eng.load_sync(torch.tensor([2]), torch.tensor([5]))
        assert same(dev.states["conv"][5], dev.states["conv"][1])
        assert same(dev.states["ssm"][5], dev.states["ssm"][1])
    with pytest.raises(IndexError):
        host.get_data_page(4)
    with pytest.raises(ValueError):
        host.set_from_flat_data_page(0, dummy[:-1])
    with pytest.raises(ValueError):
        MambaHostPool(dev, host_size=2, host_to_device_ratio=1.0)


NOT_INDICES = [True, np.True_, torch.tensor(True), 8.5, 8.0, np.float64(8.0), torch.tensor(8.0), "8"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bad", NOT_INDICES, ids=repr)
def test_kv_host_page_protocol_refuses_indices_that_are_not_integers(layout, bad):
    """``int(index)`` made 8.5 (or 8.0, or "8") page 1 of a page size of 8 and True token 1:
    a storage read committed into, or a write taken from, a page nobody named. Page size 1 makes
    True a page start, so it lands in another page's bytes there too."""
    dev = MHATokenToKVPool(16, 1, torch.float16, head_num=2, head_dim=4, layer_num=2, device="cpu")
    for ps, pool in ((8, MHATokenToKVPool(16, 8, torch.float16, 2, 4, 2, "cpu")), (1, dev)):
        host = MHATokenToKVPoolHost(pool, host_size_bytes=2 * ps * pool.bytes_per_token, page_size=ps, layout=layout)
        host._buf.zero_()
        page = torch.full((host.page_nbytes,), 7, dtype=torch.uint8)
        with pytest.raises(TypeError, match="page index must be an integer"):
            host.set_from_flat_data_page(bad, page)
        assert not host._buf.any()
        for ask in (host.get_data_page, host.page_view):
            with pytest.raises(TypeError, match="page index must be an integer"):
                ask(bad)
        if layout == "page_first":
            with pytest.raises(TypeError, match="page indices must be integers"):
                host.page_views([bad])
        host.set_from_flat_data_page(np.int64(ps), page)  # a numpy integer is an index
        assert host.get_data_page(torch.tensor(ps)).view(torch.uint8).eq(7).all()


@pytest.mark.parametrize("bad", NOT_INDICES, ids=repr)
def test_mamba_host_page_protocol_refuses_slots_that_are_not_integers(bad):
    """The state pool's pages are slots (page size 1): ``int(True)`` was slot 1, another
    request's state, and ``int(8.5)`` slot 8."""
    dev = MambaStatePool(4, {"conv": (2, 3)}, torch.float16, "cpu")
    host = MambaHostPool(dev, host_size=10)
    host._buf.zero_()
    page = torch.full((host.page_nbytes,), 7, dtype=torch.uint8)
    with pytest.raises(TypeError, match="state slot must be an integer"):
        host.set_from_flat_data_page(bad, page)
    assert not host._buf.any()
    for ask in (host.get_data_page, host.page_view):
        with pytest.raises(TypeError, match="state slot must be an integer"):
            ask(bad)
    host.set_from_flat_data_page(np.int32(1), page)
    assert host.get_data_page(torch.tensor(1)).view(torch.uint8).eq(7).all()


def test_pinned_footprint_is_what_torch_locks() -> None:
    """torch's pinned allocator rounds a request up to a power of two: the host pool's memory
    check must count that, not the pool's own size."""
    from hicache.memory.host_alloc import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    assert pinned_footprint(40 << 30) == 64 << 30 and pinned_footprint(64 << 30) == 64 << 30


def test_negative_slots_and_layers_are_refused_not_wrapped() -> None:
    """Torch indexing wraps -1 to the last slot or layer: a write there would corrupt another
    request's KV silently. Past the end was refused already; below 0 is now too."""
    pool = MHATokenToKVPool(16, 4, torch.float32, head_num=1, head_dim=2, layer_num=2, device="cpu")
    k = torch.ones(1, 1, 2)
    with pytest.raises(IndexError, match="negative"):
        pool.set_kv_buffer(0, torch.tensor([-1]), k, k)
    with pytest.raises(IndexError, match="layer -1"):
        pool.set_kv_buffer(-1, torch.tensor([0]), k, k)
    with pytest.raises(IndexError, match="layer 2"):
        pool.get_key_buffer(2)
    pool.set_kv_buffer(1, torch.tensor([15]), k, k)
    assert torch.equal(pool.get_key_buffer(1)[15], k[0])


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_slots_and_layers_that_are_not_integers_are_refused_not_truncated(kind) -> None:
    """A list of float slots was cast to int64 (1.7 wrote slot 1), a uint8 slot tensor was taken
    by torch for a mask ([2, 1, 3, 1] in a pool of 4: slots 0 to 3 written, in order), and a
    float or bool layer went through int() (1.7 and True: layer 1): KV written where nobody
    said."""
    if kind == "mha":
        pool = MHATokenToKVPool(4, 1, torch.float32, head_num=1, head_dim=2, layer_num=2, device="cpu")
        write = lambda layer, loc, k: pool.set_kv_buffer(layer, loc, k, k)  # noqa: E731
    else:
        pool = MLATokenToKVPool(4, 1, torch.float32, kv_lora_rank=1, qk_rope_head_dim=1, layer_num=2, device="cpu")
        write = lambda layer, loc, k: pool.set_kv_buffer(layer, loc, k)  # noqa: E731
    one = torch.ones(1, 1, 2)
    for loc in ([1.7], torch.tensor([1.0]), torch.tensor([True, False, False, False]), [True]):
        with pytest.raises(TypeError, match="loc"):
            write(0, loc, one)
    for layer in (1.7, True, np.float32(1.0)):
        with pytest.raises(TypeError, match="layer must be an integer"):
            write(layer, [0], one)
        with pytest.raises(TypeError, match="layer must be an integer"):
            pool.get_key_buffer(layer)
    assert not pool.kv_data.any()
    # uint8 (or int16) slots are slots, not a mask (as a mask, [2, 1, 3, 1] is all four slots)
    k = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [3.0, 4.0]]).view(4, 1, 2)
    write(np.int64(1), torch.tensor([2, 1, 3, 1], dtype=torch.uint8), k)
    got = pool.get_key_buffer(1)
    assert [got[s].tolist() for s in range(4)] == [[[0.0, 0.0]], [[3.0, 4.0]], [[1.0, 2.0]], [[5.0, 6.0]]]
    write(0, torch.tensor([3], dtype=torch.int16), k[:1])
    assert pool.get_key_buffer(0)[3].tolist() == [[1.0, 2.0]]


def test_a_pinned_pool_must_fit_with_what_torch_locks(monkeypatch) -> None:
    """40 units of 1 GiB fit in 50 GiB unpinned; pinned, torch locks 64 GiB for them."""
    from hicache.memory import host_alloc

    monkeypatch.setattr(host_alloc, "available_host_memory", lambda: 50 << 30)
    kw = dict(device_units=20, unit_nbytes=1 << 30, host_size_bytes=None, host_to_device_ratio=2.0, what="pool")
    assert host_alloc.resolve_host_units(**kw) == 40
    with pytest.raises(MemoryError, match="torch locks 64.00 GiB"):
        host_alloc.resolve_host_units(**kw, pinned=True)
    assert host_alloc.resolve_host_units(**{**kw, "host_to_device_ratio": 1.6}, pinned=True) == 32
