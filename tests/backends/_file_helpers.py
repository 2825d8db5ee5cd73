"""Helpers shared by the ``file`` backend tests: raw access to the medium, deterministic payloads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from hicache.storage.page_format import PageCodec
from hicache_backends.file.layout import FOOTER_LEN, NamespaceLayout, decode_footer, page_id

WORKER = Path(__file__).with_name("_file_worker.py")


def page_path(root: str | Path, digest: str, key: str, pool: str = "kv") -> str:
    return NamespaceLayout(str(root), digest).path(page_id(key, pool))


def raw_payload_from_disk(root: str | Path, digest: str, key: str, pool: str = "kv") -> bytes | None:
    """The payload of a page file read straight from disk, header (and footer) stripped."""
    try:
        with open(page_path(root, digest, key, pool), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    header = PageCodec.parse(data)
    assert header is not None, "page file without a valid header"
    assert header.key == key and header.pool == pool
    assert len(data) == header.header_len + header.payload_len + FOOTER_LEN
    return data[header.header_len : header.header_len + header.payload_len]


def parent_on_disk(path: str) -> str | None:
    with open(path, "rb") as f:
        data = f.read()
    foot = decode_footer(data[-FOOTER_LEN:])
    assert foot is not None
    return foot.parent


def payload_for(key: str, size: int) -> bytes:
    """Deterministic bytes for ``key``: what any writer of ``key`` stores, so readers can check."""
    seed = hashlib.sha256(key.encode()).digest()
    reps = -(-size // len(seed))
    return (seed * reps)[:size]


def all_files(root: str | Path) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out.extend(os.path.join(d, f) for f in files)
    return out


class ForkServer:
    """Client of ``_file_worker.py``: real second processes sharing a store root."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        hello = self._reply()
        assert "ready" in hello

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server died (rc={self.proc.poll()})")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def run(self, **cmd) -> int:
        """Fork a child for ``cmd`` and wait for it; returns its exit status."""
        pid = self.call(**cmd)["pid"]
        return self.call(op="wait", pid=pid)["status"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def slow_page_writes(monkeypatch, seconds: float) -> threading.Event:
    """Make every page write of the file backend take ``seconds`` longer (a window in which to
    cancel a batch); the returned event is set once the first write has started."""
    from hicache_backends.file import io as file_io

    real_write = file_io.write_page
    started = threading.Event()

    def slow_write(*args):
        started.set()
        time.sleep(seconds)
        return real_write(*args)

    monkeypatch.setattr(file_io, "write_page", slow_write)
    return started


def hold_publish_window(monkeypatch, hold) -> None:
    """Call ``hold(path)`` (it may block) right after a page write measures the file its publish
    replaces (``io._regular_size``). Before publishes learnt that size in the same step as the
    rename, this was the window in which another process's publish or unlink of the same page
    went uncounted; a test that widens it shows nothing can come between any more."""
    from hicache_backends.file import io as file_io

    real = file_io._regular_size

    def measured_then_held(path):
        size = real(path)
        hold(path)
        return size

    monkeypatch.setattr(file_io, "_regular_size", measured_then_held)
