"""Pictures of the scale model: the simulator's timeline (one lane per engine and one for the
trainer) and the planner's memory per GPU by term."""

from __future__ import annotations

from pathlib import Path

from treadle.scale.hardware import GIB
from treadle.scale.memory import update_phase
from treadle.scale.plan import Placement
from treadle.scale.simulate import Result

COLORS = {"decode": "tab:blue", "train": "tab:orange", "sync": "tab:red"}
MAX_ENGINES = 16
"""Engine lanes drawn at most (the first ones); the trainer lane is always drawn."""


def timeline(result: Result, path: Path, title: str = "") -> Path:
    """Write ``path`` (PNG): bars of decode, train and sync over seconds, gaps idle, the first
    :data:`MAX_ENGINES` engines' lanes (the label says how many of how many), and the span of
    the steps averaged shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = sorted({b[0] for b in result.timeline if b[0] != "trainer"},
                   key=lambda lane: int(lane.split()[1]))  # fmt: skip
    engines = every[:MAX_ENGINES]
    lanes = ["trainer", *engines]
    fig, ax = plt.subplots(figsize=(11, 0.4 * len(lanes) + 1.5))
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for lane, start, end, kind in result.timeline:
        bars.setdefault((lane, kind), []).append((start, end - start))
    for (lane, kind), spans in bars.items():  # one collection a lane and kind: fast to draw
        if lane in lanes:
            row = lanes.index(lane)
            # an edge as wide as a pixel keeps bars thinner than one (a 2 s sync) in sight
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[kind],
                           edgecolors=COLORS[kind], linewidths=0.6)  # fmt: skip
    start, end = result.averaged_s
    ax.axvspan(start, end, color="0.9", zorder=0)  # behind the bars
    ax.set_xlim(left=0)
    ax.set_yticks(range(len(lanes)), lanes)
    if len(every) > len(engines):
        ax.set_ylabel(f"the first {len(engines)} of {len(every)} engines")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*COLORS.values(), "0.9"]]
    first, last = result.window or (result.warmup_steps + 1, result.steps)
    ax.legend(
        handles,
        [
            "decode",
            "train",
            "sync (+ KV recompute)",  # an engine's sync bar holds its running requests' prefill
            f"step {first}, averaged" if first == last else f"steps {first}-{last}, averaged",
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=4,
        fontsize=8,
        frameon=False,
    )  # above the lanes, clear of the bars
    ax.set_title(_plain(title) or f"step {result.step_s:.1f} s, staleness mean "
                 f"{result.staleness_mean:.2f}", loc="left", pad=20)  # fmt: skip  # over the legend
    return _write(fig, path)


def _plain(text: str) -> str:
    """``text`` drawn as written: a ``$`` escaped, which matplotlib would read as the start of
    a formula (a model folder named ``m$\\frac$`` fails to parse)."""
    return text.replace("$", r"\$")


def _write(fig, path: Path) -> Path:
    """Save ``fig`` to ``path`` (PNG) and close it; a character the font lacks (a folder's name
    in Japanese) is drawn as a box without matplotlib's warning for each glyph."""
    import warnings

    import matplotlib.pyplot as plt

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TERM_COLORS = {
    "parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green",
    "activations": "tab:red", "logits": "tab:purple", "kv_cache": "tab:cyan",
    "overhead": "tab:gray",
}  # fmt: skip
MAX_PLACEMENTS = 4


def memory_bars(p: Placement) -> list[tuple[str, dict[str, float]]]:
    """(bar label, bytes per GPU by term) of a placement's GPU groups at their peaks:
    colocated, the rollout phase (the trainer roles' parameters, gradients and optimizer
    states stay beside the engine) and the update phase (the engine asleep); disaggregated,
    the training GPUs and the engine GPUs; without an engine role, the training GPUs."""
    engine = [b for b in p.memory if b.role == "engine"]
    trainers = [b for b in p.memory if b.role != "engine"]
    update = update_phase(trainers).terms()
    if not engine:  # training roles alone: one group of GPUs
        return [("trainer GPUs", update)]
    if p.kind == "colocated":
        states = {"parameters": sum(b.parameters - b.gathered for b in trainers),
                  "gradients": update["gradients"], "optimizer": update["optimizer"]}  # fmt: skip
        rollout = {t: states.get(t, 0.0) + sum(b.terms()[t] for b in engine) for t in TERM_COLORS}
        return [("rollout", rollout), ("update", update)]
    return [("trainer GPUs", update), ("engine GPUs", engine[0].terms())]


def memory(placements: list[Placement], memory_gib: float, path: Path, title: str = "") -> Path:
    """Write ``path`` (PNG): for each of the first placements, stacked bars of GiB per GPU by
    term (:func:`memory_bars`), and the GPU's memory as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"#{i} {label}\n{p.kind if p.has_engine else 'training only'}", terms)
            for i, p in enumerate(placements[:MAX_PLACEMENTS], 1)
            for label, terms in memory_bars(p)]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(bars) + 2), 5))
    for x, (_, terms) in enumerate(bars):
        bottom = 0.0
        for term, color in TERM_COLORS.items():
            height = terms[term] / GIB
            ax.bar(x, height, bottom=bottom, color=color, width=0.7)
            bottom += height
    ax.axhline(memory_gib, color="black", linestyle="--", linewidth=1)
    ax.text(len(bars) - 0.5, memory_gib, f" {memory_gib:.1f} GiB", va="bottom", ha="right")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GiB per GPU")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in TERM_COLORS.values()]
    ax.legend(handles, [t.replace("_", " ") for t in TERM_COLORS], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))  # fmt: skip
    ax.set_title(_plain(title) or "memory per GPU by term")
    return _write(fig, Path(path))
