"""The health check of RL steps (treadle.jobs.health) on hand-made step statistics."""

from __future__ import annotations

import logging

from treadle.config import Config, MismatchConfig
from treadle.core.types import Completion, FinishReason, Message, Rollout, RolloutGroup, Task
from treadle.jobs.health import HealthMonitor, StepHealth

LOGGER = "treadle.jobs.health"


def step(n: int, rewards=((0.0, 0.0), (0.0, 0.0)), loss=0.5, truncated=0, mismatch=None):
    return StepHealth(n, rewards, 0, loss, truncated, mismatch)


def monitor(**kw) -> HealthMonitor:
    return HealthMonitor(max_tokens=40, mismatch=MismatchConfig(), **kw)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_all_zero_rewards_warn_once_at_the_third_step(caplog):
    m = monitor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rows = [m.judge(step(n)) for n in range(1, 6)]
    # flat from step 1: below 3 consecutive steps nothing holds; from step 3 on it holds
    assert [r["health/flat_rewards"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r["health/flat_steps"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r["health/warnings"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    (line,) = warnings(caplog)  # once for the whole episode, not at steps 4 and 5
    assert line.startswith("RL steps 1-3: the reward was 0 for every sample, so every advantage")
    assert "treadle reward-check" in line and "sft.steps" in line


def test_a_step_with_variance_ends_the_episode_and_restarts_the_count(caplog):
    m = monitor()
    varied = ((0.0, 1.0), (0.0, 0.0))  # one group varies: it has a nonzero advantage
    equal = ((1.0, 1.0), (0.0, 0.0))  # equal within each group, not across: still flat
    plan = [equal, equal, equal, varied, equal, equal, equal]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rows = [m.judge(step(n, rewards=r)) for n, r in enumerate(plan, start=1)]
    assert [r["health/flat_rewards"] for r in rows] == [0, 0, 1, 0, 0, 0, 1]
    first, second = warnings(caplog)
    assert first.startswith("RL steps 1-3: no group's rewards varied")
    assert second.startswith("RL steps 5-7: ")


def test_dynamic_sampling_dropping_every_group_is_flat():
    m = monitor(flat_steps=1)
    dropped = StepHealth(1, (), 8, None, 0, None)
    assert m.judge(dropped)["health/flat_rewards"] == 1.0
    # an empty step that dropped nothing (no batch at all) is not judged flat
    assert monitor(flat_steps=1).judge(StepHealth(1, (), 0, None, 0, None))["health/warnings"] == 0


def test_zero_loss_and_truncation_warn_once_per_episode(caplog):
    m = monitor()
    varied = ((0.0, 1.0),)
    plan = [(0.0, 2), (0.0, 2), (0.3, 1), (0.0, 2)]  # (loss, truncated of the 2 samples)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rows = [
            m.judge(step(n, rewards=varied, loss=loss, truncated=cut))
            for n, (loss, cut) in enumerate(plan, start=1)
        ]
    assert [r["health/zero_loss"] for r in rows] == [1, 1, 0, 1]
    assert [r["health/truncated"] for r in rows] == [1, 1, 0, 1]
    assert [r["health/warnings"] for r in rows] == [2, 2, 0, 2]
    lines = warnings(caplog)  # steps 1 and 4 begin an episode of each; steps 2 and 3 do not
    assert [line.split(":")[0] for line in lines] == ["RL step 1"] * 2 + ["RL step 4"] * 2
    assert lines[0] == (
        "RL step 1: the loss is exactly 0 (with rewards that vary: check the algorithm "
        "section's loss settings), so the update learns nothing"
    )
    assert lines[1] == (
        "RL step 1: all 2 completions ran out of rollout.max_tokens=40 (finish reason length), "
        "so their answers are cut; raise rollout.max_tokens or ask for shorter answers"
    )


def test_an_empty_step_is_no_zero_loss_and_no_truncation():
    # Nothing trained (every group dropped): a loss of 0 there is no sign of a broken update.
    row = monitor().judge(StepHealth(1, (), 0, 0.0, 0, None))
    assert row == {
        "health/flat_rewards": 0.0,
        "health/zero_loss": 0.0,
        "health/truncated": 0.0,
        "health/flat_steps": 0.0,
        "health/warnings": 0.0,
    }


def test_the_mismatch_alarm_is_counted_and_warned_once_with_action_warn(caplog):
    m = HealthMonitor(40, MismatchConfig(max_kl_k3=0.01, action="warn"))
    over = {"mismatch/kl_k3": 0.5}
    assert m.judge_mismatch({"mismatch/kl_k3": 0.001}) is None
    alarm = m.judge_mismatch(over)
    assert alarm.startswith("engine/trainer mismatch: mismatch/kl_k3 = 0.5 nats exceeds")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rows = [m.judge(step(n, rewards=((0.0, 1.0),), mismatch=alarm)) for n in (1, 2)]
    assert [r["health/warnings"] for r in rows] == [1.0, 1.0]
    assert "health/mismatch" not in rows[0]  # its metric is mismatch/alarms, set by the loop
    assert warnings(caplog) == [f"RL step 1: {alarm}"]
    # action=stop: the loop ends the run with the alarm; nothing to warn here
    stop = HealthMonitor(40, MismatchConfig(max_kl_k3=0.01, action="stop"))
    assert stop.judge_mismatch(over) is None


def test_step_health_of_a_batch():
    def group(rewards, finish):
        c = Completion((7, 8), (-0.5, -0.5), finish, 0, "x")
        task = Task("t", (Message("user", "q"),), "1", "math")
        return RolloutGroup(task, (1,), tuple(Rollout(c, r, r > 0) for r in rewards))

    groups = [group([0.0, 0.0], FinishReason.LENGTH), group([1.0, 1.0], FinishReason.STOP)]
    h = StepHealth.of(2, groups, {"loss": 0.0, "filter/dropped_groups": 3.0})
    assert h == StepHealth(2, ((0.0, 0.0), (1.0, 1.0)), 3, 0.0, 2, None)
    assert h.flat and h.samples == 4


def test_from_config_reads_the_run_settings():
    cfg = Config()
    cfg.rollout.max_tokens = 77
    m = HealthMonitor.from_config(cfg)
    assert m.max_tokens == 77 and m.mismatch is cfg.algorithm.mismatch and m.flat_steps == 3
    assert monitor(flat_steps=0).flat_steps == 1  # at least the flat step itself


def test_a_resumed_run_continues_the_count_of_flat_steps(tmp_path, caplog):
    from treadle.store.observe import MetricsLogger

    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, {"eval/accuracy": 0.0})  # the evaluation before RL has no health keys
        log.log(1, {"health/flat_steps": 1.0})
        log.log(2, {"health/flat_steps": 2.0})
    m = HealthMonitor.from_config(Config(), tmp_path, 2)  # resumed after step 2
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        row = m.judge(step(3))
    # steps 1 and 2 were flat before the resume, step 3 is: 3 in a row, as uninterrupted
    assert row["health/flat_steps"] == 3.0 and row["health/flat_rewards"] == 1.0
    assert warnings(caplog)[0].startswith("RL steps 1-3: the reward was 0 for every sample")
    # a run logged before these metrics existed (its step-2 row has no such key) counts anew
    with MetricsLogger(tmp_path / "old", tensorboard=False) as log:
        log.log(2, {"loss": 0.0})
    old = HealthMonitor.from_config(Config(), tmp_path / "old", 2)
    assert old.judge(step(3))["health/flat_steps"] == 1.0
