"""The asynchronous rollout modes through the real loop with the vLLM engine: ``treadle train``
in a fresh process per mode on a tiny config, then what the run left on disk: every step trained
(finite loss, every parameter changed), the staleness metrics logged and within the bound, every
drawn prompt accounted for, each token's policy version in the buffer; and a run killed with
SIGKILL mid-way and resumed, which loses and duplicates no prompt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle.config import load_config
from treadle.core.types import DataPosition
from treadle.store.data import TaskSampler, load_dataset

from .runs import REPO, is_finite_number, metric_rows, run_python, step_rows, write_recipe
from .test_e2e_vllm import RECIPE
from .tiny import skip_without_vllm

pytestmark = pytest.mark.slow

MODES = {
    "one_step_off": ({"mode": "one_step_off"}, 1),
    "async_partial": ({"mode": "async", "max_staleness": 2, "partial": True}, 2),
    "async_oversample": ({"mode": "async", "max_staleness": 1, "oversample": 3}, 1),
}


def recipe(root, name: str, rollout: dict, steps: int = 4) -> dict:
    out = json.loads(json.dumps(RECIPE))
    out["run"] |= {"name": name, "steps": steps, "output_dir": str(root / "runs")}
    out["rollout"] |= rollout
    return out


def ledger_holds(row: dict) -> bool:
    dropped = sum(row[f"async/prompts_dropped_{r}"] for r in ("stale", "filtered", "aborted"))
    waiting, running = row["async/prompts_waiting"], row["async/prompts_running"]
    return row["async/prompts_drawn"] == row["async/prompts_trained"] + dropped + waiting + running


@pytest.fixture(scope="module", params=list(MODES))
def mode_run(request, tmp_path_factory):
    skip_without_vllm()
    root = tmp_path_factory.mktemp(request.param)
    rollout, eta = MODES[request.param]
    path = write_recipe(root / "recipe.yaml", recipe(root, request.param, rollout))
    run_python(["-m", "treadle.cli", "train", str(path)], cwd=root, timeout_s=900)
    return root / "runs" / request.param, eta


def test_every_step_trains_within_the_staleness_bound(mode_run):
    run_dir, eta = mode_run
    steps = step_rows(run_dir)
    assert sorted(steps) == [1, 2, 3, 4] and all(len(rows) == 1 for rows in steps.values())
    for step, (row,) in steps.items():
        assert is_finite_number(row["loss"]) and row["grad_norm"] > 0, row
        assert 0 <= row["async/staleness_mean"] <= row["async/staleness_max"] <= eta, row
        assert 0 <= row["async/engine_busy"] <= 1 and 0 <= row["async/trainer_busy"] <= 1, row
        # 8 prompts x 4 samples, counted by how many versions behind they were
        lags = {k: v for k, v in row.items() if k.startswith("async/samples_lag_")}
        assert sum(lags.values()) == 32 and all(int(k.rsplit("_", 1)[1]) <= eta for k in lags)
        assert ledger_holds(row), row
        assert row["async/prompts_trained"] == 8 * step


def test_rl_changed_every_parameter_and_the_buffer_keeps_each_tokens_version(mode_run):
    run_dir, eta = mode_run
    sft = dict(AutoModelForCausalLM.from_pretrained(run_dir / "sft_model").named_parameters())
    final = dict(AutoModelForCausalLM.from_pretrained(run_dir / "final_model").named_parameters())
    assert [n for n, p in final.items() if torch.equal(p, sft[n])] == []
    for step in range(1, 5):
        rows = pq.read_table(run_dir / "buffer" / f"step_{step:06d}.parquet").to_pylist()
        assert len(rows) == 32
        for row in rows:
            versions = row["token_versions"]
            assert len(versions) == len(row["token_ids"]) - row["prompt_tokens"]
            assert min(versions) == row["policy_version"] and step - 1 - min(versions) <= eta
            assert versions == sorted(versions) and max(versions) <= step - 1


def test_a_run_killed_mid_way_resumes_without_losing_or_repeating_a_prompt(tmp_path):
    skip_without_vllm()
    # 30 steps: the kill lands after the step-4 checkpoint, long before the end
    name, eta, steps = "killed", 2, 30
    cfg = recipe(tmp_path, name, {"mode": "async", "max_staleness": eta, "partial": True}, steps)
    cfg["run"]["save_every"] = 2
    cfg["data"]["size"] = 400  # 30 x 8 prompts stay in the first epoch
    path = write_recipe(tmp_path / "recipe.yaml", cfg)
    run_dir = tmp_path / "runs" / name
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "treadle.cli", "train", str(path)]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() >= "step_000004"):
        assert proc.poll() is None and time.monotonic() < deadline, "no step-4 checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # mid-run: requests running, groups waiting
    proc.wait()
    ckpt = run_dir / "checkpoints" / latest.read_text().strip()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["pending"], "nothing was in flight at the checkpoint: the test tests nothing"
    run_python(
        ["-m", "treadle.cli", "train", "--resume", str(run_dir)], cwd=tmp_path, timeout_s=900
    )

    rows = {r["step"]: r for r in metric_rows(run_dir) if "loss" in r}
    assert sorted(rows) == list(range(1, steps + 1))
    assert all(r["async/staleness_max"] <= eta and ledger_holds(r) for r in rows.values())
    trained = []
    for step in range(1, steps + 1):
        table = pq.read_table(run_dir / "buffer" / f"step_{step:06d}.parquet").to_pylist()
        trained += sorted({row["task_id"] for row in table})
    assert len(trained) == steps * 8 and len(set(trained)) == len(trained), "a prompt trained twice"
    # Every prompt the sampler handed out (its first `offset` positions, in the first epoch) is
    # trained, dropped (counted per step) or pending at the end.
    final = json.loads((run_dir / "checkpoints" / f"step_{steps:06d}" / "state.json").read_text())
    drawn = final["data_position"]["offset"]
    assert final["data_position"]["epoch"] == 0
    dropped = sum(
        r[f"async/dropped_{k}"] for r in rows.values() for k in ("stale", "filtered", "aborted")
    )
    assert len(trained) + dropped + len(final["pending"]) == drawn
    sampler = TaskSampler(_train_tasks(run_dir), seed=0)
    handed_out = {sampler.task_at(DataPosition(0, i)).task_id for i in range(drawn)}
    pending = {sampler.task_at(DataPosition(**p)).task_id for p in final["pending"]}
    assert set(trained) | pending <= handed_out and not set(trained) & pending


def _train_tasks(run_dir):
    return load_dataset(load_config(run_dir / "config.yaml").data).train
