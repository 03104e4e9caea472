"""Golden tests of the options that reproduce a peer framework's form (ALGORITHMS.md,
"Conformance with verl, TRL and OpenRLHF"); every number is worked by hand in a comment."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conformance import treadle_side
from treadle.algorithms.advantages import (
    AdvantageInput,
    AdvantageParams,
    reinforce_pp_baseline,
    remax,
)
from treadle.algorithms.aggregation import seq_mean_token_sum_norm, token_sum_norm
from treadle.config import load_config
from treadle.core.batch import StepTotals
from treadle.core.errors import UserError
from treadle.core.types import TrainSample
from treadle.rollout.samples import drop_rejected


def test_token_sum_norm_is_verls_seq_mean_token_sum_norm():
    # losses 1, 2, 3 (sample 0) and 4 (sample 1), C = 10:
    # token-sum-norm = (1 + 2 + 3 + 4) / 10 = 1.0; Dr. GRPO's = 10 / (2 samples * 10) = 0.5
    loss, mask = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4, dtype=torch.bool)
    segments, totals = torch.tensor([0, 0, 0, 1]), StepTotals(4, 2, 10.0)
    assert float(token_sum_norm(loss, mask, segments, totals)) == pytest.approx(1.0)
    assert float(seq_mean_token_sum_norm(loss, mask, segments, totals)) == pytest.approx(0.5)


def _rpp_batch() -> AdvantageInput:
    # one group of two 2-token samples, outcomes 1 and 0, a KL penalty -0.5 on sample 0's first
    return AdvantageInput(
        rewards=torch.tensor([1.0, 0.0]),
        mask=torch.ones(2, 2, dtype=torch.bool),
        groups=torch.tensor([0, 0]),
        token_rewards=torch.tensor([[-0.5, 0.0], [0.0, 0.0]]),
    )


def test_reinforce_pp_baseline_sequence_credit_is_verls_form():
    # R = [1 - 0.5, 0] = [0.5, 0], group mean 0.25 -> R - mean = [0.25, -0.25] on every token:
    # x = [0.25, 0.25, -0.25, -0.25], mean 0, unbiased var = 4 * 0.0625 / 3 = 1/12,
    # std = 0.288675 -> A = +-0.25 / 0.288675 = +-0.866025
    out, _ = reinforce_pp_baseline(_rpp_batch(), AdvantageParams(credit="sequence"))
    assert out.advantages.flatten().tolist() == pytest.approx(
        [0.866025, 0.866025, -0.866025, -0.866025], abs=1e-5
    )


def test_reinforce_pp_baseline_default_credits_the_reward_to_go():
    # outcome - group mean = [0.5, -0.5] on the last tokens; sample 0's first token adds -0.5:
    # returns x = [-0.5 + 0.5, 0.5, -0.5, -0.5] = [0, 0.5, -0.5, -0.5], mean -0.125,
    # deviations [0.125, 0.625, -0.375, -0.375], squares sum 0.6875, var 0.6875 / 3 = 0.229167,
    # std 0.478714 -> A = [0.26112, 1.30558, -0.78335, -0.78335]
    out, _ = reinforce_pp_baseline(_rpp_batch(), AdvantageParams())
    assert out.advantages.flatten().tolist() == pytest.approx(
        [0.26112, 1.30558, -0.78335, -0.78335], abs=1e-5
    )


def test_remax_to_go_credit_is_verls_form():
    # outcome 1, KL penalties -0.1, -0.2, -0.3, greedy baseline 0.5
    batch = AdvantageInput(
        rewards=torch.tensor([1.0]),
        mask=torch.ones(1, 3, dtype=torch.bool),
        groups=torch.tensor([0]),
        token_rewards=torch.tensor([[-0.1, -0.2, -0.3]]),
        baselines=torch.tensor([0.5]),
    )
    # sequence (default): R = 1 - 0.6 = 0.4, A = 0.4 - 0.5 = -0.1 on every token
    out, _ = remax(batch, AdvantageParams())
    assert out.advantages.flatten().tolist() == pytest.approx([-0.1, -0.1, -0.1], abs=1e-6)
    # to_go: G = [1 - 0.6, 1 - 0.5, 1 - 0.3] = [0.4, 0.5, 0.7], A = G - 0.5 = [-0.1, 0, 0.2]
    out, _ = remax(batch, AdvantageParams(credit="to_go"))
    assert out.advantages.flatten().tolist() == pytest.approx([-0.1, 0.0, 0.2], abs=1e-6)


def _sample() -> TrainSample:
    # token 1's ratio pi_old / mu = e^1 = 2.718 is outside [1/2, 2]: mis_token rejects it
    return TrainSample(
        token_ids=[1, 2, 3],
        loss_mask=[True, True, True],
        behavior_logprobs=[0.0, 0.0, 0.0],
        advantages=[0.0, 0.0, 0.0],
        policy_version=0,
        group_id="g",
        old_logprobs=[0.0, 1.0, 0.0],
    )


def test_mis_denominator_kept_takes_rejected_tokens_out_of_the_loss_mask():
    cfg = treadle_side.algorithm(
        {"algorithm.importance_sampling": "mis_token", "algorithm.mis_denominator": "kept"}
    )
    sample = _sample()
    metrics = drop_rejected([sample], cfg)
    assert sample.loss_mask == [True, False, True]
    assert metrics["is/rejected_tokens"] == 1.0
    assert metrics["is/rejected_fraction"] == pytest.approx(1 / 3)
    # the mismatch metrics still see the rejected token: |logp - mu| = 1 there, 0 elsewhere,
    # so the largest is 1.0 and the mean 1/3 (the trainer's own would say 0 on the kept two)
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(1.0)
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(1 / 3)
    default = treadle_side.algorithm({"algorithm.importance_sampling": "mis_token"})
    sample = _sample()
    assert drop_rejected([sample], default) == {} and sample.loss_mask == [True] * 3


def test_mis_denominator_changes_the_token_mean_by_the_rejected_share():
    # per-token losses 1, 2, 3 with token 1 rejected: all = (1 + 0 + 3) / 3 = 1.3333;
    # kept = (1 + 3) / 2 = 2.0
    inputs = {
        "old_logprobs": [[0.0, 1.0, 0.0]],
        "behavior_logprobs": [[0.0, 0.0, 0.0]],
        "loss": [[1.0, 2.0, 3.0]],
        "mask": [[1, 1, 1]],
        "C": 2.0,
    }
    options = {"algorithm.importance_sampling": "mis_token"}
    assert treadle_side.importance_sampling(inputs, options) == pytest.approx([4 / 3])
    kept = options | {"algorithm.mis_denominator": "kept"}
    assert treadle_side.importance_sampling(inputs, kept) == pytest.approx([2.0])


def test_entropy_bonus_means_coef_times_mean_token_entropy_by_default():
    # entropies 1, 2, 3 (sample 0) and 4 (sample 1), coef 0.1, loss_agg seq-mean-token-sum:
    # default: 0.1 * (1 + 2 + 3 + 4) / 4 tokens = 0.25; entropy_agg=loss_agg (verl):
    # 0.1 * (6 + 4) / 2 samples = 0.5
    inputs = {
        "entropy": [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]],
        "mask": [[1, 1, 1], [1, 0, 0]],
        "coef": 0.1,
        "C": 3,
    }
    options = {"algorithm.loss_agg": "seq-mean-token-sum"}
    assert treadle_side.entropy(inputs, options) == pytest.approx([0.25])
    verl = options | {"algorithm.entropy_agg": "loss_agg"}
    assert treadle_side.entropy(inputs, verl) == pytest.approx([0.5])


def test_off_policy_mask_drops_a_drifted_negative_sample_from_the_loss():
    # both samples drift 0.5 nats per token (mu - logp = -0.5 - -1); advantages -1 and +1.
    # ratio vs mu = e^-0.5 = 0.60653. A = -1: max(0.60653, clip 0.8) = 0.8 per token;
    # A = +1: max(-0.60653, -0.8) = -0.60653 per token.
    # off: token-mean (0.8 + 0.8 - 0.60653 - 0.60653) / 4 = 0.096735
    # threshold 0.4 < 0.5: sample 0 dropped -> (-0.60653 * 2) / 4 = -0.303265
    # threshold 0.5: drift 0.5 <= 0.5 keeps it -> 0.096735
    inputs = {
        "logprobs": [[-1.0, -1.0], [-1.0, -1.0]],
        "old_logprobs": [[-0.5, -0.5], [-0.5, -0.5]],
        "advantages": [[-1.0, -1.0], [1.0, 1.0]],
        "mask": [[1, 1], [1, 1]],
    }
    ratio = math.exp(-0.5)
    assert treadle_side.policy_loss(inputs, {}) == pytest.approx([(1.6 - 2 * ratio) / 4])
    masked = treadle_side.policy_loss(inputs, {"algorithm.off_policy_mask": 0.4})
    assert masked == pytest.approx([-2 * ratio / 4])
    assert treadle_side.policy_loss(inputs, {"algorithm.off_policy_mask": 0.5}) == pytest.approx(
        [(1.6 - 2 * ratio) / 4]
    )


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["algorithm.token_reward_credit=sequence"], "algorithm.token_reward_credit"),
        (["algorithm.mis_denominator=kept"], "algorithm.mis_denominator"),
        (
            ["algorithm.importance_sampling=tis_token", "algorithm.mis_denominator=kept"],
            "tis_token drops none",
        ),
    ],
)
def test_a_peer_option_where_it_would_do_nothing_is_refused(overrides, names):
    with pytest.raises(UserError, match=names):
        load_config(None, overrides)
