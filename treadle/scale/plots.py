"""The simulator's timeline as a picture: one lane per engine and one for the trainer."""

from __future__ import annotations

from pathlib import Path

from treadle.scale.simulate import Result

COLORS = {"decode": "tab:blue", "train": "tab:orange", "sync": "tab:red"}
MAX_ENGINES = 16
"""Engine lanes drawn at most (the first ones); the trainer lane is always drawn."""


def timeline(result: Result, path: Path, title: str = "") -> Path:
    """Write ``path`` (PNG): bars of decode, train and sync over seconds; gaps are idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted({b[0] for b in result.timeline if b[0] != "trainer"},
                     key=lambda lane: int(lane.split()[1]))[:MAX_ENGINES]  # fmt: skip
    lanes = ["trainer", *engines]
    fig, ax = plt.subplots(figsize=(11, 0.4 * len(lanes) + 1.5))
    for lane, start, end, kind in result.timeline:
        if lane in lanes:
            ax.barh(lanes.index(lane), end - start, left=start, color=COLORS[kind], height=0.8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", ncol=3)
    ax.set_title(title or f"step {result.step_s:.1f} s, staleness mean {result.staleness_mean:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
