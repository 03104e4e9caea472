"""Golden values for the foundation's algorithms, each derived by hand in a comment."""

import math

import torch

from treadle.algorithms.advantages import group_index, grpo_advantages
from treadle.algorithms.losses import kl_k3, ppo_clip_loss, token_mean


def test_equal_rewards_with_std_normalisation_give_zero_finite_advantages():
    # mean 1, deviations 0, std 0: (1 - 1) / (0 + eps) = 0 for every sample, never nan.
    adv, metrics = grpo_advantages(torch.ones(4), group_index(["p"] * 4), std_normalize=True)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert metrics["adv/zero_variance_groups"] == 1.0


def test_groups_by_prompt_id_not_position():
    # A: [1, 0, 1] has mean 2/3 -> [1/3, -2/3, 1/3];
    # B: [1, 1, 0, 0] has mean 1/2 -> [.5, .5, -.5, -.5].
    ids = ["A", "B", "A", "B", "B", "A", "B"]
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    adv, _ = grpo_advantages(rewards, group_index(ids), std_normalize=False)
    a = [adv[i].item() for i, g in enumerate(ids) if g == "A"]
    b = [adv[i].item() for i, g in enumerate(ids) if g == "B"]
    assert a == [pytest_approx(1 / 3), pytest_approx(-2 / 3), pytest_approx(1 / 3)]
    assert b == [0.5, 0.5, -0.5, -0.5]


def pytest_approx(x):
    import pytest

    return pytest.approx(x, abs=1e-6)


def test_std_normalised_group_uses_unbiased_std():
    # [1, 0]: mean .5, unbiased std sqrt(((.5)^2 + (.5)^2) / 1) = 0.70711
    # -> +-0.5 / 0.70711 = +-0.70711.
    adv, _ = grpo_advantages(torch.tensor([1.0, 0.0]), group_index(["p", "p"]), std_normalize=True)
    assert adv.tolist() == [pytest_approx(0.707106), pytest_approx(-0.707106)]


def test_singleton_group_gets_zero_advantage_and_is_counted():
    adv, metrics = grpo_advantages(torch.tensor([1.0, 1.0, 0.0]), group_index(["a", "b", "b"]))
    assert adv[0].item() == 0.0 and torch.isfinite(adv).all()
    assert metrics["adv/singleton_groups"] == 1.0


def test_ppo_clip_golden():
    # ratio = exp(-1.0 - -1.2) = exp(0.2) = 1.2214; A = +1: unclipped 1.2214, clipped 1.2 (1 + 0.2);
    # loss = -min(1.2214, 1.2) = -1.2, and the clipped term is the active one.
    loss, metrics = ppo_clip_loss(
        torch.tensor([-1.0]), torch.tensor([-1.2]), torch.tensor([1.0]), torch.tensor([True])
    )
    assert metrics["ratio/mean"] == pytest_approx(math.exp(0.2))
    assert round(math.exp(0.2), 4) == 1.2214
    assert loss.item() == pytest_approx(-1.2)
    assert metrics["clip/fraction"] > 0


def test_ppo_clip_negative_advantage_uses_lower_clip():
    # ratio exp(-0.5) = 0.6065 < 0.8; A = -1: unclipped -0.6065, clipped -0.8;
    # min = -0.8 -> loss 0.8.
    loss, _ = ppo_clip_loss(
        torch.tensor([-1.5]), torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([True])
    )
    assert loss.item() == pytest_approx(0.8)


def test_token_mean_uses_step_denominator():
    # micro-batch 1: 2 tokens, loss 1 each (sum 2); micro-batch 2: 6 tokens, 0.5 each (sum 3).
    # Step token-mean = (2 + 3) / 8 = 0.625;
    # a mean of micro-batch means would be (1 + 0.5) / 2 = 0.75.
    total = token_mean(torch.ones(2), torch.ones(2, dtype=torch.bool), 8.0) + token_mean(
        torch.full((6,), 0.5), torch.ones(6, dtype=torch.bool), 8.0
    )
    assert total.item() == 0.625


def test_k3_value_and_extremes():
    # logp -1.0, ref -1.5: delta = ref - logp = -0.5;
    # k3 = e^-0.5 + 0.5 - 1 = 0.6065307 - 0.5 = 0.106531.
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-1.5])).item() == pytest_approx(0.106531)
    # logp -30, ref -0.01: delta = 29.99 clamped to 20 -> e^20 - 21, large but finite.
    extreme = kl_k3(torch.tensor([-30.0]), torch.tensor([-0.01])).item()
    assert math.isfinite(extreme) and abs(extreme - (math.exp(20) - 21)) < 1e-6 * math.exp(20)
