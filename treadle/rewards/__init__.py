"""Reward functions and the pool that runs them.

Implementations are not imported here: :func:`build_reward_function` imports the one a config
names, so a run pays only for the verifiers it uses.
"""

from treadle.config import RewardConfig, RewardSpec
from treadle.rewards.base import REWARD_FUNCTIONS, RewardFunction, Score, build_reward_function
from treadle.rewards.pool import BatchScores, RewardPool

__all__ = [
    "REWARD_FUNCTIONS",
    "BatchScores",
    "RewardConfig",
    "RewardFunction",
    "RewardPool",
    "RewardSpec",
    "Score",
    "build_reward_function",
]
