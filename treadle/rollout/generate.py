"""Generation and scoring: render each task's prompt, sample completions with an engine, score
them with the reward pool into groups, and check which policy produced them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from treadle.core.errors import StaleWeightsError
from treadle.core.protocols import InferenceEngine, SamplingParams
from treadle.core.types import Completion, Rollout, RolloutGroup, Task
from treadle.rewards.pool import RewardPool
from treadle.store.data import render_prompt


@dataclass(frozen=True)
class Generated:
    """Unscored completions of one prompt."""

    task: Task
    prompt_token_ids: tuple[int, ...]  # [P]
    completions: tuple[Completion, ...]


def generate(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    params: SamplingParams,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Generated]:
    """Render each task's prompt (``template_kwargs``: extra chat-template variables,
    ``data.chat_template_kwargs``) and sample ``params.n`` completions of it."""
    prompts = [tuple(render_prompt(tokenizer, t, template_kwargs)) for t in tasks]
    outputs = engine.generate(prompts, params)
    return [Generated(t, p, tuple(c)) for t, p, c in zip(tasks, prompts, outputs, strict=True)]


@dataclass(frozen=True)
class Scored:
    """The scored rollouts of some generated prompts, with the reward pool's failure counts."""

    groups: list[RolloutGroup]
    failures: int
    """Reward-function calls that raised (scored with the fallback)."""
    timeouts: int
    """Reward-function calls that ran past their timeout (scored with the fallback)."""
    cached: int = 0
    """Completions scored by reusing an identical (task, completion) pair's score."""
    deadline_misses: int = 0
    """Reward-function calls cut by ``reward.step_timeout_s`` (scored with the fallback)."""


def score(pool: RewardPool, generated: Sequence[Generated]) -> Scored:
    """Score every completion with the reward pool (in parallel, each call under a timeout,
    the whole call under ``reward.step_timeout_s``)."""
    items = [(g.task, c.text) for g in generated for c in g.completions]
    batch = pool.score(items)
    scores = iter(batch.scores)
    failed = iter(batch.failed)
    groups = []
    for g in generated:
        rollouts = []
        for c in g.completions:
            s = next(scores)
            rollouts.append(Rollout(c, s.reward, s.correct, next(failed)))
        groups.append(RolloutGroup(g.task, g.prompt_token_ids, tuple(rollouts)))
    return Scored(groups, batch.failures, batch.timeouts, batch.cached, batch.deadline_misses)


def check_policy_version(generated: Sequence[Generated], version: int) -> None:
    """Every completion must come from policy ``version`` (the trainer's weights now).

    Raises:
        StaleWeightsError: one came from another version: a weight sync was skipped or failed,
            and training on it would silently mix policies.
    """
    for g in generated:
        for c in g.completions:
            if c.sampled_mask and not any(c.sampled_mask):
                continue  # an episode cut off before its first turn: no policy sampled in it
            if c.policy_version != version:
                raise StaleWeightsError(
                    f"task {g.task.task_id}: the engine sampled with policy version "
                    f"{c.policy_version} but the trainer is at version {version}; a weight sync "
                    "was skipped or failed"
                )
