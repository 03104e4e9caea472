"""Golden values of the DPO loss (Rafailov et al., arXiv:2305.18290, eq. 7), derived by hand.

``loss = -log sigmoid(m)`` with the margin ``m = beta * ((pc - rc) - (pr - rr))``;
``-log sigmoid(m) = log(1 + e^-m)``.
"""

import math

import pytest
import torch

from treadle.algorithms.preference import dpo_loss

approx = pytest.approx
T = torch.tensor


def test_policy_equal_to_reference_gives_ln_2():
    # Every margin is 0: -log sigmoid(0) = -log(1/2) = ln 2 = 0.693147.
    pc, pr = T([-3.0, -7.5]), T([-4.0, -2.0])
    loss, m = dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=0.1)
    assert loss.tolist() == approx([0.693147, 0.693147], abs=1e-6)
    assert m["dpo/reward_margin"] == 0.0
    assert m["dpo/reward_accuracy"] == 0.0  # a margin of exactly 0 is not "> 0"
    assert m["dpo/chosen_reward"] == m["dpo/rejected_reward"] == 0.0


def test_nonzero_margins_and_metrics():
    # Pair 0, beta 0.5: r_w = 0.5 * (-10 - -11) = 0.5, r_l = 0.5 * (-12 - -11) = -0.5,
    #   m = 1.0, loss = log(1 + e^-1) = log(1.367879) = 0.313262.
    # Pair 1 with the same beta: r_w = 0.5 * (-5 - -4) = -0.5, r_l = 0.5 * (-3 - -5) = 1.0,
    #   m = -1.5, loss = log(1 + e^1.5) = log(5.481689) = 1.701413.
    pc, pr = T([-10.0, -5.0]), T([-12.0, -3.0])
    rc, rr = T([-11.0, -4.0]), T([-11.0, -5.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.tolist() == approx([0.313262, 1.701413], abs=1e-6)
    assert m["dpo/reward_margin"] == approx((1.0 - 1.5) / 2)  # -0.25
    assert m["dpo/reward_accuracy"] == 0.5  # only pair 0 has m > 0
    assert m["dpo/chosen_reward"] == approx((0.5 - 0.5) / 2)  # 0.0
    assert m["dpo/rejected_reward"] == approx((-0.5 + 1.0) / 2)  # 0.25


def test_beta_scales_the_margin():
    # beta 0.1, pc - rc = -1, pr - rr = 2: m = 0.1 * (-1 - 2) = -0.3,
    # loss = log(1 + e^0.3) = log(2.349859) = 0.854355.
    loss, m = dpo_loss(T([-5.0]), T([-3.0]), T([-4.0]), T([-5.0]), beta=0.1)
    assert loss.item() == approx(0.854355, abs=1e-6)
    assert m["dpo/reward_margin"] == approx(-0.3)


def test_gradient_raises_chosen_and_lowers_rejected():
    # d loss / d pc = -beta * sigmoid(-m); pair 0 above: -0.5 * sigmoid(-1) = -0.5 * 0.268941
    # = -0.134471, and d loss / d pr = +0.134471. No gradient reaches the reference.
    pc = T([-10.0], requires_grad=True)
    pr = T([-12.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, T([-11.0]), T([-11.0]), beta=0.5)
    loss.sum().backward()
    assert pc.grad.item() == approx(-0.134471, abs=1e-6)
    assert pr.grad.item() == approx(0.134471, abs=1e-6)


def test_extreme_margins_stay_finite():
    # m = -1000: loss = log(1 + e^1000) = 1000 (to float precision); m = +1000: loss ~ e^-1000 = 0.
    loss, _ = dpo_loss(T([0.0, 2000.0]), T([2000.0, 0.0]), T([0.0, 0.0]), T([0.0, 0.0]), 0.5)
    assert all(math.isfinite(v) for v in loss.tolist())
    assert loss.tolist() == approx([1000.0, 0.0])
