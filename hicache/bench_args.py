"""Argument types the benchmark scripts under ``scripts/`` share, so that a bad number is a
one-line usage error (``argparse`` names the option) and never a traceback halfway through a
run, or a run that measures nothing (zero pages, zero repeats)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["int_list", "name_list", "non_negative_float", "non_negative_int", "output_file", "positive_float",
           "positive_int", "unwritable_file"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of pages, layers, repeats, ...)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a seed, a count that may be none)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a delay that may be none): a negative or nan one reached
    ``time.sleep`` as an error on every call, inf as one that never returned."""
    value = _float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, at least one (``"1000,10000"``)."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("needs at least one integer")
    return values


def name_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names out of ``allowed``, at least one
    (``"runs,scattered"``): a misspelt name was a ``KeyError`` traceback halfway through a run,
    or ran another case under its label."""

    def names(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        for name in chosen:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {name!r}; allowed: {', '.join(allowed)}")
        if not chosen:
            raise argparse.ArgumentTypeError("needs at least one name")
        return chosen

    return names


def unwritable_file(text: str) -> str | None:
    """Why a file named ``text`` cannot be written (a folder, in a folder that is missing or
    not writable, or a file not writable), or ``None`` when it can: a command checks the
    names of what it writes at its end (a report, a plot) before its work, not after it."""
    path = Path(text)
    if path.is_dir():
        return f"{text!r} is a folder; name a file"
    if path.exists() and not path.is_file():
        # a pipe or a device (/dev/stdout) is written in place, no temporary file beside it: its
        # folder need not be writable (/dev is root's: every other user's plot there was refused)
        return None if os.access(path, os.W_OK) else f"{text!r}: not writable; name another file"
    folder = path.parent
    if not folder.is_dir():
        return f"{text!r}: no folder {str(folder)!r} to write it in"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{text!r}: not writable; name another file"
    return None


def output_file(text: str) -> Path:
    """The ``--out`` file a report is written to: one that cannot be written is refused now
    (it failed when the report was written, after the whole benchmark had run)."""
    problem = unwritable_file(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return Path(text)
