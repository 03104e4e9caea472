"""The evaluation math: the unbiased pass@k estimator against values worked by hand, and
:func:`evaluate` on a model-free engine whose samples are known."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from tests.contracts.fakes import FakeEngine
from treadle.config import RewardConfig, RewardSpec
from treadle.core.protocols import SamplingParams
from treadle.core.types import Message, Task
from treadle.rewards.pool import RewardPool
from treadle.rollout.evaluate import evaluate, pass_at_k
from treadle.store.models import build_tokenizer


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 1, 0.3),  # k=1 is c/n: 1 - C(7,1)/C(10,1) = 1 - 7/10
        (8, 1, 4, 0.5),  # 1 - C(7,4)/C(8,4) = 1 - 35/70
        (4, 0, 2, 0.0),  # nothing right: C(4,2)/C(4,2) = 1
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a right one (C(1,2) = 0)
        (4, 1, 4, 1.0),  # k = n: at least one of all n right
    ],
)
def test_pass_at_k_matches_values_worked_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_a_float():
    # C(1000, 500) ~ 2.7e299 and C(990, 500) are near the float limit; the exact ratio by
    # fractions: 1 - C(990,500)/C(1000,500).
    exact = 1 - Fraction(math.comb(990, 500), math.comb(1000, 500))
    assert pass_at_k(1000, 10, 500) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, rel=1e-12)  # 1 - 1999!/.. = 1000/2000


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="need 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)


def test_evaluate_reports_each_k_and_keeps_every_sample():
    tokenizer = build_tokenizer([f"{d}" for d in range(10)] * 5, 300)
    engine = FakeEngine(tokenizer)  # sample j is the digit j, greedy is sample 0's "0"
    # "0" and "2" are right: 2 of the 4 samples ("0", "1", "2", "3") of every prompt.
    spec = RewardSpec("format", params={"pattern": "^[02]$"})
    pool = RewardPool.from_config(RewardConfig(functions=[spec], workers=0))
    tasks = [Task(f"t{i}", (Message("user", f"q{i}"),), "0", "math") for i in range(3)]
    try:
        result = evaluate(engine, tokenizer, pool, tasks, SamplingParams(n=4), ks=[2, 4])
    finally:
        pool.close()
    assert result.pass_at == pytest.approx({1: 0.5, 2: 5 / 6, 4: 1.0})  # c=2 of n=4, as above
    assert result.pass_at_1 == pytest.approx(0.5) and result.pass_at_k == 1.0
    assert result.greedy_accuracy == 1.0 and result.prompts == 3
    metrics = result.metrics()
    assert metrics["eval/pass@2"] == pytest.approx(5 / 6) and metrics["eval/pass@k"] == 1.0
    assert len(result.samples) == 3 * 4 + 3  # the sampled ones, then one greedy per prompt
    first, greedy = result.samples[2], result.samples[-1]
    assert (first.task_id, first.completion, first.sample_index, first.correct) == (
        "t0",
        "2",
        2,
        True,
    )
    assert (greedy.task_id, greedy.greedy, greedy.completion, greedy.gold) == ("t2", True, "0", "0")
    assert first.finish_reason == "stop" and first.prompt == "q0"
