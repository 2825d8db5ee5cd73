"""How every benchmark script under ``scripts/`` reports: one indented JSON document on stdout,
and the same text in ``--out`` when given (so a run can be both read and kept)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["emit_report"]


def emit_report(report: dict[str, Any], out: str | Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
