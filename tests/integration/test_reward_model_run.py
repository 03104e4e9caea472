"""An RL run whose reward mixes a verifier with a learned reward model in its own process."""

from __future__ import annotations

import io

import pytest
from rewards.tiny_rm import train_tiny_reward_model
from rich.console import Console

from treadle.config import load_config
from treadle.core.types import Message, Task
from treadle.jobs.train import train
from treadle.rewards.reward_model import RewardModelReward
from treadle.store.observe import read_samples, samples_path

from .runs import REPO, TINY_RUN, metric_rows


def test_run_with_a_separate_reward_model(tmp_path, one_torch_thread):
    rm_dir = train_tiny_reward_model(tmp_path / "reward_model")
    overrides = [
        *(o for o in TINY_RUN if not o.startswith("reward.")),
        f"run.output_dir={tmp_path}",
        "run.name=rm",
        "run.steps=2",
        "sft.steps=0",
        "eval.every=0",
        "eval.greedy=false",
        "reward.functions=[{name: reasoning_gym}, {name: reward_model, weight: 0.5, "
        f"params: {{path: '{rm_dir}', placement: separate, batch_size: 4}}}}]",
    ]
    cfg = load_config(REPO / "recipes" / "default.yaml", overrides)
    train(cfg, console=Console(file=io.StringIO()))
    rows = [r for r in metric_rows(tmp_path / "rm") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/failures"] == r["reward/timeouts"] == 0 for r in rows)
    # Each logged reward is 1 * verifier + 0.5 * the reward model's score of that completion,
    # which a colocated copy of the model recomputes from the logged prompt and completion.
    check = RewardModelReward(str(rm_dir), placement="colocated")
    records = read_samples(samples_path(tmp_path / "rm", 1))
    assert len(records) == 16  # 4 prompts x 4 samples
    for record in records:
        system = (Message("system", cfg.data.system_prompt),) if cfg.data.system_prompt else ()
        turns = (*system, Message("user", record.prompt))  # how data.py builds a task's chat
        rm_score = check.score(Task("t", turns, "", "rg"), record.completion).reward
        assert record.reward == pytest.approx(float(record.correct) + 0.5 * rm_score, abs=1e-4)
