"""The package's layers (README, Architecture): the import-linter contracts in pyproject.toml hold,
and the light layers stay light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    # Layers only import downward (exhaustively: a module at treadle/ outside the listed layers
    # breaks it too), and no two modules import each other, directly or through others.
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


def imported_by(statement: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after ``statement`` runs in a fresh interpreter."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_loading_a_recipe_imports_neither_torch_nor_pebble():
    modules = imported_by(
        "from treadle.config import load_config\n"
        f"load_config({str(REPO / 'recipes' / 'default.yaml')!r}, ['trainer.lr=1e-5'])"
    )
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "pebble", "transformers")}
    assert not heavy, sorted(heavy)[:5]


def test_the_single_process_job_imports_no_cluster_code():
    modules = imported_by("import treadle.jobs.train, treadle.cli")
    assert not {m for m in modules if m.startswith(("treadle.cluster", "ray"))}
