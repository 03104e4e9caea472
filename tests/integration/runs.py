"""Running treadle end to end from a test, and reading what a run leaves on disk."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_python(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` offline in a fresh process (a fresh process holds its own vLLM)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, (
        f"`python {' '.join(args)}` exited {proc.returncode}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-8000:]}"
    )
    return proc


def metric_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_rows(run_dir: Path) -> dict[int, list[dict]]:
    """RL-step rows (those with a ``loss``) by step."""
    out: dict[int, list[dict]] = {}
    for row in metric_rows(run_dir):
        if "loss" in row:
            out.setdefault(row["step"], []).append(row)
    return out


def is_finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
