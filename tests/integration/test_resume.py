"""Resuming a run from its last checkpoint continues it exactly (HF engine, in this process)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from treadle.config import load_config
from treadle.core.errors import UserError
from treadle.jobs.train import train
from treadle.store.buffer import RolloutBuffer

from .runs import TINY_RUN as OVERRIDES
from .runs import is_finite_number, metric_rows, step_rows


def run(output_dir, name: str, steps: int, resume=None) -> dict:
    cfg = load_config(
        None, [*OVERRIDES, f"run.output_dir={output_dir}", f"run.name={name}", f"run.steps={steps}"]
    )
    return train(cfg, resume=resume, console=Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    resumed = out / "resumed"
    run(out, "resumed", steps=2)
    first = {r["step"]: r for r in metric_rows(resumed) if "loss" in r}
    run(out, "resumed", steps=3, resume=resumed)
    run(out, "straight", steps=3)
    return resumed, out / "straight", first


def test_resume_continues_from_the_last_step(runs):
    resumed, _, first = runs
    steps = step_rows(resumed)
    assert sorted(steps) == [1, 2, 3] and all(len(rows) == 1 for rows in steps.values())
    assert all(is_finite_number(rows[0]["loss"]) for rows in steps.values())
    # Steps 1 and 2 are the first run's rows, untouched by the resume.
    assert steps[1][0] == first[1] and steps[2][0] == first[2]
    ckpts = resumed / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000003"]
    state = json.loads((ckpts / "step_000003" / "state.json").read_text())
    assert state["step"] == 3 and state["policy_version"] == 3
    assert state["data_position"] == {"epoch": 0, "offset": 12}  # 3 steps x 4 prompts
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["rl_steps"] == 3
    # The rollout buffer holds each step's 16 rollouts once (step 3 was trained after resuming).
    buffer = RolloutBuffer(resumed)
    assert buffer.steps() == [1, 2, 3] and len(buffer) == 48


def test_resumed_run_equals_an_uninterrupted_one(runs):
    """Weights, optimizer state, data position and RNG all come back from the checkpoint."""
    resumed, straight, _ = runs
    a, b = step_rows(resumed)[3][0], step_rows(straight)[3][0]
    for key in ("reward/mean", "adv/abs_mean", "loss", "grad_norm", "rollout/mean_length"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    # ... and so are the stored rollouts of the step trained after resuming.
    rows_a, rows_b = (RolloutBuffer(d).read_step(3).rows for d in (resumed, straight))
    assert [r["token_ids"] for r in rows_a] == [r["token_ids"] for r in rows_b]
    assert [r["reward"] for r in rows_a] == [r["reward"] for r in rows_b]
    ma = AutoModelForCausalLM.from_pretrained(resumed / "final_model")
    mb = AutoModelForCausalLM.from_pretrained(straight / "final_model")
    pb = dict(mb.named_parameters())
    for name, p in ma.named_parameters():
        torch.testing.assert_close(p, pb[name], rtol=0, atol=1e-6, msg=name)


def test_resuming_a_finished_run_changes_nothing(runs):
    resumed, _, _ = runs
    rows_before = (resumed / "metrics.jsonl").read_text()
    summary = run(resumed.parent, "resumed", steps=3, resume=resumed)
    assert summary == json.loads((resumed / "summary.json").read_text())
    assert (resumed / "metrics.jsonl").read_text() == rows_before


def test_resuming_with_fewer_steps_than_done_prints_the_summary_or_refuses(runs, tmp_path):
    resumed, _, _ = runs
    rows_before = (resumed / "metrics.jsonl").read_text()
    # The run did 3 steps: asked for 2 it has nothing left to do and reports its summary ...
    summary = run(resumed.parent, "resumed", steps=2, resume=resumed)
    assert summary == json.loads((resumed / "summary.json").read_text())
    # ... and without its summary (killed after its last checkpoint) it refuses in one line
    # before anything of the run is truncated.
    copy = tmp_path / "copy"
    shutil.copytree(resumed, copy)
    (copy / "summary.json").unlink()
    with pytest.raises(UserError, match=r"at step 3, past run.steps=2; resume with run.steps=3"):
        run(tmp_path, "copy", steps=2, resume=copy)
    assert (copy / "metrics.jsonl").read_text() == rows_before
    assert RolloutBuffer(copy).steps() == [1, 2, 3]
