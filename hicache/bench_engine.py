"""An engine a benchmark script runs in a subprocess of its own, spoken to in JSON lines.

Why a pipe and not an import: an engine (vLLM, SGLang) takes the process over (its threads,
its spawned workers, its allocator, its exit), and several engines of one benchmark must not
share one; a subprocess each gives every configuration the same fresh process. The engine's
side prints each answer as one line starting with :data:`TAG` (:func:`say`) among whatever
else the engine prints; the benchmark's side (:class:`EngineProcess`) skips the rest into the
engine's log, and on an engine that died raises ``SystemExit`` with the log's tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["TAG", "EngineProcess", "say"]

#: the mark of a line the benchmark reads (the engine's own output goes to the log)
TAG = "@@hicache-bench "


def say(message: dict[str, Any]) -> None:
    """The engine's side: one answer to the benchmark."""
    print(TAG + json.dumps(message), flush=True)


class EngineProcess:
    """``python script --engine SPEC`` as a subprocess: requests as JSON lines on its stdin,
    answers from its stdout, its stderr (and untagged stdout) into ``log``."""

    def __init__(self, script: str | os.PathLike[str], spec: dict[str, Any], log: Path, env: dict[str, str],
                 cwd: str | os.PathLike[str] | None = None, log_tail: int = 6000) -> None:
        self.log = log
        self.log_tail = log_tail
        self._log_file = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(script), "--engine", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env, cwd=cwd)

    def reply(self) -> dict[str, Any]:
        """The engine's next answer (its other output goes to the log)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return dict(json.loads(line[len(TAG):]))
            self._log_file.write(line)
        self._log_file.flush()
        raise SystemExit(f"engine died (rc {self.proc.wait()}); log tail:\n{self.log.read_text()[-self.log_tail:]}")

    def send(self, request: Any) -> dict[str, Any]:
        """One request, its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        """End of input: the engine shuts down (killed after two minutes)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()
