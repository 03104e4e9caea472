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
        "unknown reward function 'math_verifier'; valid names: "
        "code, format, judge, math_verify, reasoning_gym, remote, reward_model"
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
