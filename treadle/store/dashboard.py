"""The run dashboard: one matplotlib figure of a run's curves, panel by panel.

Every panel reads its metrics from the rows of ``RUN/metrics.jsonl`` by name (the names the
RL loop logs: :mod:`treadle.jobs.loop`, :mod:`treadle.rollout.samples`,
:mod:`treadle.train.objectives`, :mod:`treadle.algorithms.losses`). A panel none of whose
metrics were logged says so in its middle ("not logged: clip/fraction") instead of staying
blank. Steps are optimizer steps, so every x axis has integer ticks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter, ScalarFormatter

from treadle.store.observe import MetricsRow


@dataclass(frozen=True)
class Curve:
    """How one metric is drawn: a line with its own colour, marker and line style."""

    metric: str
    """Name in ``metrics.jsonl``, e.g. ``"eval/pass@1"``."""
    label: str
    """Legend text."""
    color: str
    marker: str | None = None
    """A matplotlib marker (``"o"``, ``"s"``, ``"^"``) or None for a plain line."""
    linestyle: str = "-"
    size: float = 6.0
    """Marker size (points); the held-out curves get decreasing sizes, so hollow markers of
    equal values sit inside each other instead of hiding each other."""
    width: float = 1.5
    """Line width (points)."""


TRAIN_ACCURACY = Curve("reward/accuracy", "train accuracy (per step)", "0.55", width=1.0)
EVAL_CURVES: tuple[Curve, ...] = (
    Curve("eval/pass@1", "held-out pass@1 (sampled)", "tab:blue", "o", "-", 9.0, 2.4),
    Curve("eval/greedy_accuracy", "held-out greedy accuracy", "tab:orange", "s", "--", 6.5, 1.8),
    Curve("eval/pass@k", "held-out pass@k", "tab:green", "^", ":", 4.5, 1.4),
)
"""The held-out evaluations: step 0 is before RL, the last step after it, others periodic
(``eval.every``)."""
CONTROL_CURVES: tuple[Curve, ...] = (
    Curve("control/pass@1", "control: SFT for the same time, pass@1", "tab:red", "X", "-."),
    Curve(
        "control/greedy_accuracy",
        "control: SFT for the same time, greedy",
        "tab:purple",
        "D",
        (0, (5, 1, 1, 1, 1, 1)),  # dash-dot-dot
    ),
)
"""The control run (``eval.control_sft``), drawn as levels across the panel: what the same
wall time of extra SFT reached instead of RL (rows made from the run's summary by
:func:`treadle.store.report.control_rows`)."""
ASYNC_CURVES: tuple[Curve, ...] = (
    Curve("async/staleness_mean", "staleness, mean (versions)", "tab:blue"),
    Curve("async/staleness_max", "staleness, max (versions)", "tab:orange", linestyle="--"),
    Curve("async/engine_busy", "engine busy (fraction)", "tab:green", linestyle=":"),
    Curve("async/trainer_busy", "trainer busy (fraction)", "tab:red", linestyle="-."),
)
"""The asynchronous rollout's metrics, drawn in a panel of their own when the run logged them."""
PHASE_ORDER = (
    "generate",
    "reward",
    "filter",
    "baseline",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "advantages",
    "update",
    "critic_update",
    "sync",
)
"""The loop's timed phases in the order a step runs them (:func:`treadle.jobs.loop.rl_step`);
any other ``time/*_s`` is stacked after them, ``eval`` last."""
GEN_TOKENS_PER_S = "perf/gen_tokens_per_s"


def series(rows: Sequence[MetricsRow], name: str) -> tuple[list[int], list[float]]:
    """Steps and values of metric ``name`` over the rows that have a finite value for it."""
    steps: list[int] = []
    values: list[float] = []
    for row in rows:
        value, step = row.get(name), row.get("step")
        if value is not None and step is not None and math.isfinite(value):
            steps.append(int(step))
            values.append(float(value))
    return steps, values


def mark_not_logged(ax: Axes, names: Sequence[str]) -> None:
    """Write "not logged: NAME, ..." in the middle of ``ax`` (a panel with nothing to draw)."""
    ax.text(
        0.5,
        0.5,
        "not logged: " + ", ".join(names),
        transform=ax.transAxes,
        ha="center",
        va="center",
        wrap=True,
        color="0.35",
    )


def _plot(ax: Axes, rows: Sequence[MetricsRow], curve: Curve, label: str | None = None) -> bool:
    steps, values = series(rows, curve.metric)
    if not steps:
        return False
    ax.plot(
        steps,
        values,
        color=curve.color,
        marker=curve.marker,
        markersize=curve.size,
        markerfacecolor="none",  # hollow: coinciding markers of other curves stay visible
        linestyle=curve.linestyle,
        linewidth=curve.width,
        label=label or curve.label,
        clip_on=False,
    )
    return True


def _curves_panel(ax: Axes, rows: Sequence[MetricsRow], curves: Sequence[Curve]) -> bool:
    """Draw each of ``curves`` that was logged; mark the panel when none was."""
    drawn = [_plot(ax, rows, c) for c in curves]
    if not any(drawn):
        mark_not_logged(ax, [c.metric for c in curves])
    elif len(curves) > 1:
        ax.legend(loc="best", fontsize="small")
    return any(drawn)


def _percent(value: float) -> str:
    """``0.97`` -> ``"97%"``, ``0.985`` -> ``"98.5%"``: a tenth of a percent where it is not
    whole (a held-out set of 200 prompts moves in halves), so a legend agrees with
    ``summary.json``."""
    tenths = round(value * 1000)
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


def _before_after(values: list[float]) -> str:
    """``[0.2, 0.3, 0.455]`` -> ``"20% -> 45.5%"``: the first and last evaluation."""
    if len(values) == 1:
        return _percent(values[0])
    return f"{_percent(values[0])} → {_percent(values[-1])}"


def draw_reward(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Mean training reward per step (``reward/mean``)."""
    _curves_panel(ax, rows, [Curve("reward/mean", "reward/mean", "tab:blue")])
    ax.set_title("Training reward")
    ax.set_ylabel("mean reward")


def draw_accuracy(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Training accuracy per step, the held-out evaluations (before RL at step 0, after RL at
    the last step, periodic ones between; legend: first -> last value) and the control run as
    levels, each with its own colour, marker and line style."""
    drawn = _plot(ax, rows, TRAIN_ACCURACY)
    for curve in EVAL_CURVES:
        _, values = series(rows, curve.metric)
        if values:
            drawn |= _plot(ax, rows, curve, f"{curve.label}: {_before_after(values)}")
    for curve in CONTROL_CURVES:
        _, values = series(rows, curve.metric)
        if values:
            ax.axhline(
                values[-1],
                color=curve.color,
                linestyle=curve.linestyle,
                linewidth=1.5,
                label=f"{curve.label}: {_percent(values[-1])}",
            )
            drawn = True
    if drawn:  # x-small: six entries leave the control's levels in sight
        ax.legend(loc="best", fontsize="x-small")
    else:
        names = [c.metric for c in (TRAIN_ACCURACY, *EVAL_CURVES)]
        mark_not_logged(ax, names)
    ax.set_ylim(-0.04 * (top := _accuracy_top(rows)), top)  # 0% is not hidden by the frame
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_title("Accuracy")
    ax.set_ylabel("accuracy")


def _accuracy_top(rows: Sequence[MetricsRow]) -> float:
    """The accuracy panel's upper limit: 104% once a value passes 50%, else room above the
    highest value for the legend (at least 10%), so small accuracies are not a flat line."""
    names = [c.metric for c in (TRAIN_ACCURACY, *EVAL_CURVES, *CONTROL_CURVES)]
    highest = max((v for n in names for v in series(rows, n)[1]), default=1.0)
    return 1.04 if highest > 0.5 else min(max(2.0 * highest, 0.1), 1.04)


def draw_loss(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """The policy loss the optimizer minimized (``loss``)."""
    _curves_panel(ax, rows, [Curve("loss", "loss", "tab:blue")])
    ax.set_title("Loss")
    ax.set_ylabel("loss")


def draw_kl(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """KL to the reference policy (``kl/<estimator>``, logged when ``algorithm.kl.coef > 0``)
    and the engine/trainer mismatch KL (``mismatch/kl_k3``), in nats per token, each named in
    the legend; without a reference KL the title says so, lest the mismatch (near 0 when the
    engine and trainer agree) read as the policy's distance from the reference."""
    names = sorted({k for row in rows for k in row if k.startswith("kl/")})
    curves = [Curve(n, f"to reference ({n.removeprefix('kl/')})", "tab:blue") for n in names]
    curves.append(Curve("mismatch/kl_k3", "engine vs trainer (k3)", "tab:orange", None, "--"))
    drawn = [c for c in curves if series(rows, c.metric)[0]]
    if not drawn:
        mark_not_logged(ax, ["kl/*", "mismatch/kl_k3"])
    else:
        for curve in drawn:
            _plot(ax, rows, curve)
        ax.legend(loc="best", fontsize="small")
    reference = any(c.metric.startswith("kl/") for c in drawn) or not drawn
    ax.set_title("KL" if reference else "KL, engine vs trainer (no reference KL logged)")
    ax.set_ylabel("nats / token")


def draw_entropy(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """The policy's mean token entropy over the trained tokens (``entropy/mean``)."""
    _curves_panel(ax, rows, [Curve("entropy/mean", "entropy/mean", "tab:blue")])
    ax.set_title("Entropy")
    ax.set_ylabel("nats / token")


def draw_clip(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Fraction of trained tokens whose importance ratio was clipped (PPO-style losses)."""
    curves = [
        Curve("clip/fraction", "clipped", "tab:blue"),
        Curve("clip/low_fraction", "below 1 - eps", "tab:orange", None, "--"),
        Curve("clip/high_fraction", "above 1 + eps", "tab:green", None, ":"),
    ]
    _curves_panel(ax, rows, curves)
    ax.set_ylim(bottom=0.0, top=max(ax.get_ylim()[1], 0.01))  # a fraction: never below 0%
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_title("Clip fraction")
    ax.set_ylabel("share of trained tokens")


def draw_length(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Completion length per step: the mean (``rollout/mean_length``) with the range from
    ``rollout/min_length`` to ``rollout/max_length`` shaded, in tokens."""
    steps, mean = series(rows, "rollout/mean_length")
    if not steps:
        mark_not_logged(ax, ["rollout/mean_length"])
    else:
        ax.plot(steps, mean, color="tab:blue", linewidth=1.5, label="mean")
        lows = dict(zip(*series(rows, "rollout/min_length"), strict=True))
        highs = dict(zip(*series(rows, "rollout/max_length"), strict=True))
        ranged = [s for s in steps if s in lows and s in highs]
        if ranged:
            ax.fill_between(
                ranged,
                [lows[s] for s in ranged],
                [highs[s] for s in ranged],
                color="tab:blue",
                alpha=0.2,
                label="min - max",
            )
        ax.legend(loc="best", fontsize="small")
    ax.set_title("Response length")
    ax.set_ylabel("tokens")


def draw_lr(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """The learning rate each step applied (``lr``)."""
    _curves_panel(ax, rows, [Curve("lr", "lr", "tab:blue")])
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_title("Learning rate")
    ax.set_ylabel("lr")


def phases(rows: Sequence[MetricsRow]) -> list[str]:
    """The ``time/<phase>_s`` phases logged, in the loop's order (:data:`PHASE_ORDER`), then any
    others by name, ``eval`` last; ``step`` (their total) is not a phase."""
    logged = {
        k.removeprefix("time/").removesuffix("_s")
        for row in rows
        for k in row
        if k.startswith("time/") and k.endswith("_s")
    }
    logged.discard("step")
    known = [p for p in PHASE_ORDER if p in logged]
    others = sorted(logged - set(known) - {"eval"})
    return known + others + (["eval"] if "eval" in logged else [])


def draw_step_time(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Wall seconds of each step, stacked by phase (``time/<phase>_s``); what ``time/step_s``
    holds beyond its phases is ``other``. With ``perf/gen_tokens_per_s`` logged, generation
    throughput on a second y axis."""
    step_rows = [r for r in rows if r.get("time/step_s") is not None]
    names = phases(step_rows)
    if not step_rows:
        mark_not_logged(ax, ["time/*_s"])
    else:
        steps = [int(r["step"]) for r in step_rows]
        bottom = [0.0] * len(step_rows)
        inner = [0.0] * len(step_rows)  # the phases timed inside the step
        cmap = _colors(len(names) + 1)
        for i, name in enumerate(names):
            heights = [r.get(f"time/{name}_s") or 0.0 for r in step_rows]
            ax.bar(steps, heights, bottom=bottom, width=0.8, color=cmap[i], label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            if name != "eval":  # evaluation runs after the step's timer stopped
                inner = [a + h for a, h in zip(inner, heights, strict=True)]
        other = [max(r["time/step_s"] - s, 0.0) for r, s in zip(step_rows, inner, strict=True)]
        if any(o > 0 for o in other):
            ax.bar(steps, other, bottom=bottom, width=0.8, color=cmap[-1], label="other")
        tallest = max(b + o for b, o in zip(bottom, other, strict=True))
        ax.set_ylim(0, 1.5 * tallest if tallest > 0 else 1.0)  # headroom for the legend
        ax.legend(loc="upper left", fontsize="x-small", ncols=3)
        _draw_throughput(ax, rows)
    ax.set_title("Step time by phase")
    ax.set_ylabel("seconds")


def _colors(n: int) -> list:
    """``n`` distinct colours for the stacked phases, the last (``other``) grey."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    palette = [c for i in range(cmap.N) if (c := cmap(i)) != cmap(7)]  # tab10's 7 is grey
    return [palette[i % len(palette)] for i in range(n - 1)] + ["0.6"]


def _draw_throughput(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    steps, values = series(rows, GEN_TOKENS_PER_S)
    if not steps:
        return
    twin = ax.twinx()
    twin.plot(steps, values, color="black", marker=".", linewidth=1.0, label="gen tokens/s")
    twin.set_ylabel("generated tokens / s")
    twin.legend(loc="upper right", fontsize="x-small")


def draw_async(ax: Axes, rows: Sequence[MetricsRow]) -> None:
    """Staleness (policy versions) and the engine's and trainer's busy fractions."""
    _curves_panel(ax, rows, ASYNC_CURVES)
    ax.set_title("Asynchronous rollout")


PANELS: tuple[Callable[[Axes, Sequence[MetricsRow]], None], ...] = (
    draw_reward,
    draw_accuracy,
    draw_loss,
    draw_kl,
    draw_entropy,
    draw_clip,
    draw_length,
    draw_lr,
    draw_step_time,
)
"""The dashboard's panels, left to right, top to bottom."""


def build_dashboard(rows: Sequence[MetricsRow], title: str) -> Figure:
    """The dashboard of a run: a 3 x 3 grid of :data:`PANELS` (16 x 11 inches), and for an
    asynchronous run a 4 x 3 grid with :func:`draw_async` as the tenth panel (16 x 14.5).

    Every panel has a title (find a panel by ``ax.get_title()``; a twin axis has none), a
    ``step`` x axis with integer ticks shared by all panels, and a grid. Uses no pyplot state.
    """
    panels = list(PANELS)
    if any(c.metric in row for row in rows for c in ASYNC_CURVES):
        panels.append(draw_async)
    nrows = math.ceil(len(panels) / 3)
    fig = Figure(figsize=(16, 3.5 * nrows + 0.5), layout="constrained")
    grid = fig.subplots(nrows, 3, sharex=True, squeeze=False).flatten()
    steps = [int(row["step"]) for row in rows if row.get("step") is not None]
    for ax, draw in zip(grid, panels, strict=False):
        draw(ax, rows)
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)  # sharex hides them on all but the bottom row
        ax.grid(True, alpha=0.3)
        if isinstance(formatter := ax.yaxis.get_major_formatter(), ScalarFormatter):
            formatter.set_useOffset(False)  # a flat curve reads as its value, not "+1e-4"
    for ax in grid[len(panels) :]:
        ax.remove()
    if steps:
        low, high = min(steps), max(steps)
        grid[0].set_xlim(low - 0.5, high + 0.5 if high > low else low + 0.5)
    grid[0].xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by every panel
    fig.suptitle(title)
    return fig
