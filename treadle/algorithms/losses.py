"""Policy losses, KL estimators, entropy and the value loss as pure tensor functions.

Per-token functions take the flat ``[N]`` tensors of a packed micro-batch (all tokens of its
samples, concatenated); ``segments [N]`` gives the sample each token belongs to (0 .. S-1) for
the sequence-level quantities (GSPO's ratio). Masked tokens may hold anything: they are dropped
by the aggregation (:mod:`treadle.algorithms.aggregation`) and never enter a metric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from treadle.core.metrics import Metric, Reduction

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` so one extreme token gives a large finite
number (e^20 ~ 4.9e8), never inf or nan."""


@dataclass(frozen=True)
class PolicyLossParams:
    """Clipping knobs shared by the PPO-family policy losses (ratio bounds, dual clip)."""

    clip_eps_low: float = 0.2
    """Ratio floor is ``1 - clip_eps_low``."""
    clip_eps_high: float = 0.2
    """Ratio ceiling is ``1 + clip_eps_high`` (DAPO's clip-higher raises it above the floor)."""
    dual_clip: float = 0.0
    """Dual-clip constant ``c > 1`` bounding the loss of negative-advantage tokens at ``-c*A``
    (Ye et al., arXiv:1912.09729, eq. 6); 0 turns it off."""


PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossParams],
    tuple[torch.Tensor, dict[str, float]],
]
"""``(logprobs, old_logprobs, advantages, mask, segments, params) -> (loss [N], metrics)``."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> Metric:
    """Mean of ``x`` ``[N]`` over ``mask`` ``[N]`` (0.0 when nothing is masked in), as a token-mean
    metric; masked-out values, even nan, never enter."""
    x = x.detach()
    kept = torch.where(mask, x, torch.zeros_like(x))
    return Metric(float(kept.sum() / mask.sum().clamp(min=1)), Reduction.MEAN)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> Metric:
    """Max of ``x`` ``[N]`` over ``mask`` ``[N]`` (0.0 when nothing is masked in), as a maximum
    metric."""
    return Metric(float(x.detach()[mask].max()) if mask.any() else 0.0, Reduction.MAX)


def segment_sum(x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """``[N] -> [S]``: sum of ``x`` over the tokens of each segment (differentiable)."""
    num = int(segments.max()) + 1 if segments.numel() else 0
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add(0, segments, x)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, p: PolicyLossParams
) -> tuple[torch.Tensor, dict[str, float]]:
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - p.clip_eps_low, 1.0 + p.clip_eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if p.dual_clip > 0:
        bound = -p.dual_clip * advantages  # the most a negative-advantage token may cost
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    metrics = {
        "ratio/mean": masked_mean(ratio, mask),
        "ratio/max": masked_max(ratio, mask),
        "clip/fraction": masked_mean((clipped > unclipped).float(), mask),
        "clip/low_fraction": masked_mean(((ratio < 1 - p.clip_eps_low) & (advantages < 0)), mask),
        "clip/high_fraction": masked_mean(((ratio > 1 + p.clip_eps_high) & (advantages > 0)), mask),
        "clip/dual_fraction": masked_mean(dual.float(), mask),
    }
    return loss, metrics


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate per token (Schulman et al., arXiv:1707.06347, eq. 7), dual-clipped.

    ``rho_t = exp(logp_t - logp_old_t)``;
    ``loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)``, and for
    ``A_t < 0`` also ``loss_t = min(loss_t, -c A_t)`` (dual-clip, arXiv:1912.09729, eq. 6).
    ``eps_high > eps_low`` is DAPO's clip-higher (arXiv:2503.14476, eq. 10).

    Args:
        logprobs: ``[N]`` current-policy logprobs (nats), with grad.
        old_logprobs: ``[N]`` logprobs of the policy that the ratio is taken against: the
            engine's (behavior) logprobs, or the trainer's recomputed ones before this update.
        advantages: ``[N]``.
        mask: ``[N]`` bool, True on trained tokens (metrics only).
        segments: ``[N]`` sample index of each token (unused here; one signature per family).
    Returns:
        ``[N]`` per-token loss and metrics over masked tokens (ratio mean/max, clip fractions).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, mask, params)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level importance ratio (Zheng et al., arXiv:2507.18071, eqs. 5-7, 13).

    ``s_i = exp(mean_{t in y_i} (logp_t - logp_old_t))`` (the length-normalised sequence ratio),
    clipped as in PPO with the sequence's advantage. Implemented in the paper's GSPO-token form
    ``s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])``: the value is ``s_i`` on every token and
    the gradient, under the paper's sequence-mean-token-mean aggregation, equals that of the
    sequence objective. The paper's clip range is tiny (eps_low 3e-4, eps_high 4e-4).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    m = mask.to(log_ratio.dtype)
    seq_log_ratio = segment_sum(log_ratio, segments) / segment_sum(m, segments).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach()[segments] + logprobs - logprobs.detach()
    return _clipped_surrogate(torch.exp(token_log_ratio), advantages, mask, params)


def vanilla_pg(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla policy gradient (REINFORCE, Williams 1992; Sutton et al. 1999), no clipping.

    ``loss_t = -rho_t A_t`` with ``rho_t = exp(logp_t - logp_old_t)``: on-policy ``rho = 1`` and
    the gradient is ``-A_t grad logp_t``; off-policy tokens are importance-weighted, unclipped.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return -ratio * advantages, {"ratio/mean": masked_mean(ratio, mask)}


POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo": ppo_clip, "gspo": gspo, "vanilla": vanilla_pg}
"""``algorithm.policy_loss`` names; every member has the :data:`PolicyLoss` signature."""


# KL estimators of KL(policy || reference) per token, from samples of the policy
# (Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html).
# All take (logprobs [N], ref_logprobs [N]) -> [N] with log r = ref - logp.


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = logp - ref = -log r``: unbiased, high variance, can be negative; unclamped. Its
    gradient is the score function, 0 in expectation, so it is a reward penalty only (the config
    refuses it as a loss term)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = (log r)^2 / 2``: biased, low variance, >= 0; unclamped. As a loss term its expected
    gradient (tokens sampled from the policy) is exactly that of KL(policy || reference); verl
    calls it ``mse``."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = r - 1 - log r``: unbiased, >= 0 (GRPO's KL, arXiv:2402.03300, eq. 4). As a loss
    term its gradient is that of KL(reference || policy) in expectation, not of the reverse KL.

    ``log r`` is clamped to [-20, 20] so a token the reference finds far likelier gives at most
    ``e^20 - 21`` instead of inf.
    """
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(delta) - delta - 1.0


def kl_low_var_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 with its output clamped to [-10, 10] (verl's ``low_var_kl``): the same value as k3
    for ordinary tokens, at most 10 per token, so a few extreme tokens cannot dominate."""
    return kl_k3(logprobs, ref_logprobs).clamp(-10.0, 10.0)


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_k3": kl_low_var_k3,
}
"""``algorithm.kl.estimator`` names: ``(logprobs [N], ref_logprobs [N]) -> kl [N]``."""


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each next-token distribution: ``[N, V] -> [N]``,
    ``H = logsumexp(z) - sum softmax(z) z``."""
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def sequence_entropy_proxy(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sampled-token estimate of each sequence's entropy: ``-sum_t mask_t logp_t``,
    ``[B, T] -> [B]`` (nats). Padding never enters: a padded position may hold any value."""
    return -(logprobs * mask).sum(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss per token (PPO implementation, arXiv:2005.12729 section 3; verl).

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``; ``c = 0`` turns the
    clipping off (plain squared error). All ``[N]``.
    """
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err, {}
