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
    # a user's shell has not got what this process's own DeepSpeed tests set (the CLI must
    # choose DeepSpeed's CPU accelerator itself, or DeepSpeed warns on the console)
    env.pop("DS_ACCELERATOR", None)
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


# A fast in-process run on the HF engine with a tiny model (each step really updates it).
TINY_RUN = [
    "run.seed=0",
    "run.save_every=1",
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=128",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "model.tiny.tokenizer_vocab_size=300",
    "data.task=chain_sum",
    "data.task_params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    "data.size=100",
    "data.eval_size=4",
    "rollout.engine=hf",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_tokens=8",
    "eval.samples_per_prompt=2",
    "trainer.lr=1e-3",
    # The verifier alone scores a random model 0 everywhere; a small reward for any digit
    # varies within groups, so each step really updates the weights.
    "reward.functions=[{name: reasoning_gym}, {name: format, weight: 0.1, "
    "params: {pattern: '.*[0-9].*'}}]",
]
