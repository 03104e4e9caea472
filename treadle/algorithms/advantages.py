"""Advantage estimators: ``(rewards [N], group_index [N]) -> (advantages [N], metrics)``.

Groups are identified by prompt (``group_index``), never by position in the batch, so samples of
one prompt may be interleaved with others and groups may differ in size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_index(group_ids: Sequence[str]) -> torch.Tensor:
    """Map group ids (prompt ids) to dense integers ``[N]`` in order of first appearance."""
    dense: dict[str, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages (GRPO, DeepSeekMath, arXiv:2402.03300, section 4.1.2).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the samples of the same prompt ``g``
    (``std`` unbiased, as in the paper's reference implementations); without ``std_normalize``
    it is ``r_i - mean_g(r)`` (Dr. GRPO, arXiv:2503.20783, eq. 3). A group of one sample, whose
    std is undefined, gets advantage 0 and is counted in ``adv/singleton_groups``.

    Args:
        rewards: ``[N]`` scalar reward per sample.
        groups: ``[N]`` dense group index per sample (see :func:`group_index`).
    Returns:
        ``[N]`` advantages (float32) and metrics.
    """
    rewards = rewards.to(torch.float64)
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, groups, torch.ones_like(rewards)
    )
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, rewards) / count
    centred = rewards - mean[groups]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, centred**2)
    if std_normalize:
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        centred = centred / (std[groups] + eps)
    singleton = count[groups] < 2
    advantages = torch.where(singleton, torch.zeros_like(centred), centred).to(torch.float32)
    n = max(advantages.numel(), 1)
    metrics = {
        "adv/mean": float(advantages.sum()) / n,
        "adv/abs_mean": float(advantages.abs().sum()) / n,
        "adv/singleton_groups": float((count < 2).sum()),
        "adv/zero_variance_groups": float(((sq == 0) & (count >= 2)).sum()),
    }
    return advantages, metrics
