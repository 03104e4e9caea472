"""MathVerifyReward on hand-made answers and, when present, the real GSM8K / MATH-500 golds."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.math_verify import MathVerifyReward

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def math_task(answer: str) -> Task:
    return Task(task_id="t/0", messages=(), answer=answer, domain="math")


@pytest.mark.parametrize(
    ("gold", "response", "expected"),
    [
        ("\\frac{2}{3}", "<answer>2/3</answer>", 1.0),
        ("\\frac{2}{3}", "<answer>$\\frac{2}{3}$</answer>", 1.0),
        ("\\frac{2}{3}", "<answer>0.666667</answer>", 1.0),  # numeric, 6 decimals
        ("\\frac{2}{3}", "<answer>3/4</answer>", 0.0),
        ("\\frac{2}{3}", "The answer is 2/3.", 0.0),  # no tag: no answer
        ("\\frac{2}{3}", "<answer>3/4</answer> no, <answer>2/3</answer>", 1.0),  # last tag
        ("1000", "<answer>1,000</answer>", 1.0),  # GSM8K gold after '####'
        ("1000", "<answer>1001</answer>", 0.0),
        ("\\sqrt{51}", "<answer>\\sqrt{51}</answer>", 1.0),
        ("\\$18.90", "<answer>18.90</answer>", 1.0),  # an escaped dollar is not math mode
        # Bare, math-verify would read "2\sqrt{3}" as 2 and accept the answer 2.
        ("2\\sqrt{3}", "<answer>2</answer>", 0.0),
        ("2\\sqrt{3}", "<answer>2\\sqrt{3}</answer>", 1.0),
        ("\\sqrt{12}", "<answer>2\\sqrt{3}</answer>", 1.0),  # symbolic equality
    ],
)
def test_answer_tag(gold: str, response: str, expected: float) -> None:
    score = MathVerifyReward().score(math_task(gold), response)
    assert score == Score(reward=expected, correct=expected == 1.0)


def test_boxed_and_full_and_last_number() -> None:
    task = math_task("\\frac{2}{3}")
    response = "Thus $x = \\boxed{\\frac{2}{3}}$."
    assert MathVerifyReward(extract="boxed").score(task, response).correct
    assert MathVerifyReward(extract="full").score(task, response).correct
    assert not MathVerifyReward(extract="answer_tag").score(task, response).correct
    last = MathVerifyReward(extract="last_number")
    assert last.score(math_task("1000"), "4 boxes of 250 make 1,000 in all").reward == 1.0


def test_bad_gold_raises_and_bad_option_is_a_user_error() -> None:
    with pytest.raises(ValueError, match="cannot parse gold"):
        MathVerifyReward().score(math_task(""), "<answer>1</answer>")
    with pytest.raises(UserError, match="valid options"):
        MathVerifyReward(extract="xml")


def test_runs_off_the_main_thread() -> None:
    # math-verify's signal.alarm timeout raises off the main thread unless it is disabled.
    results: list[Score] = []
    thread = threading.Thread(
        target=lambda: results.append(
            MathVerifyReward().score(math_task("\\frac{2}{3}"), "<answer>2/3</answer>")
        )
    )
    thread.start()
    thread.join()
    assert results == [Score(reward=1.0, correct=True)]


@pytest.mark.skipif(not (DATA / "gsm8k").is_dir(), reason=f"needs {DATA / 'gsm8k'}")
def test_gsm8k_golds() -> None:
    rows = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").open()]
    golds = [row["answer"].split("####")[-1].strip() for row in rows]
    reward = MathVerifyReward()
    right = sum(reward.score(math_task(g), f"<answer>{g}</answer>").correct for g in golds)
    off_by_one = sum(
        reward.score(math_task(g), f"<answer>{int(g.replace(',', '')) + 1}</answer>").correct
        for g in golds
    )
    assert (len(golds), right, off_by_one) == (1319, 1319, 0)


@pytest.mark.skipif(not (DATA / "math500").is_dir(), reason=f"needs {DATA / 'math500'}")
def test_math500_golds_verify_against_themselves() -> None:
    rows = [json.loads(line) for line in (DATA / "math500" / "test.jsonl").open()]
    reward = MathVerifyReward()
    wrong = [
        row["answer"]
        for row in rows
        if not reward.score(math_task(row["answer"]), f"<answer>{row['answer']}</answer>").correct
    ]
    assert (len(rows), wrong) == (500, [])
