"""Held-out accuracy: pass@k for several k (the unbiased estimator of Chen et al. 2021), pass@1
at the evaluation temperature, and greedy accuracy, with every sample kept for the record."""

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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k for one prompt with ``c`` of ``n`` samples correct:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, arXiv:2107.03374, eq. 1), computed as
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` so no binomial coefficient overflows.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


@dataclass(frozen=True)
class EvalSample:
    """One scored evaluation completion, as written to ``samples.jsonl`` by ``treadle eval``."""

    task_id: str
    prompt: str
    """The last message of the task's prompt (the question as the model saw it)."""
    completion: str
    gold: str
    """The task's gold answer (``Task.answer``)."""
    reward: float
    correct: bool
    sample_index: int
    """0 .. samples_per_prompt - 1 among a prompt's sampled completions (0 for the greedy one)."""
    greedy: bool
    """Decoded greedily (temperature 0), not sampled."""
    finish_reason: str
    """``stop`` (end of turn or a stop string), ``length`` (max_tokens reached), ``abort``."""


@dataclass(frozen=True)
class EvalResult:
    """Accuracies are fractions in [0, 1], means over the evaluated prompts."""

    pass_at_1: float
    """Mean over prompts of the share of the ``k`` samples judged right (= the unbiased pass@1)."""
    pass_at_k: float
    """Share of prompts with at least one of the ``k`` samples right (pass@k at k = n)."""
    k: int
    """Samples per prompt (``eval.samples_per_prompt``)."""
    greedy_accuracy: float | None
    """Share of prompts whose greedy completion is right (None when not measured)."""
    mean_reward: float
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)
    """With an environment: the sampled episodes' ``env/*`` statistics (tool calls, turns, ...
    per episode); empty otherwise."""
    pass_at: dict[int, float] = dataclasses.field(default_factory=dict)
    """Unbiased pass@k (:func:`pass_at_k`) averaged over prompts, for each k asked for."""
    samples: tuple[EvalSample, ...] = ()
    """Every scored completion: the sampled ones prompt by prompt, then the greedy ones."""
    prompts: int = 0
    """Prompts evaluated."""

    def metrics(self) -> dict[str, float]:
        """The result as ``eval/...`` metrics: ``eval/pass@1``, ``eval/pass@k`` (k = samples per
        prompt), ``eval/pass@<k>`` for each k of ``pass_at``, ``eval/reward``, and
        ``eval/greedy_accuracy`` when measured."""
        out = {
            "eval/pass@1": self.pass_at_1,
            "eval/pass@k": self.pass_at_k,
            **{f"eval/pass@{k}": v for k, v in sorted(self.pass_at.items())},
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
    ks: Sequence[int] = (),
) -> EvalResult:
    """Sample ``params.n`` completions per held-out task (and a greedy one) and score them;
    with ``episodes``, each sample is an episode (``engine`` serves single requests) and its
    final answer is scored. ``template_kwargs``: chat-template variables. ``ks``: the k of the
    unbiased pass@k (each at most ``params.n``; pass@1 and pass@n always). A ``params.seed``
    repeats the samples (same seed, weights, tasks: training's and ``treadle eval``'s).

    Raises:
        ValueError: ``tasks`` is empty, or a k is not in 1 .. ``params.n``.
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
    correct = [sum(r.correct for r in g.rollouts) for g in sampled]
    sizes = [len(g.rollouts) for g in sampled]
    rewards = [r.reward for g in sampled for r in g.rollouts]
    records = eval_samples(sampled, greedy=False)
    greedy_acc = None
    if greedy:
        argmax = dataclasses.replace(params, n=1, temperature=0.0, seed=None)
        greedy_groups = scored(argmax)
        greedy_acc = sum(g.rollouts[0].correct for g in greedy_groups) / len(greedy_groups)
        records += eval_samples(greedy_groups, greedy=True)
    estimates = {
        k: sum(pass_at_k(n, c, k) for n, c in zip(sizes, correct, strict=True)) / len(sampled)
        for k in sorted({1, *ks})
    }
    return EvalResult(
        pass_at_1=sum(c / n for n, c in zip(sizes, correct, strict=True)) / len(sampled),
        pass_at_k=sum(c > 0 for c in correct) / len(sampled),
        k=params.n,
        greedy_accuracy=greedy_acc,
        mean_reward=sum(rewards) / len(rewards),
        episodes=episode_stats,
        pass_at=estimates,
        samples=tuple(records),
        prompts=len(sampled),
    )


def eval_samples(groups: Sequence[RolloutGroup], *, greedy: bool) -> list[EvalSample]:
    """Each scored rollout of ``groups`` as an :class:`EvalSample`, group by group."""
    return [
        EvalSample(
            task_id=g.task.task_id,
            prompt=g.task.messages[-1].content,
            completion=r.completion.text,
            gold=g.task.answer,
            reward=r.reward,
            correct=r.correct,
            sample_index=i,
            greedy=greedy,
            finish_reason=str(r.completion.finish_reason),
        )
        for g in groups
        for i, r in enumerate(g.rollouts)
    ]
