"""ReasoningGymReward with real reasoning-gym entries and scorers."""

from __future__ import annotations

import dataclasses

import pytest

from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.reasoning_gym import ReasoningGymReward


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("1663 - 5242 = -3579, ... <answer>-14282</answer>", Score(1.0, True)),
        ("<answer>-14,282</answer>", Score(1.0, True)),  # chain_sum strips commas
        ("<answer>14282</answer>", Score(0.0, False)),
        ("the sum is -14282", Score(0.0, False)),  # no tag: the scorer is not asked
    ],
)
def test_chain_sum(chain_sum_task: Task, response: str, expected: Score) -> None:
    assert ReasoningGymReward().score(chain_sum_task, response) == expected


def test_partial_credit_is_not_correct(prime_task: Task) -> None:
    reward = ReasoningGymReward()
    assert reward.score(prime_task, "<answer>433 × 2</answer>") == Score(1.0, True)  # sorted
    # 866 alone has the right product but is not a factorization: 0.5 partial credit.
    assert reward.score(prime_task, "<answer>866</answer>") == Score(0.5, False)
    assert reward.score(prime_task, "<answer>2 × 3</answer>") == Score(0.01, False)


def test_scorer_exception_surfaces(prime_task: Task) -> None:
    with pytest.raises(ValueError, match="invalid literal for int"):
        ReasoningGymReward().score(prime_task, "<answer>abc</answer>")


def test_boxed_extraction(chain_sum_task: Task) -> None:
    reward = ReasoningGymReward(extract="boxed")
    assert reward.score(chain_sum_task, "so \\boxed{-14282}") == Score(1.0, True)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("", "payload must be JSON"),
        ('{"entry": {}}', "payload must be JSON"),
        ('{"dataset": "chain_sum", "entry": []}', "must be a str, 'entry' a dict"),
        ('{"dataset": "no_such_set", "entry": {"answer": "1"}}', "not registered"),
    ],
)
def test_bad_payload_raises(chain_sum_task: Task, payload: str, message: str) -> None:
    task = dataclasses.replace(chain_sum_task, payload=payload)
    with pytest.raises(ValueError, match=message):
        ReasoningGymReward().score(task, "<answer>1</answer>")
