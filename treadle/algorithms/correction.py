"""Rollout/train mismatch: how far the engine's logprobs are from the trainer's, and the
importance-sampling corrections for it.

The engine (vLLM) and the trainer compute the same policy with different kernels, so the
behavior logprobs ``mu`` the engine reports differ from the trainer's ``pi_old`` even at equal
weights. Truncated importance sampling (TIS; Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training", 2025, https://fengyao.notion.site/off-policy-rl) weights each
token's loss by ``min(pi_old / mu, C)``; masked importance sampling (MIS; Liu et al., "When speed
kills stability", 2025, https://yingru.notion.site/When-Speed-Kills-Stability) drops tokens or
sequences whose ratio leaves ``[1/C, C]``.

The same weights serve asynchronous training, where the behaviour policy ``mu`` is an older
policy version (per token: a partial rollout's tokens may come from several): the decoupled
PPO objective (AReaL, Fu et al., arXiv:2505.24298, eq. 5) takes the clipped ratio against the
proximal policy ``pi_prox`` (the trainer's logprobs recomputed before the update, the
``old_logprobs``) and weights each token by ``pi_prox / mu`` (:func:`decoupled`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from treadle.algorithms.losses import LOG_RATIO_CLAMP, masked_max, masked_mean, segment_sum
from treadle.config.algorithm import MismatchConfig

ISWeights = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    tuple[torch.Tensor, dict[str, float]],
]
"""``(old_logprobs, behavior_logprobs, mask, segments, threshold) -> (weights [N], metrics)``;
weights carry no gradient and multiply the per-token policy loss."""


def _token_log_w(old, behavior, mask):
    return ((old - behavior) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_log_w(old, behavior, mask, segments):
    log_w = segment_sum((old - behavior) * mask, segments)  # log prod_t pi_old / mu
    return log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[segments]


def _report(w: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {
        "is/weight_mean": masked_mean(w, mask),
        "is/raw_weight_mean": masked_mean(raw, mask),
        "is/modified_fraction": masked_mean((w != raw).float(), mask),
    }


def tis_token(old, behavior, mask, segments, threshold):
    """Token-level TIS: ``w_t = min(pi_old_t / mu_t, C)``."""
    raw = torch.exp(_token_log_w(old, behavior, mask)).detach()
    w = raw.clamp(max=threshold)
    return w, _report(w, raw, mask)


def tis_seq(old, behavior, mask, segments, threshold):
    """Sequence-level TIS: ``w_i = min(prod_t pi_old_t / mu_t, C)`` on every token of sample i."""
    raw = torch.exp(_seq_log_w(old, behavior, mask, segments)).detach()
    w = raw.clamp(max=threshold)
    return w, _report(w, raw, mask)


def mis_token(old, behavior, mask, segments, threshold):
    """Token-level MIS: ``w_t = pi_old_t / mu_t`` inside ``[1/C, C]``, else 0 (token dropped;
    it stays in the aggregation's denominator)."""
    raw = torch.exp(_token_log_w(old, behavior, mask)).detach()
    w = torch.where((raw >= 1 / threshold) & (raw <= threshold), raw, torch.zeros_like(raw))
    return w, _report(w, raw, mask)


def mis_seq(old, behavior, mask, segments, threshold):
    """Sequence-level MIS: the sequence ratio ``prod_t pi_old_t / mu_t`` inside ``[1/C, C]``
    keeps the sample with that weight, else the whole sample gets weight 0."""
    raw = torch.exp(_seq_log_w(old, behavior, mask, segments)).detach()
    w = torch.where((raw >= 1 / threshold) & (raw <= threshold), raw, torch.zeros_like(raw))
    return w, _report(w, raw, mask)


def decoupled(old, behavior, mask, segments, threshold):
    """Decoupled PPO's behaviour weight (AReaL, arXiv:2505.24298, eq. 5): ``w_t = pi_prox_t /
    mu_t``, untruncated; a token whose weight exceeds ``C`` is dropped (weight 0; AReaL's
    ``behav_imp_weight_cap``), as a token the behaviour policy sampled far more rarely than the
    proximal one would dominate the step. With the PPO loss this is
    ``-w_t min(u_t A_t, clip(u_t, 1-eps, 1+eps) A_t)``, ``u_t = pi_theta_t / pi_prox_t``."""
    raw = torch.exp(_token_log_w(old, behavior, mask)).detach()
    w = torch.where(raw <= threshold, raw, torch.zeros_like(raw))
    return w, _report(w, raw, mask)


IS_CORRECTIONS: dict[str, ISWeights] = {
    "decoupled": decoupled,
    "tis_token": tis_token,
    "tis_seq": tis_seq,
    "mis_token": mis_token,
    "mis_seq": mis_seq,
}
"""``algorithm.importance_sampling`` names (besides ``none``)."""


def rejected_tokens(
    old: torch.Tensor,
    behavior: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    correction: str,
    threshold: float,
) -> torch.Tensor:
    """``[N]`` bool: the trained tokens a masking correction (``mis_token``, ``mis_seq``,
    ``decoupled``) gives weight 0, i.e. rejects. With ``algorithm.mis_denominator=kept`` the loop
    takes them out of the loss mask before the update, so they leave every denominator too
    (verl's rollout rejection sampling, ``rollout_corr_helper.compute_rollout_rejection_mask``);
    by default they stay in it (OpenRLHF's ICEPOP, TRL's ``token_mask``).

    Raises:
        ValueError: ``correction`` does not mask (``tis_*`` truncate and reject nothing).
    """
    if correction not in ("mis_token", "mis_seq", "decoupled"):
        raise ValueError(f"{correction} rejects no token: only mis_token, mis_seq, decoupled do")
    weights, _ = IS_CORRECTIONS[correction](old, behavior, mask, segments, threshold)
    return mask & (weights == 0)


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, eq. 9; TRL's
    ``off_policy_mask_threshold``): a token of a negative advantage is dropped when its sample's
    mean ``mu - logp`` (a k1 estimate of KL(behaviour || policy), nats per token) exceeds
    ``threshold``: a sample the current policy has drifted far from, scored bad, teaches
    little and destabilises. Positive-advantage tokens are always kept.

    Args:
        logprobs: ``[N]`` current-policy logprobs (used without their gradient).
        behavior_logprobs: ``[N]`` the engine's logprobs of the sampled tokens.
        advantages: ``[N]`` (a sample's outcome advantage on each of its tokens).
        mask: ``[N]`` bool, trained tokens; segments: ``[N]`` sample index of each token.
    Returns:
        ``[N]`` float keep-mask (1 keep, 0 drop) that multiplies the per-token policy loss, and
        ``off_policy_mask/dropped_fraction`` over the trained tokens.
    """
    m = mask.to(logprobs.dtype)
    drift = segment_sum((behavior_logprobs - logprobs.detach()) * m, segments)
    mean_drift = drift / segment_sum(m, segments).clamp(min=1)
    keep = (advantages >= 0) | (mean_drift[segments] <= threshold)
    return keep.to(logprobs.dtype), {
        "off_policy_mask/dropped_fraction": masked_mean((~keep).float(), mask)
    }


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the engine's sampled-token logprobs are from the trainer's at the same weights.

    ``mismatch/abs_logprob_diff`` = mean ``|logp_trainer - logp_engine|`` (nats);
    ``mismatch/max_abs_logprob_diff`` = its maximum over the trained tokens (nats);
    ``mismatch/kl_k1`` = mean ``logp_engine - logp_trainer``, an unbiased estimate of
    KL(engine || trainer) since the tokens were sampled by the engine;
    ``mismatch/kl_k3`` = mean ``r - 1 - log r`` with ``r = p_trainer / p_engine`` (same KL,
    lower variance, >= 0). All over trained tokens ``[N]``.
    """
    diff = (behavior_logprobs - trainer_logprobs).detach()
    diff = torch.where(mask, diff, torch.zeros_like(diff))  # masked positions may hold anything
    log_r = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch/abs_logprob_diff": masked_mean(diff.abs(), mask),
        "mismatch/max_abs_logprob_diff": masked_max(diff.abs(), mask),
        "mismatch/kl_k1": masked_mean(diff, mask),
        "mismatch/kl_k3": masked_mean(torch.exp(log_r) - 1 - log_r, mask),
    }


MISMATCH_CAUSES = (
    "stale weights (a weight sync skipped or failed, so the engine samples an older policy)",
    "the engine's prefix cache serving KV computed before the last weight sync",
    "different dtypes in engine and trainer (e.g. a bf16 engine against an fp32 trainer: "
    "rollout.dtype, trainer.bf16_autocast)",
    "a different temperature or top_p in the engine's logprobs than in the trainer's",
)
"""Why an engine's logprobs drift from the trainer's, most common first, as the alarm says."""


def mismatch_alarm(
    metrics: Mapping[str, float], cfg: MismatchConfig, staleness_bound: int = 0
) -> str | None:
    """The alarm of one RL step on its engine/trainer mismatch, or None when within bounds.

    Compares ``mismatch/kl_k3`` (nats per token) with ``cfg.max_kl_k3`` and
    ``mismatch/max_abs_logprob_diff`` (nats) with ``cfg.max_abs_logprob_diff``; a threshold of
    0 is off, a metric the step lacks (no trained tokens) is not judged, and a nan exceeds any
    threshold. ``staleness_bound``: the versions the behaviour policy may lag by design
    (:attr:`~treadle.config.RolloutConfig.staleness_bound`), named among the causes when > 0.

    Returns:
        One line naming each metric over its threshold (value and config key), then the likely
        causes; None when nothing exceeds its threshold.
    """
    limits = (
        ("mismatch/kl_k3", cfg.max_kl_k3, "algorithm.mismatch.max_kl_k3"),
        (
            "mismatch/max_abs_logprob_diff",
            cfg.max_abs_logprob_diff,
            "algorithm.mismatch.max_abs_logprob_diff",
        ),
    )
    over = [
        f"{name} = {metrics[name]:.4g} nats exceeds {key} = {limit:g}"
        for name, limit, key in limits
        if limit > 0 and name in metrics and not metrics[name] <= limit  # nan: not <=
    ]
    if not over:
        return None
    causes = list(MISMATCH_CAUSES)
    if staleness_bound > 0:
        causes.append(
            f"the asynchronous rollout mode's policy lag (up to {staleness_bound} versions by "
            "design): raise the thresholds if that lag is expected"
        )
    return "engine/trainer mismatch: " + "; ".join(over) + ". Likely causes: " + "; ".join(causes)
