"""``treadle reward-check RECIPE``: do the configured graders accept the data's own gold answers,
and do those golds look whole?

A grader that rejects a correct answer (a parse failure, a wrong extraction mode, a format the
gold is written in) silently teaches nothing on that task. This renders every task's gold
answer as a model would write it, through the recipe's response format (``data.answer_template``,
the same rendering SFT demonstrations use), scores that text with the recipe's reward functions
exactly as training would, and reports those the primary verifier does not judge correct.

A gold cut short by its extraction (a brace regex on a nested ``\\boxed{}``) can still pass its
own grader, since it is compared with itself; so each gold taken out of a longer field is also
checked for the look of a cut: unbalanced braces, brackets or parentheses, an empty answer, or
one value across most rows. Those count as failures too. Every row of every source is checked,
whatever the held-out split (``data.eval_size``) and ``data.size``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from treadle.config import Config
from treadle.core.errors import UserError
from treadle.rewards.pool import RewardPool
from treadle.store.data import GoldRows, load_gold_rows, render_demonstration

# One value in at least this share of the extracted golds (of at least _SAME_MIN_ROWS rows)
# looks like an extraction that reads something other than the answer.
_SAME_SHARE = 0.8
_SAME_MIN_ROWS = 10
_PAIRS = {"{": "}", "(": ")", "[": "]"}


@dataclass(frozen=True)
class GoldFailure:
    """A task whose gold failed a check: its grader's, or the look of a whole answer."""

    task_id: str
    answer: str
    completion: str
    """The gold as a model would write it (``data.answer_template``), the text scored."""
    reward: float
    reasons: tuple[str, ...]
    """Why, one phrase each: ``rejected by the graders``, ``unbalanced braces``, ``empty``,
    ``same value as 45 of 50 golds``."""


@dataclass(frozen=True)
class GoldSample:
    """One row's raw answer field beside the gold taken out of it (the report's sample)."""

    task_id: str
    raw: str
    answer: str


@dataclass(frozen=True)
class RewardCheck:
    """The outcome of :func:`check_gold`."""

    total: int
    """Gold answers checked (every row of every source)."""
    failures: list[GoldFailure]
    """Gold answers the primary verifier did not judge correct, or that look cut."""
    rejected: int
    """Of the failures, those the graders rejected."""
    suspect: int
    """Of the failures, those that look cut (unbalanced, empty, or one value across rows)."""
    errors: int
    """Reward-function calls that raised, timed out or missed ``reward.step_timeout_s`` on a gold
    answer (scored as fallback)."""
    skipped: tuple[str, ...]
    """Bad rows skipped under ``data.skip_bad_rows`` (``file:line: why``), not checked."""
    samples: list[GoldSample]
    """The first few golds taken out of a longer field, beside that field."""


def check_gold(cfg: Config, samples: int = 5) -> RewardCheck:
    """Score every task's gold, written through ``data.answer_template``, with the recipe's
    reward functions, and check the look of each gold taken out of a longer field.

    Raises:
        UserError: bad data or reward config (as for training), or no gold answer to check (an
            empty file, every row skipped, a loader returning no task): "0 of 0 fail" would
            read as a pass.
    """
    rows = load_gold_rows(cfg.data)
    tasks = list(rows.tasks)
    if not tasks:
        where = cfg.data.path or cfg.data.source
        why = "is the file empty?"
        if rows.skipped:
            why = f"{len(rows.skipped)} bad rows skipped, the first: {rows.skipped[0]}"
        raise UserError(f"treadle reward-check: data ({where}) gives no task to check; {why}")
    completions = [render_demonstration(t, cfg.data.answer_template) for t in tasks]
    # Scored a training step's worth of samples at a time, so that reward.step_timeout_s,
    # sized for one step, applies as it does in training (not to the whole data set at once).
    step = cfg.rollout.prompts_per_step * cfg.rollout.n
    pairs = list(zip(tasks, completions, strict=True))
    scores, errors = [], 0
    with RewardPool.from_config(cfg.reward) as pool:
        for start in range(0, len(pairs), step):
            batch = pool.score(pairs[start : start + step])
            scores += batch.scores
            errors += batch.failures + batch.timeouts + batch.deadline_misses
    looks = gold_looks(rows)
    failures, rejected, suspect = [], 0, 0
    for t, c, s, why in zip(tasks, completions, scores, looks, strict=True):
        reasons = (() if s.correct else ("rejected by the graders",)) + why
        if reasons:
            failures.append(GoldFailure(t.task_id, t.answer, c, s.reward, reasons))
            rejected += not s.correct
            suspect += bool(why)
    extracted = [i for i, t in enumerate(tasks) if t.answer != rows.raw_answers[i]]
    shown = [GoldSample(tasks[i].task_id, rows.raw_answers[i], tasks[i].answer) for i in extracted]
    return RewardCheck(
        len(tasks), failures, rejected, suspect, errors, rows.skipped, shown[:samples]
    )


def gold_looks(rows: GoldRows) -> list[tuple[str, ...]]:
    """``[len(rows.tasks)]``: for each gold, why it looks cut (``()`` when it does not).

    Every gold is checked for being empty. A gold taken out of a longer field (it differs from
    its raw answer) is also checked for unbalanced ``{}`` (``\\{`` is a literal and does not
    count) and for unbalanced brackets and parentheses, where either closes either (so the
    half-open interval ``[0, 1)`` passes); and, when at least 80% of at least 10 such golds
    are one value, each of those is flagged as the same value.
    """
    extracted = [t.answer != raw for t, raw in zip(rows.tasks, rows.raw_answers, strict=True)]
    values = Counter(t.answer for t, e in zip(rows.tasks, extracted, strict=True) if e)
    n = sum(values.values())
    common, count = values.most_common(1)[0] if values else ("", 0)
    same = n >= _SAME_MIN_ROWS and count >= _SAME_SHARE * n
    looks = []
    for t, e in zip(rows.tasks, extracted, strict=True):
        why = [] if t.answer.strip() else ["empty"]
        if e:
            why += _unbalanced(t.answer)
            if same and t.answer == common:
                why.append(f"same value as {count} of {n} golds")
        looks.append(tuple(why))
    return looks


def _unbalanced(text: str) -> list[str]:
    """``["unbalanced braces"]`` and/or ``["unbalanced brackets or parentheses"]`` for a gold
    ``text``; a depth that goes below 0 or ends above it is unbalanced."""
    braces = round_or_square = 0
    found: set[str] = set()
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ \} \( \[ are literals (or delimiters), not grouping
            continue
        if char in "{}":
            braces += 1 if char == "{" else -1
            if braces < 0:
                found.add("unbalanced braces")
        elif char in "()[]":
            round_or_square += 1 if char in _PAIRS else -1
            if round_or_square < 0:
                found.add("unbalanced brackets or parentheses")
        i += 1
    if braces > 0:
        found.add("unbalanced braces")
    if round_or_square > 0:
        found.add("unbalanced brackets or parentheses")
    return sorted(found)


def report(result: RewardCheck, console: Console, show: int = 20) -> None:
    """Print the skipped rows, a sample of extracted golds beside their raw fields, the
    counts, and the first ``show`` failures."""
    if result.skipped:
        console.print(
            f"{len(result.skipped)} bad rows skipped (data.skip_bad_rows), not checked; the "
            f"first: {result.skipped[0]}",
            markup=False,
        )
    if result.samples:
        table = Table("task", "raw answer field (its end)", "gold taken out", title="sample")
        for s in result.samples:
            table.add_row(Text(s.task_id), Text(_tail(s.raw, 60)), Text(_head(s.answer, 40)))
        console.print(table)
    n = len(result.failures)
    console.print(
        f"{n} of {result.total} gold answers fail: {result.rejected} rejected by their own "
        f"grader, {result.suspect} look cut (unbalanced, empty or one value across rows)"
        + (f"; {result.errors} grader errors or timeouts" if result.errors else ""),
        markup=False,
    )
    if result.suspect:
        console.print(
            "golds that look cut come from data.answer_pattern or data.answer_extract; a regex "
            "cannot take a nested \\boxed{...}, data.answer_extract=boxed can",
            markup=False,
        )
    if not n:
        return
    table = Table("task", "gold answer", "gold completion", "reward", "why")
    for f in result.failures[:show]:
        table.add_row(
            Text(f.task_id),
            Text(_head(f.answer, 40)),
            Text(_tail(f.completion, 60)),
            f"{f.reward:g}",
            Text("; ".join(f.reasons)),
        )
    console.print(table)
    if n > show:
        console.print(f"... and {n - show} more")


def _head(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _tail(text: str, width: int) -> str:
    """The last ``width`` characters of ``text`` on one line, an ellipsis before them."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else "…" + flat[-(width - 1) :]
