"""The typed metric and its reductions over micro-batches, ranks and optimizer steps."""

from __future__ import annotations

import json
import pickle

import pytest

from treadle.core.metrics import Metric, Reduction, accumulate, mean_over_steps, merge_ranks

MEAN, SUM, MAX, STEP = Reduction.MEAN, Reduction.SUM, Reduction.MAX, Reduction.STEP


def test_a_metric_is_the_float_it_holds_and_keeps_its_reduction_across_processes():
    m = Metric(0.25, MAX)
    assert m == 0.25 and m + 1 == 1.25 and f"{m:.2f}" == "0.25"
    assert json.dumps({"x": m}) == '{"x": 0.25}'  # logged as the number
    back = pickle.loads(pickle.dumps(m))  # a Ray trainer rank's metrics cross a pickle
    assert back == 0.25 and back.reduction is MAX
    assert Metric(3.0).reduction is MEAN


def test_micro_batches_weigh_means_by_their_share_of_the_step_tokens():
    # Shares 2/8 and 6/8 of the step's trained tokens: mean 1.0 * 0.25 + 0.5 * 0.75 = 0.625;
    # a mean of the means would say 0.75. Sums add (0.25 + 0.375), maxima stay maxima.
    first = {"m": Metric(1.0, MEAN), "s": Metric(0.25, SUM), "x": Metric(1.5, MAX)}
    second = {"m": Metric(0.5, MEAN), "s": Metric(0.375, SUM), "x": Metric(1.25, MAX)}
    out = accumulate([(first, 0.25), (second, 0.75)])
    assert out == {"m": 0.625, "s": 0.625, "x": 1.5}
    assert [out[k].reduction for k in ("m", "s", "x")] == [MEAN, SUM, MAX]


def test_a_metric_without_a_reduction_or_per_step_is_refused_per_micro_batch():
    with pytest.raises(TypeError, match="'plain' is a plain float"):
        accumulate([({"plain": 0.5}, 1.0)])
    with pytest.raises(ValueError, match="per optimizer step"):
        accumulate([({"lr": Metric(1e-3, STEP)}, 1.0)])


def test_ranks_add_their_shares_and_give_per_step_values_once():
    # Rank 0 holds 3/8 of the step's tokens at a mean of 2.0 (share 0.75), rank 1 5/8 at 0.4
    # (share 0.25): the step's mean is 0.75 + 0.25 = 1.0. Rank 1 trained no token with a ratio.
    ranks = [
        {"m": Metric(0.75, MEAN), "lr": Metric(1e-3, STEP), "r": Metric(1.2, MAX)},
        {"m": Metric(0.25, MEAN), "lr": Metric(1e-3, STEP)},
    ]
    assert merge_ranks(ranks) == {"m": 1.0, "lr": 1e-3, "r": 1.2}


def test_optimizer_steps_average_except_maxima_and_a_first_step_only_metric_is_kept():
    steps = [
        {"loss": Metric(0.5, SUM), "r": Metric(1.1, MAX), "mismatch/kl": Metric(0.02, MEAN)},
        {"loss": Metric(0.25, SUM), "r": Metric(1.3, MAX)},  # measured before the first update
    ]
    assert mean_over_steps(steps) == {"loss": 0.375, "r": 1.3, "mismatch/kl": 0.02}
    one = mean_over_steps([{"g": Metric(0.1 + 0.2, STEP)}])["g"]
    assert one == 0.1 + 0.2  # one step's value to the last bit (0.30000000000000004)
