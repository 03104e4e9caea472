"""The rollout buffer: exact parquet round trip by rollout id, resume truncation, no duplicates."""

from __future__ import annotations

import pytest

from treadle.core.types import (
    Completion,
    FinishReason,
    Message,
    Rollout,
    RolloutGroup,
    Task,
    TrainSample,
)
from treadle.store.buffer import DuplicateRolloutError, RolloutBuffer, rollout_id


def group(task_id: str, rewards: list[float], prompt=(5, 6)) -> RolloutGroup:
    task = Task(task_id, (Message("system", "be brief"), Message("user", f"q {task_id}")), "1", "m")
    rollouts = tuple(
        Rollout(
            Completion((7, 8 + i), (-0.1 * (i + 1), -1 / 3), FinishReason.STOP, 2, f"c{i}"),
            reward,
            reward > 0,
        )
        for i, reward in enumerate(rewards)
    )
    return RolloutGroup(task, prompt, rollouts)


def samples_of(groups: list[RolloutGroup]) -> list[TrainSample]:
    out = []
    for g in groups:
        for r in g.rollouts:
            c = r.completion
            out.append(
                TrainSample(
                    token_ids=[*g.prompt_token_ids, *c.token_ids],
                    loss_mask=[False, False, True, True],
                    behavior_logprobs=[0.0, 0.0, *c.logprobs],
                    # float32 values the update used: stored as float64, read back exactly
                    advantages=[0.0, 0.0, 0.7071067690849304, 0.7071067690849304],
                    policy_version=c.policy_version,
                    group_id=g.task.task_id,
                    ref_logprobs=[0.0, 0.0, -0.2, -0.3],
                )
            )
    return out


def test_round_trip_is_exact_and_addressed_by_rollout_id(tmp_path):
    groups = [group("a", [1.0, 0.0]), group("b", [0.5, 0.5, 0.25])]
    samples = samples_of(groups)
    buffer = RolloutBuffer(tmp_path)
    buffer.add(4, groups, samples)
    assert len(buffer) == 5 and buffer.steps() == [4]
    assert not list((tmp_path / "buffer").glob(".*"))  # no temporary file left behind
    stored = RolloutBuffer(tmp_path).read_step(4)  # a fresh reader (a later process)
    assert [r["rollout_id"] for r in stored.rows] == [
        "000004-0000-000", "000004-0000-001", "000004-0001-000", "000004-0001-001",
        "000004-0001-002",
    ]  # fmt: skip
    assert stored.samples == samples  # every per-token list equal, float for float
    row = buffer.get(rollout_id(4, 1, 2))
    assert (row["task_id"], row["reward"], row["correct"], row["completion"]) == (
        "b",
        0.25,
        True,
        "c2",
    )
    assert row["prompt_tokens"] == 2 and row["finish_reason"] == "stop"
    assert (
        row["messages"]
        == '[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q b"}]'
    )
    with pytest.raises(KeyError, match="000009-0000-000"):
        buffer.get("000009-0000-000")
    with pytest.raises(FileNotFoundError, match=r"steps 4\.\.4, not step 5"):
        buffer.read_step(5)


def test_a_step_stored_again_replaces_it_and_resume_drops_later_steps(tmp_path):
    buffer = RolloutBuffer(tmp_path)
    for step in (1, 2, 3):
        groups = [group("a", [float(step), 0.0])]
        buffer.add(step, groups, samples_of(groups))
    assert len(buffer) == 6
    # Resumed from the checkpoint of step 1: steps 2 and 3 are forgotten, then re-run.
    reopened = RolloutBuffer(tmp_path)
    reopened.truncate_after(1)
    assert reopened.steps() == [1] and len(reopened) == 2
    groups = [group("a", [9.0, 0.0])]
    reopened.add(2, groups, samples_of(groups))
    reopened.add(2, groups, samples_of(groups))  # the same step again replaces, not appends
    assert len(reopened) == 4
    assert [r["reward"] for r in reopened.read_step(2).rows] == [9.0, 0.0]


def test_mismatched_samples_and_duplicate_ids_are_refused(tmp_path):
    buffer = RolloutBuffer(tmp_path)
    groups = [group("a", [1.0, 0.0])]
    with pytest.raises(ValueError, match="2 rollouts but 1 train samples"):
        buffer.add(1, groups, samples_of(groups)[:1])
    buffer.add(1, groups, samples_of(groups))
    buffer._ids[rollout_id(2, 0, 1)] = 1  # an id held by another step (a retried request)
    with pytest.raises(DuplicateRolloutError, match="000002-0000-001"):
        buffer.add(2, groups, samples_of(groups))
    assert buffer.steps() == [1] and rollout_id(2, 0, 0) not in buffer  # nothing half-added
