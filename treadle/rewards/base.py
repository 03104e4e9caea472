"""The reward-function Protocol, its result type and the lazy registry of built-in functions.

A reward function turns one completion of one task into a :class:`Score`. Implementations live
one per file and are imported only when a config names them, so a run that only checks math
answers never imports reasoning-gym. A recipe may also name a user's own function by import
path (``reward.functions: [{name: mypkg.rewards:ContainsGold}]``): a class implementing
:class:`RewardFunction`, built with ``params``, or a plain function ``(task, completion) ->
float | Score``, wrapped in :class:`FunctionReward`. The wrapper pickles the function by
reference (its module and name), so the reward pool's spawned workers import the user's module
themselves (they inherit this process's ``sys.path``, which
:func:`~treadle.core.plugins.import_path` extends with the current directory): it must be a
module-level function, not a lambda or a function defined inside another.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from treadle.config import ParamValue, RewardSpec
from treadle.core.errors import UserError
from treadle.core.plugins import import_path, is_import_path, require_methods
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


REWARD_KIND = "a reward function (treadle.rewards.base.RewardFunction)"
REWARD_METHODS = {"score": "score(task, response)"}
"""What a plug-in reward class must have (``name`` too: a str for logs and metrics)."""


def build_reward_function(name: str, **params: ParamValue) -> RewardFunction:
    """Import and construct the reward function ``name`` (built-in or import path).

    Args:
        name: A key of :data:`REWARD_FUNCTIONS`, or ``package.module:Name``.
        **params: Keyword arguments of the implementation's constructor: numbers, bools,
            strings or lists, as they come from the config file.

    Raises:
        UserError: see :func:`reward_function` (the message names ``reward.functions``).
    """
    return reward_function(RewardSpec(name, params=dict(params)), "reward.functions[0]")


def reward_function(spec: RewardSpec, key: str) -> RewardFunction:
    """The function one ``reward.functions[i]`` entry names, built with its ``params``.

    Args:
        spec: The entry.
        key: Its dotted config key, e.g. ``reward.functions[0]``, for errors.

    Raises:
        UserError: one line naming ``key``: an unknown built-in (listing the valid names); a
            bad import path (no module, no attribute, an error at import); a plug-in class
            without ``score`` or ``name``; a plain function that does not take ``(task,
            completion)`` or is given params; ``params`` that do not fit the constructor (listing
            the accepted ones), or a value the constructor rejects.
    """
    if is_import_path(spec.name):
        return _plugin(spec, key)
    if spec.name not in REWARD_FUNCTIONS:
        valid = ", ".join(sorted(REWARD_FUNCTIONS))
        raise UserError(
            f"config {key}.name={spec.name!r}: unknown reward function; valid names: {valid}, "
            "or an import path package.module:Name of your own"
        )
    module_name, class_name = REWARD_FUNCTIONS[spec.name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    _check_params(cls, spec.params, f"{key} ({spec.name!r})")
    return cls(**spec.params)


def _plugin(spec: RewardSpec, key: str) -> RewardFunction:
    """A user's reward class built with ``params``, or their plain function wrapped."""
    what = f"{key}.name={spec.name!r}"
    found = import_path(spec.name, what)
    if not inspect.isclass(found):
        if spec.params:
            raise UserError(
                f"config {key}.params: {spec.name!r} is a plain function, called as "
                "fn(task, completion) with no params; make it a class whose constructor takes "
                "them, or remove params"
            )
        check_reward_callable(found, what)
        return FunctionReward(found, spec.name)
    require_methods(found, REWARD_METHODS, what, REWARD_KIND)
    _check_params(found, spec.params, f"{key} ({spec.name!r})")
    try:
        instance = found(**spec.params)
    except UserError:
        raise
    except Exception as error:  # the user's constructor fails on its params: one line too
        raise UserError(
            f"config {what}: building {found.__name__}({', '.join(spec.params)}) failed: "
            f"{type(error).__name__}: {error}"
        ) from None
    if not isinstance(getattr(instance, "name", None), str):
        raise UserError(
            f"config {what}: class {found.__name__} has no attribute name (a str for logs and "
            f"metrics, e.g. name = {found.__name__.lower()!r}); {REWARD_KIND} needs it"
        )
    return instance


def _check_params(cls: type, params: Mapping[str, Any], what: str) -> None:
    """A one-line error when ``params`` do not fit ``cls``'s constructor."""
    signature = inspect.signature(cls)
    try:
        signature.bind(**params)
    except TypeError as error:
        accepted = ", ".join(signature.parameters) or "none"
        raise UserError(
            f"config {what}: bad params {sorted(params)} ({error}); accepted params: {accepted}"
        ) from None


@dataclass(frozen=True)
class FunctionReward:
    """Scores with a plain function: a float return is the reward, and the answer counts as
    correct when it is at least 1.0 (as reasoning-gym's scores); a :class:`Score` return is
    used as it is.

    Raises:
        TypeError: from :meth:`score`, the function returned something else, or a reward that
            is not finite (the pool counts it as a failure and gives the fallback).
    """

    fn: Callable[[Task, str], float | Score]
    """The user's function, called as ``fn(task, completion)``."""
    name: str
    """Its import path, for logs and metrics."""

    def score(self, task: Task, response: str) -> Score:
        """``fn(task, response)`` as a :class:`Score`."""
        value = self.fn(task, response)
        if isinstance(value, Score):
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's too
            raise TypeError(
                f"reward function {self.name} returned {type(value).__name__} {value!r}; "
                "return a float or a treadle.rewards.Score"
            )
        if not math.isfinite(value):
            raise TypeError(f"reward function {self.name} returned {value}, not a finite number")
        return Score(reward=float(value), correct=value >= 1.0)


def check_reward_callable(fn: Callable[..., object], what: str) -> None:
    """That a plain function can be called as ``fn(task, completion)`` and pickled by name.

    Raises:
        UserError: one line naming ``what``: its signature takes other arguments, or it is a
            lambda or nested function the reward workers could not import.
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise UserError(
            f"config {what}: function {name}{inspect.signature(fn)} cannot be called as "
            f"{name}(task, completion); {REWARD_KIND} as a plain function takes (task, "
            "completion) and returns a float or a Score"
        ) from None
    except ValueError:  # a builtin without a signature: found when it is called
        pass
    if "<" in getattr(fn, "__qualname__", ""):
        raise UserError(
            f"config {what}: {name} is a lambda or a nested function, which the reward workers "
            "cannot import; define it at the top level of its module"
        )
