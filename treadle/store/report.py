"""What a run reports at the end: a plot of its curves, a summary table and ``summary.json``."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter
from rich.console import Console
from rich.table import Table

from treadle.store.atomic import write_json_atomic
from treadle.store.dashboard import build_dashboard, series
from treadle.store.observe import MetricsRow, read_metrics

logger = logging.getLogger(__name__)

SUMMARY_FILENAME = "summary.json"
Summary = Mapping[str, float | str | None]
"""Final results of a run: name -> number or text (see :func:`format_summary_value`)."""
CONTROL_SUMMARY_KEYS: Mapping[str, str] = {
    "accuracy_control_sft": "control/pass@1",
    "greedy_accuracy_control_sft": "control/greedy_accuracy",
}
"""The control run's results in the summary -> the names the dashboard draws them by (they
are not in ``metrics.jsonl``: a wall-time budget makes them differ between identical runs)."""


def build_run_figure(rows: list[MetricsRow], title: str) -> Figure:
    """Build the figure of :func:`plot_run` from metrics rows: the run's dashboard
    (:func:`treadle.store.dashboard.build_dashboard`, 16 x 11 inches; 16 x 14.5 for an
    asynchronous run)."""
    return build_dashboard(rows, title)


def plot_run(
    metrics_path: str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    *,
    title: str | None = None,
    summary: Summary | None = None,
) -> Path:
    """Plot a run's dashboard against step into a PNG.

    Panels (:data:`treadle.store.dashboard.PANELS`): training reward; accuracy (training per
    step, the held-out evaluations before, during and after RL, and the control run); loss;
    KL; entropy; clip fraction; response length (mean, min-max shaded); learning rate; step
    time stacked by phase; and for an asynchronous run staleness and busy fractions. A panel
    whose metrics were never logged says so. Uses matplotlib's Agg canvas without touching
    pyplot's global state; the PNG is written atomically.

    Args:
        metrics_path: ``RUN/metrics.jsonl``.
        out_png: where to write the PNG; its directory is created.
        title: figure title; defaults to the run directory's name.
        summary: the run's summary; its control results (:data:`CONTROL_SUMMARY_KEYS`) are
            drawn as levels in the accuracy panel.

    Returns:
        ``out_png`` as a Path.

    Raises:
        UserError: ``metrics_path`` does not exist.
    """
    metrics_path, out_png = Path(metrics_path), Path(out_png)
    rows = read_metrics(metrics_path) + control_rows(summary or {})
    fig = build_run_figure(
        rows, title if title is not None else f"treadle run {metrics_path.parent.name}"
    )

    return _save_figure(fig, out_png)


def control_rows(summary: Summary) -> list[MetricsRow]:
    """The control results of ``summary`` as one row of ``control/*`` metrics at step 0 (the
    dashboard draws them as levels across the steps), or none when the run had no control."""
    row = {
        name: float(value)
        for key, name in CONTROL_SUMMARY_KEYS.items()
        if isinstance(value := summary.get(key), int | float)
    }
    return [{"step": 0, **row}] if row else []


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
        steps, values = series(read_metrics(Path(path)), "eval/pass@1")
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
    - names ending in ``_s`` or ``_seconds`` are seconds: ``12.34`` -> ``"12.3 s"``;
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
    if name.endswith(("_s", "_seconds")):
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
        if isinstance(value, dict):  # a record (``machine``), printed where it was decided
            continue
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
