"""A run that fails loudly: per-step checks for an RL step that cannot be learning.

Each RL step's :class:`StepHealth` (its rewards, loss, finish reasons and mismatch alarm) is
judged by :class:`HealthMonitor`, which warns on the console (one ``logging`` line saying what
is wrong and the likely fix) once per *episode* of a condition, the first step it holds after
steps it did not, and records in every step's metrics which conditions hold:

- ``health/flat_rewards``: for ``flat_steps`` consecutive steps or more, no group's rewards
  varied (or dynamic sampling dropped every group as flat), so every group-relative advantage
  is 0 (GRPO, arXiv 2402.03300, eq. 3: ``(r_i - mean) / std`` of a group) and nothing is learned;
  ``health/flat_steps`` is that count of consecutive steps (0 at a step with variance), which a
  resumed run continues from;
- ``health/zero_loss``: the policy loss was exactly 0;
- ``health/truncated``: every completion of the step ran out of ``rollout.max_tokens``;
- ``mismatch/alarms`` (set by :func:`treadle.jobs.loop.mismatch_check`): the engine/trainer
  mismatch passed ``algorithm.mismatch``'s thresholds; warned here with ``action=warn`` (with
  ``stop`` the run ends with that line instead);
- ``health/warnings``: how many of these conditions hold at the step (0 to 4).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from treadle.algorithms.correction import mismatch_alarm
from treadle.config import Config, MismatchConfig
from treadle.core.types import FinishReason, RolloutGroup
from treadle.store.observe import METRICS_FILENAME, read_metrics

logger = logging.getLogger(__name__)

FLAT_STEPS = 3
"""Consecutive steps without reward variance before :class:`HealthMonitor` warns: a run whose
rewards are all 0 warns at its third step."""


@dataclass(frozen=True)
class StepHealth:
    """What :class:`HealthMonitor` judges of one RL step."""

    step: int
    """RL steps completed with this one (1 for the first)."""
    rewards: tuple[tuple[float, ...], ...]
    """``[G][n]``: each trained group's samples' rewards (empty when none was kept)."""
    dropped_flat: int
    """Groups dynamic sampling dropped as flat (``filter/dropped_groups``; 0 without it)."""
    loss: float | None
    """The policy loss of the update (None: the step logged none)."""
    truncated: int
    """Completions that ended by ``max_tokens`` (finish reason ``length``)."""
    mismatch: str | None
    """The engine/trainer mismatch alarm's line, when it fired and is only warned about."""

    @classmethod
    def of(
        cls,
        step: int,
        groups: Sequence[RolloutGroup],
        metrics: Mapping[str, float],
        mismatch: str | None = None,
    ) -> StepHealth:
        """The health of step ``step`` from its trained groups and its metrics."""
        rollouts = [r for g in groups for r in g.rollouts]
        return cls(
            step=step,
            rewards=tuple(tuple(r.reward for r in g.rollouts) for g in groups),
            dropped_flat=int(metrics.get("filter/dropped_groups", 0)),
            loss=metrics.get("loss"),
            truncated=sum(r.completion.finish_reason == FinishReason.LENGTH for r in rollouts),
            mismatch=mismatch,
        )

    @property
    def samples(self) -> int:
        """Completions trained this step."""
        return sum(len(g) for g in self.rewards)

    @property
    def flat(self) -> bool:
        """No group of the step has reward variance (or every group was dropped as flat)."""
        if not self.rewards:
            return self.dropped_flat > 0
        return all(max(g) == min(g) for g in self.rewards)


class HealthMonitor:
    """Judges every RL step (:meth:`check`) and warns once per episode of a condition.

    Args:
        max_tokens: ``rollout.max_tokens``, named in the truncation warning.
        mismatch: ``algorithm.mismatch``; its alarm is warned here when ``action`` is ``warn``.
        staleness_bound: the rollout mode's policy lag by design (named among the causes).
        flat_steps: consecutive flat-reward steps before the warning (>= 1).
    """

    def __init__(
        self,
        max_tokens: int,
        mismatch: MismatchConfig,
        staleness_bound: int = 0,
        flat_steps: int = FLAT_STEPS,
    ) -> None:
        self.max_tokens = max_tokens
        self.mismatch = mismatch
        self.staleness_bound = staleness_bound
        self.flat_steps = max(flat_steps, 1)
        self._flat_since: int | None = None  # first step of the current flat run
        self._active: set[str] = set()  # conditions warned and still holding

    @classmethod
    def from_config(cls, cfg: Config, run_dir: Path | None = None, step: int = 0) -> HealthMonitor:
        """The monitor of a run of ``cfg``; one resumed after ``step`` RL steps continues the
        count of flat steps logged at ``step`` in ``run_dir``'s ``metrics.jsonl`` (so its
        metrics are the uninterrupted run's)."""
        monitor = cls(cfg.rollout.max_tokens, cfg.algorithm.mismatch, cfg.rollout.staleness_bound)
        if run_dir is not None and step > 0 and (run_dir / METRICS_FILENAME).is_file():
            rows = read_metrics(run_dir / METRICS_FILENAME)
            flat = [r.get("health/flat_steps") for r in rows if r["step"] == step]
            streak = int(next((f for f in flat if f is not None), 0))
            monitor._flat_since = step - streak + 1 if streak > 0 else None
        return monitor

    def check(
        self, step: int, groups: Sequence[RolloutGroup], metrics: Mapping[str, float]
    ) -> dict[str, float]:
        """Judge RL step ``step`` from its trained groups and metrics (:meth:`judge`)."""
        return self.judge(StepHealth.of(step, groups, metrics, self.judge_mismatch(metrics)))

    def judge(self, health: StepHealth) -> dict[str, float]:
        """Judge one step: log one warning per condition that begins to hold at it; returns the
        step's ``health/*`` metrics (1.0 where a condition holds, else 0.0, and
        ``health/warnings``, their count with the mismatch alarm's)."""
        if not health.flat:
            self._flat_since = None
        elif self._flat_since is None:
            self._flat_since = health.step
        problems = {
            "flat_rewards": self._flat_problem(health),
            "zero_loss": self._zero_loss_problem(health),
            "truncated": self._truncated_problem(health),
            "mismatch": self._mismatch_problem(health),
        }
        for name, problem in problems.items():
            if problem is None:
                self._active.discard(name)
            elif name not in self._active:
                self._active.add(name)
                logger.warning("%s", problem)
        out = {f"health/{k}": float(v is not None) for k, v in problems.items() if k != "mismatch"}
        streak = 0 if self._flat_since is None else health.step - self._flat_since + 1
        out["health/flat_steps"] = float(streak)
        out["health/warnings"] = float(sum(p is not None for p in problems.values()))
        return out

    def _flat_problem(self, h: StepHealth) -> str | None:
        if self._flat_since is None or h.step - self._flat_since + 1 < self.flat_steps:
            return None
        values = {r for g in h.rewards for r in g}
        if len(values) == 1:
            what = f"the reward was {values.pop():g} for every sample"
        elif h.rewards:
            what = "no group's rewards varied (every sample of a prompt got the same reward)"
        else:
            what = "dynamic sampling dropped every group as flat (no group's rewards varied)"
        return (
            f"RL steps {self._flat_since}-{h.step}: {what}, so every advantage is 0 and nothing "
            "is learned; does the model write the rewarded format? try treadle reward-check, an "
            "SFT warm-up (sft.steps) or a partial-credit reward"
        )

    def _zero_loss_problem(self, h: StepHealth) -> str | None:
        if h.loss != 0.0 or h.samples == 0:  # no samples: nothing was trained, not a zero loss
            return None
        why = (
            "every advantage is 0: no group's rewards vary"
            if h.flat
            else "with rewards that vary: check the algorithm section's loss settings"
        )
        return f"RL step {h.step}: the loss is exactly 0 ({why}), so the update learns nothing"

    def _truncated_problem(self, h: StepHealth) -> str | None:
        if h.samples == 0 or h.truncated < h.samples:
            return None
        return (
            f"RL step {h.step}: all {h.samples} completions ran out of rollout.max_tokens="
            f"{self.max_tokens} (finish reason length), so their answers are cut; raise "
            "rollout.max_tokens or ask for shorter answers"
        )

    def _mismatch_problem(self, h: StepHealth) -> str | None:
        return None if h.mismatch is None else f"RL step {h.step}: {h.mismatch}"

    def judge_mismatch(self, metrics: Mapping[str, float]) -> str | None:
        """The step's mismatch alarm line when ``algorithm.mismatch.action`` is ``warn`` (with
        ``stop`` the loop ends the run with it instead), else None."""
        if self.mismatch.action != "warn":
            return None
        return mismatch_alarm(metrics, self.mismatch, self.staleness_bound)
