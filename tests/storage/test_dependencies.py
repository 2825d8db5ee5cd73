"""Every runtime dependency declared in ``pyproject.toml`` is imported by the package: a declared
dependency that nothing imports costs every install a download and says something untrue about
the design (issue 14, item 14: ``aiofiles`` was one until the config loader's async path used it;
the README says why the page path does its own I/O threads instead)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_top_levels() -> set[str]:
    names: set[str] = set()
    for folder in (REPO / "hicache", REPO / "backends"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def test_every_declared_dependency_is_imported() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    modules_of: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            modules_of.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), set()).add(module)
    imported = _imported_top_levels()
    unused = []
    for requirement in declared:
        dist = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()
        if not modules_of.get(dist, {dist}) & imported:
            unused.append(dist)
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"
