"""Import setup and fixtures for the SGLang integration tests (run by scripts/test_sglang.sh).

SGLang 0.5.23 is installed without its GPU dependencies. The GPU-only kernel modules that its
``mem_cache`` and ``managers`` modules try to import are replaced by test doubles
(``sgl_doubles``), in the tests' own import setup (never in the library); everything else is
SGLang's real code: its device and host pools, its storage factory, its cache controller, and
in test_e2e_engine.py its whole engine.
"""

from __future__ import annotations

import pytest

import sgl_doubles

#: Modules SGLang imports at module level that cannot load on this CPU-only torch (torchvision,
#: whose registry wheel is built against the CUDA torch): SGLang's mem_cache and managers code
#: never calls them; a double answers any attribute with a placeholder that fails loudly if it
#: is ever used. The engine tests (test_e2e_engine.py) install more, in their own processes.
sgl_doubles.install_module_doubles(sgl_doubles.TORCHVISION)
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
