"""The lazy registry of reward functions."""

from __future__ import annotations

import importlib

import pytest

from treadle.core.errors import UserError
from treadle.rewards.base import REWARD_FUNCTIONS, build_reward_function
from treadle.rewards.extract import Extraction
from treadle.rewards.math_verify import MathVerifyReward


def test_builds_by_name_with_params() -> None:
    reward = build_reward_function("math_verify", extract="boxed")
    assert isinstance(reward, MathVerifyReward)
    assert reward.extraction is Extraction.BOXED


def test_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(UserError) as info:
        build_reward_function("math_verifier")
    assert str(info.value) == (
        "config reward.functions[0].name='math_verifier': unknown reward function; valid names: "
        "code, format, judge, math_verify, reasoning_gym, remote, reward_model, or an import "
        "path package.module:Name of your own"
    )


def test_unknown_param_lists_the_accepted_ones() -> None:
    with pytest.raises(UserError, match="accepted params: extract"):
        build_reward_function("reasoning_gym", extrct="boxed")


def test_registry_entries_resolve() -> None:
    # Every "module:Class" entry must import and build with default params; the reward model
    # has no default folder, so its class is only imported (test_reward_model.py builds it).
    for name, target in REWARD_FUNCTIONS.items():
        if name == "reward_model":
            module, cls = target.split(":")
            assert getattr(importlib.import_module(module), cls).name == name
        else:
            assert build_reward_function(name).name == name


def test_built_in_params_are_typed_and_old_string_params_still_read() -> None:
    from treadle.rewards.code import CodeReward
    from treadle.rewards.judge import JudgeReward

    typed = build_reward_function("code", timeout_s=2.5, memory_mb=256)
    as_strings = build_reward_function("code", timeout_s="2.5", memory_mb="256")  # old recipes
    assert isinstance(typed, CodeReward) and isinstance(as_strings, CodeReward)
    # cpu_s = max(1, int(2.5)) = 2
    assert typed.limits == as_strings.limits
    assert (typed.limits.wall_s, typed.limits.cpu_s, typed.limits.memory_mb) == (2.5, 2, 256)
    judge = build_reward_function("judge", max_score=5, retries=0)
    assert isinstance(judge, JudgeReward)
    assert (judge.max_score, judge.retries) == (
        5.0,
        0,
    ) and "from 0 (wrong) to 5 (fully" in judge.rubric
    with pytest.raises(UserError, match=r"code reward: memory_mb must be an integer, got 2\.5"):
        build_reward_function("code", memory_mb=2.5)
    with pytest.raises(UserError, match=r"remote reward: timeout_s must be a number, got True"):
        build_reward_function("remote", timeout_s=True)


def test_a_plain_functions_return_value_becomes_a_score() -> None:
    import math

    import numpy as np

    from treadle.core.types import Message, Task
    from treadle.rewards.base import FunctionReward, Score

    task = Task("t", (Message("user", "q"),), "7", "math")
    assert FunctionReward(lambda t, c: 0.5, "half").score(task, "") == Score(0.5, False)
    # numpy scalars are numbers too; 1.0 and above is correct
    assert FunctionReward(lambda t, c: np.float32(1.0), "np").score(task, "") == Score(1.0, True)
    assert FunctionReward(lambda t, c: Score(0.2, True), "s").score(task, "") == Score(0.2, True)
    for bad in ("yes", True, math.nan, None):
        with pytest.raises(TypeError, match="reward function bad returned"):
            FunctionReward(lambda t, c, bad=bad: bad, "bad").score(task, "")
