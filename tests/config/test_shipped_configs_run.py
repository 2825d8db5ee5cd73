"""Every file in ``configs/`` builds a working cache, not only a valid config: a request is
admitted, committed and found again, and a fresh cache on a persistent store (``file``, ``s3``)
reads its pages back. Paths and endpoints are moved with the documented ``HICACHE__`` overrides,
so the test also holds the README's promise that they reach the backend's options.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.config import load_config
from hicache.facade import HiCache

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on loopback with the bucket ``configs/s3.toml`` names, made the way its
    comment says."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        import s3fs

        s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint).mkdir("hicache-demo")
        yield endpoint
    finally:
        server.stop()


def _overrides(path: Path, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    config = load_config(path, environ={}, check=False)
    env: dict[str, str] = {}
    if config.storage.backend == "file":
        env["HICACHE__STORAGE__OPTIONS__ROOT"] = str(tmp_path / "store")
    if config.storage.backend == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        env["HICACHE__STORAGE__OPTIONS__STORAGE_OPTIONS__ENDPOINT_URL"] = endpoint
        env["HICACHE__STORAGE__OPTIONS__URL"] = f"s3://hicache-demo/{uuid.uuid4().hex}"
    if config.events.enabled:  # not the shipped ports: tests may run beside a server
        env["HICACHE__EVENTS__ENDPOINT"] = f"inproc://events-{uuid.uuid4().hex}"
        env["HICACHE__EVENTS__REPLAY_ENDPOINT"] = f"inproc://replay-{uuid.uuid4().hex}"
    return env


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
async def test_every_shipped_config_serves_and_finds_its_pages_again(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    for name in [n for n in os.environ if n.startswith("HICACHE__")]:
        monkeypatch.delenv(name)
    for name, value in _overrides(path, tmp_path, request).items():
        monkeypatch.setenv(name, value)
    config = load_config(path)
    page = config.device.page_size
    tokens = [5_000 + i for i in range(max(600, 4 * page))]
    full = len(tokens) // page * page
    async with HiCache.from_config(path) as cache:
        h = await cache.begin("first", tokens)
        await cache.commit(h, finished=True)
        again = await cache.begin("again", tokens)
        assert again.prefix_len == full, again.hits
        await cache.commit(again, finished=True)
    assert cache.close_report.drained and not cache.close_report.unwritten, cache.close_report
    if config.storage.backend in ("file", "s3"):
        async with HiCache.from_config(path) as fresh:
            h = await fresh.begin("after-restart", tokens)
            assert h.hits["storage"] == full, h.hits
            await fresh.commit(h, finished=True)
