"""A real ``treadle train`` (HF engine, tiny random model, its own process) whose reward is
always 0 says so on the console by step 3 and in metrics.jsonl (treadle.jobs.health)."""

from __future__ import annotations

from .runs import REPO, TINY_RUN, metric_rows, run_python, write_recipe

NEVER = "reward.functions=[{name: format, params: {pattern: 'no completion is this'}}]"
"""A reward function that never matches: every reward is 0."""


def test_a_run_whose_rewards_are_all_zero_warns_within_3_steps(tmp_path):
    recipe = write_recipe(tmp_path / "zero.yaml", {"run": {"name": "zero"}})
    tiny = [o for o in TINY_RUN if not o.startswith("reward.")]
    overrides = [*tiny, NEVER, "run.steps=4", "sft.steps=0", f"run.output_dir={tmp_path}"]
    proc = run_python(["-m", "treadle.cli", "train", str(recipe), *overrides], REPO, 600)
    warned = [line for line in proc.stderr.splitlines() if line.startswith("WARNING treadle.jobs")]
    flat = [line for line in warned if "for every sample" in line]
    assert flat == [
        "WARNING treadle.jobs.health: RL steps 1-3: the reward was 0 for every sample, so every "
        "advantage is 0 and nothing is learned; does the model write the rewarded format? try "
        "treadle reward-check, an SFT warm-up (sft.steps) or a partial-credit reward"
    ]  # once: step 4 is the same episode
    assert any("RL step 1: the loss is exactly 0" in line for line in warned)
    rows = {r["step"]: r for r in metric_rows(tmp_path / "zero") if "loss" in r}
    assert [rows[s]["reward/mean"] for s in (1, 2, 3, 4)] == [0.0] * 4
    assert [rows[s]["health/flat_rewards"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert all(rows[s]["health/zero_loss"] == 1.0 and rows[s]["loss"] == 0.0 for s in rows)
    assert all(rows[s]["health/warnings"] >= 1.0 + (s >= 3) for s in rows)
    for row in rows.values():  # 4 prompts x 4 samples of up to 8 tokens each
        assert 16 <= row["perf/gen_tokens"] <= 128 and row["perf/gen_tokens_per_s"] > 0
        assert 0 < row["perf/mfu"] < 1
    assert (tmp_path / "zero" / "engine.log").is_file()
