"""Which model a server's pages are KV of: the weights it loaded (``--model-path`` and
``--revision``, read from the server's published settings), never only its served name."""

from __future__ import annotations

import logging
import types

import pytest
import sgl_helpers as helpers
import torch
from sglang.srt import runtime_context
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PS = 16
KEYS = ["ab" * 32, "cd" * 32]


def _server(root, monkeypatch, model_path, revision=None, served="default", quantization=None, **extra_keys):
    """A server as SGLang starts one: its settings published, and the storage config's
    ``model_name`` filled from ``--served-model-name``."""
    args = types.SimpleNamespace(model_path=model_path, revision=revision, served_model_name=served,
                                 kv_cache_dtype="auto", quantization=quantization)
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    cfg = helpers.storage_config(root, served, extra=extra_keys)
    host = helpers.host_pool(helpers.device_pool(), "page_first")
    st = StorageBackendFactory.create_backend("dynamic", cfg, host)
    st.register_mem_pool_host(host)
    st.on_host_pools_registered()
    return st


@pytest.mark.parametrize("other", [("org/llama-8b-instruct", None), ("org/llama-8b", "older-commit")],
                         ids=["other-model", "other-revision"])
def test_other_weights_under_one_served_name_never_share_pages(tmp_path, monkeypatch, other):
    """SGLang's ``model_name`` is ``--served-model-name``, an alias deployments often set
    alike: a base and an instruct model, or one path at two revisions, of the same geometry,
    restored each other's KV under it."""
    a = _server(tmp_path / "s", monkeypatch, "org/llama-8b")
    b = _server(tmp_path / "s", monkeypatch, *other)
    try:
        assert a.batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert b.batch_exists(KEYS) == 0
        assert b.batch_get_v1(KEYS, torch.arange(2 * PS)) == [False, False]
    finally:
        a.close()
        b.close()


def test_the_same_weights_share_pages_whatever_their_served_name(tmp_path, monkeypatch):
    a = _server(tmp_path / "s", monkeypatch, "org/llama-8b", "v1", served="default")
    b = _server(tmp_path / "s", monkeypatch, "org/llama-8b", "v1", served="llama")
    try:
        assert a.batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert b.batch_exists(KEYS) == 2
    finally:
        a.close()
        b.close()


def test_weights_quantized_as_they_load_are_other_weights(tmp_path, monkeypatch):
    """``--quantization fp8`` on a checkpoint of other precision computes other KV for the same
    tokens: servers of one ``--model-path`` with and without it restored each other's KV (vLLM's
    connector names the quantization too). Servers quantized alike share pages."""
    a = _server(tmp_path / "s", monkeypatch, "org/llama-8b")
    b = _server(tmp_path / "s", monkeypatch, "org/llama-8b", quantization="fp8")
    c = _server(tmp_path / "s", monkeypatch, "org/llama-8b", quantization="fp8")
    try:
        assert a.batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert b.batch_exists(KEYS) == 0
        assert b.batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert c.batch_exists(KEYS) == 2
    finally:
        for st in (a, b, c):
            st.close()


def test_hicache_model_id_names_the_weights_in_place_of_their_path(tmp_path, monkeypatch):
    """Two local copies of one checkpoint share pages only when the user says they are one
    model; another id is another model."""
    a = _server(tmp_path / "s", monkeypatch, "/models/a/llama", hicache_model_id="org/llama-8b@v1")
    b = _server(tmp_path / "s", monkeypatch, "/mnt/b/llama", hicache_model_id="org/llama-8b@v1")
    c = _server(tmp_path / "s", monkeypatch, "/models/a/llama", hicache_model_id="org/llama-8b@v2")
    try:
        assert a.batch_set_v1(KEYS, torch.arange(2 * PS)) == [True, True]
        assert b.batch_exists(KEYS) == 2
        assert c.batch_exists(KEYS) == 0
    finally:
        for st in (a, b, c):
            st.close()


def test_without_server_settings_the_served_name_is_the_identity_and_that_is_said(tmp_path, monkeypatch, caplog):
    def unpublished():
        raise ValueError("Global server args is not set yet!")

    monkeypatch.setattr(runtime_context, "get_server_args", unpublished)
    cfg = helpers.storage_config(tmp_path, "default")
    host = helpers.host_pool(helpers.device_pool(), "page_first")
    st = StorageBackendFactory.create_backend("dynamic", cfg, host)
    st.register_mem_pool_host(host)
    with caplog.at_level(logging.WARNING, logger="hicache.integrations.sglang"):
        st.on_host_pools_registered()
    try:
        assert st.backend is not None and st.backend.namespace.model == "default"
        assert any("only model identity" in r.getMessage() for r in caplog.records)
    finally:
        st.close()
