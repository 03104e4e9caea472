"""``treadle reward-check RECIPE``: do the configured graders accept the data's own gold answers?

A grader that rejects a correct answer (a parse failure, a wrong extraction mode, a format the
gold is written in) silently teaches nothing on that task. This renders every task's gold
answer the way a demonstration is written (``data.answer_template``), scores it with the
recipe's reward functions exactly as training would, and reports those the primary verifier
does not judge correct.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from treadle.config import Config
from treadle.rewards.pool import RewardPool
from treadle.store.data import load_dataset, render_demonstration


@dataclass(frozen=True)
class GoldFailure:
    """A task whose gold demonstration the primary verifier did not judge correct."""

    task_id: str
    answer: str
    completion: str
    reward: float


@dataclass(frozen=True)
class RewardCheck:
    """The outcome of :func:`check_gold`."""

    total: int
    """Gold answers scored (training and held-out tasks)."""
    failures: list[GoldFailure]
    """Gold answers the primary verifier did not judge correct."""
    errors: int
    """Reward-function calls that raised, timed out or missed ``reward.step_timeout_s`` on a gold
    answer (scored as fallback)."""


def check_gold(cfg: Config) -> RewardCheck:
    """Score every task's gold demonstration with the recipe's reward functions.

    Raises:
        UserError: bad data or reward config (as for training).
    """
    data = load_dataset(cfg.data)
    tasks = [*data.train, *data.held_out]
    completions = [render_demonstration(t, cfg.data.answer_template) for t in tasks]
    # Scored a training step's worth of samples at a time, so that reward.step_timeout_s,
    # sized for one step, applies as it does in training (not to the whole data set at once).
    step = cfg.rollout.prompts_per_step * cfg.rollout.n
    samples = list(zip(tasks, completions, strict=True))
    scores, errors = [], 0
    with RewardPool.from_config(cfg.reward) as pool:
        for start in range(0, len(samples), step):
            batch = pool.score(samples[start : start + step])
            scores += batch.scores
            errors += batch.failures + batch.timeouts + batch.deadline_misses
    failures = [
        GoldFailure(t.task_id, t.answer, c, s.reward)
        for t, c, s in zip(tasks, completions, scores, strict=True)
        if not s.correct
    ]
    return RewardCheck(len(tasks), failures, errors)


def report(result: RewardCheck, console: Console, show: int = 20) -> None:
    """Print the count and the first ``show`` failures."""
    n = len(result.failures)
    console.print(
        f"{n} of {result.total} gold answers fail their own grader"
        + (f" ({result.errors} grader errors or timeouts)" if result.errors else "")
    )
    if not n:
        return
    table = Table("task", "gold answer", "gold completion", "reward")
    for f in result.failures[:show]:
        table.add_row(f.task_id, f.answer[:40], f.completion[-60:], f"{f.reward:g}")
    console.print(table)
    if n > show:
        console.print(f"... and {n - show} more")
