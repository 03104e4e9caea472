"""Training objectives: per-token losses over a packed micro-batch, built from the pure functions.

An objective maps ``(logprobs [N], micro-batch) -> (per_token_loss [N], metrics)``; the training
backend aggregates with :func:`treadle.algorithms.losses.token_mean` over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from treadle.algorithms.losses import kl_k3, ppo_clip_loss
from treadle.backends.packing import MicroBatch
from treadle.config import AlgorithmConfig


class Objective(Protocol):
    def __call__(
        self, logprobs: torch.Tensor, batch: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token loss ``[N]`` for the micro-batch and metrics (means over its masked tokens)."""
        ...


@dataclass(frozen=True)
class PolicyObjective:
    """PPO clipped surrogate on the engine's behavior logprobs, plus an optional k3 KL term."""

    clip_eps_low: float
    clip_eps_high: float
    kl_coef: float

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> PolicyObjective:
        return cls(cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef)

    def __call__(
        self, logprobs: torch.Tensor, batch: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = ppo_clip_loss(
            logprobs,
            batch.behavior_logprobs,
            batch.advantages,
            batch.loss_mask,
            clip_eps_low=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high,
        )
        if self.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("algorithm.kl_coef > 0 needs reference logprobs on every sample")
            kl = kl_k3(logprobs, batch.ref_logprobs)
            loss = loss + self.kl_coef * kl
            m = batch.loss_mask.float()
            metrics["kl/k3"] = float((kl.detach() * m).sum() / m.sum().clamp(min=1))
        return loss, metrics


@dataclass(frozen=True)
class SFTObjective:
    """Negative log-likelihood of the masked (demonstration) tokens."""

    def __call__(
        self, logprobs: torch.Tensor, batch: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return -logprobs, {}
