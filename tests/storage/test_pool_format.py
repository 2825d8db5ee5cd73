"""An engine's host pool registered directly on the core (the README's "storage alone, SGLang
style" route) stores its own bytes: its byte format is part of the namespace, so two servers
whose pools differ in layout or dtype never read each other's pages as valid KV."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from hicache.errors import StorageStateError
from hicache.storage import HiCacheStorageConfig, create_storage
from hicache.storage.pool_format import pool_format_tag


class EngineHostPool:
    """A host pool as SGLang's: its own page bytes, a ``layout``, no ``storage_signature``."""

    def __init__(self, layout: str, dtype: torch.dtype, pages: int = 4, page_size: int = 4) -> None:
        self.layout, self.dtype, self.page_size = layout, dtype, page_size
        self.kv_buffer = torch.zeros(pages * page_size, 8, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * 8, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.kv_buffer[index : index + self.page_size] = data.reshape(self.page_size, 8)


@pytest.mark.parametrize("other", [("page_head", torch.float16), ("layer_first", torch.bfloat16)])
def test_pools_of_other_formats_do_not_share_pages(other) -> None:
    sid = f"fmt-{uuid.uuid4()}"
    cfg = HiCacheStorageConfig(model_name="my/model")
    writer, reader = create_storage("memory", cfg, store_id=sid), create_storage("memory", cfg, store_id=sid)
    same = create_storage("memory", cfg, store_id=sid)
    try:
        mine = EngineHostPool("layer_first", torch.float16)
        mine.kv_buffer.copy_(torch.arange(mine.kv_buffer.numel()).reshape(mine.kv_buffer.shape))
        writer.register_mem_pool_host(mine)
        reader.register_mem_pool_host(EngineHostPool(*other))
        same.register_mem_pool_host(EngineHostPool("layer_first", torch.float16, pages=8))  # size apart
        assert writer.batch_set_v1(["p0"], torch.arange(0, 4)) == [True]
        assert reader.batch_exists(["p0"]) == 0
        assert reader.batch_get_v1(["p0"], torch.arange(4, 8)) == [False]
        assert same.batch_exists(["p0"]) == 1  # the same format shares, whatever the pool's size
    finally:
        for s in (writer, reader, same):
            s.close()


def test_a_pool_of_another_format_after_the_store_opened_is_refused() -> None:
    store = create_storage("memory", HiCacheStorageConfig(model_name="my/model"))
    try:
        store.register_mem_pool_host(EngineHostPool("layer_first", torch.float16))
        assert store.batch_exists(["p0"]) == 0  # opened
        store.register_mem_pool_host(EngineHostPool("layer_first", torch.float16))  # same format: fine
        with pytest.raises(StorageStateError, match="byte format"):
            store.register_mem_pool_host(EngineHostPool("page_head", torch.float16))
    finally:
        store.close()


def test_the_tag_names_class_layout_and_element_types() -> None:
    a = pool_format_tag(EngineHostPool("layer_first", torch.float16))
    assert a.startswith("EngineHostPool/layer_first/")
    assert a == pool_format_tag(EngineHostPool("layer_first", torch.float16, pages=9))
    assert a != pool_format_tag(EngineHostPool("layer_first", torch.bfloat16))


def test_a_format_the_namespace_names_already_leaves_it_as_it_is() -> None:
    """The SGLang integration names a TP-split pool's format under SGLang's name and stores the
    pool under a name per rank: tagging it again per rank split the ranks' namespaces."""
    from hicache.keys import Namespace

    ns = Namespace(model="m", extra=(("pool.mamba", "T"),))
    assert ns.with_pool_format("mamba.tp1-2", "T") is ns
    assert Namespace(model="m", layout="K").with_pool_format("kv", "K").digest == Namespace(model="m", layout="K").digest
    assert dict(ns.with_pool_format("mamba", "U").extra)["pool.mamba"] == "U"


def _mamba_host(dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]) -> "MambaHostPool":
    from hicache.memory import MambaHostPool, MambaStatePool

    state = MambaStatePool(4, shapes, dtype, torch.device("cpu"))
    return MambaHostPool(state, host_size=4, pin_memory=False)


@pytest.mark.parametrize("other", [(torch.bfloat16, {"conv": (2, 8), "ssm": (4, 4)}),
                                   (torch.float16, {"conv": (4, 4), "ssm": (2, 8)})])
def test_extra_pools_with_a_signature_of_other_formats_do_not_share_state_pages(other) -> None:
    """A hicache extra pool (``MambaHostPool``, what ``HiCache``'s ``extra_pools`` register)
    describes its state format with ``storage_signature()``; two servers whose state dtypes or
    shapes differ but whose slots have the same size must not restore each other's states,
    reinterpreted, as valid (the KV namespace alone does not tell them apart)."""
    from hicache.storage import PoolTransfer
    from hicache.storage.types import PoolHitPolicy
    from hicache.testing.pools import ArrayHostPool

    sid = f"fmt-{uuid.uuid4()}"
    cfg = HiCacheStorageConfig(model_name="my/model")
    shapes = {"conv": (2, 8), "ssm": (4, 4)}

    def store(mamba: Any) -> Any:
        s = create_storage("memory", cfg, store_id=sid)
        kv = ArrayHostPool(4, 4, 8)
        kv.fill_random(1)
        s.register_mem_pool_host(kv)
        s.register_mem_host_pool_v2(mamba, "mamba")
        return s, kv

    src = _mamba_host(torch.float16, shapes)
    src._buf.copy_(torch.randint(0, 255, src._buf.shape, dtype=torch.uint8))
    writer, kv = store(src)
    state = [PoolTransfer("mamba", torch.tensor([1]), keys=["b"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert writer.batch_set_v2([PoolTransfer("kv", kv.indices(0, 2), keys=["a", "b"]), *state]) == {
        "kv": [True, True], "mamba": [True]}
    same, _ = store(_mamba_host(torch.float16, shapes))
    assert same.batch_exists_v2(["a", "b"], state).kv_hit_pages == 2  # the same format shares them
    reader, _ = store(_mamba_host(*other))
    assert reader.batch_exists_v2(["a", "b"], state).kv_hit_pages == 0
    assert reader.batch_get_v2(state) == {"mamba": [False]}
    for s in (writer, same, reader):
        s.close()
