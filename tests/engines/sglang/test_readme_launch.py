"""The README's "Use with SGLang" section against SGLang's own argument parser: its launch
command parses, its extra config loads the adapter, and every SGLang flag the README names is
one SGLang 0.5.23 takes (it named ``--enable-storage-metrics``, which SGLang refuses to start
with: its storage metrics follow ``--enable-metrics``)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
from pathlib import Path

from sglang.srt.server_args import ServerArgs

from hicache.integrations.sglang.config import AdapterSettings

REPO = Path(__file__).resolve().parents[3]
SECTION = (REPO / "README.md").read_text().split("## Use with SGLang", 1)[1].split("\n## ", 1)[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_the_launch_command_parses_and_loads_the_adapter() -> None:
    (block,) = re.findall(r"```bash\n(.*?)```", SECTION, re.S)
    argv = shlex.split(block.replace("\\\n", " "))
    args = _parser().parse_args(argv[argv.index("sglang.launch_server") + 1:])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    settings = AdapterSettings.from_extra_config(extra)
    assert settings.backend == "file" and settings.options["root"] == "/data/kv"


def test_every_sglang_flag_the_readme_names_exists() -> None:
    """Flags of our own scripts the section runs (``scripts/bench_sglang.py --reps``) aside."""
    options = {s for a in _parser()._actions for s in a.option_strings}
    scripts = "".join((REPO / path).read_text() for path in set(re.findall(r"scripts/\w+\.py", SECTION)))
    named = {f for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", SECTION) if f'"{f}"' not in scripts}
    assert named and named <= options, sorted(named - options)
