"""Fixtures of the vLLM tier tests: temporary stores and a moto S3 server on port 0.

vLLM's CPU build imports on a machine without a GPU as is; these tests use only its scheduler
side (the tiering manager and spec), which never touches a device.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # for ``import _tiering``
sys.path.insert(0, str(HERE.parent))  # for ``import _block_formats``
sys.path.insert(0, str(HERE.parents[2] / "backends"))  # the S3 tests' moto helpers

from s3_server import create_bucket, s3_options, threaded_moto  # noqa: E402


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    server, endpoint = threaded_moto()
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama's config (no weights: the scheduler side never loads them)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
    ).save_pretrained(path)
    return str(path)


@pytest.fixture
def s3_tier_options(moto_endpoint: str) -> dict:
    """Options of the ``s3`` backend for a fresh bucket prefix on the moto server."""
    bucket = "hicache-vllm-tier"
    create_bucket(moto_endpoint, bucket)
    return {"url": f"s3://{bucket}/{uuid.uuid4().hex}", "storage_options": s3_options(moto_endpoint)}


@pytest.fixture
def file_tier_options(tmp_path: Path) -> dict:
    """Options of the ``file`` backend in a temporary root (no free-space floor: tmp is small)."""
    return {"root": str(tmp_path / "store"), "min_free_bytes": 0}


@pytest.fixture
def platform_as_is() -> None:
    """Requested by a test that derives the tier's block format on the platform it sets up
    itself (see :func:`_cuda_block_format`)."""


@pytest.fixture(autouse=True)
def _cuda_block_format(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests play the scheduler side of a CUDA engine: vLLM's offloading worker runs only
    on GPUs (``CPUOffloadingSpec.get_worker``), so the tier refuses vLLM's CPU platform, where
    these tests run. The tier names its chunks' block format as on an NVIDIA GPU here, and
    nothing else about the platform changes."""
    if "platform_as_is" in request.fixturenames:
        return
    from _tiering import nvidia_gpu

    from hicache.integrations.vllm import block_format

    monkeypatch.setattr(block_format, "_platform", nvidia_gpu)
