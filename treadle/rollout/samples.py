"""From scored groups to trainable samples: DAPO's group filter, outcome rewards, one flat
sample per rollout, and the advantages written onto them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treadle.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInput,
    AdvantageParams,
    group_index,
)
from treadle.algorithms.correction import mismatch_metrics, rejected_tokens
from treadle.algorithms.losses import KL_ESTIMATORS, sequence_entropy_proxy
from treadle.algorithms.shaping import soft_overlong_penalty, varied_groups
from treadle.config import AlgorithmConfig
from treadle.core.types import FinishReason, RolloutGroup, TrainSample


def filter_groups(groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], dict[str, float]]:
    """DAPO dynamic sampling's filter: drop groups whose rewards are all equal (no signal)."""
    if not groups:
        return [], {"filter/dropped_groups": 0.0}
    flat = [(i, r.reward) for i, g in enumerate(groups) for r in g.rollouts]
    keep, metrics = varied_groups(
        torch.tensor([r for _, r in flat]), torch.tensor([i for i, _ in flat])
    )
    return [g for g, k in zip(groups, keep.tolist(), strict=True) if k], metrics


def outcome_rewards(groups: Sequence[RolloutGroup], cfg: AlgorithmConfig, max_tokens: int):
    """``[B]`` reward of each rollout (flattened by group), with DAPO's soft overlong
    punishment added when ``cfg.overlong_cache`` > 0. Returns the rewards and metrics."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    metrics: dict[str, float] = {}
    if cfg.overlong_cache > 0:
        lengths = torch.tensor([len(r.completion.token_ids) for r in rollouts])
        penalty = soft_overlong_penalty(lengths, max_tokens, cfg.overlong_cache)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = float(penalty.mean()) if len(rollouts) else 0.0
    return rewards, metrics


def build_samples(
    groups: Sequence[RolloutGroup], cfg: AlgorithmConfig
) -> tuple[list[TrainSample], dict[str, float]]:
    """One flat sample per rollout: prompt + completion tokens, advantages still zero.

    The completion's tokens are trained as sampled, including a final end-of-turn token (a
    completion that ended with it has finish reason ``stop`` and is complete, not truncated).
    With ``cfg.overlong_filter`` a truncated completion (finish reason ``length``) is not
    trained at all: its loss mask is all False, so it adds nothing to the loss or to any
    aggregation denominator (DAPO, arXiv:2503.14476, section 3.4).
    """
    samples = []
    for g in groups:
        for r in g.rollouts:
            c = r.completion
            p, n = len(g.prompt_token_ids), len(c.token_ids)
            trained = not (cfg.overlong_filter and c.finish_reason == FinishReason.LENGTH)
            samples.append(
                TrainSample(
                    token_ids=[*g.prompt_token_ids, *c.token_ids],
                    loss_mask=[False] * p + [trained and m for m in c.sampled_mask or [True] * n],
                    behavior_logprobs=[0.0] * p + list(c.logprobs),
                    advantages=[0.0] * (p + n),
                    policy_version=c.policy_version,
                    group_id=g.task.task_id,
                )
            )
    completions = [r.completion for g in groups for r in g.rollouts]
    n = max(len(completions), 1)
    truncated = sum(c.finish_reason == FinishReason.LENGTH for c in completions)
    width = max((len(c.logprobs) for c in completions), default=0)
    engine_logprobs = _padded([c.logprobs for c in completions], width)
    sampled = _padded([[True] * len(c.logprobs) for c in completions], width, torch.bool)
    metrics = {
        "rollout/truncated_fraction": truncated / n,
        "rollout/mean_length": sum(len(c.token_ids) for c in completions) / n,
        "rollout/min_length": float(min((len(c.token_ids) for c in completions), default=0)),
        "rollout/max_length": float(max((len(c.token_ids) for c in completions), default=0)),
        # -sum_t logp of each completion under the engine: a sampled estimate of its entropy
        "rollout/entropy_proxy": float(sequence_entropy_proxy(engine_logprobs, sampled).sum()) / n,
    }
    if cfg.overlong_filter:
        metrics["filter/overlong_samples"] = float(truncated)
    return samples, metrics


def _padded(rows: Sequence[Sequence[float]], width: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def assign_advantages(
    samples: Sequence[TrainSample],
    rewards: torch.Tensor,
    cfg: AlgorithmConfig,
    baselines: torch.Tensor | None = None,
) -> dict[str, float]:
    """Run ``cfg.advantage`` on the batch and write each sample's ``advantages`` (and
    ``returns`` with a critic) in place.

    With ``cfg.kl.placement == "reward"`` each trained token's reward gets
    ``-cfg.kl.coef * KL_t`` of the sampling policy (the trainer's old logprobs when recomputed,
    else the engine's) against the reference.

    Args:
        samples: ``B`` flat samples; ``values`` filled when the estimator is ``gae``,
            ``ref_logprobs`` when KL is in the reward.
        rewards: ``[B]`` outcome rewards (see :func:`outcome_rewards`).
        baselines: ``[B]`` greedy-baseline rewards (``remax``), else None.
    Raises:
        ValueError: from the estimator (e.g. RLOO with a group of one).
    """
    width = max((len(s) for s in samples), default=0)
    mask = _padded([s.loss_mask for s in samples], width, torch.bool)
    token_rewards = None
    metrics: dict[str, float] = {}
    if cfg.kl.placement == "reward" and cfg.kl.coef > 0:
        sampler = _padded([s.old_logprobs or s.behavior_logprobs for s in samples], width)
        ref = _padded([s.ref_logprobs for s in samples], width)
        kl = KL_ESTIMATORS[cfg.kl.estimator](sampler, ref) * mask
        token_rewards = -cfg.kl.coef * kl
        metrics[f"kl/{cfg.kl.estimator}"] = float(kl.sum() / mask.sum().clamp(min=1))
    batch = AdvantageInput(
        rewards=rewards,
        mask=mask,
        groups=group_index([s.group_id for s in samples]),
        token_rewards=token_rewards,
        values=_padded([s.values for s in samples], width) if cfg.advantage == "gae" else None,
        baselines=baselines,
    )
    params = AdvantageParams(gamma=cfg.gamma, lam=cfg.lam, credit=cfg.token_reward_credit)
    out, adv_metrics = ADVANTAGE_ESTIMATORS[cfg.advantage](batch, params)
    for i, s in enumerate(samples):
        s.advantages = out.advantages[i, : len(s)].tolist()
        if out.returns is not None:
            s.returns = out.returns[i, : len(s)].tolist()
    return metrics | adv_metrics


def drop_rejected(samples: Sequence[TrainSample], cfg: AlgorithmConfig) -> dict[str, float]:
    """With ``cfg.mis_denominator == "kept"``, take the tokens that the importance-sampling
    correction rejects (weight 0) out of each sample's ``loss_mask`` in place, so they leave the
    step's loss and its denominators (verl's rollout rejection sampling); else do nothing.

    Call it after the advantages: they are computed over every trained token (verl, too, puts
    the KL penalty in the reward before rejecting), and only the update skips rejected tokens.
    Needs each sample's ``old_logprobs``.

    Returns:
        ``is/rejected_tokens`` and ``is/rejected_fraction`` (of the trained tokens), and the
        ``mismatch/*`` metrics over all trained tokens before the rejection, which replace the
        trainer's (those cover the kept tokens only, so the mismatch alarm would not see the
        tokens rejected for being off).
    """
    if cfg.mis_denominator != "kept" or not samples:
        return {}
    lengths = [len(s) for s in samples]
    old = torch.tensor([v for s in samples for v in s.old_logprobs], dtype=torch.float32)
    behavior = torch.tensor([v for s in samples for v in s.behavior_logprobs], dtype=torch.float32)
    mask = torch.tensor([v for s in samples for v in s.loss_mask], dtype=torch.bool)
    segments = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths))
    rejected = rejected_tokens(
        old, behavior, mask, segments, cfg.importance_sampling, cfg.is_threshold
    )
    for s, r in zip(samples, rejected.split(lengths), strict=True):
        s.loss_mask = [m and not bool(x) for m, x in zip(s.loss_mask, r, strict=True)]
    metrics: dict[str, float] = dict(mismatch_metrics(old, behavior, mask))
    metrics["is/rejected_tokens"] = float(rejected.sum())
    metrics["is/rejected_fraction"] = float(rejected.sum() / mask.sum().clamp(min=1))
    return metrics
