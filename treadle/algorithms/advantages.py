"""Advantage estimators: ``(AdvantageInput, AdvantageParams) -> (Advantages, metrics)``.

Every estimator sees the same padded batch: ``B`` samples of up to ``T`` tokens, a mask of the
trained (model-sampled) tokens, the outcome reward of each sample, an optional per-token reward
(the KL penalty when KL is placed in the reward) and, where the estimator needs them, critic
values or greedy-baseline rewards. Groups are identified by prompt (``groups``), never by position
in the batch, so samples of one prompt may be interleaved with others and groups may differ in
size.

The *sequence reward* of sample ``b`` is ``R_b = rewards[b] + sum_t token_rewards[b, t]`` (the
outcome plus any per-token penalty); the critic-free estimators that give every token of a sample
one advantage use it. REINFORCE++ and GAE instead credit each token with the reward that follows
it (``token_rewards`` at its position, the outcome on the sample's last trained token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class AdvantageInput:
    """What every estimator receives. ``B`` samples, ``T`` = longest sample (tokens)."""

    rewards: torch.Tensor  # [B]
    """Outcome reward of each sample (verifier score plus any length penalty)."""
    mask: torch.Tensor  # [B, T] bool
    """True on trained tokens (``TrainSample.loss_mask``); padding and prompts are False."""
    groups: torch.Tensor  # [B] long
    """Dense prompt index of each sample (see :func:`group_index`)."""
    token_rewards: torch.Tensor | None = None  # [B, T]
    """Per-token reward added to the outcome, e.g. ``-beta * KL_t``; None is all zeros."""
    values: torch.Tensor | None = None  # [B, T]
    """Critic value of the state before each token (GAE only)."""
    baselines: torch.Tensor | None = None  # [B]
    """Reward of the greedy completion of each sample's prompt (ReMax only)."""


@dataclass(frozen=True)
class AdvantageParams:
    """Knobs of the estimators (each uses the ones its docstring names)."""

    gamma: float = 1.0
    """Discount per token (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE lambda."""
    whiten: bool = True
    """GAE: normalise advantages to mean 0, std 1 over the batch's trained tokens (the PPO
    implementation detail that verl and OpenRLHF apply by default)."""
    eps: float = 1e-6
    """Added to a standard deviation before dividing by it."""
    credit: Literal["auto", "sequence", "to_go"] = "auto"
    """How ``reinforce_pp_baseline`` and ``remax`` credit per-token rewards (a KL penalty in the
    reward): ``sequence`` puts the whole sequence reward ``R_i`` on every token, ``to_go`` gives
    each token the reward that follows it. ``auto`` is each estimator's paper form (``to_go``
    for REINFORCE++-baseline, ``sequence`` for ReMax); the other one is verl's. The other
    estimators have one form and ignore it."""


@dataclass(frozen=True)
class Advantages:
    """What every estimator returns: per-token advantages and, with a critic, value targets."""

    advantages: torch.Tensor  # [B, T] float32, 0 where ``mask`` is False
    returns: torch.Tensor | None  # [B, T] value targets ``A + V`` (GAE); None without a critic


Estimator = Callable[[AdvantageInput, AdvantageParams], tuple[Advantages, dict[str, float]]]


def group_index(group_ids: Sequence[str]) -> torch.Tensor:
    """Map group ids (prompt ids) to dense integers ``[N]`` in order of first appearance."""
    dense: dict[str, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)


def sequence_rewards(batch: AdvantageInput) -> torch.Tensor:
    """``[B]`` outcome plus the per-token rewards of each sample's trained tokens (float64)."""
    r = batch.rewards.to(torch.float64)
    if batch.token_rewards is not None:
        r = r + (batch.token_rewards.to(torch.float64) * batch.mask).sum(-1)
    return r


def _group_stats(r: torch.Tensor, groups: torch.Tensor):
    """Per-sample group size, group mean and unbiased group std (nan for a group of one)."""
    g = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, groups, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, groups, r) / count
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, groups, (r - mean[groups]) ** 2)
    std = torch.sqrt(sq / (count - 1))  # nan where count == 1: undefined, not zero
    return count[groups], mean[groups], std[groups]


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, T]``: the sample's advantage on each of its trained tokens, 0 elsewhere."""
    return (per_sample[:, None] * mask).to(torch.float32)


def _metrics(adv: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, std=None) -> dict:
    n = mask.sum().clamp(min=1)
    out = {
        "adv/mean": float((adv * mask).sum() / n),
        "adv/abs_mean": float((adv.abs() * mask).sum() / n),
        "adv/singleton_groups": float((count < 2).sum()),  # samples in groups of one
    }
    if std is not None:
        out["adv/zero_variance_samples"] = float(((std == 0) & (count >= 2)).sum())
    return out


def grpo(batch: AdvantageInput, params: AdvantageParams) -> tuple[Advantages, dict[str, float]]:
    """GRPO outcome advantage (DeepSeekMath, arXiv:2402.03300, section 4.1.2).

    ``A_i = (R_i - mean_g(R)) / (std_g(R) + eps)`` over the samples of prompt ``g``, the same on
    every token of sample ``i``; ``std`` is the unbiased one (as in verl and TRL). A group of one
    sample has no std: its advantage is 0, counted in ``adv/singleton_groups`` (the config
    refuses ``rollout.n < 2`` for GRPO, so this happens only if a caller builds such a batch).
    """
    r = sequence_rewards(batch)
    count, mean, std = _group_stats(r, batch.groups)
    a = torch.where(count < 2, torch.zeros_like(r), (r - mean) / (std + params.eps))
    adv = _broadcast(a, batch.mask)
    return Advantages(adv, None), _metrics(adv, batch.mask, count, std)


def dr_grpo(batch: AdvantageInput, params: AdvantageParams) -> tuple[Advantages, dict[str, float]]:
    """Dr. GRPO advantage (Liu et al., arXiv:2503.20783, eq. 3): ``A_i = R_i - mean_g(R)``.

    GRPO without the division by the group std, which up-weights prompts that are nearly all
    right or all wrong. Pair with the constant-normaliser loss aggregation (section 3.2).
    """
    r = sequence_rewards(batch)
    count, mean, std = _group_stats(r, batch.groups)
    adv = _broadcast(torch.where(count < 2, torch.zeros_like(r), r - mean), batch.mask)
    return Advantages(adv, None), _metrics(adv, batch.mask, count, std)


def _require_groups(count: torch.Tensor, name: str) -> None:
    if bool((count < 2).any()):
        raise ValueError(
            f"{name}: every prompt needs at least 2 samples for its baseline; "
            f"{int((count < 2).sum())} sample(s) are alone in their group (raise rollout.n)"
        )


def rloo(batch: AdvantageInput, params: AdvantageParams) -> tuple[Advantages, dict[str, float]]:
    """RLOO: leave-one-out baseline (Ahmadian et al., arXiv:2402.14740, eq. 7; Kool et al. 2019).

    ``A_i = R_i - (1 / (n - 1)) * sum_{j != i} R_j = n / (n - 1) * (R_i - mean_g(R))``.

    Raises:
        ValueError: a group has one sample (its leave-one-out baseline is undefined).
    """
    r = sequence_rewards(batch)
    count, mean, std = _group_stats(r, batch.groups)
    _require_groups(count, "rloo")
    adv = _broadcast(count / (count - 1) * (r - mean), batch.mask)
    return Advantages(adv, None), _metrics(adv, batch.mask, count, std)


def remax(batch: AdvantageInput, params: AdvantageParams) -> tuple[Advantages, dict[str, float]]:
    """ReMax: greedy-decoding baseline (Li et al., arXiv:2310.10505, algorithm 1).

    ``A_i = R_i - R(greedy completion of the prompt)`` on every token of sample ``i``; with
    ``params.credit == "to_go"`` (verl's form) token ``t`` gets ``G_t - R(greedy)`` instead,
    ``G_t`` its reward-to-go (they differ only when per-token rewards carry a KL penalty).

    Raises:
        ValueError: ``batch.baselines`` is None (the loop must score a greedy completion).
    """
    if batch.baselines is None:
        raise ValueError("remax: needs the greedy baseline reward of each prompt (baselines)")
    r = sequence_rewards(batch)
    count, _, std = _group_stats(r, batch.groups)
    baseline = batch.baselines.to(torch.float64)
    if params.credit == "to_go":  # verl's form: each token's reward-to-go minus the baseline
        to_go = _returns_to_go(_token_rewards(batch, batch.rewards), batch.mask, 1.0)
        adv = ((to_go - baseline[:, None]) * batch.mask).to(torch.float32)
    else:
        adv = _broadcast(r - baseline, batch.mask)
    return Advantages(adv, None), _metrics(adv, batch.mask, count, std)


def _token_rewards(batch: AdvantageInput, outcome: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` per-token reward with ``outcome[b]`` added on sample b's last trained token."""
    mask = batch.mask
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    if batch.token_rewards is not None:
        rewards += batch.token_rewards.to(torch.float64) * mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, positions, -1).max(-1).values  # [B], -1 when nothing is trained
    has = last >= 0
    rewards[has.nonzero().squeeze(-1), last[has]] += outcome.to(torch.float64)[has]
    return rewards


def _returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{s >= t, trained} gamma^(k) r_s`` over trained tokens only (k counts trained
    tokens between t and s); untrained tokens carry the running return through unchanged."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the trained tokens of the whole batch; 0 elsewhere."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps) * mask


def reinforce_pp(
    batch: AdvantageInput, params: AdvantageParams
) -> tuple[Advantages, dict[str, float]]:
    """REINFORCE++ (Hu, arXiv:2501.03262, eqs. 5-7): token returns, normalised over the batch.

    ``G_t = sum_{s >= t} gamma^(s-t) r_s`` with ``r_s`` the per-token reward (KL penalty) and
    the outcome on the last token; ``A = (G - mean_batch(G)) / (std_batch(G) + eps)`` over all
    trained tokens of the batch (global, not per-group, normalisation). Works with one sample
    per prompt.
    """
    rewards = _token_rewards(batch, batch.rewards)
    returns = _returns_to_go(rewards, batch.mask, params.gamma)
    adv = _whiten(returns, batch.mask, params.eps).to(torch.float32)
    count, _, _ = _group_stats(sequence_rewards(batch), batch.groups)
    return Advantages(adv, None), _metrics(adv, batch.mask, count)


def reinforce_pp_baseline(
    batch: AdvantageInput, params: AdvantageParams
) -> tuple[Advantages, dict[str, float]]:
    """REINFORCE++-baseline (arXiv:2501.03262 v3+, section 3): subtract the prompt's mean
    outcome from each outcome, then REINFORCE++'s token returns and global normalisation.

    ``r'_i = r_i - mean_g(r)`` (the group mean of the outcome rewards, as in OpenRLHF), then as
    :func:`reinforce_pp`. With ``params.credit == "sequence"`` (verl's form) the group mean of
    the sequence rewards ``R`` (outcome plus per-token KL penalties) is subtracted from ``R_i``
    and the difference is put on every token before the whitening.

    Raises:
        ValueError: a group has one sample (its mean baseline would zero the outcome).
    """
    if params.credit == "sequence":  # verl's form: R_i - mean_g(R) on every token
        r = sequence_rewards(batch)
        count, mean, std = _group_stats(r, batch.groups)
        _require_groups(count, "reinforce_pp_baseline")
        returns = (r - mean)[:, None] * batch.mask
    else:
        outcome = batch.rewards.to(torch.float64)
        count, mean, std = _group_stats(outcome, batch.groups)
        _require_groups(count, "reinforce_pp_baseline")
        rewards = _token_rewards(batch, outcome - mean)
        returns = _returns_to_go(rewards, batch.mask, params.gamma)
    adv = _whiten(returns, batch.mask, params.eps).to(torch.float32)
    return Advantages(adv, None), _metrics(adv, batch.mask, count, std)


def gae(batch: AdvantageInput, params: AdvantageParams) -> tuple[Advantages, dict[str, float]]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438, eq. 16) for PPO.

    Over the trained tokens of a sample, in order: ``delta_t = r_t + gamma * V_next - V_t`` and
    ``A_t = delta_t + gamma * lam * A_next``, where ``next`` is the sample's next *trained* token
    (0 after the last one). Untrained tokens (prompt, tool output, padding) are skipped: their
    values never leak into a delta, and their advantage is 0. Returns (value targets) are
    ``A + V``, taken before the optional whitening of ``A`` (``params.whiten``).

    Raises:
        ValueError: ``batch.values`` is None.
    """
    if batch.values is None:
        raise ValueError("gae: needs critic values (algorithm.advantage=gae runs a critic)")
    mask = batch.mask
    rewards = _token_rewards(batch, batch.rewards)
    values = batch.values.to(torch.float64) * mask
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(mask.shape[0], dtype=torch.float64)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + params.gamma * next_value - values[:, t]
        a = delta + params.gamma * params.lam * next_adv
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = (adv + values) * mask
    if params.whiten:
        adv = _whiten(adv, mask, params.eps)
    count, _, _ = _group_stats(sequence_rewards(batch), batch.groups)
    metrics = _metrics(adv, mask, count)
    n = mask.sum().clamp(min=1)
    metrics["critic/returns_mean"] = float((returns * mask).sum() / n)
    metrics["critic/values_mean"] = float((values * mask).sum() / n)
    return Advantages(adv.to(torch.float32), returns.to(torch.float32)), metrics


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
    "gae": gae,
}
"""``algorithm.advantage`` names; every member has the :data:`Estimator` signature."""
