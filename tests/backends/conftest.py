"""Fixtures of the s3/fsspec backend tests only: a moto S3 server for the whole session.

The server runs in a thread of the test process on a port the OS picks, so CI starts nothing by
hand and parallel runs never collide.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for ``import s3_server`` from test modules

from s3_server import create_bucket, threaded_moto  # noqa: E402


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL of a session-wide moto S3 server on loopback."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server, endpoint = threaded_moto()
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_bucket(moto_endpoint: str) -> str:
    """A bucket on the session server; tests isolate themselves by prefix."""
    name = f"hicache-{uuid.uuid4().hex[:12]}"
    create_bucket(moto_endpoint, name)
    return name
