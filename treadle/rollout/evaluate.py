"""Held-out accuracy: pass@1 at the sampling temperature, pass@k, and greedy accuracy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from treadle.core.protocols import InferenceEngine, RequestEngine, SamplingParams
from treadle.core.types import RolloutGroup, Task
from treadle.rewards.pool import RewardPool
from treadle.rollout.environments.rollout import AgentRollout, EpisodeRollout, score_episodes
from treadle.rollout.generate import generate, score


@dataclass(frozen=True)
class EvalResult:
    """Accuracies are fractions in [0, 1] over held-out prompts."""

    pass_at_1: float
    """Mean over prompts of the share of ``k`` samples (training temperature) judged right."""
    pass_at_k: float
    """Share of prompts with at least one of ``k`` samples right."""
    k: int
    greedy_accuracy: float | None
    """Share of prompts whose greedy completion is right (None when not measured)."""
    mean_reward: float
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)
    """With an environment: the sampled episodes' ``env/*`` statistics (tool calls, turns, ...
    per episode); empty otherwise."""

    def metrics(self) -> dict[str, float]:
        """The result as ``eval/...`` metrics (``eval/greedy_accuracy`` only when measured)."""
        out = {
            "eval/pass@1": self.pass_at_1,
            "eval/pass@k": self.pass_at_k,
            "eval/reward": self.mean_reward,
            **{f"eval/{k}": v for k, v in self.episodes.items()},
        }
        if self.greedy_accuracy is not None:
            out["eval/greedy_accuracy"] = self.greedy_accuracy
        return out


def evaluate(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    pool: RewardPool,
    tasks: Sequence[Task],
    params: SamplingParams,
    *,
    greedy: bool = True,
    episodes: EpisodeRollout | AgentRollout | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> EvalResult:
    """Sample ``params.n`` completions per held-out task (and a greedy one) and score them;
    with ``episodes``, each sample is an episode in the environment (``engine`` then serves
    single requests) and its final answer is scored. ``template_kwargs`` are extra variables of
    the chat template (``data.chat_template_kwargs``).

    Raises:
        ValueError: ``tasks`` is empty.
    """
    if not tasks:
        raise ValueError("evaluate: no held-out tasks")
    stats: dict[str, float] = {}

    def scored(p: SamplingParams) -> list[RolloutGroup]:
        """The held-out tasks sampled with ``p`` and scored (episodes' statistics kept)."""
        if episodes is None:
            return score(pool, generate(engine, tokenizer, tasks, p, template_kwargs)).groups
        ran = episodes.run(cast(RequestEngine, engine), tasks, p)
        stats.update(ran.stats())
        return score_episodes(pool, ran).groups

    sampled = scored(params)
    episode_stats = dict(stats)  # the sampled ones', not the greedy pass's
    per_prompt = [sum(r.correct for r in g.rollouts) / len(g.rollouts) for g in sampled]
    rewards = [r.reward for g in sampled for r in g.rollouts]
    greedy_acc = None
    if greedy:
        argmax = dataclasses.replace(params, n=1, temperature=0.0)
        greedy_groups = scored(argmax)
        greedy_acc = sum(g.rollouts[0].correct for g in greedy_groups) / len(greedy_groups)
    return EvalResult(
        pass_at_1=sum(per_prompt) / len(per_prompt),
        pass_at_k=sum(p > 0 for p in per_prompt) / len(per_prompt),
        k=params.n,
        greedy_accuracy=greedy_acc,
        mean_reward=sum(rewards) / len(rewards),
        episodes=episode_stats,
    )
