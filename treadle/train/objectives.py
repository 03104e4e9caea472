"""Training objectives: a micro-batch's share of the step's loss, built from the pure functions.

An objective maps ``(token outputs, micro-batch, step totals) -> (loss, metrics)``: it computes
per-token losses with the registered functions and aggregates them with the step-wide
denominators (:mod:`treadle.algorithms.aggregation`), so the training backend only sums the
micro-batches' shares and steps the optimizer. Metrics are means over the micro-batch's trained
tokens; the backend weights them by its share of the step's tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from treadle.algorithms.aggregation import AGGREGATIONS
from treadle.algorithms.correction import IS_CORRECTIONS, off_policy_sequence_mask
from treadle.algorithms.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossParams,
    masked_mean,
    value_loss,
)
from treadle.config import AlgorithmConfig
from treadle.core.batch import MicroBatch, StepTotals, TokenOutputs


@dataclass(frozen=True)
class PolicyObjective:
    """Policy loss (PPO / GSPO / vanilla PG) with optional importance-sampling correction,
    KL-to-reference loss term and entropy bonus, aggregated by ``loss_agg``.

    The ratio's denominator is the trainer's recomputed old logprobs when the batch carries
    them (importance-sampling correction on), else the engine's behavior logprobs.
    """

    policy_loss: str
    loss_params: PolicyLossParams
    loss_agg: str
    loss_constant: float
    """``C`` of ``seq-mean-token-sum-norm`` in tokens: the generation budget."""
    kl_coef: float
    """Weight of the KL loss term; 0 when KL is off or placed in the reward."""
    kl_estimator: str
    entropy_coef: float
    entropy_agg: str
    """``token-mean``: the bonus is ``coef * mean token entropy``; ``loss_agg``: aggregated
    with the policy loss."""
    importance_sampling: str
    is_threshold: float
    off_policy_mask: float = 0.0
    """Threshold of the off-policy sequence mask (nats per token); 0 is off."""
    engine_sampled: ClassVar[bool] = True
    """RL samples carry the engine's logprobs: the backend reports the mismatch."""

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig, max_tokens: int) -> PolicyObjective:
        """Args: cfg: the algorithm section; max_tokens: ``rollout.max_tokens``."""
        return cls(
            policy_loss=cfg.policy_loss,
            loss_params=PolicyLossParams(cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip),
            loss_agg=cfg.loss_agg,
            loss_constant=float(max_tokens),
            kl_coef=cfg.kl.coef if cfg.kl.placement == "loss" else 0.0,
            kl_estimator=cfg.kl.estimator,
            entropy_coef=cfg.entropy_coef,
            entropy_agg=cfg.entropy_agg,
            importance_sampling=cfg.importance_sampling,
            is_threshold=cfg.is_threshold,
            off_policy_mask=cfg.off_policy_mask,
        )

    @property
    def entropy_grad(self) -> bool:
        """Whether the loss has an entropy term, so the backend must keep the entropy's graph."""
        return self.entropy_coef != 0

    def __call__(
        self, out: TokenOutputs, batch: MicroBatch, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        lp, mask, segments = out.logprobs, batch.loss_mask, batch.segments
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.behavior_logprobs
        per_token, metrics = POLICY_LOSSES[self.policy_loss](
            lp, old, batch.advantages, mask, segments, self.loss_params
        )
        if self.importance_sampling != "none":
            if batch.old_logprobs is None:
                raise ValueError("importance-sampling correction needs recomputed old logprobs")
            weights, is_metrics = IS_CORRECTIONS[self.importance_sampling](
                batch.old_logprobs, batch.behavior_logprobs, mask, segments, self.is_threshold
            )
            per_token = per_token * weights
            metrics |= is_metrics
        if self.off_policy_mask > 0:
            keep, mask_metrics = off_policy_sequence_mask(
                lp, batch.behavior_logprobs, batch.advantages, mask, segments, self.off_policy_mask
            )
            per_token = per_token * keep
            metrics |= mask_metrics
        if self.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("a KL loss term needs reference logprobs on every sample")
            kl = KL_ESTIMATORS[self.kl_estimator](lp, batch.ref_logprobs)
            per_token = per_token + self.kl_coef * kl
            metrics[f"kl/{self.kl_estimator}"] = masked_mean(kl, mask)
        metrics["entropy/mean"] = masked_mean(out.entropy, mask)
        bonus = torch.zeros(())
        if self.entropy_coef != 0 and self.entropy_agg == "loss_agg":
            per_token = per_token - self.entropy_coef * out.entropy
        elif self.entropy_coef != 0:  # coef x the step's mean token entropy, whatever loss_agg
            bonus = self.entropy_coef * AGGREGATIONS["token-mean"](
                out.entropy, mask, segments, totals
            )
        totals = dataclasses.replace(totals, constant=self.loss_constant)
        return AGGREGATIONS[self.loss_agg](per_token, mask, segments, totals) - bonus, metrics


@dataclass(frozen=True)
class ValueObjective:
    """Clipped value loss of a critic, token-mean over the trained tokens."""

    value_clip: float
    entropy_grad: bool = False
    engine_sampled: ClassVar[bool] = False

    def __call__(
        self, out: TokenOutputs, batch: MicroBatch, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic needs old values and returns on every sample")
        per_token, _ = value_loss(out.values, batch.values, batch.returns, self.value_clip)
        mask = batch.loss_mask
        metrics = {
            "critic/value_loss": masked_mean(per_token, mask),
            "critic/abs_error": masked_mean((out.values - batch.returns).abs(), mask),
        }
        return AGGREGATIONS["token-mean"](per_token, mask, batch.segments, totals), metrics


@dataclass(frozen=True)
class SFTObjective:
    """Negative log-likelihood of the masked (demonstration) tokens, token-mean over the step."""

    entropy_grad: bool = False
    engine_sampled: ClassVar[bool] = False
    """Demonstrations: no engine sampled these tokens, so there is no mismatch to report."""

    def __call__(
        self, out: TokenOutputs, batch: MicroBatch, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return AGGREGATIONS["token-mean"](
            -out.logprobs, batch.loss_mask, batch.segments, totals
        ), {}
