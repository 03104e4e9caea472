"""Tests for treadle.rollout: scoring into groups and building flat training samples."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from treadle.config import AlgorithmConfig
from treadle.core.types import Completion, FinishReason, Message, Rollout, RolloutGroup, Task
from treadle.rewards.base import Score
from treadle.rewards.pool import BatchScores
from treadle.rollout.generate import Generated, score
from treadle.rollout.samples import assign_advantages, build_samples, filter_groups, outcome_rewards

END_OF_TURN = 2  # the engine's end-of-turn token id in these fakes


def task(task_id: str) -> Task:
    return Task(task_id, (Message("user", task_id),), "1", "math")


def completion(
    token_ids: Sequence[int],
    finish: FinishReason = FinishReason.STOP,
    version: int = 3,
    text: str = "",
) -> Completion:
    # Distinct, recognisable engine logprobs: -0.1, -0.2, ... per sampled token.
    logprobs = tuple(-0.1 * (i + 1) for i in range(len(token_ids)))
    return Completion(tuple(token_ids), logprobs, finish, version, text)


def group(task_id: str, prompt: Sequence[int], rewards: Sequence[float]) -> RolloutGroup:
    rollouts = tuple(
        Rollout(completion([10 + i, 20 + i, END_OF_TURN]), r, r > 0) for i, r in enumerate(rewards)
    )
    return RolloutGroup(task(task_id), tuple(prompt), rollouts)


def build(groups, cfg: AlgorithmConfig, max_tokens: int = 32):
    """build_samples, then the configured advantages, as the loop runs them."""
    samples, metrics = build_samples(groups, cfg)
    rewards, reward_metrics = outcome_rewards(groups, cfg, max_tokens)
    return samples, metrics | reward_metrics | assign_advantages(samples, rewards, cfg)


def test_sample_is_prompt_plus_completion_with_end_of_turn_trained():
    g = RolloutGroup(
        task("A"),
        (5, 6, 7, 8),
        (
            Rollout(completion([11, 12, 13, END_OF_TURN], version=7), 1.0, True),
            Rollout(completion([14, END_OF_TURN], version=7), 0.0, False),
        ),
    )
    samples, metrics = build([g], AlgorithmConfig(advantage="dr_grpo"))
    s = samples[0]
    assert s.token_ids == [5, 6, 7, 8, 11, 12, 13, END_OF_TURN]  # the completion tokens unchanged
    # Exactly the 4 completion tokens are trained, the final end-of-turn token included.
    assert s.loss_mask == [False] * 4 + [True] * 4
    # Index t of behavior_logprobs is the engine's logprob of token_ids[t]; prompt positions 0.
    assert s.behavior_logprobs == pytest.approx([0.0] * 4 + [-0.1, -0.2, -0.3, -0.4])
    # Rewards [1, 0], mean 0.5 -> advantages +0.5 / -0.5 on the completion tokens only.
    assert s.advantages == [0.0] * 4 + [0.5] * 4
    assert samples[1].advantages == [0.0] * 4 + [-0.5] * 2
    assert s.policy_version == 7 and s.group_id == "A" and s.ref_logprobs == []
    assert all(len(x) == len(x.token_ids) for x in samples)
    assert len(samples[1].behavior_logprobs) == len(samples[1].loss_mask) == 6
    # Both completions ended with end-of-turn (STOP): nothing was truncated.
    assert metrics["rollout/truncated_fraction"] == 0.0
    assert metrics["rollout/mean_length"] == 3.0  # (4 + 2) / 2
    assert (metrics["rollout/min_length"], metrics["rollout/max_length"]) == (2.0, 4.0)


def test_truncated_fraction_counts_only_length_completions():
    finishes = [
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.LENGTH,
        FinishReason.STOP,
        FinishReason.STOP,
        FinishReason.STOP,
    ]
    rollouts = tuple(
        Rollout(completion([9] * (i + 1), f), float(i % 2), False) for i, f in enumerate(finishes)
    )
    _, metrics = build_samples([RolloutGroup(task("A"), (1,), rollouts)], AlgorithmConfig())
    assert metrics["rollout/truncated_fraction"] == pytest.approx(2 / 7)  # ABORT is not LENGTH
    assert metrics["rollout/mean_length"] == pytest.approx(4.0)  # (1 + 2 + ... + 7) / 7 = 28 / 7
    # lengths 1..7: the shortest and the longest completion
    assert (metrics["rollout/min_length"], metrics["rollout/max_length"]) == (1.0, 7.0)


def interleaved_groups() -> list[RolloutGroup]:
    # Prompt A has rewards [1, 0, 1] and prompt B [1, 1, 0, 0], split across four RolloutGroups
    # and interleaved: A(1, 0) B(1, 1) A(1) B(0, 0). Groups are by task id, not by position.
    return [
        group("A", [1, 2], [1.0, 0.0]),
        group("B", [3, 4, 5], [1.0, 1.0]),
        group("A", [1, 2], [1.0]),
        group("B", [3, 4, 5], [0.0, 0.0]),
    ]


def completion_advantages(samples) -> list[tuple[str, float]]:
    out = []
    for s in samples:
        trained = {a for a, m in zip(s.advantages, s.loss_mask, strict=True) if m}
        assert len(trained) == 1  # one advantage per sample, on every completion token
        untrained = {a for a, m in zip(s.advantages, s.loss_mask, strict=True) if not m}
        assert untrained == {0.0}
        out.append((s.group_id, trained.pop()))
    return out


def test_group_advantages_land_on_the_right_samples():
    samples, metrics = build(interleaved_groups(), AlgorithmConfig(advantage="dr_grpo"))
    # A: mean 2/3 -> 1 - 2/3 = 1/3, 0 - 2/3 = -2/3; B: mean 1/2 -> +-1/2. In input order.
    assert completion_advantages(samples) == [
        ("A", pytest.approx(1 / 3)),
        ("A", pytest.approx(-2 / 3)),
        ("B", 0.5),
        ("B", 0.5),
        ("A", pytest.approx(1 / 3)),
        ("B", -0.5),
        ("B", -0.5),
    ]
    assert metrics["adv/singleton_groups"] == 0.0  # A's lone third sample joined its group
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-7)


def test_group_advantages_with_std_normalisation():
    samples, _ = build(interleaved_groups(), AlgorithmConfig(advantage="grpo"))
    # A: deviations (1/3, -2/3, 1/3), unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3, std 0.57735:
    #   1/3 / 0.57735 = 0.57735, -2/3 / 0.57735 = -1.15470.
    # B: deviations +-1/2, unbiased var 4 * 1/4 / 3 = 1/3, std 0.57735: +-0.5 / 0.57735 = +-0.86603.
    a, b = 0.5773503, 0.8660254
    got = [adv for _, adv in completion_advantages(samples)]
    assert got == pytest.approx([a, -2 * a, b, b, a, -b, -b], abs=1e-5)


class FakePool:
    """Rewards 1.0 for the text "right", 0.0 otherwise; records what it was asked."""

    def __init__(self) -> None:
        self.items: list[tuple[Task, str]] = []

    def score(self, items):
        self.items = list(items)
        scores = [Score(float(t == "right"), t == "right") for _, t in items]
        return BatchScores(scores, 1, 2, 0.0, cached=0, failed=[False] * len(items))


def test_score_keeps_each_reward_with_its_completion():
    right = completion([4, END_OF_TURN], text="right")
    wrong = completion([5, END_OF_TURN], text="wrong")
    generated = [
        Generated(task("A"), (1,), (wrong, right)),
        Generated(task("B"), (2, 3), (right, wrong, wrong)),
    ]
    pool = FakePool()
    scored = score(pool, generated)
    assert [(t.task_id, text) for t, text in pool.items] == [
        ("A", "wrong"),
        ("A", "right"),
        ("B", "right"),
        ("B", "wrong"),
        ("B", "wrong"),
    ]
    assert [[r.reward for r in g.rollouts] for g in scored.groups] == [[0.0, 1.0], [1.0, 0.0, 0.0]]
    assert [[r.correct for r in g.rollouts] for g in scored.groups] == [
        [False, True],
        [True, False, False],
    ]
    assert scored.groups[1].prompt_token_ids == (2, 3)
    assert scored.groups[0].rollouts[1].completion is right
    assert (scored.failures, scored.timeouts) == (1, 2)


def test_e_overlong_filter_masks_truncated_samples_out_entirely():
    g = RolloutGroup(
        task("A"),
        (5, 6),
        (
            Rollout(completion([11, END_OF_TURN]), 1.0, True),
            Rollout(completion([12, 13, 14], FinishReason.LENGTH), 0.0, False),
        ),
    )
    samples, metrics = build([g], AlgorithmConfig(advantage="dr_grpo", overlong_filter=True))
    assert samples[0].loss_mask == [False, False, True, True]
    assert samples[1].loss_mask == [False] * 5  # truncated: not one token trained
    assert set(samples[1].advantages) == {0.0}
    assert metrics["filter/overlong_samples"] == 1.0
    # Without the filter the truncated completion is trained like any other.
    samples, _ = build([g], AlgorithmConfig(advantage="dr_grpo"))
    assert samples[1].loss_mask == [False, False, True, True, True]


def test_e_soft_overlong_penalty_lowers_the_reward_before_advantages():
    # max_tokens 20, cache 5: lengths 14 (free), 17 (-0.4), 20 (-1.0); all rewards 1
    # -> rewards [1, 0.6, 0]; Dr. GRPO mean 0.5333 -> A = [0.4667, 0.0667, -0.5333]
    rollouts = tuple(
        Rollout(completion([7] * n, FinishReason.STOP), 1.0, True) for n in (14, 17, 20)
    )
    cfg = AlgorithmConfig(advantage="dr_grpo", overlong_cache=5)
    samples, metrics = build([RolloutGroup(task("A"), (1,), rollouts)], cfg, max_tokens=20)
    assert [s.advantages[-1] for s in samples] == pytest.approx(
        [0.46667, 0.06667, -0.53333], abs=1e-4
    )
    assert metrics["reward/overlong_penalty"] == pytest.approx(-1.4 / 3)


def test_kl_in_the_reward_uses_the_sampling_logprobs_and_the_reference():
    # One prompt, two samples, rewards [1, 1]. k1 KL in the reward, coef 0.5:
    # sample 0's two trained tokens: engine logprobs [-0.1, -0.2], reference [-0.1, -1.2]
    #   -> k1 = [0, 1.0] -> token rewards [0, -0.5] -> R_0 = 1 - 0.5 = 0.5
    # sample 1: reference = engine -> k1 = 0 -> R_1 = 1; Dr. GRPO mean 0.75 -> A = [-0.25, 0.25]
    g = RolloutGroup(
        task("A"),
        (5,),
        (
            Rollout(completion([11, END_OF_TURN]), 1.0, True),
            Rollout(completion([12, END_OF_TURN]), 1.0, True),
        ),
    )
    cfg = AlgorithmConfig(advantage="dr_grpo")
    cfg.kl.coef, cfg.kl.placement, cfg.kl.estimator = 0.5, "reward", "k1"
    samples, _ = build_samples([g], cfg)
    samples[0].ref_logprobs = [0.0, -0.1, -1.2]
    samples[1].ref_logprobs = [0.0, -0.1, -0.2]
    rewards, _ = outcome_rewards([g], cfg, 32)
    metrics = assign_advantages(samples, rewards, cfg)
    assert samples[0].advantages == [0.0, pytest.approx(-0.25), pytest.approx(-0.25)]
    assert samples[1].advantages == [0.0, pytest.approx(0.25), pytest.approx(0.25)]
    assert metrics["kl/k1"] == pytest.approx(0.25)  # (0 + 1 + 0 + 0) / 4 trained tokens


def test_gae_through_assign_advantages_writes_returns():
    g = RolloutGroup(task("A"), (5,), (Rollout(completion([11, END_OF_TURN]), 1.0, True),))
    cfg = AlgorithmConfig(advantage="gae", lam=1.0)
    samples, _ = build_samples([g], cfg)
    samples[0].values = [0.0, 0.25, 0.5]  # index 0 is the prompt token: untrained
    rewards, _ = outcome_rewards([g], cfg, 32)
    assign_advantages(samples, rewards, cfg)
    # gamma = lam = 1: A_t = R - V_t = [1 - 0.25, 1 - 0.5] = [0.75, 0.5]; returns = A + V = [1, 1]
    assert samples[0].returns == [0.0, 1.0, 1.0]
    # whitened over the 2 trained tokens: mean 0.625, unbiased std 0.17678 -> [+0.7071, -0.7071]
    assert samples[0].advantages == [
        0.0,
        pytest.approx(0.70710, abs=1e-4),
        pytest.approx(-0.70710, abs=1e-4),
    ]


def test_filter_groups_drops_equal_reward_groups_only():
    groups = [group("A", [1], [1.0, 1.0]), group("B", [2], [1.0, 0.0]), group("C", [3], [0.0])]
    kept, metrics = filter_groups(groups)
    assert [g.task.task_id for g in kept] == ["B", "C"]  # C: one sample, no variance estimate
    assert metrics["filter/dropped_groups"] == 1.0


def test_entropy_proxy_metric_sums_each_completions_engine_logprobs():
    # completions of 4 and 2 tokens with logprobs -0.1..-0.4 and -0.1, -0.2 (see completion()):
    # proxies 1.0 and 0.3 -> mean 0.65; the shorter one's padding never enters
    g = RolloutGroup(
        task("A"),
        (5,),
        (
            Rollout(completion([11, 12, 13, END_OF_TURN]), 1.0, True),
            Rollout(completion([14, END_OF_TURN]), 0.0, False),
        ),
    )
    _, metrics = build_samples([g], AlgorithmConfig())
    assert metrics["rollout/entropy_proxy"] == pytest.approx(0.65)
