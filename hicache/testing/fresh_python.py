"""``python_says``: run code in a fresh interpreter and hand back what it printed.

Why a fresh interpreter: what a test checks there is process-wide (which modules an import
pulls in, how a package behaves when an optional part is missing, what happens at exit), and
the test process has long imported and set up everything.
"""

from __future__ import annotations

import subprocess
import sys

__all__ = ["python_says"]


def python_says(code: str, *, timeout: float = 120.0, env: dict[str, str] | None = None) -> str:
    """Run ``code`` with this interpreter in a new process; its stdout. Fails (with its
    stderr) unless it exits 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
