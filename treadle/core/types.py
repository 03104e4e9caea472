"""Typed data that crosses treadle's stage boundaries.

Shapes are written per field: ``[L]`` is a flat sequence of ``L`` tokens. Token ids flow from the
engine to the trainer unchanged; a completion is never decoded and re-encoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why the engine stopped generating a completion."""

    STOP = "stop"
    """An end-of-turn/eos token or a stop string ended the completion; it is complete."""
    LENGTH = "length"
    """The token budget (``max_tokens``) ran out; the completion is truncated."""
    ABORT = "abort"
    """The request was cancelled (engine fault, shutdown); the completion is partial."""


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str
    """``"system"``, ``"user"``, ``"assistant"`` or ``"tool"``."""
    content: str


@dataclass(frozen=True)
class Task:
    """One prompt to roll out, with what its verifier needs."""

    task_id: str
    """Stable id of the prompt (dataset name and index); rollouts of one task form a group."""
    messages: tuple[Message, ...]
    """The conversation so far; the chat template renders it into prompt tokens."""
    answer: str
    """Gold answer (the verifier's reference); ``""`` when the task has none."""
    domain: str
    """Data domain that routes the task to its reward functions, e.g. ``"math"``."""
    payload: str = ""
    """Opaque JSON string a domain's verifier may need (e.g. reasoning-gym's entry)."""
    reasoning: str = ""
    """Worked steps of a gold solution, written before the answer in SFT demonstrations;
    ``""`` when the data has none."""


@dataclass(frozen=True)
class CodeTests:
    """What a code task's verifier runs: the ``Task.payload`` of a code task, as JSON::

        {"prefix": "...", "tests": ["assert f(1) == 2", ...]}

    ``prefix`` goes before the model's code (e.g. MBPP's test imports); each test is one
    program fragment, passed when it raises nothing.
    """

    prefix: str
    tests: tuple[str, ...]

    def to_payload(self) -> str:
        """The JSON string stored in ``Task.payload``."""
        return json.dumps({"prefix": self.prefix, "tests": list(self.tests)})

    @classmethod
    def from_payload(cls, payload: str) -> CodeTests:
        """Parse ``Task.payload``.

        Raises:
            ValueError: the payload is not a code payload (not JSON, or a field is missing or
                of the wrong type).
        """
        try:
            data = json.loads(payload)
            prefix, tests = data["prefix"], data["tests"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a code payload ({e})") from e
        if not isinstance(prefix, str) or not isinstance(tests, list):
            raise ValueError("not a code payload (prefix must be a string, tests a list)")
        return cls(prefix, tuple(tests))


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one sample of one prompt."""

    token_ids: tuple[int, ...]
    """Sampled tokens, ``[R]``, including a final eos/end-of-turn token when one was sampled."""
    logprobs: tuple[float, ...]
    """Log-probability (nats) of each sampled token under the sampling policy, ``[R]``."""
    finish_reason: FinishReason
    policy_version: int
    """Version of the weights that produced the completion (RL steps, i.e. weight syncs, since
    the start; 0 = the starting weights); for a partial rollout continued across weight
    updates, the oldest version among its tokens (the one its staleness counts from)."""
    text: str = ""
    """Detokenized text of ``token_ids`` for verifiers and logs (never re-encoded)."""
    token_versions: tuple[int, ...] = ()
    """Policy version that sampled each token, ``[R]``; empty when one version sampled them
    all (``policy_version``). See :meth:`versions`."""

    sampled_mask: tuple[bool, ...] = ()
    """``[R]`` True on the tokens the policy sampled, False on those it did not (an episode's
    environment messages and template glue, see :mod:`treadle.rollout.environments`); empty when
    the policy sampled them all. Only sampled tokens are trained."""

    def versions(self) -> tuple[int, ...]:
        """Policy version that sampled each token, ``[R]``."""
        return self.token_versions or (self.policy_version,) * len(self.token_ids)

    def continued(self, more: Completion, text: str) -> Completion:
        """This (aborted) completion followed by ``more``, which the engine sampled from the
        prompt plus these tokens (a partial rollout resumed, possibly by newer weights): tokens,
        logprobs and per-token versions concatenated, ``more``'s finish reason, and ``text``
        (the joined ids decoded again: a character may straddle the cut).

        Raises:
            ValueError: this completion was not aborted (only a partial one can be continued).
        """
        if self.finish_reason != FinishReason.ABORT:
            raise ValueError(f"only an aborted completion continues, not a {self.finish_reason}")
        versions = self.versions() + more.versions()
        return Completion(
            token_ids=self.token_ids + more.token_ids,
            logprobs=self.logprobs + more.logprobs,
            finish_reason=more.finish_reason,
            policy_version=min(versions, default=more.policy_version),
            text=text,
            token_versions=versions if len(set(versions)) > 1 else (),
        )


@dataclass(frozen=True)
class Rollout:
    """One scored completion."""

    completion: Completion
    reward: float
    """Scalar reward of the completion (sum of the weighted reward functions)."""
    correct: bool
    """Whether the verifier judged the answer right (for accuracy metrics, not for training)."""
    grader_failed: bool = False
    """A reward function raised or timed out on it (that function scored the fallback)."""


@dataclass(frozen=True)
class RolloutGroup:
    """All samples of one prompt: the unit that group-relative advantages are computed over."""

    task: Task
    prompt_token_ids: tuple[int, ...]
    """Rendered prompt, ``[P]``."""
    rollouts: tuple[Rollout, ...]
    """``n`` scored samples of the prompt."""


@dataclass
class TrainSample:
    """One flat token sequence (prompt + completion) with aligned per-token arrays.

    Index ``t`` of every per-token list refers to ``token_ids[t]``: the loss at ``t`` uses the
    model's prediction of ``token_ids[t]`` from ``token_ids[:t]``. Multi-turn samples need nothing
    special: environment tokens simply have ``loss_mask`` False.
    """

    token_ids: list[int]
    """``[L]`` prompt and completion tokens."""
    loss_mask: list[bool]
    """``[L]`` True on model-sampled tokens (these are trained)."""
    behavior_logprobs: list[float]
    """``[L]`` logprob (nats) of each token under the engine that sampled it; 0.0 where masked."""
    advantages: list[float]
    """``[L]`` advantage of each token; 0.0 where masked."""
    policy_version: int
    """Policy version that sampled the completion (its staleness is the step minus this)."""
    group_id: str
    """Id of the prompt group the sample belongs to (``Task.task_id``)."""
    ref_logprobs: list[float] = field(default_factory=list)
    """``[L]`` logprobs under the frozen reference model, or empty when there is no KL term."""
    old_logprobs: list[float] = field(default_factory=list)
    """``[L]`` logprobs the trainer recomputed before the update (the PPO ratio's denominator
    when importance-sampling correction is on), or empty: the ratio then uses the engine's."""
    values: list[float] = field(default_factory=list)
    """``[L]`` critic value of the state before each token (PPO with a critic), or empty."""
    returns: list[float] = field(default_factory=list)
    """``[L]`` value targets (GAE advantage + value), or empty without a critic."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class DataPosition:
    """Where the task sampler is: ``epoch`` passes done and ``offset`` tasks into the current
    one (part of a checkpoint's run state)."""

    epoch: int = 0
    offset: int = 0
