"""Moto S3 servers on loopback for the s3 backend's tests (nothing is started by hand in CI).

* :func:`threaded_moto` - a server in a thread of the test process, on a port the OS picks
  (``ThreadedMotoServer(port=0)``; the bound port is read back). Cheap, shared by a session.
* :class:`MotoProcess` - a server in a subprocess on a fixed free port, for outage tests: it can
  be paused (SIGSTOP: connections hang), killed, and restarted on the same port. Moto keeps its
  data in memory, so a restarted server is empty: re-create the bucket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = [
    "MotoProcess", "create_bucket", "eventually", "free_port", "make_s3", "raw_client", "raw_get", "raw_put", "s3_options",
    "threaded_moto", "wait_ready",
]

# Fake credentials for moto; tests check that they never show up in repr, stats or logs.
TEST_KEY = "AKIAHICACHETESTKEY01"
TEST_SECRET = "hicache/test-secret-must-never-leak"


def s3_options(endpoint: str) -> dict[str, Any]:
    """``storage_options`` for a moto endpoint."""
    return {
        "endpoint_url": endpoint,
        "key": TEST_KEY,
        "secret": TEST_SECRET,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(endpoint: str, timeout: float = 30.0) -> None:
    """Block until the server answers HTTP (any status)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1.0):
                return
        except urllib.error.HTTPError:
            return
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
            time.sleep(0.05)
    raise RuntimeError(f"moto server at {endpoint} did not come up: {last}")


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` with a plain botocore client (idempotent)."""
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
        region_name="us-east-1",
    )
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    finally:
        client.close()


def threaded_moto() -> tuple[Any, str]:
    """Start a moto server thread on an OS-chosen loopback port; returns (server, endpoint)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert port != 0
    endpoint = f"http://{host}:{port}"
    wait_ready(endpoint)
    return server, endpoint


class MotoProcess:
    """``python -m moto.server`` on one loopback port, which survives stop/start cycles."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        wait_ready(self.endpoint, timeout)

    def pause(self) -> None:
        """Freeze the server: the kernel still accepts connections, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proc.kill()
        proc.wait(timeout=10)

    def __enter__(self) -> MotoProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def raw_client(endpoint: str) -> Any:
    """One plain botocore client per endpoint (thread-safe; a new session per call reloads the
    service models, ~0.1-0.2 s a time, which used to dominate the checks against the bucket)."""
    import botocore.session

    with _CLIENTS_LOCK:
        client = _CLIENTS.get(endpoint)
        if client is None:
            client = _CLIENTS[endpoint] = botocore.session.get_session().create_client(
                "s3", endpoint_url=endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
                region_name="us-east-1",
            )
        return client


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def raw_get(endpoint: str, path: str) -> bytes | None:
    client = raw_client(endpoint)
    bucket, key = _split(path)
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def raw_put(endpoint: str, path: str, data: bytes) -> None:
    client = raw_client(endpoint)
    bucket, key = _split(path)
    client.put_object(Bucket=bucket, Key=key, Body=data)


_SESSION: Any = None


def shared_session() -> Any:
    """One aiobotocore session for the stores of this module: a fresh session loads botocore's
    service models again (0.1-0.4 s per store); clients, the loop-bound part, stay per store."""
    global _SESSION
    if _SESSION is None:
        from aiobotocore.session import get_session

        _SESSION = get_session()
    return _SESSION


def make_s3(endpoint: str, bucket: str, prefix: str, namespace: Any = None, **options: Any) -> Any:
    """An ``s3`` store on ``endpoint`` under ``s3://bucket/prefix`` (the shared botocore session)."""
    from hicache.storage import create_async_storage

    return create_async_storage(
        "s3", None, url=f"s3://{bucket}/{prefix}",
        storage_options={**s3_options(endpoint), "session": shared_session()}, namespace=namespace,
        **options,
    )


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll ``check`` until it is true; fail after ``timeout`` seconds."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")
