"""A backend shipped as its own package is found through entry points and passes the suite."""

from __future__ import annotations

import uuid

import pytest

from hicache.config import load_config
from hicache.errors import ConfigError
from hicache.storage import available_backends, create_async_storage, create_storage
from hicache.testing import StoreTests


def test_plugin_is_discovered(installed_plugin) -> None:
    assert "sample-dict" in available_backends()
    store = create_storage("sample-dict", None, medium="discovery")
    try:
        assert store.set("k", __import__("torch").ones(3))
        assert store.exists("k")
    finally:
        store.close()


def test_plugin_named_in_config(installed_plugin) -> None:
    config = load_config({"storage": {"backend": "sample-dict", "options": {"medium": "cfg"}}})
    assert config.storage.backend == "sample-dict"
    with pytest.raises(ConfigError, match="medium"):
        load_config({"storage": {"backend": "sample-dict", "options": {"mediun": "typo"}}})


@pytest.mark.usefixtures("installed_plugin")
class TestSamplePluginConformance(StoreTests):
    @pytest.fixture
    def store_factory(self, installed_plugin):
        medium = uuid.uuid4().hex

        def make(namespace=None):
            return create_async_storage("sample-dict", None, medium=medium, namespace=namespace)

        return make

    async def raw_payload(self, store, key, pool="kv"):
        return store.pages.get((store.namespace.digest, key, pool))
