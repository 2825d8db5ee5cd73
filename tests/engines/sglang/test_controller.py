"""hicache behind SGLang's factory and controller: file and S3 (moto) stores, verified pages,
hybrid models' extra pools, SGLang's fault injector, two processes sharing one store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from hicache.integrations.sglang import HiCacheSGLangStorage, SGLangAttachError
import sgl_drive as drive
import sgl_helpers as helpers

PAGE = 16
LAYERS = 4
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _config(extra: dict, **kw) -> HiCacheStorageConfig:
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                model_name="test/model", extra_config=extra)
    base.update(kw)
    return HiCacheStorageConfig(**base)


def _pair(extra: dict, layout: str = "page_first", seed: int = 0, **kw):
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, layout)
    helpers.fill_random(host, seed)
    return host, helpers.controller(dev, host, extra, **kw)


# ---------------------------------------------------------------- factory and lifecycle

def test_factory_builds_our_class_as_a_sglang_backend(store_root):
    extra = helpers.extra_config("file", root=store_root)
    backend = StorageBackendFactory.create_backend("dynamic", _config(extra), None)
    try:
        assert isinstance(backend, HiCacheStorage) and isinstance(backend, HiCacheSGLangStorage)
        assert extra["interface_v1"] == 1  # the controller reads it from this very dict
    finally:
        backend.close()
        backend.close()  # idempotent


def test_explicit_interface_v1_0_is_respected(store_root):
    extra = {**helpers.extra_config("file", root=store_root), "interface_v1": 0}
    StorageBackendFactory.create_backend("dynamic", _config(extra), None).close()
    assert extra["interface_v1"] == 0


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hicache_backend": "no-such-backend"}, "no-such-backend"),
        ({"hicache_options": {"root": "/x", "bogus": 1}}, "bogus"),
        ({"hicache_optoins": {}}, "hicache_optoins"),
        ({"hicache_call_timeout": -1}, "hicache_call_timeout"),
    ],
)
def test_bad_extra_config_fails_the_factory_clearly(change, needle, store_root):
    extra = {**helpers.extra_config("file", root=store_root), **change}
    with pytest.raises(Exception, match=needle):
        StorageBackendFactory.create_backend("dynamic", _config(extra), None)


@pytest.mark.parametrize("via_file", [False, True])
def test_a_namespace_in_the_backend_options_fails_the_factory(store_root, tmp_path, via_file):
    """The adapter builds the namespace from SGLang's config and put it over a ``namespace``
    the user gave in the backend's options (a tenant's, say) without a word: two servers
    given different namespaces shared each other's pages. It is refused now, naming the key
    that does separate them (as the vLLM tier and hicache's config file refuse it)."""
    options = {"root": store_root, "namespace": {"model": "m", "salt": "tenant-a"}}
    extra = {k: v for k, v in helpers.extra_config().items() if not k.startswith("hicache_")}
    if via_file:
        cfg = tmp_path / "hicache.json"
        cfg.write_text(json.dumps({"storage": {"backend": "file", "options": options}}))
        extra["hicache_config"] = str(cfg)
    else:
        extra.update(hicache_backend="file", hicache_options=options)
    with pytest.raises(Exception, match="namespace_salt"):
        StorageBackendFactory.create_backend("dynamic", _config(extra), None)


def test_a_store_that_cannot_open_fails_the_attach(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SGLangAttachError, match="could not open"):
        _pair(helpers.extra_config("file", root=str(blocker / "store")))


def test_config_file_selects_backend_and_options(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(f'[storage]\nbackend = "file"\noptions = {{ root = "{tmp_path / "from-file"}" }}\n')
    extra = {k: v for k, v in helpers.extra_config().items() if not k.startswith("hicache_")}
    extra["hicache_config"] = str(cfg)
    host, ctl = _pair(extra)
    try:
        toks = drive.tokens(PAGE * 2)
        assert drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks))) == len(toks)
        assert any((tmp_path / "from-file").rglob("*.page"))
    finally:
        ctl.detach_storage_backend()


@pytest.mark.parametrize("file_storage", ['backend = "none"', 'backend = "file"\noptions = { root = "/nowhere/kv" }'])
def test_hicache_backend_overrides_the_config_files_backend(tmp_path, file_storage):
    """``hicache_backend`` overrides the file's backend, as documented; but a file whose L3 is
    off failed the factory with 'storage.backend is null' although the key named one, and a
    file of another backend handed that backend's options to this one ('memory' has no option
    'root'). The file's options are its own backend's: another backend takes none of them."""
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(f"[storage]\n{file_storage}\n")
    extra = {k: v for k, v in helpers.extra_config().items() if not k.startswith("hicache_")}
    extra.update(hicache_config=str(cfg), hicache_backend="memory")
    host, ctl = _pair(extra)
    try:
        assert ctl.storage_backend.backend.backend_name == "memory"
        toks = drive.tokens(PAGE * 2)
        assert drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks))) == len(toks)
        assert drive.prefetch(ctl, toks)[0] == len(toks)
    finally:
        ctl.detach_storage_backend()


def test_get_stats_is_sglang_storage_metrics(store_root):
    host, ctl = _pair(helpers.extra_config("file", root=store_root), metrics=True)
    try:
        toks = drive.tokens(PAGE * 4)
        drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks)))
        drive.prefetch(ctl, toks)
        m = ctl.storage_backend.get_stats()
        assert isinstance(m, StorageMetrics)
        assert sum(m.backup_pgs) == 4 and sum(m.prefetch_pgs) == 4 and all(b > 0 for b in m.prefetch_bandwidth)
        again = ctl.storage_backend.get_stats()
        assert again.backup_pgs == [] and again.prefetch_pgs == []  # per interval, as SGLang's backends
    finally:
        ctl.detach_storage_backend()


def test_calls_after_detach_are_misses_not_crashes(store_root):
    host, ctl = _pair(helpers.extra_config("file", root=store_root))
    backend = ctl.storage_backend
    ctl.detach_storage_backend()
    assert backend.batch_exists(["k"]) == 0
    assert backend.batch_get_v1(["k"], torch.arange(PAGE)) == [False]
    assert backend.batch_set_v1(["k"], torch.arange(PAGE)) == [False]


# ---------------------------------------------------------------- integrity and sharing

def test_a_corrupt_page_is_a_miss_never_garbage(store_root):
    w_host, writer = _pair(helpers.extra_config("file", root=store_root), "layer_first", seed=1)
    r_host, reader = _pair(helpers.extra_config("file", root=store_root), "page_head", seed=2)
    try:
        toks = drive.tokens(PAGE * 4)
        src = writer.mem_pool_host.alloc(len(toks))
        assert drive.backup(writer, toks, src) == len(toks)
        from hicache_backends.file.layout import page_id

        third = page_id(drive.get_storage_hash_str(toks, None, page_size=PAGE)[2], "kv")
        (victim,) = Path(store_root).rglob(f"{third}.page")
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0x40
        victim.write_bytes(bytes(data))
        done, dst = drive.prefetch(reader, toks)
        assert done == 2 * PAGE  # the leading run before the corrupt page, nothing past it
        assert drive.pages_equal(w_host, src[: 2 * PAGE], r_host, dst[: 2 * PAGE], LAYERS)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


def test_other_models_and_ranks_never_share_pages(store_root):
    toks = drive.tokens(PAGE * 2)
    host, ctl = _pair(helpers.extra_config("file", root=store_root))
    try:
        drive.backup(ctl, toks, ctl.mem_pool_host.alloc(len(toks)))
        other = StorageBackendFactory.create_backend(
            "dynamic", _config(helpers.extra_config("file", root=store_root), tp_rank=1, tp_size=2), None
        )
        other.register_mem_pool_host(host)
        other.on_host_pools_registered()
        try:
            assert other.batch_exists(drive.get_storage_hash_str(toks, None, page_size=PAGE)) == 0
        finally:
            other.close()
    finally:
        ctl.detach_storage_backend()


def test_lookups_answer_on_the_calling_thread_and_still_see_other_writers(store_root, monkeypatch):
    """SGLang's prefetch thread asks ``batch_exists``: indexed pages are answered on that thread
    (no hand-off to the store's loop); a page another controller wrote goes through the loop
    once, which indexes it."""
    host, ctl = _pair(helpers.extra_config("file", root=store_root))
    _, other = _pair(helpers.extra_config("file", root=store_root), seed=3)
    try:
        toks = drive.tokens(PAGE * 4, seed=5)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        assert drive.backup(ctl, toks[: PAGE * 2], ctl.mem_pool_host.alloc(PAGE * 2)) == PAGE * 2
        st = ctl.storage_backend
        on_loop: list[int] = []
        real = st._backend.exists_prefix

        async def counted(keys, pool="kv"):
            on_loop.append(len(keys))
            return await real(keys, pool)

        monkeypatch.setattr(st._backend, "exists_prefix", counted)
        assert st.batch_exists(keys) == 2 and st.batch_exists_v2(keys).kv_hit_pages == 2
        assert on_loop == []
        assert drive.backup(other, toks, other.mem_pool_host.alloc(len(toks))) == len(toks)
        assert st.batch_exists(keys) == 4 and on_loop == [4]  # found on disk: the loop indexes it
        assert st.batch_exists_v2(keys).kv_hit_pages == 4 and on_loop == [4]
    finally:
        other.detach_storage_backend()
        ctl.detach_storage_backend()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_reads_run_on_the_prefetch_thread(store_root, monkeypatch, layout):
    """SGLang's prefetch reads small pages on its own thread (no hand-off to the store's loop),
    byte for byte what the writer stored."""
    from hicache_backends.file import FileStorage

    w_host, writer = _pair(helpers.extra_config("file", root=store_root), layout, seed=1)
    r_host, reader = _pair(helpers.extra_config("file", root=store_root), layout, seed=2)
    try:
        toks = drive.tokens(PAGE * 3, seed=9)
        src = writer.mem_pool_host.alloc(len(toks))
        assert drive.backup(writer, toks, src) == len(toks)
        on_loop: list[int] = []
        real = FileStorage._read

        async def counted(self, pages, buffers):
            on_loop.append(len(pages))
            return await real(self, pages, buffers)

        monkeypatch.setattr(FileStorage, "_read", counted)  # the loop's read (the class's own: still read here)
        done, dst = drive.prefetch(reader, toks)
        assert done == len(toks) and on_loop == []
        assert drive.pages_equal(w_host, src, r_host, dst, LAYERS)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


def test_two_processes_share_one_store(store_root, tmp_path):
    """Another process (its own SGLang controller, another layout) writes; this one reads."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import conftest  # the same import setup (test doubles of GPU-only modules)
        import sgl_drive as drive
        import sgl_helpers as helpers
        dev = helpers.device_pool(page_size={PAGE}, layers={LAYERS})
        host = helpers.host_pool(dev, "page_head")
        helpers.fill_random(host, 11)
        ctl = helpers.controller(dev, host, helpers.extra_config("file", root={store_root!r}))
        toks = drive.tokens({PAGE} * 5, seed=9)
        idx = ctl.mem_pool_host.alloc(len(toks))
        n = drive.backup(ctl, toks, idx)
        kv = [[drive.token_kv(host, l, t).float().tolist() for l in range({LAYERS})] for t in idx.tolist()]
        ctl.detach_storage_backend()
        json.dump({{"n": n, "kv": kv}}, open(sys.argv[1], "w"))
    """))
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(script), str(out)], check=True, env=env, timeout=240)
    written = json.loads(out.read_text())
    assert written["n"] == PAGE * 5
    host, ctl = _pair(helpers.extra_config("file", root=store_root), "layer_first", seed=3)
    try:
        done, dst = drive.prefetch(ctl, drive.tokens(PAGE * 5, seed=9))
        assert done == PAGE * 5
        for t, expect in zip(dst.tolist(), written["kv"]):
            for layer in range(LAYERS):
                assert drive.token_kv(host, layer, t).float().tolist() == expect[layer]
    finally:
        ctl.detach_storage_backend()


# ---------------------------------------------------------------- S3 through moto

@pytest.mark.parametrize("w_layout,r_layout", [("page_head", "layer_first"), ("page_first_direct", "page_first")])
def test_s3_round_trip_through_the_controller(w_layout, r_layout, s3_options):
    w_host, writer = _pair(helpers.extra_config("s3", **s3_options), w_layout, seed=1)
    r_host, reader = _pair(helpers.extra_config("s3", **s3_options), r_layout, seed=2)
    try:
        drive.write_then_read(writer, w_host, reader, r_host, 5, LAYERS)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


# ---------------------------------------------------------------- fault injector

def test_sglang_fault_injector_never_yields_wrong_kv(store_root, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    w_host, writer = _pair(helpers.extra_config("file", root=store_root), "page_first", seed=1)
    r_host, reader = _pair(helpers.extra_config("file", root=store_root), "page_head", seed=2)
    try:
        assert type(writer.storage_backend).__name__ == "HiCacheStorageFailureInjector"
        for i in range(12):
            toks = drive.tokens(PAGE * 3, seed=100 + i)
            src = writer.mem_pool_host.alloc(len(toks))
            drive.backup(writer, toks, src)
            done, dst = drive.prefetch(reader, toks, rid=f"r{i}")
            if done:
                assert drive.pages_equal(w_host, src[:done], r_host, dst[:done], LAYERS)
            writer.mem_pool_host.free(src)
            if dst is not None:
                reader.mem_pool_host.free(dst)
    finally:
        writer.detach_storage_backend()
        reader.detach_storage_backend()


# ---------------------------------------------------------------- hybrid models

def test_hybrid_extra_pool_round_trip_and_restorable_prefixes_as_sglang(store_root, tmp_path):
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "layer_first")
    helpers.fill_random(host, 1)
    swa_host, entry = helpers.swa_entry(PAGE)
    ctl = helpers.controller(dev, host, helpers.extra_config("file", root=store_root), extra_entries=[entry])
    try:
        st = ctl.storage_backend
        toks = drive.tokens(PAGE * 6, seed=21)
        keys = drive.get_storage_hash_str(toks, None, page_size=PAGE)
        kv_idx = ctl.mem_pool_host.alloc(len(toks))
        assert drive.backup(ctl, toks, kv_idx) == len(toks)
        # trailing-state pages only at nodes 2 and 5 (a checkpoint every few pages)
        present = [1, 4]
        swa_idx = swa_host.alloc(len(present) * PAGE)
        got = st.batch_set_v2([PoolTransfer(PoolName.SWA, swa_idx, keys=[keys[i] for i in present])])
        assert got[PoolName.SWA] == [True, True]
        query = [PoolTransfer(PoolName.SWA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        ours = st.batch_exists_v2(keys, query)
        assert isinstance(ours, PoolTransferResult)

        # SGLang's own file backend, same pages present, same query
        ref_cfg = _config({"file_storage_path": str(tmp_path / "ref")})
        ref = HiCacheFile(ref_cfg, file_path=str(tmp_path / "ref"))
        dummy = torch.zeros(4, dtype=torch.uint8)
        for k in keys:
            ref.set(k, dummy)
        for i in present:
            ref.set(f"{keys[i]}.{PoolName.SWA.value}", dummy)
        theirs = ref.batch_exists_v2(keys, query)
        assert ours.kv_hit_pages == theirs.kv_hit_pages == 5
        assert list(ours.restorable_prefix_pages) == list(theirs.restorable_prefix_pages) == [2, 5]
        assert ours.extra_pool_hit_pages == theirs.extra_pool_hit_pages

        # read the extra pool back into fresh pages
        back = swa_host.alloc(len(present) * PAGE)
        res = st.batch_get_v2([PoolTransfer(PoolName.SWA, back, keys=[keys[i] for i in present])])
        assert res[PoolName.SWA] == [True, True]
        assert drive.pages_equal(swa_host, swa_idx, swa_host, back, 2)
    finally:
        ctl.detach_storage_backend()


# ---------------------------------------------------------------- fp8 KV: the format is in the namespace

def _fp8_namespace(store_root: str, dtype: torch.dtype, **extra_keys) -> str:
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS, dtype=dtype)
    host = helpers.host_pool(dev, "page_first")
    assert host.kv_buffer.dtype == torch.uint8  # SGLang stores every fp8 format as bytes
    ctl = helpers.controller(dev, host, {**helpers.extra_config("file", root=store_root), **extra_keys})
    try:
        return ctl.storage_backend.backend.namespace.digest
    finally:
        ctl.detach_storage_backend()


def test_fp8_formats_never_share_a_namespace(store_root, monkeypatch):
    """e4m3 and e5m2 pages have the same size and pass every check: only the namespace keeps
    one server's bytes from being served to the other as valid KV."""
    e4m3 = _fp8_namespace(store_root, torch.float8_e4m3fn, hicache_kv_cache_dtype="fp8_e4m3")
    e5m2 = _fp8_namespace(store_root, torch.float8_e5m2, hicache_kv_cache_dtype="fp8_e5m2")
    assert e4m3 != e5m2
    # a running server publishes its settings: the format is read from them
    import types

    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_server_args", lambda: types.SimpleNamespace(kv_cache_dtype="fp8_e5m2"))
    assert _fp8_namespace(store_root, torch.float8_e5m2) == e5m2


def test_an_fp8_pool_of_unknown_format_fails_the_attach(store_root):
    with pytest.raises(SGLangAttachError, match="hicache_kv_cache_dtype"):
        _fp8_namespace(store_root, torch.float8_e4m3fn)
    with pytest.raises(Exception, match="hicache_kv_cache_dtype"):
        _fp8_namespace(store_root, torch.float8_e4m3fn, hicache_kv_cache_dtype=3)


def test_the_servers_own_fp8_format_wins_over_the_extra_config(store_root, monkeypatch):
    """``hicache_kv_cache_dtype`` is the fallback for a server whose settings cannot be read;
    it overrode the format a running server publishes, so an e5m2 server under a fleet's
    shared extra config saying e4m3 filed its bytes under the e4m3 namespace, where e4m3
    servers read them as valid KV. The server's format wins; a key that contradicts it fails
    the attach naming both; a server on ``auto`` names no format, so the key still says it."""
    import types

    import sglang.srt.runtime_context as runtime_context

    def serving(dtype: str) -> None:
        monkeypatch.setattr(runtime_context, "get_server_args", lambda: types.SimpleNamespace(kv_cache_dtype=dtype))

    serving("fp8_e4m3")
    e4m3 = _fp8_namespace(store_root, torch.float8_e4m3fn)
    serving("fp8_e5m2")
    with pytest.raises(SGLangAttachError, match=r"'fp8_e4m3'.*--kv-cache-dtype 'fp8_e5m2'"):
        _fp8_namespace(store_root, torch.float8_e5m2, hicache_kv_cache_dtype="fp8_e4m3")
    assert _fp8_namespace(store_root, torch.float8_e5m2, hicache_kv_cache_dtype="fp8_e5m2") != e4m3
    serving("auto")
    assert _fp8_namespace(store_root, torch.float8_e4m3fn, hicache_kv_cache_dtype="fp8_e4m3") == e4m3


def test_sglangs_own_extra_config_keys_are_not_refused(store_root):
    """A PD decode server's KV offload manager hands SGLang's raw extra config to the
    controller, SGLang's own ``hicache_storage_pass_prefix_keys`` included (elsewhere SGLang
    takes it out first): the adapter refused it as an unknown ``hicache_`` key, so a decode
    server started with its prefill server's extra config could not start."""
    import json

    raw = json.dumps({**helpers.extra_config("file", root=store_root),
                      "hicache_storage_pass_prefix_keys": True, "prefetch_threshold": 256})
    dev = helpers.device_pool(page_size=PAGE, layers=LAYERS)
    host = helpers.host_pool(dev, "page_first")
    ctl = helpers.controller(dev, host, json.loads(raw))
    try:
        assert ctl.storage_backend is not None
    finally:
        ctl.detach_storage_backend()
