"""Tests for treadle.store.report: the run plot, the summary table and summary.json."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import pytest
from rich.console import Console

from treadle.core.errors import UserError
from treadle.store.observe import MetricsLogger, read_metrics
from treadle.store.report import (
    build_run_figure,
    format_summary_value,
    plot_run,
    print_summary,
    summary_table,
    write_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (bytes 16..24, big-endian)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _write_run(run_dir: Path) -> Path:
    with MetricsLogger(run_dir, tensorboard=False) as metrics:
        metrics.log(0, {"eval/pass@1": 0.2, "eval/pass@k": 0.5})
        for step in range(1, 11):
            metrics.log(step, {"reward/mean": 0.1 * step, "time/step_s": 3.0})
        metrics.log(5, {"eval/pass@1": 0.35, "eval/pass@k": 0.6})
        metrics.log(10, {"eval/pass@1": 0.45, "eval/pass@k": 0.7})
    return run_dir / "metrics.jsonl"


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    metrics_path = _write_run(tmp_path / "run")
    out = plot_run(metrics_path, tmp_path / "plots" / "run.png")
    assert out == tmp_path / "plots" / "run.png"
    # the 3 x 3 dashboard: 16 x (3 * 3.5 + 0.5) = 16 x 11 inches at 120 dpi = 1920 x 1320 pixels
    assert _png_size(out) == (1920, 1320)
    assert out.stat().st_size > 50_000  # nine panels of lines, text and legends, not a blank
    assert [p.name for p in out.parent.iterdir()] == ["run.png"]  # no temporary file left


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_figure_draws_only_the_logged_metrics(tmp_path: Path) -> None:
    rows = read_metrics(_write_run(tmp_path))
    panels = _panels(build_run_figure(rows, "demo"))
    reward_ax, eval_ax = panels["Training reward"], panels["Accuracy"]
    (reward_line,) = reward_ax.get_lines()
    assert list(reward_line.get_xdata()) == list(range(1, 11))
    assert list(reward_line.get_ydata()) == pytest.approx([0.1 * s for s in range(1, 11)])
    # eval/greedy_accuracy was never logged: no line, no crash; the labels give first -> last
    labels = [line.get_label() for line in eval_ax.get_lines()]
    assert labels == ["held-out pass@1 (sampled): 20% → 45%", "held-out pass@k: 50% → 70%"]
    assert list(eval_ax.get_lines()[0].get_xdata()) == [0, 5, 10]
    assert list(eval_ax.get_lines()[0].get_ydata()) == pytest.approx([0.2, 0.35, 0.45])
    assert [t.get_text() for t in eval_ax.get_legend().get_texts()] == labels
    assert eval_ax.get_xlabel() == "step" and reward_ax.get_ylabel() == "mean reward"


def test_plot_survives_missing_and_null_metrics(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"loss": 0.5, "reward/mean": math.nan})
        metrics.log(2, {"loss": 0.4, "reward/mean": 0.25})
    panels = _panels(build_run_figure(read_metrics(tmp_path / "metrics.jsonl"), "sparse"))
    reward_ax, eval_ax = panels["Training reward"], panels["Accuracy"]
    assert list(reward_ax.get_lines()[0].get_xdata()) == [2]  # the NaN (null) step is skipped
    assert eval_ax.get_lines() == []
    assert [t.get_text() for t in eval_ax.texts] == [
        "not logged: reward/accuracy, eval/pass@1, eval/greedy_accuracy, eval/pass@k"
    ]
    assert _png_size(plot_run(tmp_path / "metrics.jsonl", tmp_path / "p.png")) == (1920, 1320)


def test_the_control_run_is_drawn_from_the_summary(tmp_path: Path) -> None:
    from treadle.store.report import control_rows

    summary = {"accuracy_after_rl": 0.45, "accuracy_control_sft": 0.3, "k": 2}
    assert control_rows(summary) == [{"step": 0, "control/pass@1": 0.3}]
    assert control_rows({"accuracy_after_rl": 0.45}) == []  # no control run, no row
    rows = read_metrics(_write_run(tmp_path)) + control_rows(summary)
    eval_ax = _panels(build_run_figure(rows, "demo"))["Accuracy"]
    (control,) = [ln for ln in eval_ax.get_lines() if ln.get_label().startswith("control")]
    assert control.get_label() == "control: SFT for the same time, pass@1: 30%"
    assert list(control.get_ydata()) == [0.3, 0.3]  # a level across the panel
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "p.png", summary=summary)
    assert _png_size(out) == (1920, 1320)


def test_plot_of_an_empty_run(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "p.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_of_a_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        plot_run(tmp_path / "metrics.jsonl", tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("eval/pass@1_before", 0.4567, "45.7%"),
        ("eval/greedy_accuracy_after", 0.5, "50.0%"),
        ("correct_fraction", 1.0, "100.0%"),
        ("time/total_s", 1234.56, "1234.6 s"),
        ("control_sft_seconds", 92.514, "92.5 s"),
        ("steps", 200, "200"),
        ("reward/mean_final", 0.012345, "0.01235"),
        ("model", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
        ("eval/pass@1_after", math.nan, "nan"),
    ],
)
def test_format_summary_value(name: str, value: float | str, shown: str) -> None:
    assert format_summary_value(name, value) == shown


def test_summary_table_rows_and_print() -> None:
    summary = {"eval/pass@1_before": 0.25, "eval/pass@1_after": 0.4, "time/total_s": 61.25}
    table = summary_table(summary)
    assert [c.header for c in table.columns] == ["result", "value"]
    assert list(table.columns[0].cells) == list(summary)
    assert list(table.columns[1].cells) == ["25.0%", "40.0%", "61.2 s"]

    out = io.StringIO()
    print_summary(Console(file=out, width=80, force_terminal=False), summary)
    text = out.getvalue()
    assert "Run summary" in text
    assert "eval/pass@1_after" in text and "40.0%" in text


def test_summary_table_leaves_out_records() -> None:
    # summary.json's machine record is printed at start-up, not as a row of numbers
    summary = {"rl_steps": 60, "machine": {"engine": "hf", "dtype": "float32"}}
    assert list(summary_table(summary).columns[0].cells) == ["rl_steps"]


def test_write_summary_is_json_in_order(tmp_path: Path) -> None:
    path = write_summary(tmp_path, {"z_first": 1.5, "a_second": "text", "bad": math.inf})
    assert path == tmp_path / "summary.json"
    assert list(json.loads(path.read_text())) == ["z_first", "a_second", "bad"]
    assert json.loads(path.read_text()) == {"z_first": 1.5, "a_second": "text", "bad": None}


def test_unmeasured_summary_value_shows_a_dash():
    # eval.greedy=false leaves the greedy accuracies None; the table must not crash on them.
    from treadle.store.report import format_summary_value

    assert format_summary_value("greedy_accuracy_after_rl", None) == "-"


def test_an_asynchronous_run_gets_a_panel_of_staleness_and_busy_fractions(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        for step in (1, 2, 3):
            metrics.log(step, {"reward/mean": 0.1 * step, "async/staleness_mean": step / 2,
                               "async/staleness_max": 2, "async/engine_busy": 0.9})  # fmt: skip
    fig = build_run_figure(read_metrics(tmp_path / "metrics.jsonl"), "async")
    async_ax = fig.axes[9]  # the tenth panel, after the nine of every run
    assert async_ax.get_title() == "Asynchronous rollout"
    labels = [line.get_label() for line in async_ax.get_lines()]
    # the trainer's busy fraction was not logged: three lines
    assert labels == [
        "staleness, mean (versions)",
        "staleness, max (versions)",
        "engine busy (fraction)",
    ]
    assert list(async_ax.get_lines()[0].get_ydata()) == pytest.approx([0.5, 1.0, 1.5])
    # a 4 x 3 grid: 16 x (4 * 3.5 + 0.5) = 16 x 14.5 inches at 120 dpi
    assert _png_size(plot_run(tmp_path / "metrics.jsonl", tmp_path / "p.png")) == (1920, 1740)
