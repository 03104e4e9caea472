"""The three steps from tasks to trainable samples: generate, score, build samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from treadle.algorithms.advantages import group_index, grpo_advantages
from treadle.config import AlgorithmConfig
from treadle.data import render_prompt
from treadle.engines import InferenceEngine, SamplingParams
from treadle.rewards.pool import RewardPool
from treadle.types import Completion, FinishReason, Rollout, RolloutGroup, Task, TrainSample


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
) -> list[Generated]:
    """Render each task's prompt and sample ``params.n`` completions of it."""
    prompts = [tuple(render_prompt(tokenizer, t)) for t in tasks]
    outputs = engine.generate(prompts, params)
    return [Generated(t, p, tuple(c)) for t, p, c in zip(tasks, prompts, outputs, strict=True)]


@dataclass(frozen=True)
class Scored:
    groups: list[RolloutGroup]
    failures: int
    """Reward-function calls that raised (scored with the fallback)."""
    timeouts: int
    """Reward-function calls that ran past their timeout (scored with the fallback)."""


def score(pool: RewardPool, generated: Sequence[Generated]) -> Scored:
    """Score every completion with the reward pool (in parallel, each call under a timeout)."""
    items = [(g.task, c.text) for g in generated for c in g.completions]
    batch = pool.score(items)
    scores = iter(batch.scores)
    groups = []
    for g in generated:
        rollouts = []
        for c in g.completions:
            s = next(scores)
            rollouts.append(Rollout(c, s.reward, s.correct))
        groups.append(RolloutGroup(g.task, g.prompt_token_ids, tuple(rollouts)))
    return Scored(groups, batch.failures, batch.timeouts)


def build_samples(
    groups: Sequence[RolloutGroup], cfg: AlgorithmConfig
) -> tuple[list[TrainSample], dict[str, float]]:
    """Group-relative advantages, then one flat sample per rollout: prompt + completion tokens.

    The completion's tokens are trained as sampled, including a final end-of-turn token (a
    completion that ended with it has finish reason ``stop`` and is complete, not truncated).
    """
    flat = [(g, r) for g in groups for r in g.rollouts]
    rewards = torch.tensor([r.reward for _, r in flat], dtype=torch.float32)
    index = group_index([g.task.task_id for g, _ in flat])
    advantages, metrics = grpo_advantages(rewards, index, std_normalize=cfg.std_normalize)
    samples = []
    for (g, r), adv in zip(flat, advantages.tolist(), strict=True):
        c = r.completion
        p, n = len(g.prompt_token_ids), len(c.token_ids)
        samples.append(
            TrainSample(
                token_ids=[*g.prompt_token_ids, *c.token_ids],
                loss_mask=[False] * p + [True] * n,
                behavior_logprobs=[0.0] * p + list(c.logprobs),
                advantages=[0.0] * p + [adv] * n,
                policy_version=c.policy_version,
                group_id=g.task.task_id,
            )
        )
    completions = [r.completion for _, r in flat]
    metrics["rollout/truncated_fraction"] = sum(
        c.finish_reason == FinishReason.LENGTH for c in completions
    ) / max(len(completions), 1)
    metrics["rollout/mean_length"] = sum(len(c.token_ids) for c in completions) / max(
        len(completions), 1
    )
    return samples, metrics
