"""Import setup and fixtures for the SGLang integration tests (run by scripts/test_sglang.sh).

SGLang 0.5.23 is installed without its GPU dependencies. The GPU-only kernel modules that its
``mem_cache`` and ``managers`` modules try to import are replaced by test doubles *here*, in
the tests' own import setup (never in the library); everything else is SGLang's real code:
its device and host pools, its storage factory, its cache controller.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest

#: Modules SGLang imports at module level that cannot load on this CPU-only torch: GPU kernel
#: packages, and torchvision, whose registry wheel is built against the CUDA torch (its ops fail
#: to register on torch's CPU build). SGLang's mem_cache and managers code never calls them; a
#: double answers any attribute with a placeholder that fails loudly if it is ever used.
_DOUBLED = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("a GPU-only / CUDA-built module was used in the CPU tests")

    def __class_getitem__(cls, item):
        return cls


class _Double(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


def _install_doubles() -> None:
    try:  # transformers decides once, at import, which optional packages exist: before the doubles
        importlib.import_module("transformers.utils.import_utils")
    except Exception:  # noqa: BLE001
        pass
    for top in sorted({n.split(".")[0] for n in _DOUBLED}):
        try:
            importlib.import_module(top)
            continue  # really there and loadable (a CPU build): use it
        except Exception:  # noqa: BLE001 - missing, or built for CUDA
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        for name in (n for n in _DOUBLED if n == top or n.startswith(top + ".")):
            module = _Double(name)
            module.__path__ = []  # a package: submodule imports resolve to the doubles
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)


_install_doubles()
pytest.importorskip("sglang", reason="SGLang is installed by scripts/test_sglang.sh")

import sgl_helpers as helpers  # noqa: E402  (after the doubles)
from sglang.srt.runtime_context import get_parallel  # noqa: E402

# One server process of one rank, as SGLang's launcher would publish it (no torch.distributed).
get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


@pytest.fixture
def store_root(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free port, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_options(s3_endpoint, monkeypatch, request):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = "kv-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return helpers.s3_backend_options(s3_endpoint, bucket)


__all__ = ["helpers"]
