"""Tests for treadle.store.dashboard: the run dashboard's panels, built from hand-made rows."""

from __future__ import annotations

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.patches import Rectangle

from treadle.store.dashboard import build_dashboard, phases
from treadle.store.observe import MetricsRow

TITLES = [
    "Training reward",
    "Accuracy",
    "Loss",
    "KL",
    "Entropy",
    "Clip fraction",
    "Response length",
    "Learning rate",
    "Step time by phase",
]


def _step_row(step: int) -> MetricsRow:
    """An RL step's row with every metric a panel reads (values chosen to be checked by hand)."""
    return {
        "step": step,
        "reward/mean": 0.1 * step,
        "reward/accuracy": 0.05 * step,
        "loss": 1.0 / step,
        "kl/k3": 0.01 * step,
        "mismatch/kl_k3": 0.001,
        "entropy/mean": 2.0 - 0.1 * step,
        "clip/fraction": 0.02,
        "clip/low_fraction": 0.01,
        "clip/high_fraction": 0.01,
        "rollout/mean_length": 10.0 + step,
        "rollout/min_length": 4.0,
        "rollout/max_length": 20.0 + step,
        "lr": 1e-6,
        "time/generate_s": 2.0,
        "time/reward_s": 0.5,
        "time/update_s": 1.0,
        "time/sync_s": 0.25,
        "time/step_s": 4.0,  # 2 + 0.5 + 1 + 0.25 = 3.75 timed: 0.25 s "other"
    }


def _full_run() -> list[MetricsRow]:
    """Three RL steps, held-out evaluations before (step 0), at step 2 and after (step 3), and
    the control run at the last step."""
    rows: list[MetricsRow] = [
        {"step": 0, "eval/pass@1": 0.2, "eval/greedy_accuracy": 0.2, "eval/pass@k": 0.2}
    ]
    rows += [_step_row(s) for s in (1, 2, 3)]
    rows[2] |= {"eval/pass@1": 0.3, "eval/greedy_accuracy": 0.3, "eval/pass@k": 0.5}
    rows[2]["time/eval_s"] = 1.5
    rows.append({"step": 3, "eval/pass@1": 0.4, "eval/greedy_accuracy": 0.4, "eval/pass@k": 0.6})
    rows.append({"step": 3, "control/pass@1": 0.25, "control/greedy_accuracy": 0.3})
    return rows


def _panels(rows: list[MetricsRow]) -> dict:
    fig = build_dashboard(rows, "demo")
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_the_dashboard_has_its_nine_panels_in_order() -> None:
    fig = build_dashboard(_full_run(), "demo")
    assert [ax.get_title() for ax in fig.axes] == TITLES
    assert fig.get_suptitle() == "demo"
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    assert not any(ax.texts for ax in fig.axes)  # every metric logged: nothing marked


def test_before_after_and_control_lines_have_distinct_styles() -> None:
    ax = _panels(_full_run())["Accuracy"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    # pass@1 0.2 -> 0.4, greedy 0.2 -> 0.4 and pass@k 0.2 -> 0.6: the first two coincide
    # everywhere, so only their styles tell them apart.
    assert list(lines) == [
        "train accuracy (per step)",
        "held-out pass@1 (sampled): 20% → 40%",
        "held-out greedy accuracy: 20% → 40%",
        "held-out pass@k: 20% → 60%",
        "control: SFT for the same time, pass@1: 25%",
        "control: SFT for the same time, greedy: 30%",
    ]
    styles = [(ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in lines.values()]
    assert len({s[0] for s in styles}) == 6  # six colours
    assert len({s[1:] for s in styles}) == 6  # and six (marker, line style) pairs
    pass1, greedy = (
        lines["held-out pass@1 (sampled): 20% → 40%"],
        lines["held-out greedy accuracy: 20% → 40%"],
    )
    assert list(pass1.get_xdata()) == list(greedy.get_xdata()) == [0, 2, 3]  # before, during, after
    assert list(pass1.get_ydata()) == list(greedy.get_ydata()) == pytest.approx([0.2, 0.3, 0.4])
    assert pass1.get_markersize() > greedy.get_markersize()  # hollow markers nest, not hide
    # the control is a level across the panel at its value
    control = lines["control: SFT for the same time, pass@1: 25%"]
    assert list(control.get_ydata()) == [0.25, 0.25]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == list(lines)


def test_every_panel_has_integer_step_ticks() -> None:
    # steps 0..3 over a 4-step range: matplotlib's default locator puts ticks at 0.5 steps
    fig = build_dashboard(_full_run(), "demo")
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if -0.5 <= t <= 3.5]
        assert ticks == [0, 1, 2, 3], ax.get_title()


def test_a_panel_whose_metric_was_not_logged_says_so() -> None:
    rows = [{k: v for k, v in _step_row(s).items() if not k.startswith(("clip/", "kl/", "mis"))}
            for s in (1, 2)]  # fmt: skip
    panels = _panels(rows)
    assert [t.get_text() for t in panels["Clip fraction"].texts] == [
        "not logged: clip/fraction, clip/low_fraction, clip/high_fraction"
    ]
    assert [t.get_text() for t in panels["KL"].texts] == ["not logged: kl/*, mismatch/kl_k3"]
    assert panels["Clip fraction"].get_lines() == [] and panels["KL"].get_lines() == []
    assert len(panels["Loss"].texts) == 0 and len(panels["Loss"].get_lines()) == 1


def test_without_a_reference_kl_the_kl_panel_names_the_mismatch() -> None:
    # GRPO with algorithm.kl.coef 0 (the default recipe) logs only the engine/trainer mismatch:
    # its one curve is named in a legend and the title, not read as the KL to the reference.
    rows = [{k: v for k, v in _step_row(s).items() if not k.startswith("kl/")} for s in (1, 2)]
    fig = build_dashboard(rows, "demo")
    ax = fig.axes[TITLES.index("KL")]
    assert ax.get_title() == "KL, engine vs trainer (no reference KL logged)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["engine vs trainer (k3)"]
    assert list(ax.get_lines()[0].get_ydata()) == [0.001, 0.001]
    # with the reference KL logged: both curves, the plain title
    both = _panels(_full_run())["KL"]
    assert [t.get_text() for t in both.get_legend().get_texts()] == [
        "to reference (k3)",
        "engine vs trainer (k3)",
    ]


def test_legends_keep_a_half_percent() -> None:
    # 200 held-out prompts move in halves of a percent: 0.985 is "98.5%" as in summary.json,
    # not "98%" (round half to even) or "99%"; whole percentages stay whole
    rows = _full_run()
    rows[-2] |= {"eval/pass@k": 0.985}
    rows[-1] |= {"control/pass@1": 0.4625}  # 462.5 tenths, rounded to even: 46.2%, as summary.json
    labels = [line.get_label() for line in _panels(rows)["Accuracy"].get_lines()]
    assert labels[3] == "held-out pass@k: 20% → 98.5%"
    assert labels[4] == "control: SFT for the same time, pass@1: 46.2%"


def test_an_empty_run_marks_every_panel() -> None:
    fig = build_dashboard([], "empty")
    assert [ax.get_title() for ax in fig.axes] == TITLES
    assert all(len(ax.texts) == 1 for ax in fig.axes)
    assert all(ax.texts[0].get_text().startswith("not logged: ") for ax in fig.axes)


def test_step_time_is_stacked_by_phase_in_the_loops_order() -> None:
    rows = _full_run()
    assert phases(rows) == ["generate", "reward", "update", "sync", "eval"]
    ax = _panels(rows)["Step time by phase"]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    # 3 steps x (4 phases + eval + other) bars
    assert len(bars) == 18
    at_step_2 = sorted((b.get_y(), b.get_height()) for b in bars if abs(b.get_x() - 1.6) < 1e-9)
    # generate 0..2, reward 2..2.5, update 2.5..3.5, sync 3.5..3.75, eval 3.75..5.25, then the
    # step's untimed 4 - 3.75 = 0.25 s on top, 5.25..5.5
    expected = [(0.0, 2.0), (2.0, 0.5), (2.5, 1.0), (3.5, 0.25), (3.75, 1.5), (5.25, 0.25)]
    assert [v for bar in at_step_2 for v in bar] == pytest.approx([v for e in expected for v in e])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["generate", "reward", "update", "sync", "eval", "other"]


def test_response_length_shades_the_min_max_range() -> None:
    ax = _panels(_full_run())["Response length"]
    (mean,) = ax.get_lines()
    assert list(mean.get_ydata()) == [11.0, 12.0, 13.0]  # 10 + step
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == 4.0 and max(ys) == 23.0  # min_length 4, max_length 20 + 3


def test_generation_throughput_gets_a_twin_axis_when_logged() -> None:
    rows = _full_run()
    assert len(build_dashboard(rows, "demo").axes) == 9  # not logged: no twin
    for row in rows[1:4]:
        row["perf/gen_tokens_per_s"] = 100.0 * row["step"]
    fig = build_dashboard(rows, "demo")
    (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "generated tokens / s"]
    assert list(twin.get_lines()[0].get_ydata()) == [100.0, 200.0, 300.0]


def test_the_accuracy_axis_fits_small_accuracies() -> None:
    rows = _full_run()  # up to pass@k 0.6: the whole 0..100% (104%, room for the frame)
    assert _panels(rows)["Accuracy"].get_ylim() == pytest.approx((-0.04 * 1.04, 1.04))
    small = [{"step": 0, "eval/pass@1": 0.02}, {"step": 4, "eval/pass@1": 0.07}]
    # highest 7%: the axis reaches 2 x 7% = 14%, room above for the legend
    assert _panels(small)["Accuracy"].get_ylim() == pytest.approx((-0.04 * 0.14, 0.14))
