"""Tests for the control run's step count and its timing line (treadle.jobs.train)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from treadle.jobs.train import control_steps, say_control_timing


def test_the_step_count_leaves_out_the_probes_first_two_steps():
    # steps 3-6 take 0.2, 0.3, 0.2, 0.3 s: mean 0.25 s; 100 s / 0.25 s = 400 steps. The first two
    # (0.5, 0.4 s, one-off costs) would have made the mean 0.3167 s and 315 steps.
    assert control_steps(100.0, [0.5, 0.4, 0.2, 0.3, 0.2, 0.3]) == 400
    assert control_steps(0.1, [1.0, 1.0, 1.0]) == 1  # less time than one step: still one


def test_a_probe_of_two_steps_is_refused():
    with pytest.raises(ValueError, match="timed 2 steps; needs 3"):
        control_steps(100.0, [0.5, 0.4])


def said(spent: float, done: int, planned: int, rl_seconds: float) -> str:
    out = io.StringIO()
    summary = {
        "control_sft_seconds": spent,
        "control_sft_steps": done,
        "control_sft_planned_steps": planned,
    }
    say_control_timing(summary, rl_seconds, Console(file=out, width=200))
    return out.getvalue().strip()


def test_a_line_says_where_the_control_finished_early_or_was_cut_short():
    # 170 s of 200: under 0.9 x 200 = 180, the machine sped up after the probe
    assert said(170.0, 800, 800, 200.0) == (
        "control: its 800 steps took 170 s of the 200 (their count timed on a busier machine)"
    )
    # 200 s ran out after 850 of 1,000 steps: under 0.9 x 1,000 = 900, the machine slowed down
    assert said(200.1, 850, 1000, 200.0) == (
        "control: its 200 s ran out after 850 of its 1000 steps (their count timed on a less "
        "busy machine; the schedule's last steps not taken)"
    )
    # 185 s of 200 (above 180) and 950 of 1,000 steps (above 900): nothing to say
    assert said(185.0, 1000, 1000, 200.0) == ""
    assert said(200.1, 950, 1000, 200.0) == ""
