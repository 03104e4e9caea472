"""What a run reports at the end: a plot of its curves, a summary table and ``summary.json``."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter
from rich.console import Console
from rich.table import Table

from treadle.store.atomic import write_json_atomic
from treadle.store.observe import MetricsRow, read_metrics

logger = logging.getLogger(__name__)

SUMMARY_FILENAME = "summary.json"
TRAIN_REWARD_METRIC = "reward/mean"
EVAL_METRICS: tuple[tuple[str, str], ...] = (
    ("eval/pass@1", "pass@1 (sampled)"),
    ("eval/greedy_accuracy", "greedy accuracy"),
    ("eval/pass@k", "pass@k"),
)
"""Held-out accuracy metrics drawn in the second panel, with their legend labels."""

Summary = Mapping[str, float | str | None]
"""Final results of a run: name -> number or text (see :func:`format_summary_value`)."""


def _series(rows: list[MetricsRow], name: str) -> tuple[list[int], list[float]]:
    """Steps and values of metric ``name`` over the rows that have a finite value for it."""
    steps: list[int] = []
    values: list[float] = []
    for row in rows:
        value, step = row.get(name), row.get("step")
        if value is not None and step is not None:
            steps.append(int(step))
            values.append(float(value))
    return steps, values


def _mark_empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", transform=ax.transAxes, ha="center", va="center")


def _draw_reward(ax: Axes, rows: list[MetricsRow]) -> None:
    steps, values = _series(rows, TRAIN_REWARD_METRIC)
    if steps:
        ax.plot(steps, values, color="tab:blue", linewidth=1.5, label=TRAIN_REWARD_METRIC)
    else:
        _mark_empty(ax, TRAIN_REWARD_METRIC)
    ax.set_title("Training reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(True, alpha=0.3)


def _draw_eval(ax: Axes, rows: list[MetricsRow]) -> None:
    drawn = 0
    for name, label in EVAL_METRICS:
        steps, values = _series(rows, name)
        if steps:
            ax.plot(steps, values, marker="o", markersize=4, linewidth=1.5, label=label)
            drawn += 1
    if drawn:
        ax.legend(loc="best")
    else:
        _mark_empty(ax, "eval accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_title("Held-out accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.grid(True, alpha=0.3)


ASYNC_METRICS: tuple[tuple[str, str], ...] = (
    ("async/staleness_mean", "staleness, mean (versions)"),
    ("async/staleness_max", "staleness, max (versions)"),
    ("async/engine_busy", "engine busy (fraction)"),
    ("async/trainer_busy", "trainer busy (fraction)"),
)
"""The asynchronous rollout's metrics drawn in a third panel, when the run logged them."""


def build_run_figure(rows: list[MetricsRow], title: str) -> Figure:
    """Build the figure of :func:`plot_run` from metrics rows (12 x 4.5 inches, 18 x 4.5 with
    the third panel).

    ``fig.axes[0]`` holds the training reward, ``fig.axes[1]`` the held-out accuracy lines,
    and for an asynchronous run (``rollout.mode`` other than ``sync``) ``fig.axes[2]`` the
    staleness and the engine's and trainer's busy fractions.
    """
    scheduled = any(name in row for row in rows for name, _ in ASYNC_METRICS)
    fig = Figure(figsize=(18 if scheduled else 12, 4.5), layout="constrained")
    axes = fig.subplots(1, 3 if scheduled else 2, sharex=True)
    _draw_reward(axes[0], rows)
    _draw_eval(axes[1], rows)
    if scheduled:
        _draw_async(axes[2], rows)
    fig.suptitle(title)
    return fig


def _draw_async(ax: Axes, rows: list[MetricsRow]) -> None:
    for name, label in ASYNC_METRICS:
        steps, values = _series(rows, name)
        if steps:
            ax.plot(steps, values, linewidth=1.5, label=label)
    ax.legend(loc="best")
    ax.set_title("Asynchronous rollout")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def plot_run(
    metrics_path: str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> Path:
    """Plot a run's training reward and held-out accuracy against step into a PNG.

    Left panel: ``reward/mean``. Middle panel: ``eval/pass@1``, ``eval/greedy_accuracy`` and
    ``eval/pass@k``, each a line where logged. An asynchronous run gets a third panel of
    :data:`ASYNC_METRICS`. A metric that was never logged is simply absent
    (a panel with none says so). Uses matplotlib's Agg canvas without touching pyplot's global
    state; the PNG is written atomically.

    Args:
        metrics_path: ``RUN/metrics.jsonl``.
        out_png: where to write the PNG; its directory is created.
        title: figure title; defaults to the run directory's name.

    Returns:
        ``out_png`` as a Path.

    Raises:
        UserError: ``metrics_path`` does not exist.
    """
    metrics_path, out_png = Path(metrics_path), Path(out_png)
    rows = read_metrics(metrics_path)
    fig = build_run_figure(
        rows, title if title is not None else f"treadle run {metrics_path.parent.name}"
    )

    return _save_figure(fig, out_png)


def plot_comparison(runs: Mapping[str, str | os.PathLike[str]], out_png) -> Path:
    """Held-out pass@1 against RL step, one line per run, into a PNG (written atomically).

    Args:
        runs: label -> ``RUN/metrics.jsonl``.
        out_png: where to write the PNG.
    Raises:
        UserError: a metrics file does not exist.
    """
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for label, path in runs.items():
        steps, values = _series(read_metrics(Path(path)), "eval/pass@1")
        ax.plot(steps, values, marker="o", label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out pass@1")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("algorithms on the default task, same budget")
    fig.tight_layout()
    return _save_figure(fig, Path(out_png))


def _save_figure(fig: Figure, out_png: Path) -> Path:
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp_", suffix=".png", dir=out_png.parent)
    os.close(fd)
    try:
        fig.savefig(tmp_name, format="png", dpi=120)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; a plot is for everyone to read
        os.replace(tmp_name, out_png)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.info("wrote %s", out_png)
    return out_png


_FRACTION_MARKERS = ("accuracy", "pass@", "pass_at_", "fraction", "_frac")


def format_summary_value(name: str, value: float | str | None) -> str:
    """Format one summary entry for display, choosing the unit from the name.

    - ``None`` (not measured) as ``-``; text as is; ``int`` as an integer;
    - names ending in ``_s`` are seconds: ``12.34`` -> ``"12.3 s"``;
    - names containing ``accuracy``, ``pass@``, ``pass_at_``, ``fraction`` or ``_frac`` are
      fractions in [0, 1] shown as percentages: ``0.4567`` -> ``"45.7%"``;
    - other numbers get 4 significant digits: ``0.012345`` -> ``"0.01235"``.
    """
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if name.endswith("_s"):
        return f"{value:.1f} s"
    if any(marker in name for marker in _FRACTION_MARKERS):
        return f"{value:.1%}"
    return f"{value:.4g}"


def summary_table(summary: Summary, *, title: str = "Run summary") -> Table:
    """Build a two-column rich table (result, value) of a run's final results, in dict order."""
    table = Table(title=title, title_justify="left")
    table.add_column("result", style="bold")
    table.add_column("value", justify="right")
    for name, value in summary.items():
        table.add_row(name, format_summary_value(name, value))
    return table


def print_summary(console: Console, summary: Summary) -> None:
    """Print :func:`summary_table` of ``summary`` to ``console``."""
    console.print(summary_table(summary))


def write_summary(run_dir: str | os.PathLike[str], summary: Summary) -> Path:
    """Write ``summary`` to ``RUN/summary.json`` atomically; NaN and infinities become null.

    Returns:
        The path written.

    Raises:
        OSError: the run directory is not writable.
    """
    return write_json_atomic(Path(run_dir) / SUMMARY_FILENAME, dict(summary))
