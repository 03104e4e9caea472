"""Every algorithm recipe runs 3 RL steps of the real loop on a tiny model (HF engine, in this
process): the loss stays finite, every policy parameter changes, and PPO's critic trains too."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from treadle.config import load_config
from treadle.jobs.train import train

from .runs import REPO, TINY_RUN, is_finite_number, metric_rows

RECIPES = [
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "ppo",
]

FAST = [
    "sft.steps=0",
    "run.steps=3",
    "run.keep_last=3",
    "eval.every=0",
    "eval.greedy=false",
    "eval.control_sft=false",
    "data.reasoning=none",
    "data.answer_template=<answer>{answer}</answer>",
    "sft.noise.loose_template={answer}",
]


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def changed_fraction(before: dict, after: dict) -> tuple[float, list[str]]:
    same = [k for k in before if torch.equal(before[k], after[k])]
    return 1 - len(same) / len(before), same


# Options that no recipe turns on, run through the loop on top of a recipe.
VARIANTS = {
    "grpo": [],
    "tis_entropy_k2": [  # trainer-recomputed old logprobs, TIS, entropy bonus, k2 KL loss
        "algorithm.importance_sampling=tis_seq",
        "algorithm.entropy_coef=0.01",
        "algorithm.kl.estimator=k2",
    ],
    "mis_low_var_k3": [
        "algorithm.importance_sampling=mis_token",
        "algorithm.kl.estimator=low_var_k3",
        "algorithm.dual_clip=0",
    ],
    "verl_and_trl_forms": [  # the options that reproduce a peer (ALGORITHMS.md, Conformance)
        "algorithm.importance_sampling=mis_token",
        "algorithm.mis_denominator=kept",
        "algorithm.loss_agg=token-sum-norm",
        "algorithm.entropy_coef=0.01",
        "algorithm.entropy_agg=loss_agg",
        "algorithm.off_policy_mask=0.5",
    ],
    "remax_to_go": [  # verl's ReMax with a per-token KL penalty in the reward
        "algorithm.kl.coef=0.01",
        "algorithm.kl.placement=reward",
        "algorithm.kl.estimator=k1",
        "algorithm.token_reward_credit=to_go",
    ],
}
BASE = {"remax_to_go": "remax"}
"""The recipe a variant starts from (grpo when not named)."""


@pytest.mark.parametrize("recipe", RECIPES + [v for v in VARIANTS if v != "grpo"])
def test_recipe_runs_three_steps_and_trains(recipe, tmp_path, one_torch_thread):
    overrides = [*TINY_RUN, *FAST, f"run.output_dir={tmp_path}", "algorithm.max_sampling_rounds=2"]
    if recipe in VARIANTS:
        overrides += [*VARIANTS[recipe], f"run.name={recipe}"]
    file = BASE.get(recipe, "grpo") if recipe in VARIANTS else recipe
    cfg = load_config(REPO / "recipes" / f"{file}.yaml", overrides)
    train(cfg, console=Console(file=io.StringIO()))
    run_dir = tmp_path / recipe

    rows = {r["step"]: r for r in metric_rows(run_dir) if "reward/mean" in r}  # RL-step rows
    assert sorted(rows) == [1, 2, 3], recipe
    for step, row in rows.items():
        if row.get("filter/kept_groups") == 0:  # dynamic sampling found no varied group
            assert "loss" not in row
            continue
        assert is_finite_number(row["loss"]), (recipe, step, row["loss"])
        assert is_finite_number(row["grad_norm"]), (recipe, step)
        assert "entropy/mean" in row and row["entropy/mean"] > 0
        assert row["mismatch/abs_logprob_diff"] < 1e-3  # HF engine and trainer: same fp32 math

    # A step whose groups all scored alike has zero advantages (and gradient); not all three.
    assert any(row.get("grad_norm", 0) > 0 for row in rows.values()), recipe
    _, same = changed_fraction(weights(run_dir / "base_model"), weights(run_dir / "final_model"))
    assert same == [], f"{recipe}: parameters that never changed: {same}"

    if recipe == "ppo":
        ckpts = run_dir / "checkpoints"
        first = weights(ckpts / "step_000001" / "critic")
        last = weights(ckpts / "step_000003" / "critic")
        _, same = changed_fraction(first, last)
        assert same == [], f"critic parameters that never changed: {same}"
        assert "score.weight" in last  # the value head is checkpointed with the critic
        assert all(is_finite_number(r["critic/value_loss"]) for r in rows.values())
        assert all(r["critic/grad_norm"] > 0 for r in rows.values())
    if recipe == "dapo":
        assert all("filter/kept_groups" in r for r in rows.values())
    if any(o.startswith("algorithm.importance_sampling") for o in VARIANTS.get(recipe, [])):
        assert all("is/weight_mean" in r for r in rows.values())
    if recipe == "verl_and_trl_forms":
        assert all("is/rejected_tokens" in r for r in rows.values())
        assert all("off_policy_mask/dropped_fraction" in r for r in rows.values())
    if recipe == "remax":
        assert all(r["time/baseline_s"] > 0 for r in rows.values())


def test_ppo_resume_restores_the_critic(tmp_path, one_torch_thread):
    """A PPO run stopped after 2 steps and resumed to 3 equals 3 uninterrupted steps: the
    critic's weights and optimizer state come back from the checkpoint."""
    base = [*TINY_RUN, *FAST, f"run.output_dir={tmp_path}"]
    recipe = REPO / "recipes" / "ppo.yaml"

    def run(name: str, steps: int, resume=None):
        overrides = [*base, f"run.name={name}", f"run.steps={steps}"]
        train(load_config(recipe, overrides), resume=resume, console=Console(file=io.StringIO()))

    run("resumed", 2)
    run("resumed", 3, resume=tmp_path / "resumed")
    run("straight", 3)
    a = weights(tmp_path / "resumed" / "checkpoints" / "step_000003" / "critic")
    b = weights(tmp_path / "straight" / "checkpoints" / "step_000003" / "critic")
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=0, atol=1e-6, msg=name)
    rows = [
        {r["step"]: r for r in metric_rows(tmp_path / run_name) if "loss" in r}[3]
        for run_name in ("resumed", "straight")
    ]
    assert rows[0]["critic/value_loss"] == pytest.approx(rows[1]["critic/value_loss"], abs=1e-6)
