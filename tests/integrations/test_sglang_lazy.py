"""The SGLang adapter costs nothing when SGLang is absent: importing hicache (or the adapter's
package) never imports SGLang, and its pure parts work without it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache.errors import ConfigError
from hicache.testing.fresh_python import python_says


def test_importing_the_package_does_not_import_sglang() -> None:
    code = (
        "import sys, hicache, hicache.integrations.sglang as s, hicache.integrations.sglang.pages, "
        "hicache.integrations.sglang.config, hicache.integrations.sglang.hits, "
        "hicache.integrations.sglang.transfer; "
        "assert 'sglang' not in sys.modules, 'sglang imported'; print(s.SUPPORTED_SGLANG)"
    )
    assert "0.5.23" in python_says(code)


def test_the_storage_class_without_sglang_is_a_clear_import_error() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import hicache.integrations.sglang as s\n"
        "try:\n    s.HiCacheSGLangStorage\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "needs SGLang" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"hicache_bakend": "file"}, "hicache_bakend"),
        ({"hicache_options": [1]}, "hicache_options"),
        ({"hicache_call_timeout": 0}, "hicache_call_timeout"),
        ({"hicache_staging_mib": 0}, "hicache_staging_mib"),
        ({"hicache_backend": ""}, "hicache_backend"),
        ({"hicache_model_id": ""}, "hicache_model_id"),
    ],
)
def test_bad_adapter_settings_name_the_key(extra, needle) -> None:
    from hicache.integrations.sglang.config import AdapterSettings

    with pytest.raises(ConfigError, match=needle):
        AdapterSettings.from_extra_config(extra)


def test_settings_from_a_config_file_and_overrides(tmp_path) -> None:
    from hicache.integrations.sglang.config import AdapterSettings

    cfg = tmp_path / "c.toml"
    cfg.write_text('[storage]\nbackend = "memory"\noptions = {}\n')
    s = AdapterSettings.from_extra_config({"hicache_config": str(cfg), "interface_v1": 1, "backend_name": "x"})
    assert s.backend == "memory" and s.call_timeout == 60.0
    s = AdapterSettings.from_extra_config({"hicache_config": str(cfg), "hicache_backend": "file",
                                           "hicache_options": {"root": "/r"}, "hicache_call_timeout": None})
    assert (s.backend, s.options, s.call_timeout) == ("file", {"root": "/r"}, None)


def test_a_config_files_namespace_salt_is_the_servers_salt(tmp_path) -> None:
    """The file's [storage] namespace_salt (a tenant's) was ignored: two servers whose files
    named other tenants shared pages. The extra config's own key still wins."""
    from hicache.integrations.sglang.config import AdapterSettings

    cfg = tmp_path / "c.toml"
    cfg.write_text('[storage]\nbackend = "memory"\nnamespace_salt = "tenant-a"\n')
    assert AdapterSettings.from_extra_config({"hicache_config": str(cfg)}).namespace_salt == "tenant-a"
    given = {"hicache_config": str(cfg), "hicache_namespace_salt": "tenant-b"}
    assert AdapterSettings.from_extra_config(given).namespace_salt == "tenant-b"
