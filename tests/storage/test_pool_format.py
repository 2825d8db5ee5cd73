"""An engine's host pool registered directly on the core (the README's "storage alone, SGLang
style" route) stores its own bytes: its byte format is part of the namespace, so two servers
whose pools differ in layout or dtype never read each other's pages as valid KV."""

from __future__ import annotations

import uuid

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
