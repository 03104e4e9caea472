"""Golden values for the algorithm library, each derived by hand in a comment.

The lettered tests (a-g) are the acceptance fixtures of the algorithm-library issue.
"""

import math

import pytest
import torch

from treadle.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInput,
    AdvantageParams,
    dr_grpo,
    gae,
    group_index,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from treadle.algorithms.aggregation import AGGREGATIONS
from treadle.algorithms.correction import IS_CORRECTIONS, mismatch_metrics
from treadle.algorithms.losses import (
    KL_ESTIMATORS,
    PolicyLossParams,
    gspo,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_low_var_k3,
    ppo_clip,
    sequence_entropy_proxy,
    token_entropy,
    value_loss,
    vanilla_pg,
)
from treadle.algorithms.shaping import soft_overlong_penalty, varied_groups
from treadle.core.batch import StepTotals
from treadle.core.metrics import Reduction

approx = pytest.approx
T = torch.tensor
NO_WHITEN = AdvantageParams(whiten=False)


def outcome(rewards, ids, width=1, **kw) -> AdvantageInput:
    """A batch of samples of ``width`` trained tokens each, with these outcome rewards."""
    r = T(rewards, dtype=torch.float32)
    return AdvantageInput(
        r, torch.ones(len(rewards), width, dtype=torch.bool), group_index(ids), **kw
    )


def adv0(out) -> list[float]:
    """Advantage on each sample's first token (of an estimator's result or its Advantages)."""
    advantages = out[0] if isinstance(out, tuple) else out
    return advantages.advantages[:, 0].tolist()


# ----------------------------------------------------------------------------- a. aggregation


ROW1 = [2.0, 2, 2, 2, 2, 6, 5, 3, 2, 4]
MASK1 = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
ROW2 = [10.0, 3, 4, 5, 2, 3, 4, 1, 1, 3]
MASK2 = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def aggregate(mode: str, row1=ROW1, row2=ROW2, constant=1.0) -> float:
    # The two rows packed flat, as a micro-batch holds them; segments say which row is which.
    per_token = T(row1 + row2)
    mask = T(MASK1 + MASK2, dtype=torch.bool)
    segments = T([0] * 10 + [1] * 10)
    totals = StepTotals(tokens=6, sequences=2, constant=constant)
    return AGGREGATIONS[mode](per_token, mask, segments, totals).item()


def test_a_aggregation_modes():
    # Trained tokens: row 1 five 2s (sum 10), row 2 one 10 (sum 10); 6 tokens, 2 sequences.
    # token-mean = (10 + 10) / 6 = 3.3333
    assert aggregate("token-mean") == approx(20 / 6)
    assert round(aggregate("token-mean"), 4) == 3.3333
    # seq-mean-token-mean = (10/5 + 10/1) / 2 = (2 + 10) / 2 = 6.0
    assert aggregate("seq-mean-token-mean") == approx(6.0)
    # seq-mean-token-sum = (10 + 10) / 2 = 10.0
    assert aggregate("seq-mean-token-sum") == approx(10.0)
    # constant normaliser C = 10 (the generation budget): (10 + 10) / (2 * 10) = 1.0
    assert aggregate("seq-mean-token-sum-norm", constant=10.0) == approx(1.0)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_a_masked_values_never_enter(mode):
    # Change every masked value to 1e6 (and one to nan): no mode may move.
    row1 = ROW1[:5] + [1e6] * 5
    row2 = ROW2[:1] + [float("nan")] + [1e6] * 8
    before = aggregate(mode, constant=10.0)
    after = aggregate(mode, row1, row2, constant=10.0)
    assert after == approx(before)


def test_a_denominators_are_step_wide_across_micro_batches():
    # The two rows in separate micro-batches with the same step totals sum to the same loss
    # (a mean of micro-batch means would give (2 + 10) / 2 = 6 for token-mean instead of 3.33).
    totals = StepTotals(tokens=6, sequences=2, constant=10.0)
    for mode in AGGREGATIONS:
        first = AGGREGATIONS[mode](
            T(ROW1), T(MASK1, dtype=torch.bool), torch.zeros(10, dtype=torch.long), totals
        )
        second = AGGREGATIONS[mode](
            T(ROW2), T(MASK2, dtype=torch.bool), torch.zeros(10, dtype=torch.long), totals
        )
        assert (first + second).item() == approx(aggregate(mode, constant=10.0)), mode


# ----------------------------------------------------------------------------- b. KL estimators


def test_b_kl_estimators_golden():
    lp, ref = T([-1.0]), T([-1.5])
    # log r = ref - logp = -0.5
    # k1 = logp - ref = 0.5
    assert kl_k1(lp, ref).item() == approx(0.5)
    # k2 = (log r)^2 / 2 = 0.25 / 2 = 0.125
    assert kl_k2(lp, ref).item() == approx(0.125)
    # k3 = e^-0.5 - 1 + 0.5 = 0.6065307 - 0.5 = 0.106531
    assert kl_k3(lp, ref).item() == approx(0.106531, abs=1e-6)
    # low-variance k3 clamps the output to [-10, 10]: 0.106531 is inside, unchanged
    assert kl_low_var_k3(lp, ref).item() == approx(0.106531, abs=1e-6)


def test_b_kl_estimators_extreme_values_are_finite_and_documented():
    lp, ref = T([-30.0]), T([-0.01])
    # log r = 29.99
    # k1 = -30 + 0.01 = -29.99 (unclamped; negative: k1 is unbiased, not non-negative)
    assert kl_k1(lp, ref).item() == approx(-29.99)
    # k2 = 29.99^2 / 2 = 899.4001 / 2 = 449.70005 (unclamped)
    assert kl_k2(lp, ref).item() == approx(449.70005, rel=1e-5)
    # k3: log r clamped to 20 -> e^20 - 20 - 1 = 485165195.4 - 21
    assert kl_k3(lp, ref).item() == approx(math.exp(20) - 21, rel=1e-6)
    # low_var_k3: that value clamped to 10
    assert kl_low_var_k3(lp, ref).item() == 10.0
    values = {name: f(lp, ref).item() for name, f in KL_ESTIMATORS.items()}
    assert all(math.isfinite(v) for v in values.values())
    assert len(set(values.values())) == 4, values  # each estimator its own value


# ----------------------------------------------------------------------------- c. entropy


def test_c_entropy_proxy_counts_valid_tokens_only():
    # -(-0.5 + -0.7) = 1.2; with the padding included it would be -(−1.2 + 2.0) = -0.8
    out = sequence_entropy_proxy(T([[-0.5, -0.7, 1.0, 1.0]]), T([[1, 1, 0, 0]]))
    assert out.tolist() == [approx(1.2)]


def test_token_entropy_golden():
    # uniform over 4 tokens: H = ln 4 = 1.386294; a one-hot-like distribution: H ~ 0
    h = token_entropy(T([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert h[0].item() == approx(math.log(4), abs=1e-6)
    assert h[1].item() == approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- d. GAE


def test_d_gae_masked_value_does_not_leak():
    batch = AdvantageInput(
        rewards=T([0.0]),
        mask=T([[1, 1, 0]], dtype=torch.bool),
        groups=T([0]),
        token_rewards=T([[0.0, 1.0, 0.0]]),
        values=T([[0.0, 0.0, 100.0]]),
    )
    out, _ = gae(batch, AdvantageParams(gamma=1.0, lam=0.95, whiten=False))
    # t=1 (last trained): delta = r1 + gamma * 0 - V1 = 1 + 0 - 0 = 1 -> A1 = 1
    #   (V2 = 100 sits on an untrained position: it must not be used as the next value)
    # t=0: delta = 0 + 1 * V1 - V0 = 0 -> A0 = 0 + gamma * lam * A1 = 0.95
    # t=2: untrained -> 0
    assert out.advantages[0].tolist() == [approx(0.95), approx(1.0), 0.0]
    # returns = A + V on trained tokens: [0.95 + 0, 1 + 0, 0]
    assert out.returns[0].tolist() == [approx(0.95), approx(1.0), 0.0]


def test_gae_outcome_on_last_trained_token_and_skips_interior_untrained_tokens():
    # Multi-turn layout: trained, untrained (tool output), trained. Outcome 1 at t=2.
    batch = AdvantageInput(
        rewards=T([1.0]),
        mask=T([[1, 0, 1]], dtype=torch.bool),
        groups=T([0]),
        values=T([[0.5, 7.0, 0.25]]),
    )
    out, _ = gae(batch, AdvantageParams(gamma=0.9, lam=0.5, whiten=False))
    # t=2: delta = 1 + 0 - 0.25 = 0.75 -> A2 = 0.75
    # t=1: untrained, skipped (its value 7 never used)
    # t=0: delta = 0 + 0.9 * V2 - V0 = 0.225 - 0.5 = -0.275; A0 = -0.275 + 0.45 * 0.75 = 0.0625
    assert out.advantages[0].tolist() == [approx(0.0625), 0.0, approx(0.75)]


# ----------------------------------------------------------------------------- e. overlong


def test_e_soft_overlong_punishment():
    # L_max 20, cache 5: free up to 15 tokens. 14 -> 0; 17 -> (15 - 17) / 5 = -0.4;
    # 20 -> (15 - 20) / 5 = -1.0; 21 (beyond L_max) -> -1
    out = soft_overlong_penalty(T([14, 17, 20, 21]), max_len=20, cache=5)
    assert out.tolist() == [0.0, approx(-0.4), approx(-1.0), -1.0]


def test_soft_overlong_rejects_a_cache_longer_than_the_budget():
    with pytest.raises(ValueError, match="cache"):
        soft_overlong_penalty(T([3]), max_len=4, cache=5)


# (The overlong *filter* is tested through build_samples and the backend in test_rollout.py
# and tests/backends/test_torch_backend.py.)


# ----------------------------------------------------------------------------- f. one sample


@pytest.mark.parametrize("estimator", [rloo, reinforce_pp_baseline])
def test_f_leave_one_out_and_baseline_refuse_groups_of_one(estimator):
    with pytest.raises(ValueError, match="at least 2 samples"):
        estimator(outcome([1.0, 0.0], ["a", "b"]), NO_WHITEN)


def test_f_reinforce_pp_with_one_sample_per_prompt_is_not_all_zero():
    # Outcomes [1, 0, 0, 1], one token each, all different prompts: returns = outcomes;
    # global whitening: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # -> (+-0.5) / 0.57735 = +-0.866025
    out = reinforce_pp(outcome([1.0, 0.0, 0.0, 1.0], ["a", "b", "c", "d"]), AdvantageParams(eps=0))
    z = 0.5 / math.sqrt(1 / 3)  # 0.866025
    assert adv0(out) == [approx(z), approx(-z), approx(-z), approx(z)]


# ----------------------------------------------------------------------------- g. filtering


def test_g_dynamic_sampling_keeps_a_group_of_one():
    # groups: a = [1, 1] (equal: dropped), b = [0] (one sample: std undefined, kept),
    # c = [1, 0] (varied: kept)
    keep, metrics = varied_groups(T([1.0, 1.0, 0.0, 1.0, 0.0]), T([0, 0, 1, 2, 2]))
    assert keep.tolist() == [False, True, True]
    assert metrics["filter/dropped_groups"] == 1.0


# (That the dynamic-sampling loop stops after algorithm.max_sampling_rounds is tested in
# tests/test_loop.py with an engine whose groups are always all-equal.)


# ----------------------------------------------------------------------------- advantages


def test_grpo_golden_unbiased_std():
    # [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = sqrt(0.25) = 0.5
    # -> (1 - 0.25) / 0.5 = 1.5; (0 - 0.25) / 0.5 = -0.5
    out = grpo(outcome([1.0, 0.0, 0.0, 0.0], ["p"] * 4), AdvantageParams(eps=0.0))
    assert adv0(out) == [approx(1.5), approx(-0.5), approx(-0.5), approx(-0.5)]


def test_grpo_equal_rewards_give_zero_finite_advantages():
    # mean 1, deviations 0, std 0: 0 / (0 + eps) = 0, never nan
    out, metrics = grpo(outcome([1.0] * 4, ["p"] * 4), AdvantageParams())
    assert out.advantages.tolist() == [[0.0]] * 4
    assert metrics["adv/zero_variance_samples"] == 4.0


def test_groups_by_prompt_id_not_position():
    # A: [1, 0, 1] has mean 2/3 -> [1/3, -2/3, 1/3]; B: [1, 1, 0, 0] has mean 1/2 -> +-1/2
    ids = ["A", "B", "A", "B", "B", "A", "B"]
    out = dr_grpo(outcome([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], ids), NO_WHITEN)
    a = adv0(out)
    assert [a[i] for i, g in enumerate(ids) if g == "A"] == [
        approx(1 / 3),
        approx(-2 / 3),
        approx(1 / 3),
    ]
    assert [a[i] for i, g in enumerate(ids) if g == "B"] == [0.5, 0.5, -0.5, -0.5]


def test_grpo_singleton_group_gets_zero_and_is_counted():
    out, metrics = grpo(outcome([1.0, 1.0, 0.0], ["a", "b", "b"]), AdvantageParams())
    assert adv0(out)[0] == 0.0
    assert metrics["adv/singleton_groups"] == 1.0


def test_rloo_golden():
    # [1, 0, 0]: baselines are the means of the others: [0, 0.5, 0.5]
    # -> A = [1, -0.5, -0.5] (= 3/2 * (r - 1/3) = [1, -0.5, -0.5])
    out = rloo(outcome([1.0, 0.0, 0.0], ["p"] * 3), NO_WHITEN)
    assert adv0(out) == [approx(1.0), approx(-0.5), approx(-0.5)]


def test_remax_golden_and_requires_baselines():
    # greedy baseline of prompt p is 0.5: [1, 0] -> [0.5, -0.5]
    out = remax(outcome([1.0, 0.0], ["p", "p"], baselines=T([0.5, 0.5])), NO_WHITEN)
    assert adv0(out) == [0.5, -0.5]
    with pytest.raises(ValueError, match="baseline"):
        remax(outcome([1.0, 0.0], ["p", "p"]), NO_WHITEN)


def test_reinforce_pp_returns_to_go_with_kl_reward():
    # One sample, 3 trained tokens, token rewards (KL penalty) [-0.1, -0.2, -0.3], outcome 1.
    # r = [-0.1, -0.2, -0.3 + 1] = [-0.1, -0.2, 0.7]; gamma 1: G = [0.4, 0.5, 0.7]
    # whiten over the 3 tokens: mean 0.5333, unbiased std = sqrt((0.01778 + 0.00111 + 0.02778)
    # / 2) = sqrt(0.023333) = 0.152753 -> [-0.872872, -0.218218, 1.091089]
    batch = AdvantageInput(
        T([1.0]), torch.ones(1, 3, dtype=torch.bool), T([0]), token_rewards=T([[-0.1, -0.2, -0.3]])
    )
    out, _ = reinforce_pp(batch, AdvantageParams(eps=0.0))
    assert out.advantages[0].tolist() == [
        approx(-0.872872, abs=1e-5),
        approx(-0.218218, abs=1e-5),
        approx(1.091089, abs=1e-5),
    ]


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # Group [1, 0] and group [1, 1], one token each: outcomes minus group means
    # = [0.5, -0.5, 0, 0]; whiten: mean 0, unbiased std sqrt(0.5 / 3) = 0.408248
    # -> [1.224745, -1.224745, 0, 0]
    out = reinforce_pp_baseline(
        outcome([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]), AdvantageParams(eps=0.0)
    )
    assert adv0(out) == [approx(1.224745, abs=1e-5), approx(-1.224745, abs=1e-5), 0.0, 0.0]


def test_kl_in_reward_enters_the_sequence_reward_of_outcome_estimators():
    # Dr. GRPO over two samples of one prompt, outcomes [1, 1] but sample 0 paid a KL penalty
    # of -0.2 on each of its 2 tokens: R = [0.6, 1.0], mean 0.8 -> A = [-0.2, +0.2]
    batch = AdvantageInput(
        T([1.0, 1.0]),
        torch.ones(2, 2, dtype=torch.bool),
        T([0, 0]),
        token_rewards=T([[-0.2, -0.2], [0.0, 0.0]]),
    )
    out, _ = dr_grpo(batch, NO_WHITEN)
    assert out.advantages.tolist() == [[approx(-0.2), approx(-0.2)], [approx(0.2), approx(0.2)]]


def test_every_estimator_zeroes_untrained_tokens():
    batch = AdvantageInput(
        T([1.0, 0.0]),
        T([[0, 1, 1], [0, 1, 0]], dtype=torch.bool),
        T([0, 0]),
        values=T([[5.0, 0.1, 0.2], [5.0, 0.3, 9.0]]),
        baselines=T([0.5, 0.5]),
    )
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        out, _ = estimator(batch, AdvantageParams())
        assert (
            out.advantages[0, 0] == 0 and out.advantages[1, 0] == 0 and out.advantages[1, 2] == 0
        ), name
        assert torch.isfinite(out.advantages).all(), name


# ----------------------------------------------------------------------------- policy losses

P = PolicyLossParams(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)
ONE = T([True])
SEG = T([0])


def test_ppo_clip_golden():
    # ratio = exp(-1.0 - -1.2) = exp(0.2) = 1.2214; A = +1: unclipped 1.2214, clipped 1.2;
    # loss = -min(1.2214, 1.2) = -1.2, the clipped term active
    loss, metrics = ppo_clip(T([-1.0]), T([-1.2]), T([1.0]), ONE, SEG, P)
    assert loss.item() == approx(-1.2)
    assert metrics["ratio/mean"] == approx(math.exp(0.2))
    assert metrics["clip/fraction"] == 1.0 and metrics["clip/high_fraction"] == 1.0


def test_ppo_negative_advantage_uses_lower_clip():
    # ratio exp(-0.5) = 0.6065 < 0.8; A = -1: -min(-0.6065, -0.8) = 0.8
    loss, metrics = ppo_clip(T([-1.5]), T([-1.0]), T([-1.0]), ONE, SEG, P)
    assert loss.item() == approx(0.8)
    assert metrics["clip/low_fraction"] == 1.0


def test_dapo_clip_higher():
    # eps_low 0.2, eps_high 0.28: ratio 1.25, A = +1 -> unclipped (1.25 < 1.28): loss -1.25;
    # symmetric 0.2 would clip it to -1.2
    high = PolicyLossParams(0.2, 0.28, 3.0)
    lp, old = T([math.log(1.25)]), T([0.0])
    assert ppo_clip(lp, old, T([1.0]), ONE, SEG, high)[0].item() == approx(-1.25)
    assert ppo_clip(lp, old, T([1.0]), ONE, SEG, P)[0].item() == approx(-1.2)


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio e^2 = 7.389, A = -1: PPO loss = max(7.389, 0.8) = 7.389; dual-clip c = 3 -> 3.0
    lp, old, a = T([2.0]), T([0.0]), T([-1.0])
    loss, metrics = ppo_clip(lp, old, a, ONE, SEG, P)
    assert loss.item() == approx(3.0)
    assert metrics["clip/dual_fraction"] == 1.0
    no_dual = PolicyLossParams(0.2, 0.2, 0.0)
    assert ppo_clip(lp, old, a, ONE, SEG, no_dual)[0].item() == approx(math.exp(2.0), rel=1e-6)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # Sequence 0: log ratios [0.1, 0.3] (third token masked, log ratio 5 ignored)
    # -> s_0 = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 on every token; A = +1, eps_high 0.3
    # -> not clipped: loss = -1.2214 per token. Sequence 1: log ratio -1 -> s_1 = e^-1 = 0.3679,
    # A = +1 -> -min(0.3679, 0.8) = -0.3679.
    lp = T([0.1, 0.3, 5.0, -1.0], requires_grad=True)
    old = torch.zeros(4)
    mask = T([True, True, False, True])
    loss, _ = gspo(
        lp, old, T([1.0, 1.0, 1.0, 1.0]), mask, T([0, 0, 0, 1]), PolicyLossParams(0.2, 0.3, 0.0)
    )
    assert loss[0].item() == approx(-math.exp(0.2)) and loss[1].item() == approx(-math.exp(0.2))
    assert loss[3].item() == approx(-math.exp(-1.0))
    # Gradient: in the token form d loss_t / d lp_t = -s_0. Aggregated seq-mean-token-mean over
    # 2 sequences: total = ((loss_0 + loss_1) / 2 + loss_3) / 2, so d total / d lp_0 = -s_0 / 4.
    # The sequence objective gives the same: -s_0 / 2 with d s_0 / d lp_0 = s_0 / 2 -> -s_0 / 4.
    agg = AGGREGATIONS["seq-mean-token-mean"](loss, mask, T([0, 0, 0, 1]), StepTotals(3, 2))
    agg.backward()
    assert lp.grad[0].item() == approx(-math.exp(0.2) / 4)
    assert lp.grad[2].item() == 0.0


def test_vanilla_pg_gradient_is_minus_advantage_on_policy():
    # on-policy (lp == old): loss = -1 * A; d loss / d lp = -A * ratio = -A
    lp = T([-0.7], requires_grad=True)
    loss, _ = vanilla_pg(lp, T([-0.7]), T([2.0]), ONE, SEG, P)
    loss.sum().backward()
    assert loss.item() == approx(-2.0) and lp.grad.item() == approx(-2.0)


def test_value_loss_clipped():
    # V_old 0, V 1, R 2, clip 0.2: unclipped (1 - 2)^2 = 1; clipped V = 0.2 -> (0.2 - 2)^2 = 3.24
    # -> 0.5 * max(1, 3.24) = 1.62; without clipping 0.5 * 1 = 0.5
    assert value_loss(T([1.0]), T([0.0]), T([2.0]), 0.2)[0].item() == approx(1.62)
    assert value_loss(T([1.0]), T([0.0]), T([2.0]), 0.0)[0].item() == approx(0.5)


# ----------------------------------------------------------------------------- mismatch / IS


def test_importance_sampling_weights_golden():
    # token log weights old - behavior = [1.0, 0.5] -> raw w = [2.71828, 1.64872], C = 2
    old, beh, mask, seg = T([-1.0, -1.5]), T([-2.0, -2.0]), T([True, True]), T([0, 1])
    # TIS truncates at C: [2.0, 1.64872]
    assert IS_CORRECTIONS["tis_token"](old, beh, mask, seg, 2.0)[0].tolist() == [
        approx(2.0),
        approx(math.exp(0.5)),
    ]
    # MIS drops weights outside [1/2, 2]: [0, 1.64872]
    assert IS_CORRECTIONS["mis_token"](old, beh, mask, seg, 2.0)[0].tolist() == [
        0.0,
        approx(math.exp(0.5)),
    ]
    # Sequence level, both tokens in one sequence: log w = 1.5 -> w = 4.4817 on both tokens;
    # TIS -> 2.0, MIS -> 0 (the whole sequence dropped)
    one = T([0, 0])
    assert IS_CORRECTIONS["tis_seq"](old, beh, mask, one, 2.0)[0].tolist() == [2.0, 2.0]
    assert IS_CORRECTIONS["mis_seq"](old, beh, mask, one, 2.0)[0].tolist() == [0.0, 0.0]


def test_mismatch_metrics_golden():
    # trainer [-1.0, -2.0], engine [-1.5, -2.0]:
    # |diff| mean = (0.5 + 0) / 2 = 0.25; k1 = mean(engine - trainer) = (-0.5 + 0) / 2 = -0.25;
    # k3 with log r = trainer - engine = [0.5, 0]: (e^0.5 - 1 - 0.5 + 0) / 2 = 0.0743606
    m = mismatch_metrics(T([-1.0, -2.0, 9.0]), T([-1.5, -2.0, 0.0]), T([True, True, False]))
    assert m["mismatch/abs_logprob_diff"] == approx(0.25)
    assert m["mismatch/kl_k1"] == approx(-0.25)
    assert m["mismatch/kl_k3"] == approx((math.exp(0.5) - 1.5) / 2)


def test_mismatch_max_abs_logprob_diff_golden():
    # trainer [-1.0, -2.0, -0.5, 9.0], engine [-1.5, -0.8, -0.5, 0.0], the last token masked
    # out: |diff| = [0.5, 1.2, 0.0, (9.0, not trained)] -> max 1.2 (mean 1.7 / 3 = 0.566667)
    m = mismatch_metrics(
        T([-1.0, -2.0, -0.5, 9.0]), T([-1.5, -0.8, -0.5, 0.0]), T([True, True, True, False])
    )
    assert m["mismatch/max_abs_logprob_diff"] == approx(1.2)
    assert m["mismatch/abs_logprob_diff"] == approx(1.7 / 3)
    # reduced as a maximum across micro-batches, mini-batches and ranks
    assert m["mismatch/max_abs_logprob_diff"].reduction is Reduction.MAX
    # nothing trained: 0.0, not an error
    none = mismatch_metrics(T([-1.0]), T([-3.0]), T([False]))
    assert none["mismatch/max_abs_logprob_diff"] == 0.0


def test_decoupled_ppo_across_two_policy_versions_golden():
    # One sample, two trained tokens: token 0 sampled by policy version 0 (mu = 0.5), token 1
    # by version 1 after a weight sync (mu = 0.25), a partial rollout. The trainer, now at
    # version 2, recomputed pi_prox = [0.4, 0.3] before the update and is at pi_theta =
    # [0.44, 0.45] mid-update; A = 1, eps 0.2, C = 2.
    # behaviour weights w = pi_prox / mu = [0.8, 1.2]; ratios u = pi_theta / pi_prox = [1.1, 1.5]
    # token 0: -0.8 * min(1.1, clip(1.1, 0.8, 1.2)) = -0.8 * 1.1 = -0.88
    # token 1: -1.2 * min(1.5, 1.2) = -1.2 * 1.2 = -1.44  (clipped: no gradient through u)
    # token-mean: (-0.88 - 1.44) / 2 = -1.16
    lp = torch.log(T([0.44, 0.45])).requires_grad_()
    prox, mu = torch.log(T([0.4, 0.3])), torch.log(T([0.5, 0.25]))
    mask, seg, adv = T([True, True]), T([0, 0]), T([1.0, 1.0])
    w, metrics = IS_CORRECTIONS["decoupled"](prox, mu, mask, seg, 2.0)
    assert w.tolist() == [approx(0.8), approx(1.2)]
    per_token, _ = ppo_clip(lp, prox, adv, mask, seg, PolicyLossParams(0.2, 0.2))
    loss = (per_token * w).mean()
    assert loss.item() == approx(-1.16)
    loss.backward()
    # d/d lp_0 of -0.8 * exp(lp_0 - prox_0) / 2 = -0.8 * 1.1 / 2 = -0.44; token 1 is clipped: 0
    assert lp.grad.tolist() == [approx(-0.44), approx(0.0)]
    # a token the behaviour policy sampled 3x more rarely than pi_prox (w = 3 > C = 2) drops
    w, metrics = IS_CORRECTIONS["decoupled"](torch.log(T([0.6])), torch.log(T([0.2])), T([True]),
                                            T([0]), 2.0)  # fmt: skip
    assert w.tolist() == [0.0] and metrics["is/modified_fraction"] == approx(1.0)
