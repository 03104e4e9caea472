"""The reward-function Protocol, its result type and the lazy registry of built-in functions.

A reward function turns one completion of one task into a :class:`Score`. Implementations live
one per file and are imported only when a config names them, so a run that only checks math
answers never imports reasoning-gym.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Protocol

from treadle.core.errors import UserError
from treadle.core.types import Task


@dataclass(frozen=True)
class Score:
    """What one reward function says about one completion."""

    reward: float
    """Scalar reward (unitless); the pool weights and sums the rewards of all functions."""
    correct: bool
    """Whether the verifier judged the answer right (for accuracy metrics, not for training)."""


class RewardFunction(Protocol):
    """Scores one completion of one task.

    Contract (checked for every implementation by ``tests/rewards/test_contract.py``):

    - ``score`` is deterministic, pure CPU work and returns a :class:`Score` with a finite reward;
    - instances are picklable: :class:`~treadle.rewards.pool.RewardPool` sends them to worker
      processes, so they hold configuration only (no open files, locks or threads);
    - a malformed *response* should score as a wrong answer (low reward), not raise; an
      exception (bad task data, a bug, a third-party scorer that chokes on odd input) is
      counted by the pool and replaced with its fallback reward.

    A function may also define ``score_batch(samples, timeout_s=math.inf) -> list[Score]``
    (``[N]`` scores of ``[N]`` ``(task, response)`` pairs): the pool then calls that once per
    batch in its own process instead of ``score`` per sample in workers, passing as
    ``timeout_s`` the seconds left to the batch's deadline (``reward.step_timeout_s``), and the
    function bounds its own time to the smaller of that and its own limit (raising
    ``TimeoutError`` when it gives up). Batched functions need not be picklable.
    """

    name: str
    """Short name for logs and metrics, e.g. ``"math_verify"``."""

    def score(self, task: Task, response: str) -> Score:
        """Score ``response`` (the completion text, without the prompt) for ``task``."""
        ...


REWARD_FUNCTIONS: dict[str, str] = {
    "math_verify": "treadle.rewards.math_verify:MathVerifyReward",
    "reasoning_gym": "treadle.rewards.reasoning_gym:ReasoningGymReward",
    "format": "treadle.rewards.format:FormatReward",
    "code": "treadle.rewards.code:CodeReward",
    "remote": "treadle.rewards.remote:RemoteReward",
    "judge": "treadle.rewards.judge:JudgeReward",
    "reward_model": "treadle.rewards.reward_model:RewardModelReward",
}
"""Config name -> ``"module:Class"`` of each built-in reward function, imported on first use."""


def build_reward_function(name: str, **params: str) -> RewardFunction:
    """Import and construct the reward function registered as ``name``.

    Args:
        name: A key of :data:`REWARD_FUNCTIONS`.
        **params: Keyword arguments of the implementation's constructor (strings, as they come
            from the config file).

    Raises:
        UserError: ``name`` is not registered (the message lists the valid names), or ``params``
            do not fit the constructor (the message lists the accepted ones), or the
            constructor rejects a value.
    """
    if name not in REWARD_FUNCTIONS:
        valid = ", ".join(sorted(REWARD_FUNCTIONS))
        raise UserError(f"unknown reward function {name!r}; valid names: {valid}")
    module_name, class_name = REWARD_FUNCTIONS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    signature = inspect.signature(cls)
    try:
        signature.bind(**params)
    except TypeError as error:
        accepted = ", ".join(signature.parameters) or "none"
        raise UserError(
            f"reward function {name!r}: bad params {sorted(params)} ({error}); "
            f"accepted params: {accepted}"
        ) from None
    return cls(**params)
