"""Policy losses, KL estimators and loss aggregation as pure tensor functions.

Per-token functions take flat ``[N]`` tensors (all tokens of a packed micro-batch) and return
``(per_token_loss [N], metrics)``; masked tokens are excluded by :func:`token_mean`.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347, eq. 7), per token.

    ``rho = exp(logp - logp_behavior)``;
    ``loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``.
    ``eps_high > eps_low`` is DAPO's clip-higher (arXiv:2503.14476, eq. 10). The behavior
    logprobs are those the engine reported when it sampled the tokens.

    Args:
        logprobs: ``[N]`` current-policy logprobs (nats), with grad.
        behavior_logprobs: ``[N]`` sampling-policy logprobs (nats).
        advantages: ``[N]``.
        mask: ``[N]`` bool, True on trained tokens (used for the metrics only).
    Returns:
        ``[N]`` per-token loss and metrics (means over masked tokens): ``ratio/mean``,
        ``clip/fraction`` (share of tokens where the clipped term was the active one).
    """
    log_ratio = (logprobs - behavior_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        m = mask.float()
        n = m.sum().clamp(min=1)
        metrics = {
            "ratio/mean": float((ratio * m).sum() / n),
            "clip/fraction": float(((clipped < unclipped).float() * m).sum() / n),
        }
    return loss, metrics


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference) per token (Schulman, "Approximating KL", 2020).

    ``k3 = exp(ref - logp) - (ref - logp) - 1`` with the log-ratio clamped to [-20, 20] so an
    extreme token gives a large finite value instead of inf. Unbiased, always >= 0. ``[N] -> [N]``.
    """
    delta = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(delta) - delta - 1.0


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Token-mean aggregation with the denominator counted over the whole step.

    ``sum(per_token * mask) / num_tokens`` where ``num_tokens`` is the number of masked tokens in
    the whole optimizer step (all micro-batches), so accumulating micro-batches gives exactly the
    single-batch token mean (DAPO, arXiv:2503.14476, eq. 12; not a mean of micro-batch means).
    """
    return (per_token * mask).sum() / num_tokens
