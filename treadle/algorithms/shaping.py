"""DAPO's reward shaping and batch filtering (Yu et al., arXiv:2503.14476, section 3)."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """Soft overlong punishment (DAPO eq. 13), added to the reward: ``[B] -> [B]``.

    ``0`` if ``|y| <= L_max - L_cache``; ``(L_max - L_cache - |y|) / L_cache`` inside the
    cache; ``-1`` beyond ``L_max``. ``lengths`` are completion lengths in tokens.

    Raises:
        ValueError: ``cache`` is not in ``1 .. max_len``.
    """
    if not 0 < cache <= max_len:
        raise ValueError(f"overlong cache must be in 1..{max_len} tokens, got {cache}")
    lengths = lengths.to(torch.float64)
    start = max_len - cache
    inside = (start - lengths) / cache
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)


def varied_groups(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """DAPO's dynamic-sampling filter (eq. 11): keep groups whose rewards are not all equal.

    A group whose rewards are all equal has zero advantage under any group baseline, so it
    trains nothing. A group of one sample has *no* variance estimate (its unbiased std is nan,
    not 0) and is kept: it is the estimator's business what to do with it.

    Args:
        rewards: ``[N]`` rewards. groups: ``[N]`` dense group index (0 .. G-1).
    Returns:
        ``[G]`` bool, True for groups to keep; metrics ``filter/dropped_groups``.
    """
    g = int(groups.max()) + 1 if groups.numel() else 0
    r = rewards.to(torch.float64)
    high = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, groups, r, "amax")
    low = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce_(0, groups, r, "amin")
    count = torch.zeros(g).index_add_(0, groups, torch.ones(len(groups)))
    keep = (high > low) | (count < 2)
    return keep, {"filter/dropped_groups": float((~keep).sum())}
