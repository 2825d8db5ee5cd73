"""The README's "Command line" table and ``hicache --help`` agree: every subcommand has a row,
every row names a subcommand, every option a row shows is one the subcommand takes, and a row
lists exactly the choices of its positional arguments (``hicache workload`` documented
``agents`` alone, and ``chat`` only further down)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from hicache.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _rows() -> dict[str, str]:
    """Subcommand -> the usage its row shows (``hicache bench storage\\|s3 [args]``)."""
    text = README.read_text().split("## Command line", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for usage in re.findall(r"^\| `hicache ([^`]+)` \|", text, re.M):
        usage = usage.replace("\\|", "|")
        rows[usage.split()[0]] = usage
    return rows


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_has_a_row_and_every_row_a_subcommand() -> None:
    assert set(_rows()) == set(_subparsers())


def test_every_option_a_row_shows_exists_and_its_choices_are_all_listed() -> None:
    parsers = _subparsers()
    for command, usage in _rows().items():
        parser = parsers[command]
        options = {s for a in parser._actions for s in a.option_strings}
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage):
            assert flag in options, f"README shows `hicache {command} {flag}`, which it does not take"
        shown = [set(w.split("|")) for w in usage.split()[1:] if "|" in w and w.islower()]  # agents|chat, not URL|ROOT
        wanted = [{str(c) for c in a.choices} for a in parser._actions if a.choices and not a.option_strings]
        assert sorted(map(sorted, shown)) == sorted(map(sorted, wanted)), \
            f"README shows `hicache {usage}`; its positional choices are {wanted}"
