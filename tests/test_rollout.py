"""Tests for treadle.rollout: scoring into groups and building flat training samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from treadle.config import AlgorithmConfig
from treadle.rewards.base import Score
from treadle.rollout import Generated, build_samples, score
from treadle.types import Completion, FinishReason, Message, Rollout, RolloutGroup, Task

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


def test_sample_is_prompt_plus_completion_with_end_of_turn_trained():
    g = RolloutGroup(
        task("A"),
        (5, 6, 7, 8),
        (
            Rollout(completion([11, 12, 13, END_OF_TURN], version=7), 1.0, True),
            Rollout(completion([14, END_OF_TURN], version=7), 0.0, False),
        ),
    )
    samples, metrics = build_samples([g], AlgorithmConfig(std_normalize=False))
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
    samples, metrics = build_samples(interleaved_groups(), AlgorithmConfig(std_normalize=False))
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
    samples, _ = build_samples(interleaved_groups(), AlgorithmConfig(std_normalize=True))
    # A: deviations (1/3, -2/3, 1/3), unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3, std 0.57735:
    #   1/3 / 0.57735 = 0.57735, -2/3 / 0.57735 = -1.15470.
    # B: deviations +-1/2, unbiased var 4 * 1/4 / 3 = 1/3, std 0.57735: +-0.5 / 0.57735 = +-0.86603.
    a, b = 0.5773503, 0.8660254
    got = [adv for _, adv in completion_advantages(samples)]
    assert got == pytest.approx([a, -2 * a, b, b, a, -b, -b], abs=1e-5)


@dataclass
class FakeBatch:
    scores: list[Score]
    failures: int
    timeouts: int


class FakePool:
    """Rewards 1.0 for the text "right", 0.0 otherwise; records what it was asked."""

    def __init__(self) -> None:
        self.items: list[tuple[Task, str]] = []

    def score(self, items):
        self.items = list(items)
        return FakeBatch([Score(float(t == "right"), t == "right") for _, t in items], 1, 2)


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
