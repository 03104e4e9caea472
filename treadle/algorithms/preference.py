"""Direct Preference Optimization's loss as a pure tensor function.

Inputs are per-pair *sequence* logprobs: the sum over a response's trained tokens (its reply and
end-of-turn token, never the prompt) of the per-token logprob, in nats. ``B`` is the number of
preference pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO loss per pair (Rafailov et al., arXiv:2305.18290, eq. 7).

    With the implicit rewards ``r_w = beta * (log pi(y_w|x) - log pi_ref(y_w|x))`` of the chosen
    response and ``r_l = beta * (log pi(y_l|x) - log pi_ref(y_l|x))`` of the rejected one,
    ``loss = -log sigmoid(r_w - r_l)``. At the start (policy = reference) every margin is 0 and
    the loss is ``ln 2``.

    Args:
        policy_chosen: ``[B]`` sequence logprob (nats) of the chosen response under the policy,
            with grad.
        policy_rejected: ``[B]`` the same for the rejected response.
        ref_chosen: ``[B]`` sequence logprob of the chosen response under the frozen reference.
        ref_rejected: ``[B]`` the same for the rejected response.
        beta: strength of the implicit KL constraint to the reference (``beta`` of eq. 7).
    Returns:
        ``[B]`` loss per pair, and metrics over the pairs: ``dpo/reward_margin`` (mean of
        ``r_w - r_l``), ``dpo/reward_accuracy`` (fraction with ``r_w - r_l > 0``),
        ``dpo/chosen_reward`` (mean ``r_w``) and ``dpo/rejected_reward`` (mean ``r_l``).
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin)  # stable for large |margin|: never log(0)
    margin = margin.detach()
    metrics = {
        "dpo/reward_margin": float(margin.mean()),
        "dpo/reward_accuracy": float((margin > 0).float().mean()),
        "dpo/chosen_reward": float(chosen_reward.detach().mean()),
        "dpo/rejected_reward": float(rejected_reward.detach().mean()),
    }
    return loss, metrics
