"""Fixtures of the s3/fsspec backend tests only: a moto S3 server for the whole session.

The server runs in a thread of the test process on a port the OS picks, so CI starts nothing by
hand and parallel runs never collide.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
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


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``mount(size_bytes) -> folder``: a real tmpfs of that size (a real full disk: writes there
    fail with ENOSPC). Needs root (CI runs as root); unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a small tmpfs")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
