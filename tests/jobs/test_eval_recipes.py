"""The benchmark recipes of ``recipes/eval/`` read the whole file from ``../shared/data`` and
grade a gold answer, written as a model would write it, right."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.jobs.evaluate_job import eval_tasks
from treadle.rewards.pool import RewardPool

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"

# recipe -> (rows in the file, the first task's id, its gold answer's start)
EXPECTED = {
    "math500": (500, "test/0", r"\left( 3, \frac{\pi}{2} \right)"),
    "gsm8k": (1319, "test/0", "18"),  # "#### 18" cut by data.answer_pattern
    "humaneval": (164, "humaneval/HumanEval/0", "```python\nfrom typing import List"),
    "mbpp": (427, "mbpp/2", "```python\ndef similar_elements"),
}


@pytest.fixture(autouse=True)
def _from_the_repo_root(monkeypatch):
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (the benchmark files live beside the checkout)")
    monkeypatch.chdir(REPO)  # the recipes name ../shared/data relative to the repository root


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_benchmark_recipe_takes_every_row_of_its_file(name):
    cfg = load_config(REPO / "recipes" / "eval" / f"{name}.yaml")
    tasks = eval_tasks(cfg)
    rows, first_id, gold = EXPECTED[name]
    assert (len(tasks), tasks[0].task_id) == (rows, first_id)
    assert tasks[0].answer.startswith(gold)
    assert cfg.eval.split == "all" and cfg.eval.k == [1, 4] and cfg.eval.samples_per_prompt == 4


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_benchmark_recipe_grades_gold_answers_as_a_model_writes_them_right(name):
    cfg = load_config(REPO / "recipes" / "eval" / f"{name}.yaml")
    tasks = eval_tasks(cfg)[:3]
    code = cfg.data.source in ("humaneval", "mbpp")
    # A model's reply: the fenced solution for code, "... \boxed{gold}" for math.
    replies = [t.answer if code else f"So the answer is \\boxed{{{t.answer}}}." for t in tasks]
    pool = RewardPool.from_config(dataclasses.replace(cfg.reward, workers=0))
    try:
        scores = pool.score(list(zip(tasks, replies, strict=True))).scores
    finally:
        pool.close()
    assert [s.correct for s in scores] == [True, True, True]
    wrong = pool_scores_of_a_wrong_reply(cfg, tasks[0], code)
    assert wrong is False  # the grader is not accepting everything


def pool_scores_of_a_wrong_reply(cfg, task, code: bool) -> bool:
    """Whether the recipe's grader accepts a wrong reply to ``task``."""
    reply = "```python\ndef f():\n    return None\n```" if code else "\\boxed{123456789}"
    pool = RewardPool.from_config(dataclasses.replace(cfg.reward, workers=0))
    try:
        return pool.score([(task, reply)]).scores[0].correct
    finally:
        pool.close()
