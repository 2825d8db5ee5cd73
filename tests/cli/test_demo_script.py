"""``scripts/demo.sh`` runs ``hicache demo`` in the caller's folder (real bash, a stand-in
set-up and ``hicache``: the real ones install a virtual environment and run the demo)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_repo(tmp_path: Path) -> Path:
    """A repository with the real demo.sh, a bootstrap.sh that notes where it ran and a venv
    whose ``hicache`` notes where it ran and what it was given."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    (repo / "scripts" / "bootstrap.sh").write_text('pwd > "$RAN/bootstrap"\n')
    hicache = repo / ".venv" / "bin" / "hicache"
    hicache.parent.mkdir(parents=True)
    hicache.write_text('#!/usr/bin/env bash\npwd > "$RAN/hicache"\necho "$@" >> "$RAN/hicache"\n')
    hicache.chmod(0o755)
    return repo


def test_demo_sh_keeps_the_callers_folder_for_the_users_paths(tmp_path: Path) -> None:
    """demo.sh cd'd to the repository before ``hicache demo "$@"``: ``-c my.toml`` from another
    folder was "cannot read config file my.toml" (exit 2), and ./.hicache landed in the
    repository. From the repository's root (the README's first command, CI) nothing changes."""
    repo = _fake_repo(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    ran = tmp_path / "ran"
    ran.mkdir()
    env = {**os.environ, "RAN": str(ran)}
    env.pop("HICACHE_VENV", None)
    for cwd, script in ((work, str(repo / "scripts" / "demo.sh")), (repo, "./scripts/demo.sh")):
        proc = subprocess.run(["bash", script, "--quick", "-c", "my.toml"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert (ran / "bootstrap").read_text().strip() == str(repo)  # the set-up: in the repository
        assert (ran / "hicache").read_text().splitlines() == [str(cwd), "demo --quick -c my.toml"]
