"""The RewardFunction contract, checked for every built-in implementation, the fakes and a plain
function named by import path (``examples/custom_reward.py``)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import pytest

from treadle.core.types import Message, Task
from treadle.rewards.base import REWARD_FUNCTIONS, RewardFunction, Score, build_reward_function
from treadle.rewards.code import code_payload

from .fake_rewards import LengthReward, ScriptedReward

# "remote" and "judge" need a live endpoint, "reward_model" a model folder: their contracts run
# in test_service.py, test_judge.py and test_reward_model.py against one.
BUILDERS: dict[str, Callable[[], RewardFunction]] = {
    **{
        name: (lambda name=name: build_reward_function(name))
        for name in REWARD_FUNCTIONS
        if name not in ("remote", "judge", "reward_model")
    },
    "scripted": ScriptedReward,
    "length": LengthReward,
    # a user's plain function by import path, as FunctionReward wraps it
    "plain function": lambda: build_reward_function("examples.custom_reward:last_number"),
}  # UnpicklableReward breaks the contract on purpose (test_pool.py: the pool refuses it)
RESPONSES = ["<answer>-14282</answer>", "<answer>7</answer>", "no answer here", "", "<answer>"]


CODE_TASK = Task(
    "code/0",
    (Message("user", "Write f(x) = x + 1."),),
    "",
    "code",
    code_payload("", ["assert f(1) == 2", "assert f(-1) == 0"]),
)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_contract(name: str, chain_sum_task: Task) -> None:
    # chain_sum_task suits every answer checker: gold "-14282" for math, a real rg payload;
    # the code reward gets a code task (its payload holds tests).
    task = CODE_TASK if name == "code" else chain_sum_task
    reward = BUILDERS[name]()
    assert isinstance(reward.name, str) and reward.name
    clone = pickle.loads(pickle.dumps(reward))  # the pool sends instances to workers
    for response in [*RESPONSES, "def f(x):\n    return x + 1"]:
        score = reward.score(task, response)
        assert isinstance(score, Score)
        assert isinstance(score.reward, float) and math.isfinite(score.reward)
        assert isinstance(score.correct, bool)
        assert clone.score(task, response) == score  # deterministic, survives pickling


@pytest.mark.parametrize("name", ["math_verify", "reasoning_gym"])
def test_answer_checkers_agree_on_right_and_wrong(name: str, chain_sum_task: Task) -> None:
    reward = BUILDERS[name]()
    assert reward.score(chain_sum_task, "<answer>-14282</answer>") == Score(1.0, True)
    assert reward.score(chain_sum_task, "<answer>7</answer>") == Score(0.0, False)
    assert reward.score(chain_sum_task, "no answer here") == Score(0.0, False)
