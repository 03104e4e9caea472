"""``treadle reward-check``: gold answers against the recipe's own graders."""

from __future__ import annotations

from pathlib import Path

from treadle.cli import main
from treadle.config import load_config
from treadle.jobs.reward_check import check_gold

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
SMALL = ["data.size=40", "data.eval_size=10", "reward.workers=0"]


def test_default_recipe_graders_accept_every_gold_answer(capsys):
    assert main(["reward-check", str(RECIPE), *SMALL]) == 0
    assert "0 of 50 gold answers fail their own grader" in capsys.readouterr().out


def test_a_grader_that_cannot_read_the_gold_format_is_reported(capsys):
    # The demonstrations write <answer>N</answer>; a math grader told to read \boxed{} finds no
    # answer in any of them: every gold fails, and the command exits 1.
    broken = [*SMALL, "reward.functions=[{name: math_verify, params: {extract: boxed}}]"]
    result = check_gold(load_config(RECIPE, broken))
    assert result.total == 50 and len(result.failures) == 50
    assert result.failures[0].reward == 0.0
    assert main(["reward-check", str(RECIPE), *broken]) == 1
    out = capsys.readouterr().out
    assert "50 of 50 gold answers fail their own grader" in out and "... and 30 more" in out


def test_bad_recipe_input_exits_2(capsys):
    assert main(["reward-check", str(RECIPE), "reward.functions=[{name: nope}]"]) == 2
    assert "nope" in capsys.readouterr().err
